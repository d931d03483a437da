"""The plugin's data path inside Megatron: documents -> packed THD micro-batches, as iterators.

Megatron pulls them through ``--dataloader-type external``: ``hooks.datasets_provider`` returns
the iterators built here and Megatron wraps each in its ``RerunDataIterator``.

- ``load_data(args, sb)``: the documents and their train/valid/test sources, with Megatron's
  semantics: ``--data-path`` is one path, several paths (weights inferred from their sizes) or
  ``W1 P1 W2 P2 ...`` (a weighted blend); each path a ``.jsonl`` file or an indexed prefix; no
  ``--data-path``: the built-in real-text corpus. ``--split`` divides every data set's documents
  (after a seeded shuffle) into train/valid/test. ``--data-args-path`` lists ``--data-path``'s
  words in a file; ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (or
  ``--per-split-data-args-path``) give each split its own data sets, whole, without ``--split``.
  Text is tokenized by Megatron's
  ``--tokenizer-type``; ``NullTokenizer`` (Megatron's "no text tokenizer") means the plugin's
  ``--sb-tokenizer`` stands for it (text and EOD id). The built-in corpus is always tokenized by
  ``--sb-tokenizer`` into a compact vocabulary.
- ``TrainIterator``: this DP rank's micro-batches of the step the callback prepared (SAB packing,
  DST plan), in slot order; each carries a ``SparsePackedSeqParams`` naming its step and slot.
- ``EvalIterator``: the valid/test split packed in Megatron's order, static density.
Every rank builds identical micro-batches from the same deterministic sampler: TP and PP ranks
need no broadcast, and every rank knows every DP rank's documents (DST needs them). Context
parallel (CP) ranks of a DP rank build the same micro-batches and keep their share of the tokens
(``microbatch_inputs``: Megatron's per-document zigzag split, documents padded to a multiple of
2 x CP so that every sequence splits evenly; the packers count the padded lengths).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...config import SparseBalanceConfig, flag_name
from ...data.context_parallel import zigzag_positions
from ...data.corpus import ConcatCorpus, DataError, load_corpus
from ...data.packing import GlobalBatchSampler, materialize, sequential_pack
from ...data.tokenizers import TextTokenizer
from ..errors import LaunchError
from ..model.budget import SparsePackedSeqParams

DEFAULT_SPLIT = "969,30,1"   # Megatron's legacy default when --split is not given
SPLITS = ("train", "valid", "test")


@dataclass
class PluginData:
    """Documents of a run and, per split, the document ids of each data set (a blend's sources)."""

    corpus: object                        # DocumentCorpus | ConcatCorpus
    splits: dict                          # "train"/"valid"/"test" -> list[np.ndarray] per source
    weights: Optional[list]               # blend weights per source, None: inferred from sizes
    tokenizer: str                        # what tokenized the text (for logs)

    def sampler(self, split: str, *, capacity: int, seed: int, long_sample_policy: str,
                dp: int = 1, num_microbatches: int = 1,
                pad_multiple: int = 1) -> Optional[GlobalBatchSampler]:
        """A sampler over ``split``'s documents; None when the split holds none."""
        sources = [s for s in self.splits[split] if s.size]
        if not sources:
            return None
        weights = None
        if self.weights is not None:     # None within: that split's blend had no weights
            weights = [w for w, s in zip(self.weights, self.splits[split]) if s.size]
            weights = None if None in weights else weights
        return GlobalBatchSampler(self.corpus.lengths, capacity=capacity, dp=dp,
                                  num_microbatches=num_microbatches, seed=seed,
                                  long_sample_policy=long_sample_policy, sources=sources,
                                  weights=weights, pad_multiple=pad_multiple)


def megatron_text_tokenizer(args) -> Optional[TextTokenizer]:
    """Megatron's tokenizer as the data pipeline's ``TextTokenizer``; None for NullTokenizer."""
    if args.tokenizer_type in (None, "NullTokenizer"):
        return None
    from megatron.training.global_vars import get_tokenizer

    tok = get_tokenizer()
    what = args.tokenizer_model or args.vocab_file or ""
    return TextTokenizer(
        name=f"megatron:{args.tokenizer_type}:{what}:{tok.vocab_size}", eod_id=int(tok.eod),
        n_vocab=int(tok.vocab_size),
        _encode_batch=lambda texts: [tok.tokenize(t) for t in texts],
        _decode=lambda ids: tok.detokenize(list(ids)))


def data_blend(data_path: Optional[Sequence[str]], flag: str = "--data-path"
               ) -> tuple[Optional[list], Optional[list]]:
    """(paths, weights) of ``--data-path`` (or the data-path ``flag``, e.g. one split's) with
    Megatron's rules; (None, None) without one."""
    if not data_path:
        return None, None
    from megatron.core.datasets.utils import get_blend_from_list

    given = f"{flag} {' '.join(data_path)}"
    try:
        paths, weights = get_blend_from_list(list(data_path))
    except (AssertionError, ValueError):
        raise LaunchError(f"{given}: expected one or more paths, or weight/path pairs "
                          f"(W1 P1 W2 P2 ...), not a mix of both") from None
    if weights is not None and not all(np.isfinite(w) and w > 0 for w in weights):
        raise LaunchError(f"{given}: blend weights {weights} must be numbers > 0")
    numbers = [p for p in paths if _is_number(p) and not os.path.exists(p)]
    if weights is None and numbers:
        raise LaunchError(f"{given}: {numbers[0]!r} looks like a blend weight, not a path; "
                          f"expected paths, or weight/path pairs (W1 P1 W2 P2 ...)")
    return paths, weights


def split_blends(args) -> Optional[dict]:
    """Megatron's data sets per split, as its ``get_blend_and_blend_per_split`` reads them:
    ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (each a list or a blend,
    as ``--data-path``) or ``--per-split-data-args-path`` (a JSON file with ``train``, ``valid``
    and ``test``, each such a list or one string of them): {split: (paths, weights)}, (None,
    None) for a split without data; None where no split has its own."""
    file = getattr(args, "per_split_data_args_path", None)
    if file is not None:
        try:
            with open(file) as f:
                given = json.load(f)
            lists = {s: given[s].split() if isinstance(given[s], str) else given[s]
                     for s in SPLITS}
            for s, words in lists.items():
                if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                    raise TypeError(f"{s!r} is {words!r}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LaunchError(f"--per-split-data-args-path {file}: expected a JSON file with "
                              f"'train', 'valid' and 'test', each a list of paths or of weight/"
                              f"path pairs ({type(e).__name__}: {e})") from None
        return {s: data_blend(lists[s], f"--per-split-data-args-path {file}: {s!r} =")
                for s in SPLITS}
    lists = {s: getattr(args, f"{s}_data_path", None) for s in SPLITS}
    if not any(v is not None for v in lists.values()):
        return None
    return {s: data_blend(lists[s], f"--{s}-data-path") for s in SPLITS}


def whole_blend(args) -> tuple[Optional[list], Optional[list]]:
    """(paths, weights) of ``--data-path``, or of the file ``--data-args-path`` names (its
    whitespace-separated list, as Megatron reads it)."""
    file = getattr(args, "data_args_path", None)
    if file is None:
        return data_blend(getattr(args, "data_path", None))
    try:
        with open(file) as f:
            listed = f.read().split()
    except OSError as e:
        raise LaunchError(f"--data-args-path {file}: cannot be read ({e.strerror})") from None
    return data_blend(listed, f"--data-args-path {file} =")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split_ratios(split: Optional[str]) -> np.ndarray:
    """``--split`` as normalised train/valid/test ratios (Megatron's parser)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        ratios = parse_and_normalize_split(split or DEFAULT_SPLIT)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise LaunchError(f"--split {split!r}: expected up to three numbers >= 0 with a positive "
                          f"sum, e.g. 969,30,1") from None
    return np.asarray(ratios, dtype=np.float64)


def split_documents(doc_ids: np.ndarray, ratios: np.ndarray, seed: int) -> list[np.ndarray]:
    """``doc_ids`` shuffled (seeded) and cut into train/valid/test ranges by ``ratios``."""
    order = doc_ids[np.random.default_rng([seed, 7919]).permutation(doc_ids.size)]
    bounds = np.round(np.concatenate([[0.0], np.cumsum(ratios)]) * doc_ids.size).astype(int)
    bounds[-1] = doc_ids.size
    return [np.sort(order[bounds[i]:bounds[i + 1]]) for i in range(len(SPLITS))]


def load_data(args, sb: SparseBalanceConfig, *, text_tokenizer: Optional[TextTokenizer] = None
              ) -> PluginData:
    """The run's documents and splits (see the module docstring for the rules)."""
    per_split = split_blends(args)
    paths, weights = whole_blend(args) if per_split is None else (
        [p for s in SPLITS for p in per_split[s][0] or []], None)
    tok = text_tokenizer if text_tokenizer is not None else sb.tokenizer
    if paths is None:
        if args.tokenizer_type not in (None, "NullTokenizer"):
            raise LaunchError(
                f"--tokenizer-type {args.tokenizer_type}: the built-in corpus is tokenized by "
                f"the plugin ({flag_name('tokenizer')} {sb.tokenizer}); give --data-path to train on "
                f"data for a Megatron tokenizer, or use --tokenizer-type NullTokenizer")
        parts = [load_corpus(None, tokenizer=sb.tokenizer, cache_dir=sb.data_cache_dir,
                             compact_vocab=True, doc_unit=sb.doc_unit)]
    else:
        parts = [load_corpus(p, tokenizer=tok, cache_dir=sb.data_cache_dir) for p in paths]
    corpus = parts[0] if len(parts) == 1 else ConcatCorpus(parts)
    per_source = [np.arange(len(parts[0]), dtype=np.int64)] if len(parts) == 1 else \
        [corpus.part_doc_ids(k) for k in range(len(parts))]
    if per_split is None:
        ratios = split_ratios(getattr(args, "split", None))
        cut = [split_documents(ids, ratios, sb.seed) for ids in per_source]
        splits = {name: [c[i] for c in cut] for i, name in enumerate(SPLITS)}
        what = f"--split {args.split or DEFAULT_SPLIT}"
    else:   # each data set wholly in its split; a split's blend weights its own sources
        owner = [s for s in SPLITS for _ in per_split[s][0] or []]
        none = np.zeros(0, dtype=np.int64)
        splits = {s: [ids if o == s else none for ids, o in zip(per_source, owner)]
                  for s in SPLITS}
        given = [per_split[s][1] or [None] * len(per_split[s][0] or []) for s in SPLITS]
        weights = [w for ws in given for w in ws]
        weights = None if all(w is None for w in weights) else weights
        what = "--train-data-path"
    if not any(s.size for s in splits["train"]):
        raise DataError(f"{what}: no document left for training ({len(corpus)} documents in "
                        f"all)")
    name = tok.name if isinstance(tok, TextTokenizer) else f"plugin:{tok}"
    return PluginData(corpus=corpus, splits=splits, weights=weights, tokenizer=name)


def check_vocab(data: PluginData, model_vocab_size: int) -> None:
    """The model's (padded) vocabulary must hold every token id of the data."""
    need = int(data.corpus.vocab_size)
    if model_vocab_size < need:
        raise LaunchError(
            f"the model's vocabulary ({model_vocab_size} ids, from --vocab-size / the tokenizer) "
            f"is smaller than the data's ({need} ids, {data.tokenizer}): pass --vocab-size {need}")


# --- micro-batches ---------------------------------------------------------------------------

def microbatch_inputs(segments, corpus, capacity: int, device, *, step: Optional[int] = None,
                      index: Optional[int] = None, pad_multiple: int = 1, cp_size: int = 1,
                      cp_rank: int = 0, length_multiple: int = 0) -> dict:
    """One packed micro-batch as Megatron THD inputs: tokens/labels/loss_mask/position_ids
    ``[1, T]`` and a ``SparsePackedSeqParams`` (cu_seqlens int32 ``[n_seq + 1]``).

    With ``pad_multiple`` > 1 documents are padded after their EOD (outside the loss), and the
    params carry Megatron's padded-THD pair: ``cu_seqlens_q`` the real lengths,
    ``cu_seqlens_q_padded`` the boundaries. With ``cp_size`` > 1 the token tensors hold CP rank
    ``cp_rank``'s share, ``[1, T / cp_size]`` in Megatron's per-document zigzag order (what
    transformer-engine's ``thd_get_partitioned_indices`` gives); the cu_seqlens stay global.
    ``T`` is ``capacity``, or with ``length_multiple`` > 0 the documents' positions rounded up
    to a multiple of it (``data.packing.packed_length``: variable-length micro-batches)."""
    mb = materialize(segments, corpus, capacity, pad_multiple=pad_multiple,
                     length_multiple=length_multiple)
    cu = torch.from_numpy(mb.cu_seqlens).to(device)
    real = None if mb.cu_seqlens_real is None else torch.from_numpy(mb.cu_seqlens_real).to(device)
    max_len = mb.max_seqlen
    psp = SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu if real is None else real,
                                cu_seqlens_kv=cu if real is None else real,
                                cu_seqlens_q_padded=None if real is None else cu,
                                cu_seqlens_kv_padded=None if real is None else cu,
                                max_seqlen_q=max_len, max_seqlen_kv=max_len, sb_step=step,
                                sb_microbatch=index,
                                sb_doc_ids=tuple(int(d) for d, _, _ in segments),
                                sb_cp_size=int(cp_size),
                                sb_cu_seqlens_host=tuple(int(x) for x in (
                                    mb.cu_seqlens if real is None else mb.cu_seqlens_real)),
                                sb_cu_seqlens_padded_host=None if real is None else
                                tuple(int(x) for x in mb.cu_seqlens))
    keep = zigzag_positions(mb.cu_seqlens, cp_size, cp_rank) if cp_size > 1 else slice(None)

    def t(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(np.asarray(a)[keep])).to(
            device=device, dtype=dtype).unsqueeze(0)

    return {"tokens": t(mb.tokens, torch.int64), "labels": t(mb.labels, torch.int64),
            "loss_mask": t(mb.loss_mask, torch.float32),
            "position_ids": t(mb.position_ids, torch.int64), "packed_seq_params": psp}


