"""Compiled forms of a DST band pass's phases (``policy.dst_band.plan_dst_candidates``), when
numba is installed: the cut of every DP-rank row, its floats, and each raise try (each row its
objective's way: quality water-filling or sensitivity order), 1F1B simulation included, in one
loop per row instead of a dozen numpy passes over the whole batch.

The numpy path gathers, sums and scatters every row's [slots, pp] units several times per try;
at 64 DP x 16 x PP4 a band pass holds up to 512 rows, and those passes, not the arithmetic, were
most of the band search's time. Each function here composes the kernels the numpy path's calls
run (``kernels.grid``' lifting, water-filling and sensitivity moves, ``kernels.graph``'
simulation and floats of one row), on the same operands in the same order: sums over a row's
slots are sequential, as numpy sums a [rows, slots, pp >= 2] array over its slots (with pp = 1
numpy sums pairwise: the callers keep the numpy path there), and a try whose water-filling
searches one column in all (numpy sums that one pairwise too) is reported, not run, so the
caller runs its numpy path. So a plan is the same bit for bit whichever runs
(``tests/unit/test_compiled_kernels.py``).

Pure numpy and numba; must not import torch, megatron or anything else from this package but
``kernels`` (its warm-up builds a draft's own objects: ``sim.pipeline``'s graph,
``policy.dst_moves``' gain index).
"""

from __future__ import annotations

import copy

import numpy as np

from . import f64, i64, jit
from .graph import floats_rows, simulate_rows
from .grid import fill_exps, lifted, moves_row, water_fill_pass


@jit
def _fill_searched(t, units, rows, brow, lo, by_row, hi, limit, search, n, dp, gflat,
                   shift_sp, first_sp, low, high, exps, iters):
    # dst_moves.water_fill's compiled search of the n (row, stage) columns marked in
    # ``search`` [rows, pp] (the ones that do not fit at their ``hi``), gathered as its
    # [n, slots] arrays in row-major order; the answers written over ``hi`` ([rows, slots,
    # pp]; ``lo``: by the pass's row (``by_row``: lo[rows[i]]) or by the try's (lo[i]))
    slots, pp = units.shape[1], units.shape[2]
    u2 = np.empty((n, slots), dtype=np.int64)
    b2 = np.empty((n, slots))
    lo2 = np.empty((n, slots), dtype=np.int64)
    hi2 = np.empty((n, slots), dtype=np.int64)
    sh2 = np.empty((n, slots))
    fi2 = np.empty((n, slots), dtype=np.int64)
    lim2 = np.empty(n)
    out2 = np.empty((n, slots), dtype=np.int64)
    j = 0
    for i in range(rows.size):
        r = rows[i]
        for q in range(pp):
            if search[i, q]:
                for s in range(slots):
                    u2[j, s] = units[r, s, q]
                    b2[j, s] = brow[r % dp, s, q]
                    lo2[j, s] = lo[r, s, q] if by_row else lo[i, s, q]
                    hi2[j, s] = hi[i, s, q]
                    sh2[j, s] = shift_sp[s, q]
                    fi2[j, s] = first_sp[s, q]
                lim2[j] = limit[i, q]
                j += 1
    water_fill_pass(t, u2, b2, lo2, hi2, lim2, gflat, sh2, fi2, low, high, exps, iters, out2)
    j = 0
    for i in range(rows.size):
        for q in range(pp):
            if search[i, q]:
                for s in range(slots):
                    hi[i, s, q] = out2[j, s]
                j += 1


@jit
def _lift_step(cur, rows, water, bound):
    # costs._lift_step over the try's water units' [cur, bound] spans: the largest power of
    # two <= the widest (0 for none)
    span = 0
    for i in range(rows.size):
        r = rows[i]
        if water[r]:
            for s in range(cur.shape[1]):
                for q in range(cur.shape[2]):
                    w = bound - cur[r, s, q] + 1
                    if w > span:
                        span = w
    step = 0
    if span > 0:
        step = 1
        while step * 2 <= span:
            step *= 2
    return step


