"""SAB's assignment of a global batch's segments to the DP ranks, the same on every rank, and
each rank's own micro-batches from it (docs/DESIGN.md section 6, "DST and SAB at scale", SAB's
part): ``SABAssignment`` computes the costs, their order and the LPT over the ranks alike from
the whole batch's lengths, on arrays; a rank then packs only its own micro-batches (``units``),
agrees with the others (``agree``; in a run ``sab_rounds``) and places them (``rank_plan``).

Pure numpy (and ``kernels``); must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from .. import kernels
from .latency_cost import LatencyCost
from .plan import BatchingError, BatchPlan, finish_plan, padded_lengths, seeded_order
from .segments import offsets_of, take_runs
from . import slots as slot_search


@dataclass
class RankUnits:
    """Some DP ranks' micro-batches as packed, before the cross-rank search: one CSR from the
    kernel that cuts them (``kernels.packing.rank_bins``) to the plan (``finish_plan``)."""

    ranks: np.ndarray                 # [k] DP ranks, ascending
    items: Optional[np.ndarray]       # segment indices, rank-major, each rank's in its slots
    counts: Optional[np.ndarray]      # [k, m] items of each (rank, slot); None: some rank's
    # micro-batches do not fit
    fwd_s: Optional[np.ndarray] = None    # [k, m, stages] seconds (with a LatencyCost)
    bwd_s: Optional[np.ndarray] = None
    slots: Optional[np.ndarray] = None    # [k, m] seed slots (indices into the rank's own)
    span_s: Optional[np.ndarray] = None   # [k] makespan with them
    scale: Optional[np.ndarray] = None    # [k, stages] their calibration factors (priced with)

    @property
    def fits(self) -> bool:
        return self.counts is not None

    def take(self, idx: np.ndarray) -> "RankUnits":
        """The units of ``ranks[idx]`` (``idx`` ascending)."""
        pick = (lambda a: None if a is None else a[idx])
        m = self.counts.shape[1]
        items, counts = take_runs(self.items, self.counts, idx[:, None] * m + np.arange(m))
        return replace(self, ranks=self.ranks[idx], items=items, counts=counts,
                       fwd_s=pick(self.fwd_s), bwd_s=pick(self.bwd_s), slots=pick(self.slots),
                       span_s=pick(self.span_s), scale=pick(self.scale))


@dataclass
class Agreement:
    """What every rank of the step holds alike after the reductions: ``fallback`` (some rank's
    micro-batches do not fit: the sequential bins, every rank alike) and the candidates' units
    (``slots.candidates``; None where nothing is arranged)."""

    fallback: bool
    candidates: Optional[RankUnits]


def cost_ranks(cost: np.ndarray, priced=None) -> tuple:
    """(each segment's index into the costs ranked [n], the rank of each of those among them,
    decreasing [k]): by the distinct sizes' costs where ``packing.sample_costs`` priced each
    distinct size once (``priced``: that index, their costs), else by every segment's own."""
    at, by = priced if priced is not None else (np.arange(cost.size), cost)
    return at, np.unique(-by, return_inverse=True)[1]


