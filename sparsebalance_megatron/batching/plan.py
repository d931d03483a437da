"""BatchPlan: which segments of which samples each DP rank runs in each micro-batch slot.

Plain data, shared by SAB and the two baselines (Megatron's sequential packing and token-count
balancing) so the data path and the benchmarks treat them alike:

    plan.micro_batches[dp_rank][slot] -> list of Segment (sample_id, start, end)

A segment is the token range [start, end) of sample ``sample_id`` (for the data pipeline's
documents: positions of the document + EOD, see ``data/packing.py``). A micro-batch holds at most
``max_tokens`` tokens (Megatron's ``--seq-length``; packed THD); it may be empty (all padding).
Also here: splitting samples longer than ``max_tokens`` (``long_sample_policy``) and the checks
every planner shares.

Pure Python + numpy (and ``kernels``); must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np

from .. import kernels
from ..data.packing import LONG_SAMPLE_POLICIES, PAD_SEQ_TOKENS, Segment, packed_length
from .segments import SegmentRows, checked_segments, offsets_of  # noqa: F401 (re-exported)


class BatchingError(ValueError):
    """The global batch cannot be planned (empty, too small for the DP ranks, does not fit)."""


class LongSampleError(BatchingError):
    """A sample is longer than ``max_tokens`` and ``long_sample_policy`` is 'error'."""


@dataclass
class BatchPlan:
    """A global batch laid out as ``micro_batches[dp_rank][slot]`` lists of segments, held as
    one CSR from the start: the segments [n, 3] rank-major in slot order and each micro-batch's
    count (a packer's ``SegmentRows``, or nested lists walked once when the plan is made)."""

    micro_batches: list            # [dp][m] -> list[Segment]
    method: str                    # "sequential" | "token_balanced" | "sab" | "dp_balanced"
    max_tokens: int
    num_split_samples: int = 0     # samples cut into several segments (long_sample_policy=split)
    fallback: bool = False         # SAB re-used the sequential bins (cost-aware packing did not fit);
    # dp_balanced: empty micro-batches where Megatron's own rule stops
    predicted_rank_cost_s: np.ndarray = field(default=None)  # [dp] planner's cost proxy per rank
    length_multiple: int = 0       # 0: every micro-batch is max_tokens long (padding fills it);
    # k > 0: variable-length micro-batches, their tokens rounded up to a multiple of k
    # (data.packing.packed_length, --sb-microbatch-multiple)
    # derived arrays (unit_csr, flat_lengths), computed once: a plan is not changed once made
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mbs = self.micro_batches
        if isinstance(mbs, SegmentRows):
            segments, offsets = mbs.segments, mbs.offsets
        else:
            counts = np.fromiter((len(mb) for rank in mbs for mb in rank), dtype=np.int64)
            segments = np.fromiter(chain.from_iterable(chain.from_iterable(chain.from_iterable(
                mbs))), dtype=np.int64, count=3 * int(counts.sum())).reshape(-1, 3)
            offsets = offsets_of(counts)
        self._cache.update({("csr", False): (offsets, segments[:, 2] - segments[:, 1]),
                            "segments": segments})

    def __getstate__(self) -> dict:
        """Pickled as arrays: the segments [n, 3] and each micro-batch's count, not a Python
        object per segment (the planner process sends the plan back at every step), and
        without ``_cache``'s other derived arrays."""
        state = dict(self.__dict__)
        offsets = self.unit_csr()[0]
        state.update(micro_batches=None, _cache={}, _packed=(
            self.segment_array(), np.diff(offsets), self.dp, self.num_microbatches))
        return state

    def __setstate__(self, state: dict) -> None:
        """The micro-batches as ``SegmentRows`` (a rank's lists made when first read) over the
        arrays."""
        segments, counts, dp, m = state.pop("_packed")
        self.__dict__.update(state)
        self.micro_batches = SegmentRows(segments, offsets_of(counts), dp, m)
        self.__post_init__()

    def with_length_multiple(self, multiple: int) -> "BatchPlan":
        """This plan with micro-batches of ``packed_length(tokens, max_tokens, multiple)`` (the
        same micro-batches, so the same arrays)."""
        return replace(self, length_multiple=check_int("length_multiple", multiple, 0))

    @classmethod
    def of_items(cls, arr: np.ndarray, items: np.ndarray, counts: np.ndarray, dp: int, m: int,
                 *args) -> "BatchPlan":
        """The plan a packer made from item indices: ``items`` [n] indices of rows of ``arr``
        [N, 3] rank-major in slot order, ``counts`` [dp * m] how many each micro-batch holds,
        ``args`` the plan's fields after the micro-batches."""
        return cls(SegmentRows(arr[items], offsets_of(counts), dp, m), *args)

    def row_plan(self, r: int) -> "BatchPlan":
        """DP rank ``r``'s micro-batches as a one-row plan (what a rank that packs only its own
        holds): the same segments, cost and padding, its arrays sliced from this plan's."""
        check_rank(r, self.dp)
        m, offsets = self.num_microbatches, self.unit_csr()[0]
        lo, hi = int(offsets[r * m]), int(offsets[(r + 1) * m])
        row = SegmentRows(self.segment_array()[lo:hi], offsets[r * m:(r + 1) * m + 1] - lo, 1, m)
        return replace(self, micro_batches=row,
                       predicted_rank_cost_s=None if self.predicted_rank_cost_s is None
                       else self.predicted_rank_cost_s[r:r + 1])

    @property
    def dp(self) -> int:
        return len(self.micro_batches)

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def unit_csr(self, with_padding: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The micro-batches as latency-model units in CSR form, rank-major: (offsets [dp*m + 1],
        lengths), unit u's sequences ``lengths[offsets[u]:offsets[u + 1]]``; ``with_padding``
        appends the padding sequences that fill each micro-batch to its packed length
        (``max_tokens``, or its tokens rounded up to ``length_multiple``), as the packed
        micro-batch holds them (``data.padding_lengths``). Computed once, vectorised."""
        key = ("csr", bool(with_padding))
        if key not in self._cache:      # the padded one: the plain CSR's lengths, padded
            plain, lengths = self.unit_csr(False)
            lengths, counts = padded_lengths(lengths, np.diff(plain), self.max_tokens,
                                             self.length_multiple)
            self._cache[key] = (offsets_of(counts), lengths)
        return self._cache[key]

    def flat_lengths(self, with_padding: bool = False) -> list:
        """The [dp][m] lengths flattened rank-major, as latency-model units (dp * m arrays);
        ``with_padding`` as in ``unit_csr``."""
        key = ("flat", bool(with_padding))
        if key not in self._cache:
            offsets, lengths = self.unit_csr(with_padding)
            self._cache[key] = np.split(lengths, offsets[1:-1])
        return self._cache[key]

    def tokens(self) -> np.ndarray:
        """[dp, m] tokens per micro-batch."""
        offsets, lengths = self.unit_csr()
        run = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=run[1:])
        return (run[offsets[1:]] - run[offsets[:-1]]).reshape(self.dp, self.num_microbatches)

    def packed_lengths(self) -> np.ndarray:
        """[dp, m] positions of every packed micro-batch (its tokens and the padding that fills
        it: ``max_tokens``, or the tokens rounded up to ``length_multiple``)."""
        return packed_length(self.tokens(), self.max_tokens, self.length_multiple)

    def segments(self) -> list:
        """All segments, rank-major then slot order."""
        return [seg for rank in self.micro_batches for mb in rank for seg in mb]

    def segment_array(self) -> np.ndarray:
        """``segments()`` as an [n, 3] int64 array (sample id, start, end)."""
        return self._cache["segments"]


def gathered_plan(batch, gather):
    """Every DP rank's micro-batches as one ``BatchPlan`` from each rank's own one-row
    ``batch``; ``gather``: a float64 row -> every rank's [dp, n] (a collective in a run: the
    counts, then the segments padded to the longest)."""

    counts = gather(np.diff(batch.unit_csr()[0]).astype(np.float64)).astype(np.int64)
    per_rank = counts.sum(axis=1)
    seg = batch.segment_array()
    pad = np.zeros((int(per_rank.max()), 3))
    pad[:len(seg)] = seg
    rows = gather(pad.reshape(-1)).reshape(len(counts), -1, 3).astype(np.int64)
    segments = np.concatenate([rows[r, :n] for r, n in enumerate(per_rank.tolist())])
    return BatchPlan(SegmentRows(segments, offsets_of(counts.reshape(-1)), *counts.shape),
                     batch.method, batch.max_tokens, batch.num_split_samples, batch.fallback,
                     None, batch.length_multiple)


def finish_plan(items, counts, method, max_tokens, n_split, fallback, arr, cost) -> BatchPlan:
    """The plan of the micro-batches ``items`` (indices of rows of ``arr``, the segments' [n, 3]
    array), ``counts`` [dp, m] of them each (``BatchPlan.of_items``), each rank's cost the
    ``sum()`` of its segments' ``cost`` in slot order (compiled: ``kernels.packing.py_sums``)."""
    rank_cost = kernels.packing.py_sums(cost, items, offsets_of(counts.sum(axis=1)))
    return BatchPlan.of_items(arr, items, counts.reshape(-1), *counts.shape, method, max_tokens,
                              n_split, fallback, rank_cost)


def padded_lengths(lengths: np.ndarray, counts: np.ndarray, max_tokens: int,
                   length_multiple: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every unit's lengths followed by ``padding_lengths(its packed length - its tokens)``:
    full padding sequences of ``PAD_SEQ_TOKENS``, the last one shorter."""
    n = counts.size
    unit = np.repeat(np.arange(n), counts)
    tokens = np.bincount(unit, weights=lengths, minlength=n).astype(np.int64)
    pad = packed_length(tokens, max_tokens, length_multiple) - tokens
    if np.any(pad < 0):
        raise ValueError(f"micro-batch {int(np.argmin(pad))} holds "
                         f"{int(tokens[np.argmin(pad)])} tokens > max_tokens {max_tokens}")
    full, rest = np.divmod(pad, PAD_SEQ_TOKENS)
    npad = full + (rest > 0)
    new_counts = counts + npad
    starts = np.cumsum(new_counts) - new_counts
    out = np.empty(int(new_counts.sum()), dtype=np.int64)
    local = np.arange(lengths.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out[starts[unit] + local] = lengths
    punit = np.repeat(np.arange(n), npad)
    plocal = np.arange(punit.size) - np.repeat(np.cumsum(npad) - npad, npad)
    out[starts[punit] + counts[punit] + plocal] = np.where(plocal < full[punit], PAD_SEQ_TOKENS,
                                                          rest[punit])
    return out, new_counts


def seeded_order(tie: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """``np.lexsort((tie,) + keys)`` where ``tie`` is a permutation of 0..n-1 (the seeded tie
    break): the items by ``keys[-1]``, then ``keys[-2]``, ..., then ``tie``. The same order
    from one stable argsort per key, starting from the items in tie order, instead of a stable
    sort per key and one for ``tie`` (about twice as fast at a step's 4,500 segments)."""
    p = np.empty(tie.size, dtype=np.int64)
    p[tie] = np.arange(tie.size)
    for key in keys:
        p = p[np.argsort(key[p], kind="stable")]
    return p


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` as an int, else a ValueError naming ``name`` (an integer >= ``low`` expected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    return int(value)


def check_rank(rank, dp: int) -> None:
    """ValueError unless ``rank`` is a DP rank in [0, dp)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < dp:
        raise ValueError(f"rank={rank!r}: expected a DP rank in [0, {dp})")


def check_long_sample_policy(long_sample_policy: str) -> None:
    """ValueError naming ``--sb-long-sample-policy`` unless it is one of the policies."""
    if long_sample_policy not in LONG_SAMPLE_POLICIES:
        raise ValueError(f"--sb-long-sample-policy={long_sample_policy!r}: expected one of "
                         f"{', '.join(LONG_SAMPLE_POLICIES)}")


def split_long(arr: np.ndarray, max_tokens: int, long_sample_policy: str
               ) -> tuple[np.ndarray, int]:
    """Split segments (rows of ``arr`` [n, 3]) longer than ``max_tokens`` into pieces of
    ``max_tokens`` counted from the segment start (the last piece shorter), in place of the
    segment, or refuse. Returns (segments [n', 3], number split)."""
    check_long_sample_policy(long_sample_policy)
    sizes = arr[:, 2] - arr[:, 1]
    long = sizes > max_tokens
    if long_sample_policy == "error" and long.any():
        i = int(np.argmax(long))
        raise LongSampleError(
            f"sample {int(arr[i, 0])} has {int(sizes[i])} tokens > max_tokens {max_tokens} "
            f"(--seq-length); {int(long.sum())} sample(s) are this long. Use "
            f"--sb-long-sample-policy split or a larger --seq-length.")
    pieces = -(-sizes // max_tokens)
    out = np.repeat(arr, pieces, axis=0)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)     # each piece's segment's row
    out[:, 1] += (np.arange(len(out)) - first) * max_tokens
    np.minimum(out[:, 1] + max_tokens, out[:, 2], out=out[:, 2])
    return out, int(long.sum())


def check_fits(sizes: np.ndarray, dp: int, num_microbatches: int, max_tokens: int) -> None:
    """BatchingError when the global batch (its segments' ``sizes``) is empty, cannot give every
    DP rank a sample, or holds more tokens than dp x m micro-batches of max_tokens."""
    if sizes.size == 0:
        raise BatchingError("empty global batch: no samples to pack (is the data set empty?)")
    if sizes.size < dp:
        raise BatchingError(
            f"global batch of {sizes.size} sample segment(s) cannot fill dp={dp} DP ranks: "
            f"every rank needs at least one sample; use a larger global batch or fewer ranks")
    total = int(sizes.sum())
    if total > dp * num_microbatches * max_tokens:
        raise BatchingError(
            f"global batch of {total} tokens does not fit dp x m = {dp} x {num_microbatches} "
            f"micro-batches of {max_tokens} tokens ({dp * num_microbatches * max_tokens})")
