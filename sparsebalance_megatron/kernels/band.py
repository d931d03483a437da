"""One DST band pass, compiled (``policy.dst_band.band_pass``): every DP-rank row's
cut of the load units above its band (``cut_rows``), the floats of its cut plan, and each raise
try below the new bottleneck (``raise_try_rows``), each row its objective's way: the quality
objective's water-filling (``water_fill``) or the density objective's moves in sensitivity
order (``moves_row``); every row then simulated (``kernels.graph``).

A band pass plans K candidate bands over the step's DP ranks, so it holds K x dp rows (up to
512 at 64 DP x 16 x PP4); a row's plan never reads another's.

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import contiguous, f64, i64, jit
from .graph import simulate, unit_floats
from .grid import highest_within, row_of
from .records import SAMPLE_GRAPH, SAMPLE_TABLES, Fill, Graph, Tables


class Rows(NamedTuple):
    """What a band pass's rows read of their DP ranks (row r is rank r mod dp's copy), each
    [dp, slots, pp]: their units' table offsets, the sensitivity order of the cut's moves
    (``down``: ascending) and the raise's (``up``: descending) and, with the quality objective,
    each unit's seconds per unit of density ``b``."""

    units: np.ndarray
    down: np.ndarray
    up: np.ndarray
    b: np.ndarray


@jit
def moves_row(tables, u, cur, budget, cap, a, order, bound, raising, out):
    """One DP rank's cut (``raising`` False: each stage sheds ``budget[q]`` x a seconds, down
    to grid index ``bound`` = d_min) or raise (True: each stage grows by at most ``budget[q]`` x
    a, each unit by at most its float ``cap`` x a, up to ``bound`` = d_max), the micro-batches
    of every stage in ``order`` (cut: least sensitive first; raise: most), into ``out``
    ([slots, pp] like ``u``, ``cur``): a unit moves by what the stage still needs after the
    units before it moved all they could (the running sum of their moves, less its own), to
    the highest grid index whose seconds fit."""
    t, work = tables.tot, tables.work
    slots, pp = u.shape
    for p in range(pp):
        cum = 0.0
        bud = budget[p] * a
        for jj in range(slots):
            j = order[jj, p]
            uu, c = u[j, p], cur[j, p]
            t_cur = t[uu + c]
            out[j, p] = c
            cp = 0.0
            if raising:
                x = t[uu + bound] - t_cur
                cp = a * cap[j, p]
                if cp < x or cp != cp:
                    x = cp
            else:
                x = t_cur - t[uu + bound]
            cum = x if jj == 0 else cum + x
            left = bud - (cum - x)
            if raising and (cp < left or cp != cp):
                left = cp
            if left > 0 and x > 0:
                if raising:
                    out[j, p] = highest_within(t, work, row_of(uu), c, bound, t_cur + left)
                else:
                    out[j, p] = highest_within(t, work, row_of(uu), bound, c, t_cur - left)


@jit
def _position(flat, low, high, x, shift, a, z):
    # where x = lambda x b falls in the gain tables ``flat``: its key clip(-x, low, high) +
    # shift searched (side right) within [a, z], which holds it (NaN: after everything)
    q = -x
    if q < low:
        q = low
    if q > high:
        q = high
    q += shift
    if q != q:
        return flat.size
    while a < z:
        mid = (a + z) >> 1
        if flat[mid] <= q:
            a = mid + 1
        else:
            z = mid
    return a


@jit
def _clipped(pos, first, lo, hi):
    i = pos - first
    return lo if i < lo else (hi if i > hi else i)