class SABAssignment:
    """One global batch's segments (``packing.prepare_samples``' [n, 3] array, sizes [n],
    samples split) assigned to ``dp`` ranks of ``m`` micro-batches of ``max_tokens`` by
    ``cost`` [n] (the module docstring); ``key``: each segment's sensitivity, as a function
    of (sample ids, lengths) of any of them; ``cost_fn``: a ``LatencyCost`` to
    arrange the slots with (else none; ``arrange`` False: none either); ``priced``: the costs'
    distinct sizes where ``packing.sample_costs`` found them (``cost_ranks``)."""

    def __init__(self, arr, sizes, n_split: int, cost: np.ndarray, *, dp: int, m: int,
                 max_tokens: int, seed: int, key, cost_fn=None, arrange: bool = True,
                 length_multiple: int = 0, priced=None):
        self.arr, self.sizes, self.n_split, self.cost = arr, sizes, n_split, cost
        self.dp, self.m, self.max_tokens, self.key = dp, m, max_tokens, key
        self.cost_fn = cost_fn if arrange and isinstance(cost_fn, LatencyCost) else None
        self.length_multiple = length_multiple
        self.tie = np.random.default_rng(seed).permutation(sizes.size)
        # cost descending (each cost's rank among them), ties by the seeded permutation
        self.rank_of = kernels.packing.lpt_ranks(cost, sizes, self.tie, *cost_ranks(cost, priced),
                                                 dp, m * max_tokens)
        self._fallback = None

    def units(self, ranks: Optional[np.ndarray] = None) -> RankUnits:
        """The micro-batches of ``ranks`` (ascending; None: every rank) as packed, priced."""
        ranks = np.arange(self.dp) if ranks is None else np.asarray(ranks, dtype=np.int64)
        if self.rank_of is None:                       # the LPT found no room for a segment
            return RankUnits(ranks, None, None)
        if ranks.size == self.dp:
            items, tie = None, self.tie
            rank_of = self.rank_of
        else:
            items = np.flatnonzero(self.rank_of == ranks[0] if ranks.size == 1 else
                                   np.isin(self.rank_of, ranks))
            tie = np.argsort(np.argsort(self.tie[items]))      # their own tie order
            rank_of = np.searchsorted(ranks, self.rank_of[items])
        ids, lengths = (self.arr[:, 0], self.sizes) if items is None else \
            (self.arr[items, 0], self.sizes[items])
        sens = np.asarray(self.key(ids, lengths), dtype=np.float64).reshape(-1)
        if sens.shape != lengths.shape:
            raise ValueError(f"sensitivity returned {sens.shape}: expected one value per "
                             f"segment ({lengths.size})")
        # by rank, then sensitivity, then the seeded tie (the ranks as uint16 where they fit:
        # numpy sorts those by radix)
        by_rank = seeded_order(tie, sens, rank_of.astype(np.uint16)
                               if ranks.size <= 65536 else rank_of)
        if items is not None:
            by_rank = items[by_rank]
        starts = np.r_[0, np.cumsum(np.bincount(rank_of, minlength=ranks.size))]
        cut = kernels.packing.rank_bins(by_rank, starts, self.sizes, self.cost, self.m,
                                        self.max_tokens)
        return RankUnits(ranks, None, None) if cut is None else self._priced(
            RankUnits(ranks, *in_slots(*cut, self.cost)))

    def _priced(self, out: RankUnits) -> RankUnits:
        """These units with their costs and seed slots (with a ``LatencyCost``)."""
        if self.cost_fn is None:
            return out
        k, m = out.counts.shape
        lengths, counts = padded_lengths(self.sizes[out.items], out.counts.reshape(-1),
                                         self.max_tokens, self.length_multiple)
        f, b = self.cost_fn.unit_costs((offsets_of(counts), lengths))
        nv = f.shape[1]
        out.fwd_s, out.bwd_s = f.reshape(k, m, nv), b.reshape(k, m, nv)
        # the calibration factors of ``ranks`` as this process knows them: in a run a rank's
        # own (each DP rank calibrates its pipeline; the candidates' travel with their units,
        # ``sab_rounds``), in one process every rank's
        out.scale = self.cost_fn.scale(self.dp)[out.ranks]
        out.slots, out.span_s = slot_search.seed_slots(out.fwd_s, out.bwd_s, self.cost_fn.p2p_s,
                                                       self.cost_fn.pp, out.scale)
        return out

    def fallback_units(self, ranks: np.ndarray) -> RankUnits:
        """``ranks``' sequential bins (``fallback_bins``, made once), priced."""
        if self._fallback is None:
            self._fallback = RankUnits(np.arange(self.dp), *fallback_bins(
                self.sizes, self.cost, self.dp, self.m, self.max_tokens))
        return self._priced(self._fallback.take(ranks))

    def agree(self, units: RankUnits) -> Agreement:
        """The agreement from every rank's ``units`` (in a run: the reductions)."""
        fallback = not units.fits
        if fallback:
            units = self.fallback_units(np.arange(self.dp))
        if self.cost_fn is None:
            return Agreement(fallback, None)
        return Agreement(fallback, units.take(slot_search.candidates(units.span_s)))

    def _placed(self, mine: RankUnits, agreed: Agreement) -> tuple:
        """(items, counts [k, m]) of ``mine.ranks``' micro-batches in their slots after the
        search over the candidates."""
        if agreed.fallback:
            mine = self.fallback_units(mine.ranks)
        if agreed.candidates is None:
            return mine.items, mine.counts
        m, c = self.m, agreed.candidates
        found, _ = slot_search.search(c.ranks, c.fwd_s, c.bwd_s, c.slots, c.span_s, c.scale,
                                      self.cost_fn.p2p_s, self.cost_fn.pp)
        ids = mine.ranks[:, None] * m + mine.slots
        pos = np.minimum(np.searchsorted(c.ranks, mine.ranks), c.ranks.size - 1)
        hit = c.ranks[pos] == mine.ranks
        ids[hit] = found[pos[hit]]
        # each micro-batch named from its rank's units: the candidates' (as they travelled),
        # else mine (both laid end to end, mine first)
        r = ids // m
        at = np.minimum(np.searchsorted(c.ranks, r), c.ranks.size - 1)
        row = np.where(c.ranks[at] == r, mine.ranks.size + at, np.searchsorted(mine.ranks, r))
        return take_runs(np.concatenate([mine.items, c.items]),
                         np.concatenate([mine.counts, c.counts]), row * m + ids % m)

    def rank_plan(self, mine: RankUnits, agreed: Agreement, method: str = "sab") -> BatchPlan:
        """The micro-batches of ``mine``'s ranks (one: a rank's own) after the agreement."""
        return finish_plan(*self._placed(mine, agreed), method, self.max_tokens, self.n_split,
                           agreed.fallback, self.arr, self.cost
                           ).with_length_multiple(self.length_multiple)

    def plan(self, method: str = "sab") -> BatchPlan:
        """Every rank's micro-batches (``rank_plan`` over all ranks)."""
        mine = self.units()
        return self.rank_plan(mine, self.agree(mine), method)


