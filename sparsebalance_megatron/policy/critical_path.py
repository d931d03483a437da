"""Critical-path descent: a DST candidate that shortens the pipeline's longest path, not its
busiest stage (issue 27's headroom study).

DST's cut phase (``policy.dst``) lowers the densities of load units, (DP rank, pipeline stage),
whose busy time is above a band around the anchor; its raise phase fills float. Once SAB has
balanced the DP ranks, what is left is the pipeline's own shape: the step is the longest path
through the schedule's events (fill, steady state, drain; with the interleaved schedule a path
that crosses every rank several times), and no stage's busy time is far above the others'. Then
nothing is outside the band, or cutting a stage's busy time down to it moves the longest path
little, and the floors (mean density, per-stage density, predicted quality) widen the band back.
On issue 27's robustness cases (long-document mixes, interleaved layouts) a linear program over
the same event graph, floors, bounds and quality rule (continuous densities, costs linear in
density; a one-off check with scipy, not kept here) put the optimum 10-20% below the step time
of DST's band plan; on short documents (``lognormal_short``) even every unit at d_min is only
2-5% faster, so nothing is left there.

The descent here approaches that optimum with the simulator and the float of every event
(``policy.slack``), vectorised over DP ranks; each round:

1. target T' = (1 - eta) x the plan's step time;
2. cut: every unit on a path longer than T' (negative float at deadline T') sheds the same
   fraction alpha of its cuttable time (its time above d_min); per DP rank the smallest alpha of
   ``CUT_FRACTIONS`` that brings the rank within T' (all fractions in one simulator call);
3. raise: every unit grows by beta x its float at (1 - h) x T' (h: the raise headroom, as in
   DST's raise), up to d_max; per rank the largest beta of ``RAISE_FRACTIONS`` the simulator
   clears (a rank may not end above max((1 - h) x T', its cut makespan));
4. keep the round only if the step got faster and the plan meets the floors (and, with the
   quality objective, loses no predicted quality against uniform d0); else halve eta.

The descent spends no density: its plan keeps the work-weighted mean density at d0 or above
(``NEUTRAL_DENSITY``), even where the density floor would let the band plan go lower. Its speed
comes from the pipeline's shape, not from attention dropped, so it is also what the layout
study counts as a win (a layout qualifies only at mean density >= d0).

So the result is never slower than the plan it starts from, and ``plan_dst_with_floor`` keeps it
only when it is predicted faster by more than ``dst.SPEED_TIE``. Cost: ``ROUNDS`` rounds of two
float passes and three simulator calls.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import kernels
from ..kernels.records import Graph, Lookup, Tables
from ..sim.pipeline import FWD, event_graph
from .costs import UnitCosts, stage_mean_densities, weighted_mean_density
from .dst_settings import DSTSettings
from .grid_search import highest_at_most
from .floors import FloorCheck
from .slack import unit_floats_from

ROUNDS = 8                                   # descent rounds per plan
CUT_FRACTIONS = np.array([1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0])
RAISE_FRACTIONS = np.array([1.0, 0.5, 0.25, 0.125, 0.0])
ETA_START, ETA_MAX, ETA_MIN = 0.02, 0.1, 1e-3   # step-time reduction asked of a round
_REL_EPS = 1e-9
NEUTRAL_DENSITY = 1.0                        # the descent's mean-density floor, x d0


class _Step:
    """Times, simulations and floats of plans (grid indices [..., dp, m, nv], or a subset of
    the DP ranks) on costs: a simulation keeps its event durations and earliest finishes, so
    the floats of a plan already simulated cost only the backward pass
    (``slack.unit_floats_from``)."""

    def __init__(self, costs: UnitCosts, p2p_s: float):
        self.c, self.p2p = costs, float(p2p_s)
        self.pp = costs.pipeline_ranks
        dp, m, nv = costs.shape
        self.graph = event_graph(m, self.pp, nv // self.pp)
        self.g = costs.densities.size
        self.units = np.arange(dp * m * nv).reshape(dp, m, nv) * self.g
        self.fwd, self.bwd = costs.fwd_s.reshape(-1), costs.bwd_s.reshape(-1)
        self.t_flat = costs.total_s.reshape(-1)
        rows = self.graph.unit_events                           # event row of each (kind, unit)
        self.fwd_row, self.bwd_row = rows[FWD], rows[1 - FWD]
        self.per_rank = m * nv
        self._records = None

    def records(self) -> tuple:
        """The compiled search's records of this step's graph and tables (``kernels.records``:
        ``Graph``, ``Tables``), made on first use."""
        if self._records is None:
            self._records = (Graph.of(self.graph, self.p2p),
                             Tables(*(np.require(a, np.float64, "CW")
                                      for a in (self.fwd, self.bwd, self.t_flat)), self.g))
        return self._records

    def times(self, idx):
        """fwd, bwd seconds of the plan ``idx`` [dp, m, nv]."""
        u = self.units + idx
        return self.fwd.take(u), self.bwd.take(u)

    def run(self, f, b):
        """(durations, earliest finishes [E, cols], makespans [..., ranks]) of plans' times
        f, b [..., ranks, m, nv]."""
        _, m, nv = self.c.shape
        dur = self.graph.durations(f.reshape(-1, m, nv), b.reshape(-1, m, nv))
        ef = self.graph.earliest_finish(dur, self.p2p)
        return dur, ef, self.graph.makespan(ef).reshape(f.shape[:-2])

    def holders(self, flat_units: np.ndarray):
        """(ranks, column of each unit's rank among them [n], each rank's units
        ``seg[j]:seg[j + 1]`` [r + 1], unit within its rank [n]) of the DP ranks that hold a
        unit of ``flat_units`` [n] (ascending)."""
        rank_of = flat_units // self.per_rank              # ascending: units come sorted
        first = np.ones(rank_of.size, dtype=bool)
        first[1:] = rank_of[1:] != rank_of[:-1]
        starts = np.flatnonzero(first)
        return (rank_of[starts], np.cumsum(first) - 1, np.append(starts, rank_of.size),
                flat_units % self.per_rank)

    def candidates(self, dur: np.ndarray, flat_units: np.ndarray, moved: np.ndarray):
        """(ranks, column of each unit's rank among them [n], event durations [E, k x r]) of
        the DP ranks that hold a unit of ``flat_units`` [n] (ascending): the plan simulated
        as ``dur`` [E, dp] with those units at grid indices ``moved`` [k, n] (column c x r + j:
        candidate c of rank ``ranks[j]``). Only the moved units' seconds are looked up; the
        other events keep the plan's durations (the same seconds)."""
        ranks, col, _, local = self.holders(flat_units)
        k, r = moved.shape[0], ranks.size
        out = np.tile(dur[:, ranks], (1, k))
        cols = np.arange(k)[:, None] * r + col
        at = flat_units * self.g + moved                            # [k, n] table offsets
        out[self.fwd_row[local], cols] = self.fwd.take(at)
        out[self.bwd_row[local], cols] = self.bwd.take(at)
        return ranks, col, out

    def simulate(self, dur):
        """(earliest finishes [E, cols], makespans [cols]) of event durations [E, cols] (no
        simulator call for no columns: no DP rank holds a moved unit)."""
        if not dur.shape[1]:
            return dur.copy(), np.zeros(0)
        ef = self.graph.earliest_finish(dur, self.p2p)
        return ef, self.graph.makespan(ef)

    def first_fit(self, dur: np.ndarray, flat_units: np.ndarray, moved: np.ndarray,
                  limit: np.ndarray, probe_first: bool = False, fits_from=None) -> tuple:
        """Of the plan simulated as ``dur`` [E, dp] with units ``flat_units`` (ascending) at
        one of the candidates ``moved`` [k, n], per DP rank that holds one of them: the first
        candidate whose makespan is <= ``limit`` [dp] (makespans never rise from one candidate
        to the next: each moves every unit no higher than the one before). Returns (ranks, column
        of each unit's rank [n], whether one fits [r], its index (0 where none) [r], its
        makespan [r], its durations and earliest finishes [E, r]). One compiled binary search
        per rank where ``kernels`` run (``probe_first``: the first candidate tried alone
        before the search, where it usually fits; ``fits_from`` [r]: per rank a candidate known
        to fit, where its search starts); else every candidate simulated (``candidates``) and
        the first kept: the same numbers."""
        ranks, col, seg, local = self.holders(flat_units)
        if kernels.enabled():
            graph, tables = self.records()
            tries = kernels.fit.tries(ranks, seg, self.fwd_row[local], self.bwd_row[local],
                                      limit[ranks], moved.shape[0], fits_from)
            return (ranks, col) + kernels.fit.first_fit(
                graph, dur, tries, tables, flat_units * self.g + moved,
                probe_first=probe_first)
        k, r = moved.shape[0], ranks.size
        _, _, dur_k = self.candidates(dur, flat_units, moved)
        ef_k, mk_k = self.simulate(dur_k)
        ok = mk_k.reshape(k, r) <= limit[ranks]
        pick, j = np.argmax(ok, axis=0), np.arange(r)
        sel = pick * r + j
        return ranks, col, ok.any(axis=0), pick, mk_k[sel], dur_k[:, sel], ef_k[:, sel]

    def put(self, plan, f, b, flat_units, i):
        """Plan ``plan`` [dp, m, nv] and its seconds ``f``, ``b`` with units ``flat_units`` at
        grid indices ``i`` [n], in place."""
        at = flat_units * self.g + i
        np.put(plan, flat_units, i)
        np.put(f, flat_units, self.fwd.take(at))
        np.put(b, flat_units, self.bwd.take(at))

    def raise_fit(self, dur, up, first, t_up, cap, lo, i_max: int, limit) -> tuple:
        """``first_fit`` of the raise fractions (``RAISE_FRACTIONS``) of units ``up``
        (ascending; seconds ``t_up``, floats ``cap``, grid indices ``lo`` [n]), the largest
        fraction's grid indices ``first`` given and the others looked up only where a rank
        tries them (compiled), the first fraction tried alone first. Returns ``first_fit``'s and
        the picked grid index of every unit [n]."""
        at = np.full((RAISE_FRACTIONS.size, up.size), -1, dtype=np.int64)
        at[0] = up * self.g + first
        return self._lazy_fit(dur, up, at, t_up, cap, np.full(up.size, i_max, dtype=np.int64),
                              lo, RAISE_FRACTIONS, limit, True)

    def _lazy_fit(self, dur, units, at, t, delta, top, bottom, fracs, limit, probe_first):
        ranks, col, seg, local = self.holders(units)
        u = units * self.g
        graph, tables = self.records()
        tries = kernels.fit.tries(ranks, seg, self.fwd_row[local], self.bwd_row[local],
                                  limit[ranks], at.shape[0])
        lookup = Lookup(*(np.require(a, d, "CW") for a, d in (
            (u, np.int64), (t, np.float64), (delta, np.float64), (top, np.int64),
            (bottom, np.int64), (fracs, np.float64))), 1 + _REL_EPS)
        out = kernels.fit.first_fit(graph, dur, tries, tables, at, lookup, self.c.formula,
                                    probe_first)
        return (ranks, col) + out + (at[out[1][col], np.arange(units.size)] - u,)

    def floats(self, dur, ef, deadline):
        """[cols, m * nv] the smaller float of every unit's forward and backward."""
        return unit_floats_from(self.graph, dur, ef, deadline, self.p2p).T

    def highest_within(self, flat_units, thr, lo, hi) -> np.ndarray:
        """Per unit (flat unit ids ``flat_units`` [n]), the highest grid index i in [lo, hi]
        with t(i) <= thr (lo if none), thr [k, n] (a candidate per row), lo / hi [n] or
        scalars; t non-decreasing along the grid (``UnitCosts``)."""
        limit = np.asarray(thr, dtype=np.float64) * (1 + _REL_EPS) + 1e-15
        if self.c.formula is not None and kernels.enabled() and limit.ndim == 2 \
                and limit.shape[1] == flat_units.size:     # the totals computed, not read
            return kernels.fit.highest_formula(self.c.formula, flat_units, lo, hi, limit)
        return highest_at_most(self.t_flat, flat_units * self.g, limit, lo, hi)


def descend(costs: UnitCosts, idx: np.ndarray, i_min: int, i_max: int, p2p_s: float,
            raise_headroom: float, meets, rounds: int = ROUNDS, floors=None):
    """Critical-path descent from the plan at grid indices ``idx`` [dp, m, nv] (module
    docstring); ``meets(densities)`` says whether a plan keeps the floors. Returns (grid
    indices, predicted step time s) of the best plan found, ``idx`` itself if none is faster.

    Only what a round can change is searched and simulated: a unit off every path longer
    than T' keeps its density under every cut fraction (its own time is its threshold), and
    a unit whose next grid density does not fit under the largest raise fraction keeps it
    under every fraction; a DP rank none of whose units moves keeps its simulation.
    ``floors(densities)`` (optional) is a part of ``meets`` that no raise can break (true of a
    plan, true of every plan at or above it unit by unit, as mean-density floors are): a round
    whose largest raise fails it is given up before its raises are simulated, as the round
    would be after (its plan is at or below that one)."""
    return _descent(costs, idx, i_min, i_max, p2p_s, raise_headroom,
                    lambda i: meets(costs.densities[i]), rounds,
                    None if floors is None else lambda i: floors(costs.densities[i]))[:2]


def _descent(costs: UnitCosts, idx: np.ndarray, i_min: int, i_max: int, p2p_s: float,
             raise_headroom: float, meets_at, rounds: int, floors_at=None):
    """``descend``, and the DP ranks' makespans [dp] of the plan it returns; ``meets_at`` and
    ``floors_at`` take a plan's grid indices (``descend``'s take its densities)."""
    st = _Step(costs, p2p_s)
    dp = costs.shape[0]
    t_min = np.ascontiguousarray(costs.total_s[..., i_min]).reshape(-1)
    f, b = st.times(idx)
    dur, ef, mk = st.run(f, b)
    step = float(mk.max())
    eta = ETA_START
    known = (np.zeros(0, dtype=np.int64), np.zeros((CUT_FRACTIONS.size, 0), dtype=np.int64))

    def cuts_of(on, known):
        """(grid indices [fractions, n] of units ``on`` (ascending) under every cut fraction,
        the units searched so far and their cuts). A unit's cuts depend only on its own
        density in the plan, so only units not searched since their density last changed
        are searched (a round that keeps the plan asks less: its units on a path longer
        than T' are a subset of the last round's)."""
        seen, cuts = known
        at = np.minimum(np.searchsorted(seen, on), max(seen.size - 1, 0))
        hit = seen[at] == on if seen.size else np.zeros(on.size, dtype=bool)
        if hit.all():
            return cuts[:, at], known
        moved = np.empty((CUT_FRACTIONS.size, on.size), dtype=np.int64)
        moved[:, hit] = cuts[:, at[hit]]
        miss = on[~hit]
        t_on = (f + b).reshape(-1)[miss]
        moved[:, ~hit] = st.highest_within(
            miss, t_on - CUT_FRACTIONS[:, None] * (t_on - t_min[miss]), i_min,
            idx.reshape(-1)[miss])
        return moved, (on, moved)

    fused = None
    if kernels.enabled():           # both phases compiled whole
        fused = kernels.descent.Round(*st.records(), st.c.formula, st.c.shape, i_min, i_max)
    for _ in range(rounds):
        if eta < ETA_MIN:
            break
        target = step * (1.0 - eta)
        # cut: every unit on a path longer than T' sheds a fraction of its cuttable time
        if fused is not None:
            now = fused.plan(dur, ef, f, b, idx)
            on, ranks, col, fits, mk_p, dur_p, ef_p, cut_i = fused.cut(
                now, t_min, target, target * (1 + _REL_EPS), CUT_FRACTIONS, 1 + _REL_EPS)
        else:
            on = np.flatnonzero(st.floats(dur, ef, np.full(dp, target)).reshape(-1) < 0)
            moved, known = cuts_of(on, known)
            ranks, col, fits, pick, mk_p, dur_p, ef_p = st.first_fit(
                dur, on, moved, np.full(dp, target * (1 + _REL_EPS)))   # smallest alpha that fits
            cut_i = moved[pick[col], np.arange(on.size)]
        if not fits.all():                                           # T' out of reach: ask less
            eta /= 2
            continue
        # raise: every unit grows by a fraction of its float at (1 - h) x T'
        deadline = np.full(dp, target * (1.0 - raise_headroom))
        lazy = kernels.enabled()       # the smaller fractions looked up where a rank tries them
        if fused is not None:
            cut, f1, b1, mk_cut, dur1, ef1, cap, t1, up, first = fused.after_cut(
                now, mk, kernels.descent.Cut(on, cut_i, ranks, mk_p, dur_p, ef_p),
                target * (1.0 - raise_headroom), 1 + _REL_EPS)
            lo, moved = cut.reshape(-1), first[None]
        else:
            cut, f1, b1, mk_cut, dur1, ef1 = idx.copy(), f.copy(), b.copy(), mk.copy(), \
                dur.copy(), ef.copy()
            st.put(cut, f1, b1, on, cut_i)
            mk_cut[ranks] = mk_p
            dur1[:, ranks], ef1[:, ranks] = dur_p, ef_p
            cap = np.maximum(st.floats(dur1, ef1, deadline), 0.0).reshape(-1)
            t1, lo = (f1 + b1).reshape(-1), cut.reshape(-1)
            up = np.flatnonzero(lo < i_max)
            up = up[st.t_flat.take(up * st.g + lo[up] + 1)
                    <= (t1[up] + RAISE_FRACTIONS[0] * cap[up]) * (1 + _REL_EPS) + 1e-15]
            fractions = RAISE_FRACTIONS[:1, None] if lazy else RAISE_FRACTIONS[:, None]
            moved = st.highest_within(up, t1[up] + fractions * cap[up], lo[up], i_max)
        if floors_at is not None:       # the round's best plan is below it: nothing will do
            top = cut.copy()
            np.put(top, up, moved[0])
            if not floors_at(top):
                eta /= 2
                continue
        raise_limit = np.maximum(deadline, mk_cut) * (1 + _REL_EPS) + 1e-15  # beta 0 holds
        if lazy:                                    # most ranks take the whole float
            ranks, col, _, pick, mk_p, dur_p, ef_p, raised = st.raise_fit(
                dur1, up, moved[0], t1[up], cap[up], lo[up], i_max, raise_limit)
        else:
            ranks, col, _, pick, mk_p, dur_p, ef_p = st.first_fit(
                dur1, up, moved, raise_limit, probe_first=True)
            raised = moved[pick[col], np.arange(up.size)]
        new, mk_new = cut.copy(), mk_cut.copy()
        np.put(new, up, raised)
        mk_new[ranks] = mk_p
        new_step = float(mk_new.max())
        if new_step < step * (1 - _REL_EPS) and meets_at(new):
            st.put(cut, f1, b1, up, raised)                 # cut becomes new; f1, b1 its times
            dur1[:, ranks], ef1[:, ranks] = dur_p, ef_p
            seen, cuts = known                  # the units whose density changed: unknown
            same = new.reshape(-1) == idx.reshape(-1)
            known = (seen[same[seen]], cuts[:, same[seen]])
            idx, f, b, step, dur, ef, mk = new, f1, b1, new_step, dur1, ef1, mk_new
            eta = min(eta * 1.5, ETA_MAX)
            if fused is not None:
                fused.plan_changed(same)
        else:
            eta /= 2
    return idx, step, mk


def refine_plan(plan, costs: UnitCosts, settings: DSTSettings, *, quality=None,
                margin: float = 1e-3, rounds: int = ROUNDS):
    """``plan`` (a ``dst.DSTPlan``), or the critical-path descent from it when that is predicted
    faster by more than ``margin`` (relative) and meets the floors of ``settings``: the
    work-weighted mean density >= max(density_floor, ``NEUTRAL_DENSITY``) x d0, every stage's >=
    stage_density_floor x d0, and with ``quality`` (a ``StageQuality``) no predicted loss against
    uniform d0. A plan that does not meet them is refined from the static plan (every unit at
    d0) instead."""
    if rounds <= 0:
        return plan
    d0 = settings.d0
    check = FloorCheck(costs, max(float(settings.density_floor), NEUTRAL_DENSITY) * d0,
                        settings.stage_density_floor * d0, quality)
    meets = check.meets
    r = plan.report
    start, start_s = plan.densities, min(r.step_time_planned_s, r.step_time_static_s)
    if r.step_time_planned_s > r.step_time_static_s or not meets(start):
        start, start_s = np.full(costs.shape, float(d0)), r.step_time_static_s
    i0, i_min, i_max = (costs.index_of(d) for d in (d0, settings.d_min, settings.d_max))
    idx0 = np.clip(np.searchsorted(costs.densities, start - 1e-12), 0, costs.densities.size - 1)
    # the floors weigh every unit at its effective density (``UnitCosts.effective_index``)
    idx, step, mk = _descent(costs, idx0, i_min, i_max, settings.p2p_s, settings.raise_headroom,
                             lambda i: check.meets_at(costs.effective_index(i, i0)), rounds,
                             lambda i: check.floors_at(costs.effective_index(i, i0)))
    if not step < min(start_s, r.step_time_planned_s) * (1.0 - margin):
        return plan
    idx = costs.effective_index(idx, i0)
    dens = costs.densities[idx]
    w, dense = costs.weights(), costs.dense_work
    report = replace(
        r, step_time_planned_s=step, speedup=r.step_time_static_s / step,
        imbalance_after=float(mk.max() / mk.mean()) if mk.mean() > 0 else 1.0,
        mean_density=weighted_mean_density(dens, w, dense),
        units_cut=int((idx < i0).sum()), units_raised=int((idx > i0).sum()), ranks_reverted=0,
        density_per_stage=tuple(float(x) for x in stage_mean_densities(dens, w, dense)),
        quality_cost=quality.plan_cost_at(idx, costs.densities) if quality is not None
        else r.quality_cost)
    return replace(plan, densities=dens, report=report, grid_index=idx)