@jit
def cut_rows(t, fwd, bwd, units, cur, excess, rows, water, order, brow, dp, i_min, gflat,
              shift_sp, first_sp, low, high, exps, iters, unit_rows, prev, dep, cross, last,
              p, out, mk, dur, ef, busy):
    # dst_band's cut of every row (water rows: water-filled within [i_min, cur] to their
    # seconds at cur less the excess, where positive; the others: the sensitivity-order cut
    # of max(excess, 0)), then the rows simulated; returns the number of columns the
    # water-filling searched, or -1 (one column: nothing run)
    nr, slots, pp = rows.size, units.shape[1], units.shape[2]
    limit = np.empty((nr, pp))
    search = np.zeros((nr, pp), dtype=np.bool_)
    lo = np.full((nr, slots, pp), i_min, dtype=np.int64)
    n = 0
    for i in range(nr):
        r = rows[i]
        out[i] = cur[r]
        if not water[r]:
            continue
        for q in range(pp):
            base = 0.0
            for s in range(slots):
                v = t[units[r, s, q] + cur[r, s, q]]
                base = v if s == 0 else base + v
            ex = excess[r, q]
            limit[i, q] = base - ex if ex > 0 else np.inf
            if not base <= limit[i, q]:
                search[i, q] = True
                n += 1
    if n == 1:
        return -1
    if n:
        _fill_searched(t, units, rows, brow, lo, False, out, limit, search, n, dp, gflat,
                       shift_sp, first_sp, low, high, exps, iters)
    budget = np.empty((1, pp))
    for i in range(nr):
        r = rows[i]
        if water[r]:
            continue
        for q in range(pp):
            budget[0, q] = excess[r, q] if excess[r, q] > 0.0 else 0.0
        o = r % dp
        moves_row(t, units[r], cur[r], budget[0], brow[0], 1.0, order[o], i_min, False,
                   out[i])
    simulate_rows(fwd, bwd, units, out, rows, unit_rows, prev, dep, cross, last, p, mk, True,
                   dur, ef, busy)
    return n


@jit
def raise_try_rows(t, fwd, bwd, units, cur, cap, slack, rows, alpha, water, order, brow, dp,
               i_max, gflat, shift_sp, first_sp, low, high, exps, iters,
               unit_rows, prev, dep, cross, last, p, trial, mk):
    # dst_band's try_raise for rows ``rows`` (indices into the pass's [k * dp] arrays) with
    # slack x alpha; returns the number of columns the water-filling searched, or -1 (one
    # column: nothing run, the caller's numpy path runs the try)
    nr, slots, pp = rows.size, units.shape[1], units.shape[2]
    # water rows: each unit's top (the highest index within cur's seconds + alpha x its float,
    # by binary lifting with the step of the widest span of the try's water units), the
    # (row, stage) limits (their seconds at cur, summed over the slots, + alpha x slack), and
    # the columns that do not fit at the tops
    step = _lift_step(cur, rows, water, i_max)
    limit = np.empty((nr, pp))
    search = np.zeros((nr, pp), dtype=np.bool_)
    n = 0
    for i in range(nr):
        r = rows[i]
        if not water[r]:
            continue
        a = alpha[i]
        for q in range(pp):
            tot = 0.0
            at_top = 0.0
            for s in range(slots):
                u, c = units[r, s, q], cur[r, s, q]
                t_cur = t[u + c]
                top = lifted(t, u + c, u + i_max, t_cur + a * cap[r, s, q], step) - u
                trial[i, s, q] = top
                tot = t_cur if s == 0 else tot + t_cur
                v = t[u + top]
                at_top = v if s == 0 else at_top + v
            limit[i, q] = tot + a * slack[r, q]
            if not at_top <= limit[i, q]:
                search[i, q] = True
                n += 1
    if n == 1:
        return -1
    if n:
        _fill_searched(t, units, rows, brow, cur, True, trial, limit, search, n, dp, gflat,
                       shift_sp, first_sp, low, high, exps, iters)
    # sensitivity-order rows: the raise's moves with slack and floats x alpha
    for i in range(nr):
        r = rows[i]
        if water[r]:
            continue
        a, o = alpha[i], r % dp
        moves_row(t, units[r], cur[r], slack[r], cap[r], a, order[o], i_max, True, trial[i])
    simulate_rows(fwd, bwd, units, trial, rows, unit_rows, prev, dep, cross, last, p, mk,
                  False, np.empty((1, 1)), np.empty((1, 1)), np.empty((1, 1)))
    return n