@jit
def water_fill(t, u, b, lo, hi, limit, fill, q, iters, out):
    """Quality water-filling of one (row, stage q) column (its slots' ``u``, ``b``, ``lo``,
    ``hi`` side by side) into ``out``: unit s takes the highest grid index in [lo, hi] whose
    marginal quality gain per unit of density is still worth its attention seconds, gain >=
    lambda x b (b: its seconds per unit of density), lambda the smallest that keeps the
    column's seconds (summed over its slots in order) within ``limit``: a bisection of
    ``iters`` steps on log lambda in [-20, 20] (on ``records.FILL_EXPS``' grid), then the
    common level between the last lambda that does not fit and the first that does (a
    piecewise-linear cost has equal gains along a segment, so units cross it together): the
    highest level that fits. A unit's index at lambda: its position in its stage's gain table
    (``fill``: the stages' tables laid end to end, ``records.Fill``, slot s's shift and first
    entry at [s, q]), less the stage's first entry, clipped to [lo, hi].

    A unit's position falls as lambda grows where b >= 0, so a column whose b all are searches
    each unit only between its positions at the bisection's two ends, and not at all once both
    ends clip to the same grid index (every position between gives it)."""
    exps, flat, low, high = fill.exps, fill.flat, fill.low, fill.high
    shift, first = fill.shift[:, q], fill.first[:, q]
    slots, top = u.size, flat.size
    pos_a, pos_z = np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64)
    cur, fit = np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64)
    a, z = 0, exps.size - 1                      # log lambda = -20 and 20
    sign = True                                  # every b >= 0 (NaN: not)
    for s in range(slots):
        sign = sign and b[s] >= 0.0
    for s in range(slots):
        pos_a[s] = _position(flat, low, high, exps[a] * b[s], shift[s], 0, top)
        pos_z[s] = _position(flat, low, high, exps[z] * b[s], shift[s], 0,
                             pos_a[s] if sign else top)
    for _ in range(iters):
        mid = (a + z) // 2
        tot = 0.0
        for s in range(slots):
            i = _clipped(pos_z[s], first[s], lo[s], hi[s])
            if sign and i == _clipped(pos_a[s], first[s], lo[s], hi[s]):
                cur[s] = pos_z[s]
            else:
                cur[s] = _position(flat, low, high, exps[mid] * b[s], shift[s],
                                   pos_z[s] if sign else 0, pos_a[s] if sign else top)
                i = _clipped(cur[s], first[s], lo[s], hi[s])
            v = t[u[s] + i]
            tot = v if s == 0 else tot + v
        if tot <= limit:
            z = mid
            pos_z[:] = cur
        else:
            a = mid
            pos_a[:] = cur
    lo_l, hi_l = 1 << 62, -(1 << 62)
    for s in range(slots):
        fit[s] = _clipped(pos_z[s], first[s], lo[s], hi[s])
        pos_a[s] = _clipped(pos_a[s], first[s], lo[s], hi[s])       # over the limit
        lo_l = min(lo_l, fit[s])
        hi_l = max(hi_l, pos_a[s])
    while lo_l < hi_l:                           # the highest common level that fits
        mid = (lo_l + hi_l + 1) // 2
        tot = 0.0
        for s in range(slots):
            v = t[u[s] + max(fit[s], min(pos_a[s], mid))]
            tot = v if s == 0 else tot + v
        if tot <= limit:
            lo_l = mid
        else:
            hi_l = mid - 1
    for s in range(slots):
        out[s] = max(fit[s], min(pos_a[s], lo_l))


@jit
def _fill_columns(t, rows_of, fill, rows, lo, hi, limit, search, iters):
    # water_fill of the (row, stage) columns marked in ``search`` [rows, pp] (those that do not
    # fit at their ``hi``), the answers written over ``hi`` ([rows, slots, pp]); ``lo`` by the
    # pass's row (lo[rows[i]])
    units, b, dp = rows_of.units, rows_of.b, rows_of.units.shape[0]
    for i in range(rows.size):
        r = rows[i]
        for q in range(units.shape[2]):
            if search[i, q]:
                water_fill(t, units[r % dp, :, q], b[r % dp, :, q], lo[r, :, q], hi[i, :, q],
                           limit[i, q], fill, q, iters, hi[i, :, q])