class TrainIterator:
    """This DP rank's micro-batches, step after step, as the callback prepared the steps.

    With the interleaved schedule Megatron reads one iterator per model chunk: each chunk's
    iterator is its own cursor over the same prepared steps (every chunk runs every
    micro-batch). ``save_state`` is Megatron's hook for external data loaders
    (``--dataloader-save``): the callback's state goes into Megatron's checkpoint folder of the
    iteration (with model chunks the hook is off and ``state.save_at_checkpoints`` writes it).
    """

    def __init__(self, callback, device, *, chunk: int = 0):
        self.callback, self.device, self.chunk = callback, device, int(chunk)
        self._step = None
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        cb = self.callback
        if self._step is None or self._next == self._step.batch.num_microbatches:
            self._step, self._next = cb.step_for_chunk(self.chunk), 0
        j = self._next
        self._next += 1
        cb.note_forward(j, self.chunk)
        batch = self._step.batch
        # the packing's own lengths (Megatron's dp_balanced: its documents only, at any length)
        return microbatch_inputs(self._step.own[j], cb.corpus, cb.capacity,
                                 self.device, step=self._step.iteration, index=j,
                                 **dict(cb.mb_args, length_multiple=batch.length_multiple))

    def save_state(self) -> dict:
        return self.callback.state_dict()


