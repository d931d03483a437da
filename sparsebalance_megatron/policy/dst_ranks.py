"""DST planned by every DP rank on its own units (issue 77 items 2-3; docs/DESIGN.md section 6,
"DST and SAB at scale"): ``dst.plan_dst_with_floor``'s band search made by each DP rank on its
[1, m, stages] slice of the costs, the ranks coupled only by fixed-size vectors that a caller
reduces across the DP group (``dst_rounds``: one generator of the rounds per rank, reduced
in-process by ``dst_ranks_local`` for the studies and tests, by the DP group's all-reduces in a
run).

Why the band search decomposes: a band's plan (``dst_band.plan_dst_candidates``) is planned per
DP rank except for three numbers, the anchor (the mean of the static busy seconds [dp, pp]), the
static step T0 and the raise target T1 (the largest cut makespan); the search's verdicts read the
plan's step (a max), its work-weighted densities and its quality cost (sums). And the search's
candidates are known before any verdict (``candidate_tree``: 3 tolerances a round inside one of
4 sub-intervals, ``search_steps // 2`` rounds), so a rank plans all of them in one batched pass
of DP-1 rows (a rank's plan of one candidate never reads another's) and three reductions agree
everything:

1. ``RankDST.__init__``: the rank's static plan; AR1 = (sum: busy seconds, weight totals by
   stage; max: static makespan) gives the anchor and T0;
2. ``RankDST.cut``: every candidate's cut; AR2 = (max: cut makespans [K]) gives every T1;
3. ``RankDST.raise_``: every candidate's raise toward (1 - h) x T1 (re-planned with less slack
   where it overshoots, as today); AR3 = (max: makespans [K]; sum: kept work and per-stage kept
   work [K, 1 + stages], quality cost [K]);
4. ``RankDST.choose``: ``dst._band_search`` (the same generator) driven by the agreed verdicts:
   every rank keeps the same candidate; the rank's part of that plan.

So up to the band the decomposed plan is the central plan (the same densities; a mean of
per-rank sums rounds differently from one sum, so a verdict on a floor's very edge could differ).
What differs is the critical-path descent (``critical_path.refine_plan``), each of whose rounds
is a global verdict. Here it is probed (``dst_probes``): after AR3 every rank knows the start
(the band plan where it meets the descent's neutral floors, else the static plan, as
``refine_plan``) and its step, and works on ``PROBES`` agreed steps below it (``probe_steps``):
a rank at or below a probe raises its floats toward it (the supply its raises give the floors),
a rank above descends to it with no floors (its demand on them); AR3b sums both with the
start's sums and the free plans'; below the fastest free plan whose sums meet the floors, every
rank descends again under a budget of the agreed slack (its share, and all of it); AR4 sums
those plans' kept work and quality and takes their steps, and every rank keeps the fastest that
meets the global floors (``RankDST.pick``), the band plan where none is faster by
``dst.SPEED_TIE``. A rank stops at each probe (``_descent``'s ``goal``), so it spends no slack
below a step another rank sets. Where plans differ: a probe is 0.005-20% below the start (a
step between probes is missed), the ranks' budgets are a split agreed ahead, not the central
rounds' joint verdicts, and the probes' descents search more than ``refine_plan``'s 8 rounds
(the decomposed plan is often faster: ``scripts/bench.py dst_decomposed``). At DP 1 every
reduction is the identity and the rank runs ``refine_plan`` itself: the plan is the central
plan bit for bit (``tests/unit/test_dst_ranks.py``). Five reductions a step (AR1, AR2, AR3,
AR3b, AR4), the largest AR3b's P x (3 stages + 6) + stages + 2 floats (15 KB at P = 64 and 8
virtual stages; AR3 K x (2 stages + 6), K = 65 candidates at the default 6 search steps: 11 KB;
AR4 2P x (stages + 2): 10 KB), none growing with DP; a rank's work is a DP-1 pass of K
candidates, P / 8 fills and at most three chains of P descents. The design (docs/DESIGN.md)
asked for two: the band search's verdicts and the descent's probes each need their own.

Covered: both objectives, with and without the descent (the quality objective without it runs
both band searches, every row of both planned at once: 2K rows); every anchor (the median's AR1
gathers the static busy seconds, dp x pp floats: the one part that grows with DP). The slow-GPU
test (``bands.straggler_present``) is an agreed boolean the caller passes (``narrow``).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

import numpy as np

from .bands import band_ladder
from .costs import UnitCosts
from .critical_path import NEUTRAL_DENSITY
from .dst import SPEED_TIE, _band_search
from .dst_band import BandCache, DSTPlan, DSTReport, _band, _cut, _pass, _plans, _raise
from .dst_probes import PROBES, RankProbes, probe_steps  # noqa: F401 (re-exported)
from .dst_settings import DSTSettings

PHASES = ("static", "cut", "raise", "choose", "descent", "pick")   # between the reductions


def rank_slice(costs: UnitCosts, r: int) -> UnitCosts:
    """DP rank ``r``'s [1, m, stages] slice of ``costs``: the same tables' rows (their
    formula's rows where they carry one)."""
    sl, m = slice(r, r + 1), costs.shape[1]
    formula = None
    if costs.formula is not None:
        work, per_pair, fixed, corr, scaled = costs.formula
        rows = slice(r * m, (r + 1) * m)
        formula = (np.ascontiguousarray(work[rows]), per_pair,
                   np.ascontiguousarray(fixed[:, rows]), np.ascontiguousarray(corr[rows]), scaled)

    def cut(a):
        return None if a is None else np.ascontiguousarray(a[sl])

    return UnitCosts(costs.densities, cut(costs.fwd_s), cut(costs.bwd_s), cut(costs.attn_work),
                     pipeline_ranks=costs.pipeline_ranks, dense_work=cut(costs.dense_work),
                     kept_grid=cut(costs.kept_grid), tables_checked=formula is not None,
                     _total=cut(costs.total_s) if formula is not None else None,
                     _formula=formula)


def candidate_tree(settings: DSTSettings, narrow: bool) -> list:
    """Every (anchor, tolerance) ``dst._band_search`` can ask for, in its order: the configured
    band (and the narrower ones with ``narrow``), the no-cut plan, then every round's 3
    tolerances in each of the 4 sub-intervals the previous round can leave. Made once per
    (anchor, tolerance, search steps, ``narrow``): every rank's and step's alike."""
    return list(_candidate_tree(settings.anchor, settings.tolerance, settings.search_steps,
                                bool(narrow)))


@lru_cache(maxsize=64, typed=True)
def _candidate_tree(anchor: str, tol: float, search_steps: int, narrow: bool) -> tuple:
    out = list(band_ladder(anchor, tol) if narrow else [(anchor, tol)])
    out.append(("max", tol))
    per_round = 3
    level = [(max(float(tol), 1e-3), 10.0)]
    for _ in range(max(search_steps // 2, 1)):
        nxt = []
        for lo, hi in level:
            ts = lo * (hi / lo) ** (np.arange(1, per_round + 1) / (per_round + 1))
            out += [(anchor, float(t)) for t in ts]
            edges = [lo] + [float(t) for t in ts]
            nxt += [(edges[i], float(ts[i])) for i in range(per_round)] + [(float(ts[-1]), hi)]
        level = nxt
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return tuple(uniq)


@dataclass
class Agreed1:
    """AR1's results: the anchors (mean, min, max), the static step T0 and the weight totals
    (every rank's)."""
    anchors: dict
    t0: float
    tot: float                  # work-weighted mean's denominator (routed work included)
    tot_s: np.ndarray           # [stages]
    dense: float                # routed work at density 1 (0 without routing)
    dense_s: np.ndarray         # [stages]
    units: int                  # micro-batches over all ranks (the quality cost's mean)
    dp: int = 1                 # DP ranks
    mk0_mean: float = 0.0       # the static makespans' mean

    def densities(self, kept_s: np.ndarray, plain_s: Optional[np.ndarray] = None) -> tuple:
        """(mean, per-stage [stages]) work-weighted density of a plan whose agreed kept work by
        stage is ``kept_s`` (routed work added here). Where the weights are zero: ``plain_s``,
        the plan's plain mean density by stage; None (a floor check): 1.0 and inf, no floor
        applies."""
        kept_s = np.asarray(kept_s, dtype=np.float64) + self.dense_s
        ok = self.tot_s > 0
        if self.tot > 0:
            mean = float(kept_s.sum() / self.tot)
        else:
            mean = 1.0 if plain_s is None else float(plain_s.sum() / plain_s.size)
        return mean, np.where(ok, kept_s / np.where(ok, self.tot_s, 1.0),
                              np.inf if plain_s is None else plain_s)

    def densities_of(self, kept_s: np.ndarray) -> tuple:
        """``densities(kept_s[j])`` (a floor check's) of every row j of ``kept_s`` [n, stages]
        at once: (means [n], per-stage [n, stages]), the same floats (a row's sum is numpy's
        over the same elements in the same order)."""
        kept_s = np.asarray(kept_s, dtype=np.float64) + self.dense_s
        ok = self.tot_s > 0
        mean = kept_s.sum(axis=1) / self.tot if self.tot > 0 else np.ones(kept_s.shape[0])
        return mean, np.where(ok, kept_s / np.where(ok, self.tot_s, 1.0), np.inf)


class RankDST:
    """One DP rank's part of the decomposed band search (module docstring). ``costs``: the
    rank's [1, m, stages] slice (``rank_slice``); ``sensitivity``: its [1, m(, stages)] rows;
    ``narrow``: the agreed slow-GPU verdict (``bands.straggler_present`` of all ranks)."""

    def __init__(self, costs: UnitCosts, sensitivity, settings: DSTSettings, *, quality=None,
                 narrow: bool = False):
        s = settings
        if costs.shape[0] != 1:
            raise ValueError(f"a rank's costs are [1, m, stages], got {costs.shape}")
        self.descend_on = s.descent and s.raise_to == "bottleneck" and s.anchor != "max" \
            and s.density_floor > 0
        self.costs, self.settings, self.quality, self.narrow = costs, s, quality, narrow
        self.cands = candidate_tree(s, narrow)
        k = len(self.cands)
        # the quality objective without the descent: both objectives' searches, as the central
        # planner runs them (the density order's rows first, then the water-filling's)
        self.both = quality is not None and not self.descend_on
        self.rows = self.cands * 2 if self.both else self.cands
        self.water = np.array([False] * k + [True] * k if self.both
                              else [quality is not None] * k)
        self.cache = BandCache()
        self.ps = _pass(costs, sensitivity, (s.d0, s.d_min, s.d_max), len(self.rows),
                        self.water, quality, s.p2p_s, self.cache)
        _band(self.ps, [])                                  # the static plan: mk0, busy0
        w = costs.weights()
        self.w = w
        dw = costs.dense_work
        self.dense_w = None if dw is None else np.asarray(dw, dtype=np.float64)

    def ar1(self) -> dict:
        """The rank's AR1 parts: sums and maxima (and for the median anchor its busy seconds)."""
        c = self.cache
        dw = self.dense_w
        pp = self.w.shape[2]
        return {"sum": {"busy": float(c.busy0.sum()), "busy_n": c.busy0.size,
                        "tot_s": self.w.sum(axis=(0, 1)),
                        "dense_s": np.zeros(pp) if dw is None else dw.sum(axis=(0, 1)),
                        "units": self.w.shape[1], "ranks": 1,
                        "mk0_sum": float(c.mk0.max())},
                "max": {"mk0": float(c.mk0.max()), "busy_max": float(c.busy0.max()),
                        "busy_min_neg": -float(c.busy0.min())},
                "cat": {"busy_all": c.busy0.reshape(-1)}        # the median: every rank's
                if self.settings.anchor == "median" else {}}

    def cut(self, a1: Agreed1) -> dict:
        """Every candidate's cut under the agreed anchor: AR2's parts, the cut makespans [K]
        (max)."""
        self.a1 = a1
        ps, cands = self.ps, self.rows
        for a in {a for a, _ in cands}:            # 'max' (the no-cut plan): the report's only
            self.cache.anchors[a] = a1.anchors[a]
        anchors = np.array([self.cache.anchors[a] for a, _ in cands])
        self.bands = np.array([(1.0 + t) for _, t in cands]) * anchors
        self.anchors = anchors
        _, self.cut_rows = _cut(ps, cands, self.bands)
        return {"max": {"mk1": self.cut_rows[1].reshape(len(cands))}, "sum": {}}

    def raise_(self, a2: dict) -> dict:
        """Every candidate's raise toward (1 - h) x its agreed T1 [K] (AR2's ``mk1``): AR3's
        parts."""
        s, ps = self.settings, self.ps
        self.t1 = np.asarray(a2["mk1"], dtype=np.float64)
        raised = _raise(ps, self.cut_rows, self.a1.t0, self.t1, s.raise_headroom, s.raise_to)
        self.plans = _plans(ps, self.rows, s.d0, (self.a1.t0, self.t1, self.anchors,
                                                  self.bands), raised)
        idx = np.stack([p.grid_index for p in self.plans])       # [K, 1, m, nv]
        dens = self.costs.densities[idx]
        kept_s = (dens * self.w).sum(axis=(1, 2))                # [K, nv]
        plain_s = dens.sum(axis=(1, 2))                          # where a stage weighs 0
        q = np.zeros(len(self.plans))
        if self.quality is not None:
            q = self._quality_sums(idx)
            units = idx.shape[1] * idx.shape[2]        # ``plan_cost_at``: the sum's mean
            for p, w, qk in zip(self.plans, self.water, q.tolist()):   # the rank's own (at DP
                if w:                               # 1 the verdicts read it): the water rows'
                    p.report.quality_cost = qk / units
        mk = np.array([p.report.step_time_planned_s for p in self.plans])
        self.kept_s, self.q, self.mk = kept_s, q, mk
        counts = np.array([[p.report.units_cut, p.report.units_raised,
                            p.report.ranks_reverted] for p in self.plans], dtype=np.int64)
        return {"sum": {"kept_s": kept_s, "plain_s": plain_s, "quality": q, "mk_sum": mk,
                        "counts": counts},
                "max": {"mk": mk}}

    def _quality_sum(self, idx: np.ndarray) -> float:
        """The quality cost's sum over the rank's micro-batches (``plan_cost_at`` x m)."""
        flat, offsets = self._quality_table()
        return float(flat.take(idx + offsets).sum(axis=2).sum())

    def _quality_sums(self, idx: np.ndarray) -> np.ndarray:
        """``_quality_sum`` of every plan of ``idx`` [k, 1, m, stages] at once (a plan's sums
        are numpy's over the same elements in the same order: the same floats)."""
        flat, offsets = self._quality_table()
        return flat.take(idx + offsets).sum(axis=3).sum(axis=(1, 2))

    def _quality_table(self) -> tuple:
        """(the quality cost's grid table, flat; each stage's offset in it [stages]), made
        once per rank (its grid and quality cost do not change)."""
        if getattr(self, "_qtable", None) is None:
            g = self.costs.densities
            self._qtable = (self.quality._grid_table(g).reshape(-1),
                            np.arange(self.costs.shape[2]) * g.size)
        return self._qtable

    def global_report(self, k: int, a3: dict) -> DSTReport:
        """Candidate k's report with the agreed step, densities, quality cost and counts (at
        DP 1 the rank's own: the world's, the central report's floats)."""
        a1, p = self.a1, self.plans[k]
        if a1.dp == 1:
            return p.report
        mean, stage = a1.densities(a3["kept_s"][k], a3["plain_s"][k] / a1.units)
        step, mean_mk = float(a3["mk"][k]), float(a3["mk_sum"][k]) / a1.dp
        cut, raised, reverted = (int(x) for x in a3["counts"][k])
        return replace(p.report, step_time_planned_s=step, speedup=a1.t0 / step if step > 0
                       else 1.0, imbalance_before=a1.t0 / a1.mk0_mean if a1.mk0_mean > 0
                       else 1.0, imbalance_after=step / mean_mk if mean_mk > 0 else 1.0,
                       units_cut=cut, units_raised=raised, ranks_reverted=reverted,
                       step_time_cut_s=float(self.t1[k]), mean_density=mean,
                       density_per_stage=tuple(float(x) for x in stage),
                       quality_cost=float(a3["quality"][k]) / a1.units
                       if self.quality is not None and self.water[k] else float("nan"))

    def choose(self, a3: dict) -> int:
        """The band search replayed on the agreed verdicts (AR3's sums and maxima): the index
        of the row every rank keeps; the rank's band plan is ``self.plans[k]``. Both
        objectives' searches (``both``) end as the central planner's: the plan the quality
        cost prefers among those within ``SPEED_TIE`` of the faster."""
        s, q = self.settings, self.quality
        index = {(c, bool(w)): i for i, (c, w) in enumerate(zip(self.rows, self.water))}
        views = {}

        def view(i):
            if i not in views:
                views[i] = DSTPlan(self.plans[i].densities, self.global_report(i, a3),
                                   self.plans[i].grid_index)
                views[i].k = i
            return views[i]

        def agreed_cost(p) -> float:
            """A row's quality cost, the whole step's (at DP 1 the central call itself)."""
            if self.a1.dp == 1:
                return p.quality_cost(q, self.costs.densities)
            return float(a3["quality"][p.k]) / self.a1.units

        if self.both:
            # the guard of a narrower band (given the plan's densities: the rank's rows alone)
            guard = q if self.a1.dp == 1 else SimpleNamespace(plan_cost=lambda d: agreed_cost(
                next(p for p in views.values() if p.densities is d)))
            searches = [(_band_search(s, narrow=self.narrow, guard=guard), False),
                        (_band_search(s, narrow=self.narrow, quality=q), True)]
        else:
            searches = [(_band_search(s, narrow=self.narrow, quality=q), q is not None)]
        pending = {n: next(g) for n, (g, _) in enumerate(searches)}
        out = [None] * len(searches)
        while pending:
            for n in list(pending):
                g, w = searches[n]
                try:               # a KeyError: the tree missed a candidate (a bug)
                    pending[n] = g.send([view(index[c, w]) for c in pending[n]])
                except StopIteration as done:
                    out[n] = done.value
                    del pending[n]
        kept = out[0]
        if self.both:                  # as ``dst.plan_dst_with_floor``
            ordered, filled = out
            ordered.report.quality_cost = agreed_cost(ordered)
            fair = [p for p in (filled, ordered) if not p.report.quality_cost > 1e-12] \
                or [filled]
            fastest = min(p.report.step_time_planned_s for p in fair)
            kept = min((p for p in fair if p.report.step_time_planned_s
                        <= fastest * (1.0 + SPEED_TIE)), key=lambda p: p.report.quality_cost)
        self.chosen, self.chosen_report = kept.k, kept.report
        return self.chosen

    def descent_start(self, a3: dict) -> dict:
        """After ``choose``: the descent's start, the band plan where it meets the descent's
        neutral floors globally (AR3's verdict: the same on every rank), else the static plan,
        as ``refine_plan``; AR3b's parts: the rank's parts of the start's sums (``parts``) and
        of every probe's supply and demand (``dst_probes.RankProbes.first``)."""
        s, r, k = self.settings, self.chosen_report, self.chosen
        floor = max(float(s.density_floor), NEUTRAL_DENSITY) * s.d0 - 1e-12
        stage_floor = s.stage_density_floor * s.d0 - 1e-12
        ok = (r.mean_density >= floor and min(r.density_per_stage) >= stage_floor
              and not (self.quality is not None and r.quality_cost > 1e-12)
              and not r.step_time_planned_s > r.step_time_static_s)
        self.from_band = ok
        if ok:
            self.cur = (self.plans[k].grid_index, float(self.mk[k]), self.kept_s[k],
                        float(self.q[k]))
        else:
            i0 = self.costs.index_of(s.d0)
            self.cur = (np.full(self.plans[k].grid_index.shape, i0), float(self.cache.mk0.max()),
                        s.d0 * self.w.sum(axis=(0, 1)), 0.0)
        # the start's agreed step: AR3's (the band plan's) or AR1's (the static plan's)
        self.start_step = float(r.step_time_planned_s) if ok else float(self.a1.t0)
        self.probes = RankProbes(self.costs, self.w, s, self._quality_sum
                                 if self.quality is not None else None, self.cur,
                                 probe_steps(self.start_step))
        out, more = self.parts(), self.probes.first()
        out["sum"].update(more["sum"])
        out["max"].update(more["max"])
        return out

    def parts(self) -> dict:
        """The rank's parts of its current plan's agreed numbers: kept work by stage and
        quality sum (sums), makespan (max)."""
        _, mk, kept_s, q = self.cur
        return {"sum": {"kept_s": kept_s, "quality": q}, "max": {"mk": mk}}

    def probe(self, agreed: dict) -> dict:
        """AR4's parts (AR3b's sums ``agreed``): the rank's plans at every probe step
        (``probe_steps`` of the start's agreed step) in two chains (``dst_probes``): makespans
        [2P] (max), kept work by stage [2P, stages] and quality sums [2P] (sums)."""
        self.start_step = float(agreed["mk"])
        return self.probes.probe(agreed, self.a1)

    def pick(self, a4: dict) -> int:
        """The plan every rank keeps (AR4's sums and maxima): the fastest that meets the
        neutral floors globally, the first of equal steps; -1: none is faster than the start.
        The rank's plan becomes its part of it."""
        best = self.probes.best(a4, self.a1, self.start_step)
        if best >= 0:
            self.cur = self.probes.plans[best]
        return best
