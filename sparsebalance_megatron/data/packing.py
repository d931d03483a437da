"""Documents -> global batches -> packed micro-batches with ``cu_seqlens`` (THD layout).

- ``GlobalBatchSampler``: a seeded, resumable order of documents over epochs; each step takes the
  next documents that fill ``dp * num_microbatches`` micro-batches of ``capacity`` tokens under
  sequential packing. Documents longer than ``capacity`` are split into pieces of ``capacity``
  tokens counted from the document start (or refused), so the pieces are the same whatever the
  step boundaries and a resumed run replays the uninterrupted one.
- ``sequential_pack``: Megatron's default assignment of a global batch (fill in order; the j-th
  micro-batch goes to DP rank ``j % dp`` as its micro-batch ``j // dp``, as Megatron's
  pretraining sampler slices each ``dp * micro_batch_size`` chunk). SAB replaces this step.
- ``materialize``: the arrays of one micro-batch; every sequence of ``cu_seqlens`` is one piece of
  one document, so attention and labels never cross a document. Padding up to ``capacity`` is
  cut into sequences of at most ``PAD_SEQ_TOKENS`` (``padding_lengths``): attention over padding
  then costs a few blocks, where one long padding sequence would cost as much as a real document
  of that length (measured on CPU by ``scripts/bench_microbatch_mix.py``, 8K micro-batch with
  1.4K real tokens, block-sparse d 0.5, fwd+bwd: 0.71 s with one padding sequence, 0.23 s with
  256-token pieces).

A document of ``n`` tokens is packed as ``n + 1`` positions: its tokens, then EOD. A ``Segment``
``(doc_id, start, end)`` is a range of those positions (``end <= n + 1``); only the last piece of a
document carries the EOD.
Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..config import LONG_SAMPLE_POLICIES

Segment = tuple[int, int, int]   # (doc_id, start, end): positions [start, end) of doc + EOD
PAD_SEQ_TOKENS = 256
"""Longest padding sequence of a packed micro-batch. Shorter pieces make attention over padding
cheaper but add per-sequence overheads (Megatron's THD rotary loops over sequences): on CPU,
pieces of 64 / 128 / 256 / 512 tokens gave 0.28 / 0.26 / 0.23 / 0.29 s for the micro-batch above."""


def padding_lengths(n_pad: int) -> list[int]:
    """Lengths of the padding sequences that fill ``n_pad`` tokens (the last may be shorter)."""
    if n_pad < 0:
        raise ValueError(f"padding of {n_pad} tokens: expected >= 0")
    full, rest = divmod(int(n_pad), PAD_SEQ_TOKENS)
    return [PAD_SEQ_TOKENS] * full + ([rest] if rest else [])


class LongDocumentError(ValueError):
    """A document does not fit a micro-batch and the policy is 'error'."""


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    return int(value)


def _sequential_bins(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` per bin: fill in order, open a new bin when the next one does not fit."""
    bins: list[list[int]] = []
    free = 0
    for i, size in enumerate(sizes):
        if size > capacity:
            raise ValueError(f"segment {i} has {size} tokens > capacity {capacity}")
        if size > free:
            bins.append([])
            free = capacity
        bins[-1].append(i)
        free -= size
    return bins


def sequential_pack(segments: Sequence[Segment], *, capacity: int, dp: int,
                    num_microbatches: int) -> list[list[list[Segment]]]:
    """``[dp][num_microbatches]`` lists of segments: Megatron's default, fill in order.

    Micro-batches left over after the segments run out are empty (all padding).
    """
    capacity = _check_positive_int("capacity", capacity)
    dp = _check_positive_int("dp", dp)
    m = _check_positive_int("num_microbatches", num_microbatches)
    sizes = [int(e) - int(s) for _, s, e in segments]
    bins = _sequential_bins(sizes, capacity)
    if len(bins) > dp * m:
        raise ValueError(f"{len(segments)} segments ({sum(sizes)} tokens) need {len(bins)} "
                         f"micro-batches of {capacity} tokens; expected at most dp x m = {dp * m}")
    bins += [[] for _ in range(dp * m - len(bins))]
    return [[[tuple(segments[i]) for i in bins[k * dp + r]] for k in range(m)] for r in range(dp)]


@dataclass
class PackedMicroBatch:
    """One micro-batch of ``T == capacity`` tokens; padding is its last sequences
    (``padding_lengths``)."""

    segments: list[Segment]
    tokens: np.ndarray        # [T] int64
    labels: np.ndarray        # [T] int64, next token of the same document (EOD at padding)
    loss_mask: np.ndarray     # [T] float32, 0 on padding and where no in-document next token
    position_ids: np.ndarray  # [T] int64, restarting at 0 at every sequence
    cu_seqlens: np.ndarray    # [n_seq + 1] int32, 0 ... T

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if self.cu_seqlens.size > 1 else 0

    @property
    def n_real_tokens(self) -> int:
        """Tokens of documents (EOD included), i.e. T minus padding."""
        return int(sum(e - s for _, s, e in self.segments))


def materialize(segments: Sequence[Segment], corpus, capacity: int) -> PackedMicroBatch:
    """Arrays of one micro-batch from its segments; ``corpus`` has ``tokens(id)`` and ``eod_id``."""
    capacity = _check_positive_int("capacity", capacity)
    eod = int(corpus.eod_id)
    tokens = np.full(capacity, eod, dtype=np.int64)
    labels = np.full(capacity, eod, dtype=np.int64)
    loss_mask = np.zeros(capacity, dtype=np.float32)
    position_ids = np.zeros(capacity, dtype=np.int64)
    cu = [0]
    p = 0
    for doc_id, start, end in segments:
        doc = corpus.tokens(int(doc_id))
        n_doc = int(doc.size)
        if not 0 <= start < end <= n_doc + 1:
            raise ValueError(f"segment {(doc_id, start, end)}: expected 0 <= start < end <= "
                             f"{n_doc + 1} (document {doc_id} has {n_doc} tokens + EOD)")
        n = end - start
        if p + n > capacity:
            raise ValueError(f"segments hold {p + n}+ tokens: expected at most capacity "
                             f"{capacity}")
        # Positions [start, end] of doc + EOD: the segment's tokens and the token after each.
        ext = np.asarray(doc[start:min(end + 1, n_doc)], dtype=np.int64)
        if end >= n_doc:
            ext = np.concatenate([ext, np.array([eod], dtype=np.int64)])
        tokens[p:p + n] = ext[:n]
        nxt = ext[1:]                     # n values, or n - 1 when the segment ends with EOD
        labels[p:p + nxt.size] = nxt
        loss_mask[p:p + nxt.size] = 1.0
        position_ids[p:p + n] = np.arange(n)
        p += n
        cu.append(p)
    for n in padding_lengths(capacity - p):
        position_ids[p:p + n] = np.arange(n)
        p += n
        cu.append(p)
    return PackedMicroBatch(segments=[tuple(int(x) for x in s) for s in segments], tokens=tokens,
                            labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                            cu_seqlens=np.asarray(cu, dtype=np.int32))


class GlobalBatchSampler:
    """Deterministic (seed) shuffled order of documents over epochs; step t's global batch is the
    next documents in that order that fill ``dp * num_microbatches`` micro-batches of ``capacity``
    tokens under sequential packing, the remainder starting the next step. Never drops or
    duplicates a document within an epoch (a step may straddle two epochs). Resumable:
    ``state_dict()`` = (epoch, position, offset) -> the same order as an uninterrupted run.

    ``lengths`` are token counts without EOD; with ``append_eod`` each document takes one more.
    """

    def __init__(self, lengths, *, capacity: int, dp: int, num_microbatches: int, seed: int,
                 long_sample_policy: str = "split", append_eod: bool = True):
        self.capacity = _check_positive_int("capacity", capacity)
        self.dp = _check_positive_int("dp", dp)
        self.num_microbatches = _check_positive_int("num_microbatches", num_microbatches)
        if long_sample_policy not in LONG_SAMPLE_POLICIES:
            raise ValueError(f"long_sample_policy={long_sample_policy!r}: expected one of "
                             f"{', '.join(LONG_SAMPLE_POLICIES)}")
        self.long_sample_policy = long_sample_policy
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed={seed!r}: expected an integer >= 0")
        self.seed = int(seed)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"lengths of shape {lengths.shape}: expected a non-empty 1-D array")
        self.n_positions = lengths + (1 if append_eod else 0)   # [n_docs] packed positions
        bad = np.flatnonzero(self.n_positions < 1)
        if bad.size:
            raise ValueError(f"document {int(bad[0])} has {int(lengths[bad[0]])} tokens: "
                             f"expected >= 1")
        if long_sample_policy == "error":
            too_long = np.flatnonzero(self.n_positions > self.capacity)
            if too_long.size:
                d = int(too_long[0])
                raise LongDocumentError(
                    f"document {d} has {int(lengths[d])} tokens"
                    + (" + EOD" if append_eod else "")
                    + f" > capacity {self.capacity} (--seq-length); {too_long.size} documents are"
                    f" this long. Use --sb-long-sample-policy split or a larger --seq-length.")
        self.epoch, self.position, self.offset, self.step = 0, 0, 0, 0
        self._order_epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.n_positions.size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document ids in the order of ``epoch``: a permutation seeded by (seed, epoch)."""
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, int(epoch)])
            self._order = rng.permutation(self.n_positions.size)
            self._order_epoch = epoch
        return self._order

    def next_global_batch(self) -> list[Segment]:
        """Segments of this step, in order; they fill at most ``dp * num_microbatches`` bins."""
        out: list[Segment] = []
        bins_left, free = self.dp * self.num_microbatches, 0
        while True:
            doc = int(self.epoch_order(self.epoch)[self.position])
            n = int(self.n_positions[doc])
            end = min(n, self.offset + self.capacity)
            size = end - self.offset
            if size > free:
                if bins_left == 0:
                    break
                bins_left -= 1
                free = self.capacity
            out.append((doc, self.offset, end))
            free -= size
            self.offset = end
            if self.offset == n:
                self.offset = 0
                self.position += 1
                if self.position == self.n_positions.size:
                    self.position, self.epoch = 0, self.epoch + 1
        self.step += 1
        return out

    def skip_steps(self, n_steps: int) -> None:
        """Advance by ``n_steps`` global batches: resuming at Megatron's ``iteration`` without a
        saved sampler state gives the same order (the sampler is a pure function of the seed)."""
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 0:
            raise ValueError(f"n_steps={n_steps!r}: expected an integer >= 0")
        for _ in range(int(n_steps)):
            self.next_global_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "offset": self.offset,
                "step": self.step, "seed": self.seed, "n_docs": int(self.n_positions.size)}

    def load_state_dict(self, state: dict) -> None:
        for k in ("epoch", "position", "offset", "seed", "n_docs"):
            if k not in state:
                raise ValueError(f"sampler state {sorted(state)}: missing {k!r}")
        if state["seed"] != self.seed or state["n_docs"] != self.n_positions.size:
            raise ValueError(
                f"sampler state of seed {state['seed']} over {state['n_docs']} documents: "
                f"expected seed {self.seed} over {self.n_positions.size} documents (same data "
                f"and --sb-seed as the run that saved it)")
        epoch, position, offset = int(state["epoch"]), int(state["position"]), int(state["offset"])
        if epoch < 0 or not 0 <= position < self.n_positions.size:
            raise ValueError(f"sampler state epoch={epoch}, position={position}: expected "
                             f"epoch >= 0 and 0 <= position < {self.n_positions.size}")
        doc = int(self.epoch_order(epoch)[position])
        if not 0 <= offset < self.n_positions[doc]:
            raise ValueError(f"sampler state offset={offset}: expected 0 <= offset < "
                             f"{int(self.n_positions[doc])} (document {doc})")
        self.epoch, self.position, self.offset = epoch, position, offset
        self.step = int(state.get("step", 0))