class BandPass:
    """What the compiled phases of one ``plan_dst_candidates`` pass read: the cost tables
    (flat), the rows' units [k * dp, slots, pp], the event graph's links, the rank-level
    sensitivity orders (cut: ascending, raise: descending; [dp, slots, pp]) and, with the
    quality objective, the water-filling's index and seconds per unit of density ``b``
    [dp, slots, pp]. For pp >= 2 only (with one stage numpy sums a stage's slots pairwise:
    the caller runs its numpy path there)."""

    def __init__(self, costs, units, dp: int, graph, p2p_s: float, sens, gains=None, b=None):
        slots, pp = units.shape[1:]
        self.t, self.fwd, self.bwd = (f64(a.reshape(-1))
                                      for a in (costs.total_s, costs.fwd_s, costs.bwd_s))
        self.units, self.dp, self.p2p = i64(units), int(dp), float(p2p_s)
        links = graph.links
        self.events = tuple(i64(a) for a in (graph.unit_rows, links[0], links[1], links[2],
                                             graph.last))
        self.backward = tuple(i64(a) for a in (links[3], links[4], links[2],
                                               graph.unit_events[0], graph.unit_events[1]))
        self.up = i64(np.argsort(-sens, axis=1, kind="stable"))
        self.down = i64(np.argsort(sens, axis=1, kind="stable"))
        if gains is None:
            self.fill = (np.zeros(1), np.zeros((slots, pp)), np.zeros((slots, pp), np.int64),
                         0.0, 0.0, fill_exps())
            self.b = np.zeros((1, 1, 1))
        else:
            stage = gains.stage
            self.fill = (f64(gains.flat), f64(stage * gains.width), i64(stage * gains.g + 1),
                         float(gains.low), float(gains.high), fill_exps())
            self.b = f64(b)

    def with_units(self, units) -> "BandPass":
        """This pass's tables, graph, orders and water-filling index for rows ``units``
        [rows, slots, pp] (a search's passes differ in their rows only)."""
        out = copy.copy(self)
        out.units = i64(units)
        return out

    def cut(self, cur, excess, water, i_min: int, iters: int):
        """(cut grid indices, makespans, event durations and earliest finishes [rows, E], busy
        seconds [rows, pp]) of every row, or None (the numpy path runs it)."""
        rows = np.arange(self.units.shape[0])
        n_ev = self.events[0].size
        out = np.empty(self.units.shape, dtype=np.int64)
        mk, busy = np.empty(rows.size), np.empty((rows.size, self.units.shape[2]))
        dur, ef = np.empty((rows.size, n_ev)), np.empty((rows.size, n_ev))
        gflat, shift, first, low, high, exps = self.fill
        n = cut_rows(
            self.t, self.fwd, self.bwd, self.units, i64(cur), f64(excess),
            rows, _bools(water), self.down, self.b, self.dp, int(i_min), gflat, shift, first,
            low, high, exps, int(iters), *self.events, self.p2p, out, mk, dur, ef, busy)
        return None if n < 0 else (out, mk, dur, ef, busy)

    def floats(self, dur, ef, deadline):
        """[rows, slots, pp] every unit's smaller float, at least 0 (NaN stays), with every
        rank's last event of row r due at ``deadline[r]``: ``slack.unit_floats_from``'s
        floats of the cut's rows (``dur``, ``ef`` [rows, E]) as ``dst_band`` takes them."""
        nxt, succ, cross, ev_f, ev_b = self.backward
        cap = np.empty((dur.shape[0], ev_f.size))
        floats_rows(nxt, succ, cross, dur, ef, f64(deadline), self.p2p, ev_f, ev_b, cap)
        return cap.reshape(self.units.shape)

    def raise_try(self, cur, cap, slack, rows, alpha, water, i_max: int, iters: int):
        """(trial grid indices [rows, slots, pp], makespans [rows]) of ``dst_band``'s raise
        try of ``rows`` with ``alpha`` [rows] x slack and floats: water rows water-filled below
        their tops, the others raised in sensitivity order, every row simulated; None where
        the numpy path must run it (one water-filled column in the whole try)."""
        trial = np.empty((rows.size,) + self.units.shape[1:], dtype=np.int64)
        mk = np.empty(rows.size)
        gflat, shift, first, low, high, exps = self.fill
        n = raise_try_rows(
            self.t, self.fwd, self.bwd, self.units, i64(cur), f64(cap),
            f64(slack), i64(rows), f64(alpha),
            _bools(water), self.up, self.b, self.dp, int(i_max), gflat, shift, first,
            low, high, exps, int(iters), *self.events, self.p2p, trial, mk)
        return None if n < 0 else (trial, mk)


def _bools(a) -> np.ndarray:
    return np.require(a, dtype=np.bool_, requirements="CW")


def warm_up() -> None:
    """``kernels.warm_up`` for this room's kernels: the cut and a raise try of one
    quality and one sensitivity-order row of a two-stage, two-micro-batch pass, with the
    argument types a draft passes."""
    from types import SimpleNamespace

    from ..policy.dst_moves import GainIndex, unit_base
    from ..sim.pipeline import event_graph

    g = 3
    t = np.tile(np.arange(1.0, g + 1), (1, 2, 2, 1))               # [dp, m, pp, g]
    costs = SimpleNamespace(total_s=2.0 * t, fwd_s=t, bwd_s=t.copy())
    units = np.tile(unit_base((1, 2, 2), np.arange(1), g), (2, 1, 1))
    marg = np.array([[np.inf, 2.0, 1.0], [np.inf, 3.0, 1.0]])
    band = BandPass(costs, units, 1, event_graph(2, 2, 1), 0.0, np.zeros((1, 2, 2)),
                    GainIndex(marg, 2, 2, 1), np.ones((1, 2, 2)))
    cur, water = np.ones((2, 2, 2), dtype=np.int64), np.array([True, False])
    _, _, dur, ef, _ = band.cut(cur, np.ones((2, 2)), water, 0, 12)
    band.floats(dur, ef, np.ones(2))
    band.raise_try(cur, np.ones((2, 2, 2)), np.ones((2, 2)), np.arange(2), np.ones(2), water,
                   g - 1, 12)