class EvalIterator:
    """Micro-batches of the valid or test split: Megatron's sequential order, ``dp`` bins per
    row, this DP rank's bin of each row; endless (the split is re-read epoch after epoch)."""

    def __init__(self, sampler: GlobalBatchSampler, corpus, *, capacity: int, dp: int,
                 dp_rank: int, device, consumed_samples: int = 0, mb_args: Optional[dict] = None):
        self.sampler, self.corpus = sampler, corpus
        self.capacity, self.dp, self.dp_rank, self.device = capacity, dp, dp_rank, device
        self.mb_args = mb_args or {}   # microbatch_inputs' keywords (CP split, lengths)
        self.sampler.skip_bins(int(consumed_samples))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.inputs(self.next_rows())

    def next_rows(self) -> list:
        """The next ``dp`` bins in Megatron's sequential order, one row (micro-batch) per DP
        rank: every DP rank's."""
        return sequential_pack(self.sampler.next_bins(self.dp), capacity=self.capacity,
                               dp=self.dp, num_microbatches=1)

    def inputs(self, rows: list) -> dict:
        """This DP rank's micro-batch of ``rows`` (``next_rows``)."""
        return microbatch_inputs(rows[self.dp_rank][0], self.corpus, self.capacity,
                                 self.device, **self.mb_args)


