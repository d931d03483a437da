"""BatchPlan: which segments of which samples each DP rank runs in each micro-batch slot.

Plain data, shared by SAB and the two baselines (Megatron's sequential packing and token-count
balancing) so the data path and the benchmarks treat them alike:

    plan.micro_batches[dp_rank][slot] -> list of Segment (sample_id, start, end)

A segment is the token range [start, end) of sample ``sample_id`` (for the data pipeline's
documents: positions of the document + EOD, see ``data/packing.py``). A micro-batch holds at most
``max_tokens`` tokens (Megatron's ``--seq-length``; packed THD); it may be empty (all padding).
Also here: splitting samples longer than ``max_tokens`` (``long_sample_policy``) and the checks
every planner shares.

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..data.packing import LONG_SAMPLE_POLICIES, Segment, padding_lengths


class BatchingError(ValueError):
    """The global batch cannot be planned (empty, too small for the DP ranks, does not fit)."""


class LongSampleError(BatchingError):
    """A sample is longer than ``max_tokens`` and ``long_sample_policy`` is 'error'."""


@dataclass
class BatchPlan:
    """A global batch laid out as ``micro_batches[dp_rank][slot]`` lists of segments."""

    micro_batches: list            # [dp][m] -> list[Segment]
    method: str                    # "sequential" | "token_balanced" | "sab"
    max_tokens: int
    num_split_samples: int = 0     # samples cut into several segments (long_sample_policy=split)
    fallback: bool = False         # SAB re-used the sequential bins (cost-aware packing did not fit)
    predicted_rank_cost_s: np.ndarray = field(default=None)  # [dp] planner's cost proxy per rank

    @property
    def dp(self) -> int:
        return len(self.micro_batches)

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def lengths(self) -> list:
        """[dp][m] int64 arrays of segment lengths (the documents attention sees)."""
        return [[np.asarray([e - s for _, s, e in mb], dtype=np.int64) for mb in rank]
                for rank in self.micro_batches]

    def flat_lengths(self, with_padding: bool = False) -> list:
        """The [dp][m] lengths flattened rank-major, as latency-model units (dp * m arrays).
        ``with_padding``: followed by the padding sequences that fill each micro-batch to
        ``max_tokens``, as the packed micro-batch holds them (``data.padding_lengths``)."""
        flat = [x for rank in self.lengths() for x in rank]
        if with_padding:
            flat = [np.concatenate([x, padding_lengths(self.max_tokens - int(x.sum()))])
                    .astype(np.int64) for x in flat]
        return flat

    def tokens(self) -> np.ndarray:
        """[dp, m] tokens per micro-batch."""
        return np.asarray([[sum(e - s for _, s, e in mb) for mb in rank]
                           for rank in self.micro_batches], dtype=np.int64)

    def segments(self) -> list:
        """All segments, rank-major then slot order."""
        return [seg for rank in self.micro_batches for mb in rank for seg in mb]


def check_shape_args(dp: int, num_microbatches: int, max_tokens: int) -> None:
    for name, v in (("dp", dp), ("num_microbatches", num_microbatches),
                    ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r}: expected an integer >= 1")


def as_segments(samples) -> list:
    """Segments from a list of (sample_id, start, end) triples or a [n] array of lengths
    (sample i = tokens [0, length_i))."""
    if isinstance(samples, np.ndarray) and samples.ndim == 1:
        samples = [(i, 0, int(n)) for i, n in enumerate(samples.tolist())]
    out = []
    for k, seg in enumerate(samples):
        if isinstance(seg, (int, np.integer)):
            seg = (k, 0, int(seg))
        try:
            i, s, e = seg
            i, s, e = int(i), int(s), int(e)
        except (TypeError, ValueError):
            raise ValueError(f"sample {k}: {seg!r}: expected (sample_id, start, end)") from None
        if not 0 <= s < e:
            raise ValueError(f"sample {k}: segment {(i, s, e)}: expected 0 <= start < end")
        out.append((i, s, e))
    return out


def split_long(segments: Sequence[Segment], max_tokens: int, long_sample_policy: str
               ) -> tuple[list, int]:
    """Split segments longer than ``max_tokens`` into pieces of ``max_tokens`` counted from the
    segment start (the last piece shorter), or refuse. Returns (segments, number split)."""
    if long_sample_policy not in LONG_SAMPLE_POLICIES:
        raise ValueError(f"--sb-long-sample-policy={long_sample_policy!r}: expected one of "
                         f"{', '.join(LONG_SAMPLE_POLICIES)}")
    out, n_split = [], 0
    for i, s, e in segments:
        if e - s <= max_tokens:
            out.append((i, s, e))
            continue
        if long_sample_policy == "error":
            n_long = sum(1 for _, a, b in segments if b - a > max_tokens)
            raise LongSampleError(
                f"sample {i} has {e - s} tokens > max_tokens {max_tokens} (--seq-length); "
                f"{n_long} sample(s) are this long. Use --sb-long-sample-policy split or a "
                f"larger --seq-length.")
        n_split += 1
        out.extend((i, a, min(a + max_tokens, e)) for a in range(s, e, max_tokens))
    return out, n_split


def check_fits(segments: Sequence[Segment], dp: int, num_microbatches: int, max_tokens: int
               ) -> None:
    """BatchingError when the global batch is empty, cannot give every DP rank a sample, or
    holds more tokens than dp x m micro-batches of max_tokens."""
    if len(segments) == 0:
        raise BatchingError("empty global batch: no samples to pack (is the data set empty?)")
    if len(segments) < dp:
        raise BatchingError(
            f"global batch of {len(segments)} sample segment(s) cannot fill dp={dp} DP ranks: "
            f"every rank needs at least one sample; use a larger global batch or fewer ranks")
    total = sum(e - s for _, s, e in segments)
    if total > dp * num_microbatches * max_tokens:
        raise BatchingError(
            f"global batch of {total} tokens does not fit dp x m = {dp} x {num_microbatches} "
            f"micro-batches of {max_tokens} tokens ({dp * num_microbatches * max_tokens})")
