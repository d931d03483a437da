"""A critical-path descent round, compiled (``policy.critical_path.descend_at`` runs the rounds):
the cut (``cut_round``), what the raise needs from it (``after_cut_round``) and the raise
(``raise_round``). Both phases pick per DP rank the first candidate fraction whose makespan fits
(``first_fit``): a binary search over the candidates (the makespans never rise from one
candidate to the next), the ranks' searches stepped together so that each step simulates their
columns side by side, each unit's grid index looked up only at the candidates its rank tries.

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import i64, jit, slack
from .graph import earliest_finish, makespan, simulate, unit_floats
from .grid import fit_limit, highest_within, seconds, source, total
from .records import SAMPLE_GRAPH, SAMPLE_TABLES, Graph, Tables, unit_offsets

CUT_FRACTIONS = np.array([1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0])
RAISE_FRACTIONS = np.array([1.0, 0.5, 0.25, 0.125, 0.0])


class Plan(NamedTuple):
    """A plan and its simulation, as a round reads it: event durations and earliest finishes
    [E, dp], and every unit's forward and backward seconds and grid index [dp x m x nv]."""

    dur: np.ndarray
    ef: np.ndarray
    f: np.ndarray
    b: np.ndarray
    idx: np.ndarray


class Cut(NamedTuple):
    """A round's cut as its raise reads it (``after_cut_round``): the cut ``plan`` and its
    makespans ``mk`` [dp], every unit's float at the raise's deadline (``cap``, at least 0, NaN
    kept), the units the largest raise fraction can move (``up``, ascending: a grid step up
    fits under their seconds + their whole float) and the highest grid index each may take
    (``first``)."""

    plan: Plan
    mk: np.ndarray
    cap: np.ndarray
    up: np.ndarray
    first: np.ndarray


class Search(NamedTuple):
    """A first-fit search over the units ``units`` (flat unit ids, ascending) of the ranks
    ``ranks`` (rank j's units ``seg[j]:seg[j + 1]``): a unit's grid index at candidate c is
    the highest in [lo, hi] whose seconds are within ``fit_limit``(on + fracs[c] x delta) (a
    cut: delta < 0; a raise: its float); DP rank r's makespan must be <= ``limit[r]``;
    ``z0[j]`` a candidate known to fit (the candidates' count: none)."""

    units: np.ndarray
    ranks: np.ndarray
    seg: np.ndarray
    on: np.ndarray
    delta: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    fracs: np.ndarray
    limit: np.ndarray
    z0: np.ndarray


@jit
def _search(graph, units, on, delta, lo, hi, fracs, limit):
    # the Search of units ``units`` (ascending): their ranks' runs
    per_rank, n = graph.ev_f.size, units.size
    ranks, seg = np.empty(n, dtype=np.int64), np.empty(n + 1, dtype=np.int64)
    r = 0
    for j in range(n):
        if r == 0 or units[j] // per_rank != ranks[r - 1]:
            ranks[r], seg[r] = units[j] // per_rank, j
            r += 1
    seg[r] = n
    return Search(units, ranks[:r], seg[:r + 1], on, delta, lo, hi, fracs, limit,
                  np.full(r, fracs.size, dtype=np.int64))


@jit
def _set_units(j, c, graph, sr, tables, at, buf):
    # column j of buf with rank j's units at candidate c (a candidate rewrites only its units'
    # rows); a unit's grid index not looked up yet (at < 0) is searched down from an earlier
    # candidate's where one is known (the limits fall with c); its seconds computed by the
    # tables' formula where they carry one (``grid.source``)
    units, on, delta, lo, hi, frac = sr.units, sr.on, sr.delta, sr.lo, sr.hi, sr.fracs[c]
    per_rank = graph.ev_f.size
    for u in range(sr.seg[j], sr.seg[j + 1]):
        src, a = source(tables, units[u]), at[c, u]
        if a < 0:
            top = hi[u]
            for c2 in range(c - 1, -1, -1):
                if at[c2, u] >= 0:
                    top = at[c2, u]
                    break
            a = highest_within(tables.tot, tables.work, src, lo[u], top,
                               fit_limit(on[u] + frac * delta[u]))
            at[c, u] = a
        local = units[u] % per_rank
        buf[graph.ev_f[local], j], buf[graph.ev_b[local], j] = seconds(
            tables.fwd, tables.bwd, tables.work, src, a)


