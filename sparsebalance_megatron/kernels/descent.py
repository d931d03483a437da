"""Compiled phases of a critical-path descent round (``policy.critical_path._descent``), when
numba is installed: the cut (which units lie on a path longer than the round's target, and per
DP rank the first cut fraction that fits: ``kernels.fit``' search) and what the raise needs
from it (the cut plan and its simulation, every unit's float at the raise's deadline, the units
the largest raise fraction moves and where to). A unit's seconds are computed by the tables'
formula where the costs carry one (``UnitCosts.formula``), else read from the tables.

The numpy path runs the same steps as a dozen array operations per phase, each a pass over the
step's units (64 DP x 16 x 8 virtual stages: 8,192) with its own gather, copy and allocation;
those passes, not the searches, were half of a descent. Here each phase is one compiled call
that composes the kernels the numpy path's calls run (``kernels.graph``' latest finishes and
floats, ``kernels.fit``' search and formula bisection) on the same operands in the same
order, so a descent's plan is the same bit for bit whichever runs
(``tests/unit/test_critical_path.py``).

Pure numpy and numba; must not import torch, megatron or anything else from this package but
``kernels`` (its warm-up builds a draft's own event graph: ``sim.pipeline``).
"""

from __future__ import annotations

import numpy as np

from typing import NamedTuple

from . import f64, jit
from .fit import first_fit_search, highest_formula_search, unit_seconds
from .grid import lift_step, lifted
from .graph import unit_floats_pass
from .records import Formula, Lookup, Tables, Tries


class Plan(NamedTuple):
    """A plan and its simulation, as a round reads it: event durations and earliest finishes
    [E, dp], and every unit's forward and backward seconds and grid index [dp x m x nv]."""

    dur: np.ndarray
    ef: np.ndarray
    f: np.ndarray
    b: np.ndarray
    idx: np.ndarray


class Cut(NamedTuple):
    """A round's cut (``cut_round``): the units on a path longer than the target, their cut
    grid indices, the ranks holding them, and each rank's pick's makespan, durations and
    earliest finishes."""

    on: np.ndarray
    cut_i: np.ndarray
    ranks: np.ndarray
    mk: np.ndarray
    dur: np.ndarray
    ef: np.ndarray


@jit
def _floats(graph, dur, ef, deadline):
    # every unit's smaller float, rank by rank ([cols x units], flat), all due at deadline
    return unit_floats_pass(graph.nxt, graph.succ, graph.cross, dur, ef,
                            np.full(dur.shape[1], deadline), graph.p2p, graph.ev_f,
                            graph.ev_b).reshape(-1)


@jit
def _seconds(q, i, formula):
    # unit q's (forward, backward) seconds at grid index i, as its tables hold them (the
    # tables' own formula, computed from arrays a cache holds instead of read from three large
    # tables: ``kernels.fit``'s formula numbers). Callers read the tables themselves where the
    # costs have no formula: with that branch in here, and the tables passed to it per unit,
    # after_cut_round took 4.4 ms a call instead of 0.8 (64 DP x 16 x 8 stages)
    work, per_pair, fixed, corr, scaled = formula
    row = q // per_pair.shape[1]
    s = q - row * per_pair.shape[1]
    return unit_seconds(work[row, i], per_pair[0, s], per_pair[1, s], fixed[0, row, s],
                        fixed[1, row, s], corr[row, s], scaled)


@jit
def _highest(formula, tables, units, lo, hi, limit, out):
    # per element k: the highest grid index in [lo, hi] whose total is <= limit[k] (lo if
    # none): the formula's bisection, or ``grid_search.highest_at_most``'s binary lifting on
    # the tables' totals (``kernels.grid.lifted``; the rows are non-decreasing, so both give
    # that answer)
    if formula.work.shape[0] > 0:
        highest_formula_search(formula, units, lo, hi, limit, out)
        return
    step = lift_step(tables.g)                  # >= every span hi - lo + 1 (at most g)
    for k in range(units.size):
        row = units[k] * tables.g
        out[k] = lifted(tables.tot, row + lo[k], row + hi[k], limit[k], step) - row