def held_out_batch(data, sb, *, capacity: int, dp: int, dp_rank: int, device,
                   mb_args: dict) -> tuple:
    """(this DP rank's micro-batches [K], every DP rank's documents' lengths [n] over all K
    rows) of the valid split's first K = ``--sb-quality-refresh-microbatches`` rows of ``dp``
    bins, each row packed as ``EvalIterator`` packs it: the quality refresh's fixed held-out
    batch (``step/quality_probe.py``). ``LaunchError`` where the split holds no documents."""
    sampler = data.sampler("valid", capacity=capacity, seed=sb.seed,
                           long_sample_policy=sb.long_sample_policy,
                           pad_multiple=mb_args["pad_multiple"])
    if sampler is None:
        raise LaunchError(f"{flag_name('quality_refresh_interval')} "
                          f"{sb.quality_refresh_interval}: the valid split holds no documents "
                          f"to measure the network on (give --split a valid share, or "
                          f"--valid-data-path)")
    it = EvalIterator(sampler, data.corpus, capacity=capacity, dp=dp, dp_rank=dp_rank,
                      device=device, mb_args=mb_args)
    k = sb.quality_refresh_microbatches
    rows = [it.next_rows() for _ in range(k)]
    segments = [tuple(seg) for r in rows for ranks in r for seg in ranks[0]]
    if len(set(segments)) < len(segments):       # the split re-read: documents counted twice
        raise LaunchError(f"{flag_name('quality_refresh_microbatches')} {k}: the valid split's "
                          f"documents fill fewer than {k} rows of {dp} micro-batches, so the "
                          f"refresh would measure some twice (give fewer micro-batches, or a "
                          f"larger valid split)")
    lengths = np.array([e - s for _, s, e in segments], dtype=np.float64)
    return [it.inputs(r) for r in rows], lengths


def plugin_datasets(cb, data, sb, args, vp_stage):
    """The plugin's train, valid and test iterators for ``hooks.datasets_provider`` (every rank
    builds its own): the callback's train iterator of model chunk ``vp_stage``, and evaluation
    iterators over the valid and test splits."""
    from megatron.core import parallel_state as ps

    train = cb.train_iterator(chunk=vp_stage or 0) if args.train_iters else None
    evals = []
    for split, consumed in (("valid", args.consumed_valid_samples), ("test", 0)):
        sampler = data.sampler(split, capacity=cb.capacity, seed=sb.seed,
                               long_sample_policy=sb.long_sample_policy,
                               pad_multiple=cb.mb_args["pad_multiple"])
        evals.append(None if sampler is None or not args.eval_iters else EvalIterator(
            sampler, cb.corpus, capacity=cb.capacity, dp=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(), device=cb.device,
            consumed_samples=consumed, mb_args=cb.mb_args))
    return train, evals[0], evals[1]