def fallback_bins(sizes, cost, dp, m, max_tokens) -> tuple:
    """(items, counts [dp, m]): the sequential bins (``packing.sequential_plan``'s: they fit
    whenever the baseline fits) assigned to ranks by LPT on cost (``kernels.packing.lpt_ranks``,
    room for m a rank), each rank's in slot order (``kernels.packing.slot_orders``)."""
    starts = kernels.packing.sequential_starts(sizes, max_tokens)
    if starts.size > dp * m:
        raise BatchingError(f"{sizes.size} segments need {starts.size} micro-batches of "
                            f"{max_tokens} tokens even packed in order; expected at most "
                            f"dp x m = {dp * m}")
    counts = np.diff(np.r_[starts, np.full(dp * m + 1 - starts.size, sizes.size)])  # 0 past
    # each bin's cost added in order, uncompensated (what sum() of numpy floats gives)
    bcost = np.bincount(np.repeat(np.arange(dp * m), counts), weights=cost, minlength=dp * m)
    rank_of = kernels.packing.lpt_ranks(bcost, np.ones(dp * m, dtype=np.int64), np.arange(dp * m),
                                        *cost_ranks(bcost), dp, m)
    order = np.argsort(-bcost, kind="stable")                 # the LPT's order, by rank
    mine = order[np.argsort(rank_of[order], kind="stable")].reshape(dp, m)
    return in_slots(*take_runs(np.arange(sizes.size), counts, mine), cost)


def in_slots(items: np.ndarray, counts: np.ndarray, cost: np.ndarray) -> tuple:
    """(items, counts [dp, m]) with each rank's micro-batches in slot order: the cheapest first,
    the second cheapest last (they bound 1F1B's fill and drain), the others as they were
    (``kernels.packing.slot_orders``; a micro-batch's cost the ``sum()`` of its items')."""
    dp, m = counts.shape
    c = kernels.packing.py_sums(cost, items, offsets_of(counts.reshape(-1))).reshape(dp, m)
    return take_runs(items, counts, kernels.packing.slot_orders(c) + np.arange(dp)[:, None] * m)


def sensitivity_key(sensitivity) -> Callable:
    """A sensitivity (a ``SensitivityTracker``, a callable (ids, lengths) -> [n], or None: the
    length prior) as the callable ``SABAssignment`` asks its ranks' estimates of."""
    from .sensitivity import SensitivityTracker

    tracker = sensitivity if sensitivity is not None else SensitivityTracker()
    return tracker.estimate if isinstance(tracker, SensitivityTracker) else tracker