@jit
def first_fit(graph, tables, dur, sr, at, probe_first):
    # per rank j of ``sr`` the first candidate whose makespan is <= its limit, by a binary
    # search (every candidate below a is over, every one from z fits; the first tried is the
    # middle, or candidate 0 with probe_first, where it usually fits), the ranks' searches
    # stepped together; ``at`` [k, units]: each unit's grid index at each candidate (-1: not
    # looked up, filled in place). Returns (fits, pick (0 where none fits), the picks as _put
    # takes them: each unit's grid index at its pick, makespans, durations and earliest
    # finishes [E, r])
    ranks, limit = sr.ranks, sr.limit
    k, r = at.shape[0], ranks.size
    fits, pick, mk, t = np.empty(r, dtype=np.bool_), np.empty(r, dtype=np.int64), \
        np.empty(r), np.empty(r)
    buf, end = np.empty((dur.shape[0], r)), np.empty((dur.shape[0], r))
    for e in range(dur.shape[0]):
        for j in range(r):
            buf[e, j] = dur[e, ranks[j]]
    a, z = np.zeros(r, dtype=np.int64), sr.z0.copy()
    held = np.zeros(r, dtype=np.bool_)          # column j holds candidate z[j], simulated
    mid, cols = np.empty(r, dtype=np.int64), np.empty(r, dtype=np.int64)
    first = probe_first
    while True:
        na = 0
        for j in range(r):
            if a[j] < z[j]:
                mid[j] = 0 if first else (a[j] + z[j]) >> 1
                _set_units(j, mid[j], graph, sr, tables, at, buf)
                cols[na] = j
                na += 1
        first = False
        if na == 0:
            break
        earliest_finish(graph, buf, cols[:na], end, np.empty((0, 0)))
        for j in cols[:na]:
            t[j] = makespan(graph.last, end, j)
            if t[j] <= limit[ranks[j]]:          # the last that fits is the first that fits
                z[j], mk[j], held[j] = mid[j], t[j], True
            else:
                a[j], held[j] = mid[j] + 1, False
    na = 0
    for j in range(r):                           # a column not holding its pick: set again
        fits[j] = a[j] < k
        pick[j] = a[j] if a[j] < k else 0
        if not held[j]:
            _set_units(j, pick[j], graph, sr, tables, at, buf)
            cols[na] = j
            na += 1
    earliest_finish(graph, buf, cols[:na], end, np.empty((0, 0)))
    for j in cols[:na]:
        mk[j] = makespan(graph.last, end, j)
    chosen = np.empty(at.shape[1], dtype=np.int64)
    for j in range(r):
        for u in range(sr.seg[j], sr.seg[j + 1]):
            chosen[u] = at[pick[j], u]
    return fits, pick, (sr.units, chosen, ranks, mk, buf, end)


@jit
def _floats(graph, dur, ef, deadline):
    # every unit's smaller float, rank by rank ([dp x units], flat), all due at deadline
    out = np.empty((dur.shape[1], graph.ev_f.size))
    unit_floats(graph, dur, ef, np.full(dur.shape[1], deadline), out)
    return out.reshape(-1)


@jit
def cut_round(graph, tables, plan, t_min, target, i_min, was):
    # the cut at ``target``: the units whose float is negative (ascending flat ids), each
    # searched between d_min and its grid index with limit t + fraction x (t_min - t) (``was``:
    # the last round's units and look-ups on the same plan at a lower target, whose look-ups
    # are this round's, and per DP rank its pick (-1: none), which fits here too). Returns
    # (fits per rank, the cut as after_cut_round takes it, and this round's look-ups and
    # picks for the next)
    was_on, was_at, was_pick = was
    dp = plan.dur.shape[1]
    fl = _floats(graph, plan.dur, plan.ef, target)
    on = np.flatnonzero(fl < 0)
    n = on.size
    t, delta, hi = np.empty(n), np.empty(n), np.empty(n, dtype=np.int64)
    for j in range(n):
        q = on[j]
        t[j] = plan.f[q] + plan.b[q]
        delta[j] = t_min[q] - t[j]
        hi[j] = plan.idx[q]
    sr = _search(graph, on, t, delta, np.full(n, i_min, dtype=np.int64), hi,
                 CUT_FRACTIONS, np.full(dp, fit_limit(target)))
    k = CUT_FRACTIONS.size
    at = np.full((k, n), -1, dtype=np.int64)
    i = 0
    for j in range(n):                     # this round's units are among the last round's
        while i < was_on.size and was_on[i] < on[j]:
            i += 1
        if i < was_on.size and was_on[i] == on[j]:
            at[:, j] = was_at[:, i]
    r = sr.ranks.size
    if was_on.size:
        for c in range(r):
            if was_pick[sr.ranks[c]] >= 0:
                sr.z0[c] = was_pick[sr.ranks[c]]
    fits, pick, picks = first_fit(graph, tables, plan.dur, sr, at, False)
    by_rank = np.full(dp, -1, dtype=np.int64)
    for c in range(r):
        if fits[c]:
            by_rank[sr.ranks[c]] = pick[c]
    return fits, picks, at, by_rank


