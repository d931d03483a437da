"""One DP rank's part of DST (docs/DESIGN.md section 6, "DST and SAB at scale"): the band search
and the critical-path descent on the rank's [1, m, stages] slice of the costs, the ranks coupled
only by fixed-size vectors a caller reduces across the DP group. ``RankDST``'s methods are the
rounds' steps up to the descent's start, in the order ``dst_rounds`` lists them (the descent's
are ``dst_probes.RankProbes``'). The band search decomposes exactly: its candidates are known
before any verdict (``bands.candidate_tree``), so a rank plans them all in one batched pass and
``choose`` replays the search on the agreed verdicts; the descent is probed.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from .costs import UnitCosts
from .density_means import WeightTotals
from .critical_path import descent_floors
from .bands import band_search, candidate_tree
from .dst_band import (SPEED_TIE, DSTReport, band_pass, cut_rows, plan_reports, raise_rows,
                       step_fields, uniform_cut)
from .dst_probes import RankProbes, probe_steps
from .dst_settings import DSTSettings
from .quality_bound import bind_quality

UNIFORM_STEP = 0.9           # the 'auto' exchange rate: the uniform trade from d0 to 0.9 x d0
MAX_EXCHANGE_RATE = 1.0      # nats per token per 1%: where a lower density buys no time
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

    docs = None
    if costs.unit_docs is not None:
        offsets, lengths, tokens, sparse = costs.unit_docs
        lo, hi = offsets[r * m], offsets[(r + 1) * m]
        docs = (offsets[r * m:(r + 1) * m + 1] - lo, lengths[lo:hi], tokens[r * m:(r + 1) * m],
                sparse[lo:hi])
    return UnitCosts(costs.densities, cut(costs.fwd_s), cut(costs.bwd_s), cut(costs.attn_work),
                     pipeline_ranks=costs.pipeline_ranks, dense_work=cut(costs.dense_work),
                     kept_grid=cut(costs.kept_grid), unit_docs=docs,
                     tables_checked=formula is not None, total_s=cut(costs.total_s),
                     formula=formula)


class Agreed1:
    """AR1's results, read off its agreed sums and maxima (``RankDST.ar1``'s keys): the anchors
    (mean, max), the static step T0 and the weight totals (every rank's, routed work
    included); the step's micro-batches, DP ranks and tokens (the quality change's
    denominator); ``mk_lo``, the step with every unit at the uniform trade's lower density, and
    ``q_lo``, that plan's quality change summed over the step's units; the static makespans'
    mean."""

    def __init__(self, a: dict):
        self.anchors = {"mean": float(a["busy"] / a["busy_n"]), "max": float(a["busy_max"])}
        self.t0, self.totals = float(a["mk0"]), WeightTotals.of_sums(a["tot_s"], a["dense_s"])
        self.units, self.dp, self.tokens = int(a["units"]), int(a["ranks"]), float(a["tokens"])
        self.mk_lo, self.q_lo = float(a["mk_lo"]), float(a["q_lo"])
        self.mk0_mean = float(a["mk0_sum"]) / self.dp

    def uniform_rate(self) -> float:
        """The step's uniform trade: nats per token that lowering every unit's density to the
        lower one costs, per percent of step time it saves (``MAX_EXCHANGE_RATE`` where it
        saves none)."""
        gain = 100.0 * (1.0 - self.mk_lo / self.t0) if self.t0 > 0 else 0.0
        if gain <= 1e-9:
            return MAX_EXCHANGE_RATE
        return float(min(max(self.q_lo / self.tokens / gain, 0.0), MAX_EXCHANGE_RATE))

    def densities(self, kept_s: np.ndarray, plain=lambda: np.inf) -> tuple:
        """(mean, per-stage) work-weighted density (``WeightTotals``) of a plan whose agreed
        kept work by stage is ``kept_s`` [stages], or of every row of ``kept_s`` [n, stages]
        at once (a row's sum is numpy's over the same elements in the same order); ``plain()``:
        what a mean and a stage read where the weights are zero (a floor check's: inf, no floor
        applies)."""
        kept_s, t = np.asarray(kept_s, dtype=np.float64), self.totals
        return (t.mean(kept_s.sum(axis=-1), lambda: float(np.mean(plain()))),
                t.stage(kept_s, plain))


def agreed_report(r: DSTReport, a1: Agreed1, a: dict, **fields) -> DSTReport:
    """``r`` with a plan's numbers the DP group agreed, ``a``: its kept and plain density by
    stage (sums), makespan (max) and the makespans' sum, and its units cut and raised
    (``counts``); ``fields``: the report's other fields that change."""
    mean, stage = a1.densities(a["kept_s"], lambda: a["plain_s"] / a1.units)
    return replace(r, **step_fields(a1.t0, float(a["mk"]), float(a["mk_sum"]) / a1.dp, mean,
                                    stage, a["counts"]), **fields)


