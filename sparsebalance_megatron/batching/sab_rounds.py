"""SAB's agreement as a DP rank makes it (issue 77; docs/DESIGN.md section 6, "DST and SAB at
scale"): ``agreement_rounds`` is one rank's generator of rounds in ``policy.dst_rounds``'
protocol, so the same drivers reduce it, and returns from the rank's own units, field for field,
the ``assignment.Agreement`` that ``SABAssignment.agree`` makes from every rank's. Its last round
sums a [candidates, width] block in which each candidate fills its own row (``_row``): every
other row is zero, so the sum is the row, exactly (integers below 2**53 travel as float64).
``packing_rounds`` goes on to the rank's own micro-batches and checks them with one more sum
(``_digest``), so a dropped or duplicated segment is named on every rank.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Generator

import numpy as np

from . import slots as slot_search
from .assignment import Agreement, RankUnits, SABAssignment
from .plan import BatchPlan
from .span_select import candidate_rounds


def agreement_rounds(a: SABAssignment, mine: RankUnits) -> Generator[dict, dict, Agreement]:
    """DP rank ``mine.ranks[0]``'s rounds of ``a``'s agreement (``mine``: its ``units``)."""
    if mine.ranks.size != 1:
        raise ValueError(f"agreement_rounds takes one rank's units, got ranks "
                         f"{mine.ranks.tolist()}")
    priced = a.cost_fn is not None
    fits = bool(mine.fits)
    nseg = int(mine.counts.sum()) if fits else 0
    got = yield {"sum": {}, "max": {"unfit": int(not fits), "nseg": int(nseg)}}
    fallback = bool(got["unfit"])
    if not priced:
        return Agreement(fallback, None)
    if fallback:                       # every rank alike: the sequential bins, its own priced
        mine = a.fallback_units(mine.ranks)
        got = yield {"sum": {}, "max": {"nseg": int(mine.counts.sum())}}
    ranks = yield from candidate_rounds(float(mine.span_s[0]), int(mine.ranks[0]), a.dp,
                                        slot_search.candidate_count())
    _, m, nv = mine.fwd_s.shape
    block = np.zeros((ranks.size, 2 * m * nv + nv + 2 * m + 1 + int(got["nseg"])))   # _row's
    at = int(np.searchsorted(ranks, mine.ranks[0]))
    if at < ranks.size and ranks[at] == mine.ranks[0]:
        block[at] = _row(mine, block.shape[1])
    got = yield {"sum": {"candidates": block}, "max": {}}
    return Agreement(fallback, _units(ranks, np.asarray(got["candidates"]), mine))


def _row(mine: RankUnits, width: int) -> np.ndarray:
    """A candidate's row: fwd and bwd [m, stages], its calibration factors [stages], seed
    slots [m], makespan, micro-batch sizes [m], its segment indices, zeros up to ``width``."""
    row = np.concatenate([mine.fwd_s[0].reshape(-1), mine.bwd_s[0].reshape(-1),
                          mine.scale[0], mine.slots[0], mine.span_s[:1], mine.counts[0],
                          mine.items])
    return np.pad(row.astype(np.float64), (0, width - row.size))


def _units(ranks: np.ndarray, rows: np.ndarray, mine: RankUnits) -> RankUnits:
    """The candidates' ``RankUnits`` from round 2's rows."""
    _, m, nv = mine.fwd_s.shape
    k, mn = ranks.size, m * nv
    fwd = rows[:, :mn].reshape(k, m, nv)
    bwd = rows[:, mn:2 * mn].reshape(k, m, nv)
    scale, at = rows[:, 2 * mn:2 * mn + nv], 2 * mn + nv
    slots = rows[:, at:at + m].astype(mine.slots.dtype)
    span = rows[:, at + m].astype(mine.span_s.dtype)
    counts = rows[:, at + m + 1:at + 2 * m + 1].astype(np.int64)
    held = rows[:, at + 2 * m + 1:]                 # each row's items, then zeros
    items = held[np.arange(held.shape[1]) < counts.sum(axis=1)[:, None]].astype(np.int64)
    return RankUnits(ranks, items, counts, fwd.astype(mine.fwd_s.dtype, copy=False),
                     bwd.astype(mine.bwd_s.dtype, copy=False), slots, span, scale)


def packing_rounds(a: SABAssignment, mine: RankUnits) -> Generator[dict, dict, BatchPlan]:
    """DP rank ``mine.ranks[0]``'s own micro-batches (a one-row ``BatchPlan``: its row of
    ``a.plan()``) after ``agreement_rounds`` and the check round (module docstring)."""
    agreed = yield from agreement_rounds(a, mine)
    plan = a.rank_plan(mine, agreed)
    got = yield {"sum": {"segments": _digest(plan.segment_array())}, "max": {}}
    want = _digest(a.arr)
    if not np.array_equal(np.asarray(got["segments"]), want):
        raise RuntimeError(f"SAB's ranks packed {int(got['segments'][0])} segments (digest "
                           f"{got['segments'][1:].tolist()}), the global batch has "
                           f"{int(want[0])} ({want[1:].tolist()}): a packer dropped or "
                           f"duplicated segments of the global batch")
    return plan


HALF = (1 << 26) - 1


def _digest(rows: np.ndarray) -> np.ndarray:
    """[count, low sum, high sum] of segments [n, 3]: each row's 52-bit hash cut in two 26-bit
    halves, each summed (exact in float64 below 2**27 segments); a multiset's, in any order."""
    r = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
    with np.errstate(over="ignore"):
        h = r[:, 0] * np.uint64(0x9E3779B97F4A7C15) ^ r[:, 1] * np.uint64(0xC2B2AE3D27D4EB4F) \
            ^ r[:, 2] * np.uint64(0x165667B19E3779F9)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    lo, hi = h & np.uint64(HALF), (h >> np.uint64(26)) & np.uint64(HALF)
    return np.array([r.shape[0], float(lo.sum()), float(hi.sum())], dtype=np.float64)