@jit
def _put(tables, plan, mk, picks):
    # a search's picks (its units, their grid indices, the ranks searched, their makespans and
    # the picks' columns) written over ``plan`` and its makespans ``mk`` [dp]
    units, idx, ranks, mk_p, dur_p, ef_p = picks
    for j in range(units.size):
        q = units[j]
        plan.idx[q] = idx[j]
        plan.f[q], plan.b[q] = seconds(tables.fwd, tables.bwd, tables.work, source(tables, q),
                                       idx[j])
    for c in range(ranks.size):
        mk[ranks[c]] = mk_p[c]
        plan.dur[:, ranks[c]] = dur_p[:, c]
        plan.ef[:, ranks[c]] = ef_p[:, c]


@jit
def after_cut_round(graph, tables, plan, mk, cut, deadline, i_max):
    # the ``Cut`` of ``plan`` and its makespans ``mk`` (``cut``: the picks of cut_round's
    # search) with its floats at the raise's deadline
    new, mk_cut = Plan(plan.dur.copy(), plan.ef.copy(), plan.f.copy(), plan.b.copy(),
                       plan.idx.copy()), mk.copy()
    _put(tables, new, mk_cut, cut)
    cap = _floats(graph, new.dur, new.ef, deadline)
    up, first = np.empty(cap.size, dtype=np.int64), np.empty(cap.size, dtype=np.int64)
    n = 0
    for q in range(cap.size):
        x = cap[q]
        cap[q] = x if (x > 0.0 or x != x) else 0.0
        lim = fit_limit(new.f[q] + new.b[q] + RAISE_FRACTIONS[0] * cap[q])
        i, src = new.idx[q], source(tables, q)
        if i < i_max and total(tables.tot, tables.work, src, i + 1) <= lim:
            up[n] = q                            # cut + 1 fits: the filter's test
            first[n] = highest_within(tables.tot, tables.work, src, i + 1, i_max, lim)
            n += 1
    return Cut(new, mk_cut, cap, up[:n].copy(), first[:n].copy())


@jit
def raise_round(graph, tables, cut, i_max, limit_s):
    # the raise of the cut's units ``up``: the largest of RAISE_FRACTIONS whose plan fits each
    # rank's limit, the first (the whole float, grid indices ``first``) tried alone first,
    # written over the cut's plan and makespans
    plan, up = cut.plan, cut.up
    n = up.size
    t, c, lo_u = np.empty(n), np.empty(n), np.empty(n, dtype=np.int64)
    for j in range(n):
        q = up[j]
        t[j], c[j], lo_u[j] = plan.f[q] + plan.b[q], cut.cap[q], plan.idx[q]
    sr = _search(graph, up, t, c, lo_u, np.full(n, i_max, dtype=np.int64),
                 RAISE_FRACTIONS, limit_s)
    at = np.full((RAISE_FRACTIONS.size, n), -1, dtype=np.int64)
    at[0] = cut.first
    _put(tables, plan, cut.mk, first_fit(graph, tables, plan.dur, sr, at, True)[2])