class RankDST:
    """One DP rank's part of the decomposed band search (module docstring). ``costs``: the
    rank's [1, m, stages] slice (``rank_slice``); ``sensitivity``: its [1, m(, stages)] rows;
    ``narrow``: the agreed slow-GPU verdict (``agreed_stats.straggler_present`` of all
    ranks)."""

    def __init__(self, costs: UnitCosts, sensitivity, settings: DSTSettings, *, quality=None,
                 narrow: bool = False):
        s = settings
        if costs.shape[0] != 1:
            raise ValueError(f"a rank's costs are [1, m, stages], got {costs.shape}")
        self.descend_on = s.descent and s.raise_to == "bottleneck" and s.anchor != "max" \
            and s.density_floor > 0
        # the quality model on this rank's units (their documents' lengths and tokens)
        quality = None if quality is None else bind_quality(quality, costs)
        self.costs, self.settings, self.quality, self.narrow = costs, s, quality, narrow
        self.tokens = quality.tokens if quality is not None else float(costs.shape[1])
        cands = candidate_tree(s, narrow)
        k = len(cands)
        # the quality objective without the descent: both objectives' searches (the density
        # order's rows first, then the water-filling's)
        self.both = quality is not None and not self.descend_on
        self.rows = cands * 2 if self.both else cands
        self.water = np.array([False] * k + [True] * k if self.both
                              else [quality is not None] * k)
        self.ps = band_pass(costs, sensitivity, (s.d0, s.d_min, s.d_max), len(self.rows),
                            self.water, quality, s.p2p_s)
        self.w = costs.attn_work

    def ar1(self) -> dict:
        """The rank's AR1 parts: sums and maxima; ``mk_lo`` and ``q_lo``, the uniform trade
        (the 'auto' exchange rate): every unit one step of density lower."""
        c, dw, g = self.ps, self.costs.dense_work, self.costs.densities     # dw: float64 or None
        i_lo = max(int(np.searchsorted(g, UNIFORM_STEP * self.settings.d0 + 1e-12)) - 1,
                   c.bounds[1])
        q_lo = 0.0
        if self.quality is not None and i_lo < c.bounds[0]:
            q_lo = float(self.quality.sums_at(np.full(self.costs.shape, i_lo), g))
        pp = self.w.shape[2]
        return {"sum": {"busy": float(c.busy0.sum()), "busy_n": c.busy0.size,
                        "tot_s": self.w.sum(axis=(0, 1)),
                        "dense_s": np.zeros(pp) if dw is None else dw.sum(axis=(0, 1)),
                        "units": self.w.shape[1], "ranks": 1, "tokens": self.tokens,
                        "q_lo": q_lo, "mk0_sum": float(c.mk0.max())},
                "max": {"mk0": float(c.mk0.max()), "mk_lo": float(uniform_cut(c, i_lo)[1].max()),
                        "busy_max": float(c.busy0.max())}}

    def cut(self, a1: Agreed1) -> dict:
        """Every candidate's cut under the agreed anchor: AR2's parts, the cut makespans [K]
        (max)."""
        self.a1 = a1
        ps, cands = self.ps, self.rows
        bands = np.array([(1.0 + t) * a1.anchors[a] for a, t in cands])
        _, self.cut_rows = cut_rows(ps, cands, bands)
        return {"max": {"mk1": self.cut_rows[1].reshape(len(cands))}, "sum": {}}

    def raise_(self, a2: dict) -> dict:
        """Every candidate's raise toward (1 - h) x its agreed T1 [K] (AR2's ``mk1``): AR3's
        parts."""
        s, ps = self.settings, self.ps
        self.t1 = np.asarray(a2["mk1"], dtype=np.float64)
        raised = raise_rows(ps, self.cut_rows, self.a1.t0, self.t1, s.raise_headroom, s.raise_to)
        self.plans, parts = plan_reports(ps, self.rows, s.d0, (self.a1.t0, self.t1), raised)
        q = np.zeros(len(self.plans))
        if self.quality is not None:
            q = self.quality.sums_at(np.stack([p.grid_index for p in self.plans]),
                                     self.costs.densities)
            for p, w, qk in zip(self.plans, self.water, q.tolist()):   # the rank's own (at DP
                if w:                               # 1 the verdicts read it): the water rows'
                    p.report.quality_cost = qk / self.tokens
        parts["sum"]["quality"] = q
        self.kept_s, self.q, self.mk = parts["sum"]["kept_s"], q, parts["max"]["mk"]
        return parts

    def replicate_parts(self) -> dict:
        """After ``choose`` (the quality objective): the rank's parts of the kept row's and the
        no-cut row's (``adopt``'s) quality change under the model's bootstrap replicates, sums
        [2, B]; they ride AR3b where the rank descends, else a round of their own (AR3q). Only
        these two rows' are read, so AR3 carries no replicates."""
        self.free = next(i for i, (c, w) in enumerate(zip(self.rows, self.water))
                         if c[0] == "max" and w)
        idx = np.stack([self.plans[i].grid_index for i in (self.chosen, self.free)])
        return {"sum": {"quality_b": self.quality.replicate_sums_at(idx, self.costs.densities)},
                "max": {}}

    def global_report(self, k: int, a3: dict) -> DSTReport:
        """Candidate k's report with the agreed step, densities, quality cost and counts (at
        DP 1 the rank's own: the world's, the central report's floats)."""
        a1, p = self.a1, self.plans[k]
        if a1.dp == 1:
            return p.report
        row = {key: a3[key][k] for key in ("kept_s", "plain_s", "mk", "mk_sum", "counts")}
        return agreed_report(p.report, a1, row, ranks_reverted=int(a3["counts"][k][2]),
                             imbalance_before=a1.t0 / a1.mk0_mean if a1.mk0_mean > 0 else 1.0,
                             step_time_cut_s=float(self.t1[k]),
                             quality_cost=float(a3["quality"][k]) / a1.tokens
                             if self.quality is not None and self.water[k] else float("nan"))

    def choose(self, a3: dict) -> int:
        """The band search replayed on the agreed verdicts (AR3's sums and maxima): the index
        of the row every rank keeps; the rank's band plan is ``self.plans[k]``. Both
        objectives' searches (``both``) end as the central planner's: the plan the quality
        cost prefers among those within ``SPEED_TIE`` of the faster."""
        s, q = self.settings, self.quality
        index = {(c, bool(w)): i for i, (c, w) in enumerate(zip(self.rows, self.water))}

        def agreed_cost(p) -> float:
            """A row's quality cost, the whole step's (the guard of a narrower band)."""
            return float(a3["quality"][p.k]) / self.a1.tokens

        def views_of(water: bool):
            """A band search's plans: each asked row's index k and agreed report, what the
            search reads (a KeyError: the tree missed a candidate, a bug)."""
            return lambda asked: [SimpleNamespace(k=k, report=self.global_report(k, a3))
                                  for k in (index[c, water] for c in asked)]

        if not self.both:
            kept = band_search(s, views_of(q is not None), narrow=self.narrow, quality=q)
        else:               # the quality cost chooses within SPEED_TIE of the faster
            ordered = band_search(s, views_of(False), narrow=self.narrow, guard=agreed_cost)
            filled = band_search(s, views_of(True), narrow=self.narrow, quality=q)
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
        neutral floors globally (AR3's verdict: the same on every rank), else the static plan;
        AR3b's parts: the rank's parts of the start's agreed numbers (kept work by stage and
        quality sum: sums; makespan: max) and of every probe's supply and demand
        (``dst_probes.RankProbes.first``)."""
        s, r, k = self.settings, self.chosen_report, self.chosen
        ok = (r.meets(*descent_floors(s), quality=self.quality is not None)
              and not r.step_time_planned_s > r.step_time_static_s)
        if ok:
            start = (self.plans[k].grid_index, float(self.mk[k]), self.kept_s[k],
                     float(self.q[k]))
        else:
            start = (np.full(self.plans[k].grid_index.shape, self.ps.bounds[0]),
                     float(self.ps.mk0.max()), s.d0 * self.w.sum(axis=(0, 1)), 0.0)
        # the start's agreed step: AR3's (the band plan's) or AR1's (the static plan's)
        step = float(r.step_time_planned_s) if ok else float(self.a1.t0)
        qsum = None if self.quality is None else \
            (lambda i: float(self.quality.sums_at(i, self.costs.densities)))
        self.probes = RankProbes(self.costs, s, self.ps.bounds, qsum, start, probe_steps(step))
        _, mk, kept_s, q = start
        more = self.probes.first()
        out = {"sum": {"kept_s": kept_s, "quality": q, **more["sum"]},
               "max": {"mk": mk, **more["max"]}}
        if self.quality is not None:
            out["sum"].update(self.replicate_parts()["sum"])
        return out

    def adopt(self, idx: np.ndarray, report: DSTReport, replicates, free_replicates,
              a3: dict) -> tuple:
        """The quality objective's last rule (docs/DESIGN.md section 5) on the plan at ``idx``:
        kept where its predicted loss change is within the model's uncertainty u and its speed
        gain at the exchange rate pays for that change + u against the no-cut plan (the ``max``
        band), else that plan. ``report``: the agreed one; ``replicates``, ``free_replicates``:
        its and the no-cut plan's change under the bootstrap replicates, summed over the step.
        (grid indices, report, the kept row or -1 for ``idx``)."""
        a1, rate = self.a1, self.settings.exchange_rate
        rate = a1.uniform_rate() if rate is None else rate
        free = self.free
        u = float(self.quality.uncertainty(replicates, a1.tokens))
        nocut = self.global_report(free, a3)
        u_free = float(self.quality.uncertainty(free_replicates, a1.tokens))

        def value(r: DSTReport, u: float = 0.0) -> float:
            return rate * 100.0 * (1.0 - r.step_time_planned_s / a1.t0) - r.quality_cost - u

        if report.quality_cost <= u + 1e-12 and value(report, u) >= value(nocut) - 1e-15:
            return idx, replace(report, quality_sd=u, adopted="dst", exchange_rate=rate), -1
        return self.plans[free].grid_index, replace(nocut, quality_sd=u_free, adopted="no_cuts",
                                                    exchange_rate=rate), free