@jit
def cut_rows(graph, tables, rows_of, fill, cur, busy, band, water, i_min, iters, out):
    # every row's cut from grid indices ``cur``: each load unit (the row's rank r mod dp, a
    # stage q) sheds the seconds its busy time ``busy[r mod dp, q]`` is above the row's band
    # ``band[r]`` (water rows: water-filled within [i_min, cur] to their seconds at cur less
    # that excess, where positive; the others: moves_row's cut of it, at least 0), then every
    # row simulated into ``out`` (grid indices, makespans, durations and earliest finishes
    # [E, rows], busy seconds [rows, pp])
    idx, mk, dur, ef, busy1 = out
    t, units, dp = tables.tot, rows_of.units, rows_of.units.shape[0]
    nr, slots, pp = cur.shape
    rows = np.arange(nr)
    limit = np.empty((nr, pp))
    search = np.zeros((nr, pp), dtype=np.bool_)
    budget = np.empty(pp)
    for r in range(nr):
        idx[r] = cur[r]
        for q in range(pp):
            ex = busy[r % dp, q] - band[r]
            budget[q] = ex if ex > 0.0 else 0.0
            if water[r]:
                base = 0.0
                for s in range(slots):
                    v = t[units[r % dp, s, q] + cur[r, s, q]]
                    base = v if s == 0 else base + v
                limit[r, q] = base - ex if ex > 0 else np.inf
                search[r, q] = not base <= limit[r, q]
        if not water[r]:
            moves_row(tables, units[r % dp], cur[r], budget, rows_of.b[0], 1.0,
                      rows_of.down[r % dp], i_min, False, idx[r])
    _fill_columns(t, rows_of, fill, rows, np.full((nr, slots, pp), i_min), idx, limit, search,
                  iters)
    simulate(graph, tables, units, idx, rows, mk, dur, ef)
    for r in range(nr):
        for q in range(pp):
            acc = 0.0
            for s in range(slots):
                f = units[r % dp, s, q] + idx[r, s, q]
                v = tables.fwd[f] + tables.bwd[f]
                acc = v if s == 0 else acc + v
            busy1[r, q] = acc


@jit
def raise_try_rows(graph, tables, rows_of, fill, cut, rows, alpha, water, i_max, iters, out):
    # the raise try of rows ``rows`` (of the pass's rows) from the cut ``cut`` (grid indices,
    # floats [rows, slots, pp], slack [rows, pp]) with slack and floats x alpha [rows], into
    # ``out`` (grid indices, makespans): water rows water-filled within [cur, top] (top: the
    # highest index within a unit's seconds + alpha x its float) to their seconds at cur +
    # alpha x slack; the others moves_row's raise
    cur, cap, slack = cut
    trial, mk = out
    t, work, units = tables.tot, tables.work, rows_of.units
    dp, nr, slots, pp = units.shape[0], rows.size, units.shape[1], units.shape[2]
    limit = np.empty((nr, pp))
    search = np.zeros((nr, pp), dtype=np.bool_)
    for i in range(nr):
        r, a = rows[i], alpha[i]
        if not water[r]:
            moves_row(tables, units[r % dp], cur[r], slack[r], cap[r], a, rows_of.up[r % dp],
                      i_max, True, trial[i])
            continue
        for q in range(pp):
            tot, at_top = 0.0, 0.0
            for s in range(slots):
                u, c = units[r % dp, s, q], cur[r, s, q]
                t_cur = t[u + c]
                top = highest_within(t, work, row_of(u), c, i_max, t_cur + a * cap[r, s, q])
                trial[i, s, q] = top
                tot = t_cur if s == 0 else tot + t_cur
                at_top = t[u + top] if s == 0 else at_top + t[u + top]
            limit[i, q] = tot + a * slack[r, q]
            search[i, q] = not at_top <= limit[i, q]
    _fill_columns(t, rows_of, fill, rows, cur, trial, limit, search, iters)
    n_ev = graph.prev.size
    simulate(graph, tables, units, trial, rows, mk, np.empty((n_ev, nr)), np.empty((n_ev, nr)))


