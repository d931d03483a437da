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
  of that length (measured on CPU by the since-removed ``scripts/bench_microbatch_mix.py``, 8K micro-batch with
  1.4K real tokens, block-sparse d 0.5, fwd+bwd: 0.71 s with one padding sequence, 0.23 s with
  256-token pieces).

A document of ``n`` tokens is packed as ``n + 1`` positions: its tokens, then EOD. A ``Segment``
``(doc_id, start, end)`` is a range of those positions (``end <= n + 1``); only the last piece of a
document carries the EOD.
Must not depend on torch, torch.distributed or megatron.

Why this is long: sampling, packing and materializing are one pipeline whose padding rules
(``padding_lengths``, the EOD position) must agree at every step; they are kept side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .. import kernels
from ..config import LONG_SAMPLE_POLICIES
from .context_parallel import padded_length

Segment = tuple[int, int, int]   # (doc_id, start, end): positions [start, end) of doc + EOD
PAD_SEQ_TOKENS = 256
"""Longest padding sequence of a packed micro-batch. Shorter pieces make attention over padding
cheaper but add per-sequence overheads (Megatron's THD rotary loops over sequences): on CPU,
pieces of 64 / 128 / 256 / 512 tokens gave 0.28 / 0.26 / 0.23 / 0.29 s for the micro-batch above."""