@jit
def cut_round(graph, tables, formula, plan, t_min, target, limit, i_min, fracs, scale, was):
    # the descent's cut at ``target``: the units whose float is negative (ascending flat ids),
    # the DP ranks holding one, each unit's rank column, and the lazy first-fit search of them
    # (fits, picks, makespans, durations and finishes of the picks, each unit's grid index;
    # and what the next round on the same plan reuses: the search's look-ups, every rank's
    # pick). ``was``: (on, at, pick [dp] (-1: none)) the last round's, on the same plan at a
    # lower target (empty: none), whose look-ups are this round's (a unit's cut depends on the
    # plan alone) and whose picks fit here too (``Round``)
    was_on, was_at, was_pick = was
    ev_f, ev_b, g = graph.ev_f, graph.ev_b, tables.g
    per_rank = ev_f.size
    fl = _floats(graph, plan.dur, plan.ef, target)
    on = np.flatnonzero(fl < 0)
    n = on.size
    col = np.empty(n, dtype=np.int64)
    r = 0
    for j in range(n):                      # _Step.holders: ranks in order of their units
        if j == 0 or on[j] // per_rank != on[j - 1] // per_rank:
            r += 1
        col[j] = r - 1
    ranks = np.empty(r, dtype=np.int64)
    seg = np.empty(r + 1, dtype=np.int64)
    seg[r] = n
    rows_f = np.empty(n, dtype=np.int64)
    rows_b = np.empty(n, dtype=np.int64)
    u = np.empty(n, dtype=np.int64)
    t = np.empty(n)
    delta = np.empty(n)
    hi = np.empty(n, dtype=np.int64)
    lo = np.full(n, i_min, dtype=np.int64)
    for j in range(n):
        q = on[j]
        if j == 0 or col[j] != col[j - 1]:
            ranks[col[j]] = q // per_rank
            seg[col[j]] = j
        local = q - (q // per_rank) * per_rank
        rows_f[j], rows_b[j] = ev_f[local], ev_b[local]
        u[j] = q * g
        t[j] = plan.f[q] + plan.b[q]
        delta[j] = t_min[q] - t[j]
        hi[j] = plan.idx[q]
    at = np.full((fracs.size, n), -1, dtype=np.int64)
    i = 0
    for j in range(n):                     # this round's units are among the last round's
        while i < was_on.size and was_on[i] < on[j]:
            i += 1
        if i < was_on.size and was_on[i] == on[j]:
            for c in range(fracs.size):
                at[c, j] = was_at[c, i]
    z0 = np.full(r, fracs.size, dtype=np.int64)
    if was_on.size:
        for c in range(r):
            if was_pick[ranks[c]] >= 0:
                z0[c] = was_pick[ranks[c]]
    dur_p, ef_p = np.empty((plan.dur.shape[0], r)), np.empty((plan.dur.shape[0], r))
    fits, pick, mk = first_fit_search(
        graph, plan.dur, Tries(ranks, seg, rows_f, rows_b, np.full(r, limit), z0), tables,
        Lookup(u, t, delta, hi, lo, fracs, scale), formula, at, False, dur_p, ef_p)
    cut_i = np.empty(n, dtype=np.int64)
    for j in range(n):
        cut_i[j] = at[pick[col[j]], j] - u[j]
    by_rank = np.full(plan.dur.shape[1], -1, dtype=np.int64)
    for c in range(r):
        if fits[c]:
            by_rank[ranks[c]] = pick[c]
    return on, ranks, col, fits, mk, dur_p, ef_p, cut_i, at, by_rank


@jit
def after_cut_round(graph, tables, formula, plan, mk, cut, deadline, i_max, scale):
    # the cut plan (_Step.put of the cut, the picks' columns), every unit's float at the raise's
    # deadline (at least 0, np.maximum's NaN kept), the units the largest raise fraction can move
    # (a grid step up fits under their seconds + their whole float) and the highest grid index
    # each may take (_Step.highest_within)
    dur, ef, ranks = plan.dur, plan.ef, cut.ranks
    read, g = formula.work.shape[0] == 0, tables.g       # no formula: the tables' numbers
    idx, f1, b1 = plan.idx.copy(), plan.f.copy(), plan.b.copy()
    for j in range(cut.on.size):
        q, i = cut.on[j], cut.cut_i[j]
        idx[q] = i
        if read:
            f1[q], b1[q] = tables.fwd[q * g + i], tables.bwd[q * g + i]
        else:
            f1[q], b1[q] = _seconds(q, i, formula)
    mk_cut, dur1, ef1 = mk.copy(), dur.copy(), ef.copy()
    for c in range(ranks.size):
        mk_cut[ranks[c]] = cut.mk[c]
        for e in range(dur.shape[0]):
            dur1[e, ranks[c]] = cut.dur[e, c]
            ef1[e, ranks[c]] = cut.ef[e, c]
    cap = _floats(graph, dur1, ef1, deadline)
    t1 = np.empty(cap.size)
    lim = np.empty(cap.size)
    up = np.empty(cap.size, dtype=np.int64)
    n = 0
    for q in range(cap.size):
        x = cap[q]
        cap[q] = x if (x > 0.0 or x != x) else 0.0                # np.maximum(x, 0.0)
        t1[q] = f1[q] + b1[q]
        lim[q] = (t1[q] + 1.0 * cap[q]) * scale + 1e-15
        if idx[q] < i_max:
            if read:                                    # UnitCosts.total_s, as numpy compares
                tot = tables.tot[q * g + idx[q] + 1]
            else:
                fw, bw = _seconds(q, idx[q] + 1, formula)
                tot = fw + bw
            if tot <= lim[q]:
                up[n] = q
                n += 1
    up = up[:n].copy()
    lo, limit, first = np.empty(n, dtype=np.int64), np.empty(n), np.empty(n, dtype=np.int64)
    for j in range(n):
        lo[j], limit[j] = idx[up[j]] + 1, lim[up[j]]      # cut + 1 fits: the filter's test
    _highest(formula, tables, up, lo, np.full(n, i_max), limit, first)
    return idx, f1, b1, mk_cut, dur1, ef1, cap, t1, up, first


class Round:
    """A descent's compiled round phases on one step's graph and cost tables
    (``policy.critical_path._Step.records``), their seconds computed by the costs' formula
    where they carry one (``UnitCosts.formula``; None: read from the tables), for plans of
    ``shape`` [dp, m, nv]."""

    def __init__(self, graph, tables: Tables, formula, shape: tuple, i_min: int, i_max: int):
        self.graph, self.tables, self.formula = graph, tables, Formula.of(formula)
        self.shape, self.i_min, self.i_max = shape, int(i_min), int(i_max)
        self.plan_changed()

    def plan_changed(self, same=None) -> None:
        """Forget the last cut's picks (a round was kept: they were of another plan and
        target), and its look-ups of every unit whose grid index changed; ``same`` [units]
        (flat, optional: none kept without it) says which did not. A unit's look-ups depend on
        its own grid index alone (its seconds there and at d_min, the fractions), so those
        of the units a round left alone are the next cut's (the numpy path keeps them too:
        ``critical_path._descent``'s ``known``); about three in four look-ups were of them."""
        on, at, _ = getattr(self, "_was", (np.zeros(0, dtype=np.int64),) * 3)
        if same is None or not on.size:
            on, at = np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
        else:
            keep = same[on]
            on, at = on[keep], np.ascontiguousarray(at[:, keep])
        self._was = (on, at, np.full(self.shape[0], -1, dtype=np.int64))   # no pick known

    @staticmethod
    def plan(dur, ef, f, b, idx) -> Plan:
        """The ``Plan`` record of a plan's grid indices ``idx`` and seconds ``f``, ``b``
        [dp, m, nv] simulated as ``dur``, ``ef`` [E, dp]."""
        return Plan(f64(dur), f64(ef), f.reshape(-1), b.reshape(-1), idx.reshape(-1))

    def cut(self, plan: Plan, t_min, target: float, limit: float, fracs, scale: float):
        """(units on a path longer than ``target``, ranks, column of each unit's rank, whether
        each rank fits, makespans, durations and finishes of the picks, each unit's cut grid
        index): ``_descent``'s floats and its cut's first-fit search. Until ``plan_changed``,
        the next call is on the same plan at a higher target (a round given up lowers its eta):
        it starts from this one's look-ups, and each rank's search from its pick here, which
        fits there too (a unit on a path longer than the higher target is on one here, and cuts
        the same way; the makespans fall with the fraction), so its answers are those of a
        search from scratch. After ``plan_changed`` it starts from the look-ups of the units whose grid
        index the kept round left alone, and every rank's search from scratch."""
        on, ranks, col, fits, mk, dur_p, ef_p, cut_i, at, by_rank = cut_round(
            self.graph, self.tables, self.formula, plan, t_min, float(target), float(limit),
            self.i_min, f64(fracs), float(scale), self._was)
        self._was = (on, at, by_rank)
        return on, ranks, col, fits, mk, dur_p, ef_p, cut_i

    def after_cut(self, plan: Plan, mk, cut: Cut, deadline: float, scale: float) -> tuple:
        """(cut grid indices, its fwd and bwd seconds [dp, m, nv], makespans, durations and
        finishes, every unit's float at ``deadline`` (>= 0) and its seconds (flat), the units
        the largest raise fraction moves, the grid index each moves to)."""
        idx, f1, b1, mk_cut, dur1, ef1, cap, t1, up, first = after_cut_round(
            self.graph, self.tables, self.formula, plan, mk, cut, float(deadline), self.i_max,
            float(scale))
        return (idx.reshape(self.shape), f1.reshape(self.shape), b1.reshape(self.shape),
                mk_cut, dur1, ef1, cap, t1, up, first)


def warm_up() -> None:
    """``kernels.warm_up`` for this room's phases: compiled (or loaded from numba's disk
    cache) with the argument types a draft passes, on a two-rank, two-micro-batch, two-stage
    step."""
    from ..sim.pipeline import event_graph
    from .records import Graph

    dp, m, pp, g = 2, 2, 2, 3
    work = np.tile(np.arange(1.0, g + 1), (dp * m, 1))
    formula = (work, np.ones((2, pp)), np.ones((2, dp * m, pp)), np.ones((dp * m, pp)), True)
    t = np.tile(2.0 * np.arange(2.0, g + 2), (dp, m, pp, 1)).reshape(-1)
    graph = event_graph(m, pp, 1)
    idx = np.ones((dp, m, pp), dtype=np.int64)
    f = np.full((dp, m, pp), 2.0)
    dur = graph.durations(f, f)
    ef = graph.earliest_finish(dur, 0.0)
    plan = Round.plan(dur, ef, f, f, idx)
    for form in (formula, None):            # seconds by the formula, and read from the tables
        rnd = Round(Graph.of(graph, 0.0), Tables(t / 2, t / 2, t, g), form, (dp, m, pp), 0,
                    g - 1)
        on, ranks, _, _, mk_p, dur_p, ef_p, cut_i = rnd.cut(
            plan, np.full(dp * m * pp, 2.0), 1.0, 1.0, np.array([0.5, 1.0]), 1.0)
        rnd.after_cut(plan, graph.makespan(ef), Cut(on, cut_i, ranks, mk_p, dur_p, ef_p), 1.0,
                      1.0)