class Round:
    """A descent's compiled round phases on one step's graph and cost tables (a unit's seconds
    computed by their formula where they carry one), for plans of ``shape`` [dp, m, nv] within
    grid indices [i_min, i_max]. A caller that descends many times on the same costs
    (``policy.dst_probes``: a rank's ~25 descents and its fills) makes it once."""

    def __init__(self, graph: Graph, tables: Tables, shape: tuple, i_min: int, i_max: int):
        self.graph, self.tables = graph, tables
        self.shape, self.i_min, self.i_max = shape, int(i_min), int(i_max)
        # every unit's offset in the flat tables [dp, m, nv], and its seconds at i_min (flat)
        self.base = unit_offsets(shape, tables.g)
        self.t_min = tables.tot.take(self.base.reshape(-1) + self.i_min)
        # no look-up and no pick known (the kernels read ``_was``, never write it: shared)
        self._none = (np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64),
                      np.full(shape[0], -1, dtype=np.int64))
        self.plan_changed()

    def plan_changed(self, same=None) -> None:
        """Forget the last cut's picks (a round was kept: they were of another plan and
        target), and its look-ups of every unit whose grid index changed; ``same`` [units]
        (flat, optional: none kept without it) says which did not. A unit's look-ups depend on
        its own grid index alone (its seconds there and at d_min, the fractions), so those
        of the units a round left alone are the next cut's (about three in four)."""
        on, at, _ = getattr(self, "_was", self._none)
        if same is None or not on.size:
            self._was = self._none
            return
        keep = same[on]
        self._was = (on[keep], np.ascontiguousarray(at[:, keep]), self._none[2])  # no pick

    def simulate(self, idx) -> tuple:
        """(the ``Plan``, makespans [dp]) of the plan at grid indices ``idx`` [dp, m, nv]."""
        dp, n_ev, idx = self.shape[0], self.graph.prev.size, i64(idx)
        mk, dur, ef = np.empty(dp), np.empty((n_ev, dp)), np.empty((n_ev, dp))
        simulate(self.graph, self.tables, self.base, idx, np.arange(dp), mk, dur, ef)
        at = (self.base + idx).reshape(-1)
        return Plan(dur, ef, self.tables.fwd.take(at), self.tables.bwd.take(at),
                    idx.reshape(-1)), mk

    def cut(self, plan: Plan, target: float) -> tuple:
        """(whether every searched rank fits, the cut ``after_cut`` takes): ``cut_round``'s
        answers but its look-ups and picks, which it keeps: until
        ``plan_changed`` the next call is on the same plan at a higher target (a round given up
        lowers its eta), so it starts from these look-ups and each rank's search from its pick
        here, which fits there too (a unit on a path longer than the higher target is on one
        here and cuts the same way; the makespans fall with the fraction): a cold search's
        answers."""
        fits, cut, at, by_rank = cut_round(self.graph, self.tables, plan, self.t_min,
                                           float(target), self.i_min, self._was)
        self._was = (cut[0], at, by_rank)
        return fits, cut

    def after_cut(self, plan: Plan, mk, cut: tuple, deadline: float) -> Cut:
        """``after_cut_round``'s ``Cut`` of ``plan`` (its makespans ``mk`` [dp])."""
        return after_cut_round(self.graph, self.tables, plan, mk, cut, float(deadline),
                               self.i_max)

    def raise_fit(self, cut: Cut, deadline: float) -> tuple:
        """(the raised plan, its makespans [dp]): ``raise_round``'s, over ``cut``'s arrays,
        under ``raise_limit``."""
        raise_round(self.graph, self.tables, cut, self.i_max, raise_limit(deadline, cut.mk))
        return cut.plan, cut.mk


def raise_limit(deadline, mk) -> np.ndarray:
    """Each DP rank's makespan limit in a raise, the descent's and the band pass's
    (``policy.dst_band.raise_rows``): a rank may grow up to ``deadline`` (``fit_limit``); one
    already above it before the raise (makespans ``mk``: the bottleneck rank, in a pipeline)
    may only fill stages off its critical path."""
    return slack.fit_limit(np.maximum(deadline, mk))


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    t = SAMPLE_TABLES
    formula = (np.ones((1, 2)), np.ones((2, 1)), np.ones((2, 1, 1)), np.ones((1, 1)), True)
    for tables in (t, Tables.of(t.fwd, t.bwd, t.tot, formula)):
        rnd = Round(SAMPLE_GRAPH, tables, (1, 1, 1), 0, tables.g - 1)
        plan, mk = rnd.simulate(np.ones((1, 1, 1)))
        rnd.raise_fit(rnd.after_cut(plan, mk, rnd.cut(plan, 1.0)[1], 1.0), 1.0)