def padding_lengths(n_pad: int, multiple: int = 1) -> list[int]:
    """Lengths of the padding sequences that fill ``n_pad`` tokens (the last may be shorter);
    each a multiple of ``multiple`` (context parallelism), ``n_pad`` must be one too."""
    if n_pad < 0:
        raise ValueError(f"padding of {n_pad} tokens: expected >= 0")
    if n_pad % multiple:
        raise ValueError(f"padding of {n_pad} tokens: expected a multiple of {multiple}")
    piece = max(PAD_SEQ_TOKENS // multiple, 1) * multiple
    full, rest = divmod(int(n_pad), piece)
    return [piece] * full + ([rest] if rest else [])


def packed_length(n_tokens, capacity: int, multiple: int = 0):
    """Positions of a packed micro-batch whose documents take ``n_tokens`` (an int or an integer
    array): ``capacity`` with ``multiple`` 0 (fixed-length micro-batches, padding fills them),
    else ``n_tokens`` rounded up to a multiple of ``multiple`` (at least one), at most
    ``capacity`` (variable-length micro-batches, ``--sb-microbatch-multiple``)."""
    if multiple < 0:
        raise ValueError(f"multiple={multiple!r}: expected an integer >= 0 (0: fixed length)")
    if multiple == 0:
        return np.full_like(n_tokens, capacity) if isinstance(n_tokens, np.ndarray) \
            else int(capacity)
    if isinstance(n_tokens, np.ndarray):
        return np.minimum(np.maximum(padded_length(n_tokens, multiple), multiple), capacity)
    return min(max(padded_length(n_tokens, multiple), multiple), int(capacity))


class LongDocumentError(ValueError):
    """A document does not fit a micro-batch and the policy is 'error'."""


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    return int(value)


def sequential_bins(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` per bin: fill in order, open a new bin when the next one does not
    fit (``kernels.packing.sequential_starts``)."""
    starts = kernels.packing.sequential_starts(np.asarray(sizes, dtype=np.int64), capacity).tolist()
    return [list(range(a, b)) for a, b in zip(starts, starts[1:] + [len(sizes)])]


def check_bin_count(n_bins: int, sizes: Sequence[int], capacity: int, dp: int, m: int) -> None:
    """ValueError when the sequential fill of segments of ``sizes`` tokens needs more
    micro-batches (``n_bins``) than dp x m."""
    if n_bins > dp * m:
        raise ValueError(f"{len(sizes)} segments ({sum(sizes)} tokens) need {n_bins} "
                         f"micro-batches of {capacity} tokens; expected at most dp x m = {dp * m}")


def sequential_pack(segments: Sequence[Segment], *, capacity: int, dp: int,
                    num_microbatches: int) -> list[list[list[Segment]]]:
    """``[dp][num_microbatches]`` lists of segments: Megatron's default, fill in order.

    Micro-batches left over after the segments run out are empty (all padding).
    """
    capacity = _check_positive_int("capacity", capacity)
    dp = _check_positive_int("dp", dp)
    m = _check_positive_int("num_microbatches", num_microbatches)
    sizes = [int(e) - int(s) for _, s, e in segments]
    bins = sequential_bins(sizes, capacity)
    check_bin_count(len(bins), sizes, capacity, dp, m)
    bins += [[] for _ in range(dp * m - len(bins))]
    return [[[tuple(segments[i]) for i in bins[k * dp + r]] for k in range(m)] for r in range(dp)]


@dataclass
class PackedMicroBatch:
    """One micro-batch of ``T`` tokens (``packed_length``: the capacity, or its documents rounded
    up); padding is its last sequences
    (``padding_lengths``) and, with a ``pad_multiple`` > 1, the positions after each document's
    EOD up to the next multiple (``cu_seqlens_real`` then differs from ``cu_seqlens``)."""

    segments: list[Segment]
    tokens: np.ndarray        # [T] int64
    labels: np.ndarray        # [T] int64, next token of the same document (EOD at padding)
    loss_mask: np.ndarray     # [T] float32, 0 on padding and where no in-document next token
    position_ids: np.ndarray  # [T] int64, restarting at 0 at every sequence
    cu_seqlens: np.ndarray    # [n_seq + 1] int32, 0 ... T: sequence boundaries (padding included)
    cu_seqlens_real: Optional[np.ndarray] = None   # [n_seq + 1] int32: cumulative real lengths
    """Megatron's ``cu_seqlens_q`` when sequences are padded (its ``cu_seqlens_q_padded`` is then
    ``cu_seqlens``); None: no sequence is padded."""

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if self.cu_seqlens.size > 1 else 0

    @property
    def n_real_tokens(self) -> int:
        """Positions of the documents' sequences (EOD and per-document padding included), i.e.
        T minus the padding sequences."""
        return int(sum(e - s for _, s, e in self.segments))


def materialize(segments: Sequence[Segment], corpus, capacity: int, *,
                pad_multiple: int = 1, length_multiple: int = 0) -> PackedMicroBatch:
    """Arrays of one micro-batch from its segments; ``corpus`` has ``tokens(id)`` and ``eod_id``.

    The micro-batch holds ``packed_length(its segments' tokens, capacity, length_multiple)``
    positions: ``capacity`` by default, its documents rounded up to a multiple of
    ``length_multiple`` when that is > 0 (a multiple of ``pad_multiple``).

    ``pad_multiple`` > 1 (context parallelism): a document of ``n`` tokens spans
    ``padded_length(n + 1, pad_multiple)`` positions, its tokens, EOD, then padding (EOD tokens
    outside the loss), as ``GlobalBatchSampler(pad_multiple=...)`` cuts it; every sequence
    then holds a multiple of ``pad_multiple`` positions, and the padding sequences too."""
    capacity = _check_positive_int("capacity", capacity)
    pad_multiple = _check_positive_int("pad_multiple", pad_multiple)
    if capacity % pad_multiple:
        raise ValueError(f"capacity {capacity}: expected a multiple of pad_multiple "
                         f"{pad_multiple}")
    if length_multiple % pad_multiple:
        raise ValueError(f"length_multiple {length_multiple}: expected a multiple of "
                         f"pad_multiple {pad_multiple}")
    n_docs = sum(int(e) - int(s) for _, s, e in segments)
    if n_docs > capacity:
        raise ValueError(f"segments hold {n_docs} tokens: expected at most capacity {capacity}")
    capacity = packed_length(n_docs, capacity, length_multiple)
    eod = int(corpus.eod_id)
    tokens = np.full(capacity, eod, dtype=np.int64)
    labels = np.full(capacity, eod, dtype=np.int64)
    loss_mask = np.zeros(capacity, dtype=np.float32)
    position_ids = np.zeros(capacity, dtype=np.int64)
    cu, cu_real = [0], [0]
    p = 0
    for doc_id, start, end in segments:
        doc = corpus.tokens(int(doc_id))
        n_doc = int(doc.size)
        limit = padded_length(n_doc + 1, pad_multiple)
        if not 0 <= start < end <= limit or start > n_doc:
            raise ValueError(f"segment {(doc_id, start, end)}: expected 0 <= start <= {n_doc} "
                             f"and start < end <= {limit} (document {doc_id} has {n_doc} tokens "
                             f"+ EOD" + (f", padded to a multiple of {pad_multiple})"
                                         if pad_multiple > 1 else ")"))
        n = end - start        # the segments fit: checked above
        real_end = min(end, n_doc + 1)
        n_real = real_end - start
        # Positions [start, real_end] of doc + EOD: the segment's tokens and the token after each.
        ext = np.asarray(doc[start:min(real_end + 1, n_doc)], dtype=np.int64)
        if real_end >= n_doc:
            ext = np.concatenate([ext, np.array([eod], dtype=np.int64)])
        tokens[p:p + n_real] = ext[:n_real]
        nxt = ext[1:]                # n_real values, or n_real - 1 when the segment holds the EOD
        labels[p:p + nxt.size] = nxt
        loss_mask[p:p + nxt.size] = 1.0
        position_ids[p:p + n] = np.arange(n)
        p += n
        cu.append(p)
        cu_real.append(cu_real[-1] + n_real)
    for n in padding_lengths(capacity - p, pad_multiple):
        position_ids[p:p + n] = np.arange(n)
        p += n
        cu.append(p)
        cu_real.append(cu_real[-1] + n)
    cu_arr = np.asarray(cu, dtype=np.int32)
    real_arr = np.asarray(cu_real, dtype=np.int32)
    return PackedMicroBatch(segments=[tuple(int(x) for x in s) for s in segments], tokens=tokens,
                            labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                            cu_seqlens=cu_arr,
                            cu_seqlens_real=None if np.array_equal(cu_arr, real_arr) else real_arr)


class GlobalBatchSampler:
    """A deterministic (seed) stream of documents cut into micro-batch "bins" of ``capacity``
    tokens under sequential packing; step t's global batch is the next ``dp * num_microbatches``
    bins. A bin is Megatron's sample: after ``k`` consumed samples the stream stands at bin ``k``
    whatever the batch sizes of the steps were (``skip_bins``), so a resumed run, or one whose
    global batch size ramps up, reads what the uninterrupted run read.

    Documents come from one or more *sources* (arrays of document ids: a data set of a blend, or
    the train/valid/test split of one). Each source is read in a shuffled order, reshuffled every
    epoch (seeded by the seed, the source and the epoch), never dropping or duplicating a document
    within an epoch. With several sources the next document comes from the source furthest behind
    its share of tokens: ``weights`` (Megatron's blend weights, normalised), or by default each
    source's token count (every source then finishes its epoch together: a plain union).
    Documents longer than ``capacity`` are split into pieces of ``capacity`` tokens counted from
    the document start (or refused), so pieces are the same whatever the step boundaries.

    ``lengths`` are token counts without EOD; with ``append_eod`` each document takes one more.
    With ``pad_multiple`` > 1 (context parallelism) a document takes its positions rounded up to
    a multiple of it (``materialize`` pads it after the EOD); ``capacity`` must be a multiple.
    """

    def __init__(self, lengths, *, capacity: int, dp: int = 1, num_microbatches: int = 1,
                 seed: int, long_sample_policy: str = "split", append_eod: bool = True,
                 sources: Optional[Sequence[Sequence[int]]] = None,
                 weights: Optional[Sequence[float]] = None, pad_multiple: int = 1):
        self.capacity = _check_positive_int("capacity", capacity)
        self.pad_multiple = _check_positive_int("pad_multiple", pad_multiple)
        if self.capacity % self.pad_multiple:
            raise ValueError(f"capacity {self.capacity}: expected a multiple of pad_multiple "
                             f"{self.pad_multiple}")
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
        self.n_positions = padded_length(self.n_positions, self.pad_multiple)
        if bad.size:
            raise ValueError(f"document {int(bad[0])} has {int(lengths[bad[0]])} tokens: "
                             f"expected >= 1")
        self.sources = self._check_sources(sources)
        self.weights = self._check_weights(weights)
        if long_sample_policy == "error":
            used = np.concatenate(self.sources)
            too_long = used[self.n_positions[used] > self.capacity]
            if too_long.size:
                d = int(np.sort(too_long)[0])
                raise LongDocumentError(
                    f"document {d} has {int(lengths[d])} tokens"
                    + (" + EOD" if append_eod else "")
                    + f" > capacity {self.capacity} (--seq-length); {too_long.size} documents are"
                    f" this long. Use --sb-long-sample-policy split or a larger --seq-length.")
        k = len(self.sources)
        self.epochs, self.positions, self.taken = [0] * k, [0] * k, [0] * k
        self.current: Optional[int] = None   # source of the document being cut (offset > 0)
        self.offset, self.step, self.bins = 0, 0, 0
        self._orders: dict = {}
        self._stream: tuple = (None,)        # (epochs, orders end to end, their starts)

    def _check_sources(self, sources) -> list:
        n = self.n_positions.size
        if sources is None:
            return [np.arange(n, dtype=np.int64)]
        out = []
        for i, src in enumerate(sources):
            src = np.asarray(src, dtype=np.int64)
            if src.ndim != 1 or src.size == 0:
                raise ValueError(f"source {i}: expected a non-empty 1-D array of document ids, "
                                 f"got shape {src.shape}")
            if src.min() < 0 or src.max() >= n or np.unique(src).size != src.size:
                raise ValueError(f"source {i}: document ids must be distinct and in [0, {n})")
            out.append(src)
        if not out:
            raise ValueError("sources=[]: expected at least one source of documents")
        return out

    def _check_weights(self, weights) -> np.ndarray:
        if weights is None:   # each source's share of tokens: a plain union of the sources
            return np.array([float(self.n_positions[s].sum()) for s in self.sources])
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(self.sources),) or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"weights={list(weights)!r}: expected {len(self.sources)} finite "
                             f"numbers > 0 (one per source)")
        return w

    def __len__(self) -> int:
        return int(self.n_positions.size)

    # Single-source views (the common case, and what logs and tests read).
    @property
    def epoch(self) -> int:
        return self.epochs[0]

    @property
    def position(self) -> int:
        return self.positions[0]

    def source_order(self, source: int, epoch: int) -> np.ndarray:
        """Document ids of ``source`` in the order of ``epoch`` (seeded by seed, source, epoch)."""
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 8:
                self._orders.clear()
            seed = [self.seed, int(epoch)] if len(self.sources) == 1 else \
                [self.seed, int(source), int(epoch)]
            src = self.sources[source]
            self._orders[key] = src[np.random.default_rng(seed).permutation(src.size)]
        return self._orders[key]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document ids in the order of ``epoch`` (single source)."""
        return self.source_order(0, epoch)

    def _pick_source(self) -> int:
        if self.current is not None:
            return self.current
        if len(self.sources) == 1:
            return 0
        return int(np.argmin(np.asarray(self.taken, dtype=np.float64) / self.weights))

    def next_bins(self, n_bins: int) -> list[Segment]:
        """Segments of the next ``n_bins`` bins, in order (the last bin may be part-filled)."""
        return list(map(tuple, self.next_bin_array(n_bins).tolist()))

    def next_bin_array(self, n_bins: int) -> np.ndarray:
        """``next_bins`` as an [n, 3] int64 array of (doc, start, end) rows: the stream cut by
        a compiled pass (``kernels.packing.stream_pass``: a document at a time, in each
        source's order, from the source furthest behind its share; a piece that does not fit
        what is free in the bin opens the next one), with no Python object per segment (what
        the planner is sent at every step)."""
        from .. import kernels

        n_bins = _check_positive_int("n_bins", n_bins)
        k = len(self.sources)
        sizes = np.fromiter((src.size for src in self.sources), dtype=np.int64, count=k)
        positions = np.asarray(self.positions, dtype=np.int64)
        taken = np.asarray(self.taken, dtype=np.int64)
        state = np.array([-1 if self.current is None else self.current, self.offset, n_bins,
                          0, 0], dtype=np.int64)
        out = np.empty((8 * n_bins + 16, 3), dtype=np.int64)
        while True:
            order, lo = self._stream_orders(sizes)
            stop = kernels.packing.stream_pass(order, lo, kernels.i64(self.n_positions),
                                               kernels.f64(self.weights),
                                               self.capacity, positions, sizes, taken, state,
                                               out)
            if stop == -1:
                break
            if stop == -2:                       # more pieces than rows: twice the rows
                out = np.concatenate([out, np.empty_like(out)])
            else:                                # source ``stop`` read all its documents
                self.epochs[stop] += 1
        self.positions, self.taken = positions.tolist(), taken.tolist()
        cur, self.offset = int(state[0]), int(state[1])
        self.current = None if cur < 0 else cur
        self.bins += n_bins
        return out[:int(state[4])].copy()

    def _stream_orders(self, sizes: np.ndarray) -> tuple:
        """(every source's order this epoch, end to end; where each starts), remade only when
        an epoch changes (``source_order``)."""
        key = tuple(self.epochs)
        if self._stream[0] != key:
            orders = [self.source_order(s, e) for s, e in enumerate(self.epochs)]
            self._stream = (key, orders[0] if len(orders) == 1 else np.concatenate(orders),
                            np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64))
        return self._stream[1], self._stream[2]

    def next_global_batch(self) -> list[Segment]:
        """Segments of this step: ``dp * num_microbatches`` bins."""
        out = self.next_bins(self.dp * self.num_microbatches)
        self.step += 1
        return out

    def skip_bins(self, n_bins: int) -> None:
        """Advance by ``n_bins`` bins (Megatron's consumed samples) without keeping them."""
        if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 0:
            raise ValueError(f"n_bins={n_bins!r}: expected an integer >= 0")
        left = int(n_bins)
        while left:
            chunk = min(left, 4096)
            self.next_bin_array(chunk)
            left -= chunk

    def skip_steps(self, n_steps: int) -> None:
        """Advance by ``n_steps`` global batches of ``dp * num_microbatches`` bins."""
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 0:
            raise ValueError(f"n_steps={n_steps!r}: expected an integer >= 0")
        self.skip_bins(int(n_steps) * self.dp * self.num_microbatches)
        self.step += int(n_steps)

    def state_dict(self) -> dict:
        state = {"epoch": self.epochs[0], "position": self.positions[0], "offset": self.offset,
                 "step": self.step, "bins": self.bins, "seed": self.seed,
                 "n_docs": int(self.n_positions.size)}
        if len(self.sources) > 1:
            state.update(epochs=list(self.epochs), positions=list(self.positions),
                         taken=list(self.taken), current=self.current)
        return state

    def load_state_dict(self, state: dict) -> None:
        for k in ("epoch", "position", "offset", "seed", "n_docs"):
            if k not in state:
                raise ValueError(f"sampler state {sorted(state)}: missing {k!r}")
        if state["seed"] != self.seed or state["n_docs"] != self.n_positions.size:
            raise ValueError(
                f"sampler state of seed {state['seed']} over {state['n_docs']} documents: "
                f"expected seed {self.seed} over {self.n_positions.size} documents (same data "
                f"and --sb-seed as the run that saved it)")
        k = len(self.sources)
        epochs = [int(x) for x in state.get("epochs", [state["epoch"]])]
        positions = [int(x) for x in state.get("positions", [state["position"]])]
        taken = [int(x) for x in state.get("taken", [0] * k)]
        if not len(epochs) == len(positions) == len(taken) == k:
            raise ValueError(f"sampler state for {len(epochs)} source(s): expected {k}")
        for i, (epoch, position) in enumerate(zip(epochs, positions)):
            if epoch < 0 or not 0 <= position < self.sources[i].size:
                raise ValueError(f"sampler state epoch={epoch}, position={position}: expected "
                                 f"epoch >= 0 and 0 <= position < {self.sources[i].size}")
        offset = int(state["offset"])
        current = state.get("current", 0 if offset else None) if k > 1 else (0 if offset else None)
        if offset:
            src = 0 if current is None else int(current)
            doc = int(self.source_order(src, epochs[src])[positions[src]])
            if not 0 <= offset < self.n_positions[doc]:
                raise ValueError(f"sampler state offset={offset}: expected 0 <= offset < "
                                 f"{int(self.n_positions[doc])} (document {doc})")
        self.epochs, self.positions, self.taken = epochs, positions, taken
        self.offset, self.current = offset, current
        self.step, self.bins = int(state.get("step", 0)), int(state.get("bins", 0))
