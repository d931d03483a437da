"""The critical-path descent, one DP rank's part (AR3b on, ``dst_ranks.RankDST.descent_start``;
why it is probed: docs/DESIGN.md section 6, "DST and SAB at scale").
Every rank (at DP 1 the one) works on ``PROBES`` agreed steps below the start's
(``probe_steps``), and two reductions agree what a rank cannot see:

1. ``first`` (AR3b): at the probes at or above the rank's makespan, its **fills** (``_fill``,
   at every ``FILL_EVERY``-th such probe from the deepest, each from the last; a probe keeps the
   shallowest fill within it), whose gain over the start in kept work by stage and quality sum
   is its **supply**; below its makespan, its **free** descent to every probe with no floors
   (``_chain``), whose loss of kept work and added quality sum (each at least 0) is its
   **demand**. AR3b sums supply, demand, the ranks descending and the free plans' sums.
2. ``probe`` (AR4): below the free plans' fastest that meets the floors, two chains of descents
   under the floors: **shared**, each rank its demand and an even part of what the slack (the
   start's surplus over the floors plus the supply) leaves, or its part of the slack in
   proportion to its demand where the ranks ask for more (``_share``); **alone**, each the
   whole slack.
3. ``best``: the fastest of AR4's 2P plans whose sums meet the descent's floors globally.

Cost: a rank's ``FILL_EVERY``-th fills and at most three chains of P descents; AR3b
[P x (3 stages + 6)] floats, AR4 [2P x (stages + 2)], none growing with DP.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from ..kernels.slack import slower
from .critical_path import ROUNDS, descend_at, descent_floors, descent_round

PROBES = 64               # the descent's probe steps ...
PROBE_SPAN = 0.2          # ... over the 20% below the start's step (``probe_steps``)
FILL_EVERY = 8            # a fill every 8th probe at or above the rank's makespan


def probe_steps(step: float) -> np.ndarray:
    """The descent's probe steps below the start's agreed ``step``: ``PROBES`` steps over the
    ``PROBE_SPAN`` below it, quadratically spaced (the first 0.005% below, the last 20%; evenly
    spaced ones missed the 0.3% a descent finds on well-balanced drafts, and a 10% span the
    20-30% it finds on the baseline packing at 128K; the ``dst_decomposed`` study, at cb3f41a): the
    resolution the decomposed descent gives up against the central one."""
    return step * (1.0 - PROBE_SPAN * (np.arange(1, PROBES + 1) / PROBES) ** 2)


class RankProbes:
    """One DP rank's probed descent from ``start`` = (grid indices [1, m, stages], makespan,
    kept work by stage, quality sum) toward ``steps`` (module docstring). ``bounds``: the grid
    indices of d0, d_min and d_max; ``qsum(idx)``: the rank's quality sum of a plan (None: no
    quality objective)."""

    def __init__(self, costs, settings, bounds: tuple, qsum, start: tuple, steps: np.ndarray):
        self.costs, self.w, self.s, self.qsum, self.start, self.steps = \
            costs, costs.attn_work, settings, qsum, start, steps
        self.i0, i_min, i_max = bounds
        self.floor, self.stage_floor = descent_floors(settings)
        # the compiled round every descent and fill of the rank share
        self.rnd = descent_round(costs, i_min, i_max, settings.p2p_s)

    def _record(self, idx, mk: float) -> tuple:
        """(effective grid indices, makespan, kept work by stage, quality sum) of a plan."""
        e = self.costs.effective_index(idx, self.i0)
        kept = (self.costs.densities.take(e) * self.w).sum(axis=(0, 1))
        return e, float(mk), kept, self.qsum(e) if self.qsum is not None else 0.0

    def first(self) -> dict:
        """The fills and the free descents: AR3b's parts, every probe's supply, demand and
        whether the rank descends there, and the free plans' kept work by stage and quality
        (sums) and makespans (``free_mk``: max)."""
        idx, mk, kept0, q0 = self.start
        p, nv = self.steps.size, kept0.size
        self.free = [None] * p
        supply_k, supply_q = np.zeros((p, nv)), np.zeros(p)
        demand_k, demand_t, demand_q = np.zeros((p, nv)), np.zeros(p), np.zeros(p)
        below = np.flatnonzero(self.steps >= mk)
        if below.size:
            tried = np.unique(np.append(below[::FILL_EVERY], below[-1]))
            cur, own = idx, []
            for j in tried[::-1]:                  # deepest first, each from the last
                cur, f_mk = self._fill(cur, float(self.steps[j]))
                own.insert(0, self._record(cur, f_mk))
            for j, step in zip(below.tolist(), self.steps[below].tolist()):
                # the shallowest fill at or below the probe (raised earlier)
                self.free[j] = next((f for f in own if f[1] <= step), self.start)
            supply_k[below] = np.stack([self.free[j][2] for j in below]) - kept0
            supply_q[below] = np.array([self.free[j][3] for j in below]) - q0
        self.top = own[0] if below.size else self.start
        chain = list(self._chain(lambda j: None))
        if chain:
            js = [j for j, _ in chain]
            for j, plan in chain:
                self.free[j] = plan
            kept = np.stack([plan[2] for _, plan in chain])        # [n, stages]
            demand_k[js] = np.maximum(kept0 - kept, 0.0)
            demand_t[js] = np.maximum(kept0.sum() - kept.sum(axis=1), 0.0)   # a row's sum:
            demand_q[js] = np.maximum(np.array([plan[3] for _, plan in chain]) - q0, 0.0)
        # (numpy's of the row alone). The rank's own demand, for ``probe`` (copies: a reducer
        # may sum its parts in place)
        self.demand = (demand_t.copy(), demand_k.copy(), demand_q.copy())
        return {"sum": {"supply_kept": supply_k, "supply_q": supply_q, "demand_kept": demand_k,
                        "demand_total": demand_t, "demand_q": demand_q,
                        "descending": np.where(self.steps >= mk, 0.0, 1.0),
                        "free_kept": np.stack([f[2] for f in self.free]),
                        "free_q": np.array([f[3] for f in self.free])},
                "max": {"free_mk": np.array([f[1] for f in self.free])}}

    def _fill(self, idx, target: float) -> tuple:
        """The descent's raise (``kernels.descent.Round``'s, after a cut that finds nothing)
        with a fixed ``target``, on the rank at or below it, in rounds until nothing moves:
        what the central rounds give a rank off the critical path. (grid indices, makespan)."""
        rnd, deadline = self.rnd, target * (1.0 - self.s.raise_headroom)
        plan, mk = rnd.simulate(idx)
        for _ in range(ROUNDS):
            rnd.plan_changed()                           # a fill's every round resets it
            cut = rnd.after_cut(plan, mk, rnd.cut(plan, target)[1], deadline)
            if not cut.up.size:
                break
            new, mk_new = rnd.raise_fit(cut, deadline)
            if np.array_equal(new.idx, plan.idx):
                break
            plan, mk = new, mk_new
        return plan.idx.reshape(idx.shape), float(mk.max())

    def _chain(self, budget, first: int = 0):
        """(probe, plan) for every probe below the start's makespan: from ``first`` on, the
        descent to it from the last, under ``budget(j)`` = (kept work, kept work by stage,
        quality) the rank may spend from the start's (None: no floors). A descent that misses
        its probe is tried again from the chain's start (the chain's own cuts may be what
        blocks it); a second miss ends the chain's descents."""
        costs, s, qsum = self.costs, self.s, self.qsum
        mk, kept0, q0 = self.start[1:]
        plan, lim, total0 = self.top, None, float(kept0.sum())
        met = [None]            # the last plan ``meets_at`` passed: (it, its record's parts)

        def kept_ok(e):
            kept = (costs.densities.take(e) * self.w).sum(axis=(0, 1))
            return kept, bool(float(kept.sum()) >= lim_total and np.all(kept >= lim_stage))

        def floors_at(i):
            return kept_ok(costs.effective_index(i, self.i0))[1]

        def meets_at(i):
            e = costs.effective_index(i, self.i0)
            kept, ok = kept_ok(e)
            if not ok:
                return False
            q = qsum(e) if qsum is not None else 0.0
            if qsum is not None and not q <= q0 + lim[2]:
                return False
            met[0] = (i, e, kept, q)          # a round kept: the descent's plan, unless a
            return True                       # later round is kept too

        def descend(start, goal):
            new, step = descend_at(self.rnd, start[0], s.raise_headroom,
                                   (lambda i: True) if lim is None else meets_at,
                                   None if lim is None else floors_at, goal=goal)
            if not step < start[1]:
                return start
            if met[0] is not None and met[0][0] is new:      # its record made by meets_at
                return met[0][1], float(step), met[0][2], met[0][3]
            return self._record(new, step)

        for j in np.flatnonzero(self.steps < mk).tolist():
            goal = float(self.steps[j])
            if plan[1] > goal and j >= first:
                lim, met[0] = budget(j), None         # read where the rank descends only
                if lim is not None:
                    lim_total, lim_stage = total0 - lim[0], kept0 - lim[1]
                got = descend(plan, goal)
                if slower(got[1], goal) and plan is not self.top:
                    again = descend(self.top, goal)
                    got = again if again[1] < got[1] else got
                plan = got
                if slower(plan[1], goal):
                    first = self.steps.size
            yield j, plan

    def probe(self, agreed: dict, a1) -> dict:
        """AR4's parts [2P] (AR3b's sums ``agreed``, AR1's totals ``a1``): the shared and the
        alone chains' plans, each the free plan down to the free plans' fastest that meets the
        floors: makespans (max), kept work by stage and quality sums (sums)."""
        kept_all, q_all = agreed["kept_s"], float(agreed["quality"])
        sup_k, sup_q = agreed["supply_kept"], agreed["supply_q"]
        t = a1.totals
        slack = (kept_all.sum() + sup_k.sum(axis=1) + t.dense - self.floor * t.tot,
                 kept_all + sup_k + t.dense_s - self.stage_floor * t.tot_s,
                 1e-12 * a1.tokens - q_all - sup_q)
        n = np.maximum(agreed["descending"], 1.0)
        total = (agreed["demand_total"], agreed["demand_kept"], agreed["demand_q"])
        share = [_share(x, o, t, n if x.ndim == 1 else n[:, None])
                 for x, o, t in zip(slack, self.demand, total)]
        free = self.best({"kept_s": agreed["free_kept"], "quality": agreed["free_q"],
                          "mk": agreed["free_mk"]}, a1, float(agreed["mk"]))
        self.plans, n_p = list(self.free) + list(self.free), self.steps.size
        for c, budget in enumerate((share, slack)):
            for j, plan in self._chain(lambda j: tuple(x[j] for x in budget), first=free + 1):
                if j > free:
                    self.plans[c * n_p + j] = plan
        return {"sum": {"kept_s": np.stack([x[2] for x in self.plans]),
                        "quality": np.array([x[3] for x in self.plans])},
                "max": {"mk": np.array([x[1] for x in self.plans])}}

    def best(self, a: dict, a1, start_step: float) -> int:
        """The fastest of plans whose agreed sums ``a`` (kept work by stage, quality sums,
        makespans: [P, ...]) meet the descent's floors globally, the first of equal steps; -1:
        none is faster than ``start_step``."""
        floor, stage_floor = self.floor - 1e-12, self.stage_floor - 1e-12
        mean, stage = a1.densities(a["kept_s"])          # every plan's
        mk = np.asarray(a["mk"], dtype=np.float64)
        meets = (mean >= floor) & (stage.min(axis=1) >= stage_floor) & (mk < start_step)
        if self.qsum is not None:
            meets &= ~(np.asarray(a["quality"]) / a1.tokens > 1e-12)
        if not meets.any():
            return -1
        return int(np.argmin(np.where(meets, mk, np.inf)))   # the first of equal steps


def _share(slack, own, total, n):
    """A rank's budget of ``slack``: its demand ``own`` and an n-th of what the ranks'
    ``total`` leaves; its part of the slack in proportion where they ask for more."""
    over = total > slack
    return np.where(over, slack * own / np.where(over, total, 1.0), own + (slack - total) / n)
