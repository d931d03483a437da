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

from typing import NamedTuple

from . import f64, i64, jit
from .graph import floats_rows, simulate_rows
from .grid import lift_step, lifted, moves_row, water_fill_pass
from .records import Fill, Graph, Tables, fill_exps


class Rows(NamedTuple):
    """A band pass's rows: their units' table offsets [k x dp, slots, pp], the rank-level
    sensitivity order of the pass's moves [dp, slots, pp] (cut: ascending, raise: descending)
    and, with the quality objective, each unit's seconds per unit of density ``b`` [dp, slots,
    pp]; the DP ranks."""

    units: np.ndarray
    order: np.ndarray
    b: np.ndarray
    dp: int


@jit
def _fill_searched(t, rows_of, fill, rows, lo, by_row, hi, limit, search, iters):
    # dst_moves.water_fill's compiled search of the (row, stage) columns marked in ``search``
    # [rows, pp] (the ones that do not fit at their ``hi``), gathered as its [n, slots] arrays
    # in row-major order; the answers written over ``hi`` ([rows, slots, pp]; ``lo``: by the
    # pass's row (``by_row``: lo[rows[i]]) or by the try's (lo[i]))
    units, brow, dp = rows_of.units, rows_of.b, rows_of.dp
    slots, pp = units.shape[1], units.shape[2]
    n = 0
    for i in range(rows.size):
        for q in range(pp):
            if search[i, q]:
                n += 1
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
                    sh2[j, s] = fill.shift[s, q]
                    fi2[j, s] = fill.first[s, q]
                lim2[j] = limit[i, q]
                j += 1
    water_fill_pass(t, u2, b2, lo2, hi2, lim2,
                    Fill(fill.flat, sh2, fi2, fill.low, fill.high, fill.exps), iters, out2)
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
    return lift_step(span)


@jit
def cut_rows(graph, tables, rows_of, fill, cur, excess, water, i_min, iters, out):
    # dst_band's cut of every row (water rows: water-filled within [i_min, cur] to their
    # seconds at cur less the excess, where positive; the others: the sensitivity-order cut
    # of max(excess, 0)), then the rows simulated into ``out`` (grid indices, makespans,
    # durations, earliest finishes, busy seconds); returns the number of columns the
    # water-filling searched, or -1 (one column: nothing run)
    idx, mk, dur, ef, busy = out
    t, units, order, brow, dp = tables.tot, rows_of.units, rows_of.order, rows_of.b, rows_of.dp
    rows = np.arange(units.shape[0])
    nr, slots, pp = rows.size, units.shape[1], units.shape[2]
    limit = np.empty((nr, pp))
    search = np.zeros((nr, pp), dtype=np.bool_)
    lo = np.full((nr, slots, pp), i_min, dtype=np.int64)
    n = 0
    for i in range(nr):
        r = rows[i]
        idx[i] = cur[r]
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
        _fill_searched(t, rows_of, fill, rows, lo, False, idx, limit, search, iters)
    budget = np.empty((1, pp))
    for i in range(nr):
        r = rows[i]
        if water[r]:
            continue
        for q in range(pp):
            budget[0, q] = excess[r, q] if excess[r, q] > 0.0 else 0.0
        o = r % dp
        moves_row(t, units[r], cur[r], budget[0], brow[0], 1.0, order[o], i_min, False,
                  idx[i])
    simulate_rows(graph, tables, units, idx, rows, mk, True, dur, ef, busy)
    return n