class BandPass:
    """What the compiled phases of one ``policy.dst_band`` pass read: the cost tables
    (``Tables``), the event graph (``Graph``), the DP ranks' ``Rows`` (units [dp, slots, pp],
    the sensitivity orders of the cut and the raise) and, with the quality objective, the
    water-filling's gain tables (``Fill``, its shift and first laid [slots, pp]) and seconds
    per unit of density ``b`` [dp, slots, pp]. A pass's rows are set by the grid indices it
    is given ([rows, slots, pp]), row r a copy of rank r mod dp."""

    def __init__(self, tables: Tables, graph: Graph, units, sens, fill: Fill = None, b=None):
        self.tables, self.graph = tables, graph
        units, b = i64(units), np.zeros((1, 1, 1)) if fill is None else f64(b)
        self.rows = Rows(units, i64(np.argsort(sens, axis=1, kind="stable")),
                         i64(np.argsort(-sens, axis=1, kind="stable")), b)
        self.fill = fill if fill is not None else Fill.of(
            np.zeros(1), np.zeros(units.shape[1:]), np.zeros(units.shape[1:]), 0.0, 0.0)

    def cut(self, cur, busy, band, water, i_min: int, iters: int) -> tuple:
        """``cut_rows``' answers (its ``out``) of every row of ``cur``."""
        rows, n_ev = cur.shape[0], self.graph.prev.size
        out = (np.empty(cur.shape, dtype=np.int64), np.empty(rows), np.empty((n_ev, rows)),
               np.empty((n_ev, rows)), np.empty((rows, cur.shape[2])))
        cut_rows(self.graph, self.tables, self.rows, self.fill, i64(cur), f64(busy), f64(band),
                 contiguous(water, np.bool_), int(i_min), int(iters), out)
        return out

    def floats(self, dur, ef, deadline) -> np.ndarray:
        """[rows, slots, pp] every unit's smaller float, at least 0 (NaN stays), of the cut's
        rows (``dur``, ``ef`` [E, rows]), every rank's last event of row r due at
        ``deadline[r]``."""
        cap = np.empty((dur.shape[1], self.graph.ev_f.size))
        unit_floats(self.graph, dur, ef, f64(deadline), cap)
        return np.maximum(cap, 0.0, out=cap).reshape((dur.shape[1],)
                                                     + self.rows.units.shape[1:])

    def raise_try(self, cur, cap, slack, rows, alpha, water, i_max: int, iters: int) -> tuple:
        """``raise_try_rows``' answers (trial grid indices, makespans) of ``rows``."""
        out = (np.empty((rows.size,) + cur.shape[1:], dtype=np.int64), np.empty(rows.size))
        raise_try_rows(self.graph, self.tables, self.rows, self.fill,
                       (i64(cur), f64(cap), f64(slack)), i64(rows), f64(alpha),
                       contiguous(water, np.bool_), int(i_max), int(iters), out)
        return out


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    g, units = SAMPLE_TABLES.g, np.zeros((1, 1, 1), dtype=np.int64)
    band = BandPass(SAMPLE_TABLES, SAMPLE_GRAPH, units, np.zeros((1, 1, 1)),
                    Fill.of(np.arange(4.0), np.zeros((1, 1)), np.ones((1, 1)), 0.0, 1.0),
                    np.ones((1, 1, 1)))
    cur, water = np.ones((2, 1, 1), dtype=np.int64), np.array([True, False])
    _, _, dur, ef, _ = band.cut(cur, np.ones((1, 1)), np.zeros(2), water, 0, 12)
    band.floats(dur, ef, np.ones(2))
    band.raise_try(cur, np.ones((2, 1, 1)), np.ones((2, 1)), np.arange(2), np.ones(2), water,
                   g - 1, 12)