@jit
def raise_try_rows(graph, tables, rows_of, fill, cut, rows, alpha, water, i_max, iters, out):
    # dst_band's try_raise for rows ``rows`` (indices into the pass's [k * dp] arrays) of the
    # cut ``cut`` (grid indices, floats, slack) with slack x alpha, into ``out`` (grid indices,
    # makespans); returns the number of columns the water-filling searched, or -1 (one
    # column: nothing run, the caller's numpy path runs the try)
    cur, cap, slack = cut
    trial, mk = out
    t, units, order, brow, dp = tables.tot, rows_of.units, rows_of.order, rows_of.b, rows_of.dp
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
        _fill_searched(t, rows_of, fill, rows, cur, True, trial, limit, search, iters)
    # sensitivity-order rows: the raise's moves with slack and floats x alpha
    for i in range(nr):
        r = rows[i]
        if water[r]:
            continue
        a, o = alpha[i], r % dp
        moves_row(t, units[r], cur[r], slack[r], cap[r], a, order[o], i_max, True, trial[i])
    simulate_rows(graph, tables, units, trial, rows, mk, False, np.empty((1, 1)),
                  np.empty((1, 1)), np.empty((1, 1)))
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
        self.tables = Tables(*(f64(a.reshape(-1)) for a in (costs.fwd_s, costs.bwd_s,
                                                            costs.total_s)),
                             int(costs.total_s.shape[-1]))
        self.graph = Graph.of(graph, p2p_s)
        b = np.zeros((1, 1, 1)) if gains is None else f64(b)
        units = i64(units)
        self.down = Rows(units, i64(np.argsort(sens, axis=1, kind="stable")), b, int(dp))
        self.up = self.down._replace(order=i64(np.argsort(-sens, axis=1, kind="stable")))
        if gains is None:
            self.fill = Fill(np.zeros(1), np.zeros((slots, pp)), np.zeros((slots, pp), np.int64),
                             0.0, 0.0, fill_exps())
        else:
            self.fill = Fill.of(gains.flat, gains.stage * gains.width,
                                gains.stage * gains.g + 1, gains.low, gains.high)

    @property
    def units(self) -> np.ndarray:
        return self.down.units

    def with_units(self, units) -> "BandPass":
        """This pass's tables, graph, orders and water-filling index for rows ``units``
        [rows, slots, pp] (a search's passes differ in their rows only)."""
        out = copy.copy(self)
        out.down, out.up = self.down._replace(units=i64(units)), self.up._replace(units=i64(units))
        return out

    def cut(self, cur, excess, water, i_min: int, iters: int):
        """(cut grid indices, makespans, event durations and earliest finishes [rows, E], busy
        seconds [rows, pp]) of every row, or None (the numpy path runs it)."""
        rows, n_ev = self.units.shape[0], self.graph.unit_rows.size
        out = (np.empty(self.units.shape, dtype=np.int64), np.empty(rows),
               np.empty((rows, n_ev)), np.empty((rows, n_ev)),
               np.empty((rows, self.units.shape[2])))
        n = cut_rows(self.graph, self.tables, self.down, self.fill, i64(cur), f64(excess),
                     _bools(water), int(i_min), int(iters), out)
        return None if n < 0 else out

    def floats(self, dur, ef, deadline):
        """[rows, slots, pp] every unit's smaller float, at least 0 (NaN stays), with every
        rank's last event of row r due at ``deadline[r]``: ``slack.unit_floats_from``'s
        floats of the cut's rows (``dur``, ``ef`` [rows, E]) as ``dst_band`` takes them."""
        cap = np.empty((dur.shape[0], self.graph.ev_f.size))
        floats_rows(self.graph, dur, ef, f64(deadline), cap)
        return cap.reshape(self.units.shape)

    def raise_try(self, cur, cap, slack, rows, alpha, water, i_max: int, iters: int):
        """(trial grid indices [rows, slots, pp], makespans [rows]) of ``dst_band``'s raise
        try of ``rows`` with ``alpha`` [rows] x slack and floats: water rows water-filled below
        their tops, the others raised in sensitivity order, every row simulated; None where
        the numpy path must run it (one water-filled column in the whole try)."""
        out = (np.empty((rows.size,) + self.units.shape[1:], dtype=np.int64),
               np.empty(rows.size))
        n = raise_try_rows(self.graph, self.tables, self.up, self.fill,
                           (i64(cur), f64(cap), f64(slack)), i64(rows), f64(alpha),
                           _bools(water), int(i_max), int(iters), out)
        return None if n < 0 else out


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
