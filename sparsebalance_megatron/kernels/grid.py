"""Compiled forms of the planner's grid look-ups: ``policy.grid_search.highest_at_most`` (as
[k, n] rows: the descent's and DST's candidates, or any elements as one row), ``policy.dst_moves.GainIndex``'s
water-filling index and ``UnitCosts.from_latency``'s tables. Each does the numpy path's
operations per element (the binary lifting's schedule, a multiply, an add, comparisons), so
the results are the numpy path's bit for bit (``tests/unit/test_compiled_kernels.py``). Callers check
``kernels.enabled()`` first.

Pure numpy and numba; must not import torch, megatron or anything else from this package but
``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import f64, i64, jit
from .records import FILL_GRID, Fill
from .fit import unit_seconds


@jit
def lift_step(span):
    # the binary lifting's first step for spans of at most ``span`` entries: the largest power
    # of two <= span (0 for none; ``policy.grid_search._lift_step``'s, compiled)
    step = 0
    if span > 0:
        step = 1
        while step * 2 <= span:
            step *= 2
    return step


@jit
def lifted(flat, first, last, lim, step):
    # highest_at_most's binary lifting of one element: steps of step, step / 2, ... 1 from
    # first - 1, each kept where the entry at the probe (clamped to last) is <= lim; then
    # clamped to [first, last]
    pos, s = first - 1, step
    while s:
        probe = pos + s
        if probe > last:
            probe = last
        if flat[probe] <= lim:
            pos += s
        s >>= 1
    if pos > last:                               # past hi: hi fits
        pos = last
    if pos < first:                              # none fits: lo
        pos = first
    return pos


@jit
def highest_rows_pass(flat, first, last, limit, step):
    k, n = limit.shape
    out = np.empty((k, n), dtype=np.int64)
    for j in range(n):                           # unit by unit: its row stays in cache
        for c in range(k):
            out[c, j] = lifted(flat, first[j], last[j], limit[c, j], step)
    return out


@jit
def _gain_q(x, shift, low, high):
    # _gain_index's search key: clip(-x, low, high) + shift, as np.maximum / np.minimum clip
    # (NaN stays NaN)
    q = -x
    if q < low:
        q = low
    if q > high:
        q = high
    return q + shift


@jit
def _position(flat, q, a, z):
    # searchsorted(flat, q, side="right") within [a, z], which holds it
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
    if i < lo:
        i = lo
    if i > hi:
        i = hi
    return i


@jit
def _gain_index(flat, x, shift, first, lo, hi, low, high):
    # GainIndex's grid index of one unit at x = lambda x b: clip(-x, low, high) + shift searched
    # (side right) in the stages' tables, less the stage's first entry, clipped to [lo, hi];
    # searchsorted puts NaN after everything
    q = _gain_q(x, shift, low, high)
    return _clipped(flat.size if q != q else _position(flat, q, 0, flat.size), first, lo, hi)




@jit
def fill_index_pass(flat, e, b, shift, first, lo, hi, low, high):
    slots, n = b.shape
    out = np.empty((slots, n), dtype=np.int64)
    for s in range(slots):
        for j in range(n):
            out[s, j] = _gain_index(flat, e[j] * b[s, j], shift[s, j], first[s, j], lo[s, j],
                                    hi[s, j], low, high)
    return out


@jit
def water_fill_pass(t, u, b, lo, hi, limit, fill, iters, out):
    # per column j (a (row, stage) pair): the bisection on log lambda over the grid
    # -20 + 40 k / 4096 (exps[k] its exp), then the common level; totals summed over the
    # slots in order from the first, as numpy sums a [slots, n >= 2] array over axis 0. The
    # per-unit arrays (u, b, lo, hi, shift, first, out) are [n, slots]: a column's slots lie
    # side by side (laid [slots, n], every slot of a column was another cache line, re-read on
    # each of the bisection's steps: most of the search's time).
    # Each unit's search position falls as lambda grows (b >= 0), so a column whose b are all
    # >= 0 searches each unit only between its positions at the bisection's two ends, and not
    # at all once both ends clip to the same grid index (the clip is monotone: every position
    # between gives that index; most units' [lo, hi] are a few grid steps)
    flat, shift, first, low, high, exps = fill
    n, slots = u.shape
    fit = np.empty(slots, dtype=np.int64)
    over = np.empty(slots, dtype=np.int64)
    pos_a = np.empty(slots, dtype=np.int64)
    pos_z = np.empty(slots, dtype=np.int64)
    cur = np.empty(slots, dtype=np.int64)
    for j in range(n):
        a, z = 0, exps.size - 1                  # log lambda = -20 and 20
        bracket = True
        for s in range(slots):
            if not b[j, s] >= 0.0:               # negative or NaN: searched in full
                bracket = False
        if bracket:
            for s in range(slots):
                pos_a[s] = _position(flat, _gain_q(exps[a] * b[j, s], shift[j, s], low, high),
                                     0, flat.size)
                pos_z[s] = _position(flat, _gain_q(exps[z] * b[j, s], shift[j, s], low, high),
                                     0, pos_a[s])
        for _ in range(iters):
            mid = (a + z) // 2
            e = exps[mid]
            tot = 0.0
            for s in range(slots):
                if bracket:
                    i = _clipped(pos_z[s], first[j, s], lo[j, s], hi[j, s])
                    if i == _clipped(pos_a[s], first[j, s], lo[j, s], hi[j, s]):
                        cur[s] = pos_z[s]        # every position between clips to i: the
                        # search is skipped (the bracket stays on positions that clip to i)
                    else:
                        cur[s] = _position(flat, _gain_q(e * b[j, s], shift[j, s], low,
                                                         high), pos_z[s], pos_a[s])
                        i = _clipped(cur[s], first[j, s], lo[j, s], hi[j, s])
                else:
                    i = _gain_index(flat, e * b[j, s], shift[j, s], first[j, s], lo[j, s],
                                    hi[j, s], low, high)
                v = t[u[j, s] + i]
                tot = v if s == 0 else tot + v
            if tot <= limit[j]:
                z = mid
                if bracket:
                    pos_z[:] = cur
            else:
                a = mid
                if bracket:
                    pos_a[:] = cur
        lo_l, hi_l = 1 << 62, -(1 << 62)
        for s in range(slots):
            if bracket:                          # the ends' positions, searched already
                fit[s] = _clipped(pos_z[s], first[j, s], lo[j, s], hi[j, s])
                over[s] = _clipped(pos_a[s], first[j, s], lo[j, s], hi[j, s])
            else:
                fit[s] = _gain_index(flat, exps[z] * b[j, s], shift[j, s], first[j, s],
                                     lo[j, s], hi[j, s], low, high)
                over[s] = _gain_index(flat, exps[a] * b[j, s], shift[j, s], first[j, s],
                                      lo[j, s], hi[j, s], low, high)
            if fit[s] < lo_l:
                lo_l = fit[s]
            if over[s] > hi_l:
                hi_l = over[s]
        while lo_l < hi_l:                       # level_search: the highest level that fits
            mid = (lo_l + hi_l + 1) // 2
            tot = 0.0
            for s in range(slots):
                i = over[s] if over[s] < mid else mid
                if fit[s] > i:
                    i = fit[s]
                v = t[u[j, s] + i]
                tot = v if s == 0 else tot + v
            if tot <= limit[j]:
                lo_l = mid
            else:
                hi_l = mid - 1
        for s in range(slots):
            i = over[s] if over[s] < lo_l else lo_l
            out[j, s] = fit[s] if fit[s] > i else i


@jit
def unit_tables_pass(work, per_pair, fixed, corr, scale, out, total):
    # out[k] (k = 0 forward, 1 backward) as the numpy passes make it, and total = out[0] + out[1]
    n, pp, g = out.shape[1:]
    for i in range(n):
        for s in range(pp):
            c = corr[i, s]
            for j in range(g):
                v, u = unit_seconds(work[i, j], per_pair[0, s], per_pair[1, s],
                                     fixed[0, i, s], fixed[1, i, s], c, scale)
                out[0, i, s, j] = v
                out[1, i, s, j] = u
                total[i, s, j] = v + u


@jit
def moves_row(flat, u, cur, budget, cap, a, order, bound, raising, out):
    # sensitivity_moves_pass on one row ([slots, pp]; budget [pp]) with budget x a and cap x a
    # (the numpy path's products; a = 1 leaves them as they are): the micro-batches in
    # ``order``, the running sum as np.cumsum makes it (c_0 = x_0, c_j = c_(j-1) + x_j) less
    # the unit's own, minima as np.minimum (NaN wins); a unit that moves takes the highest
    # grid index whose seconds fit, by bisection (a row's seconds are non-decreasing,
    # ``UnitCosts``: highest_at_most's answer)
    slots, pp = u.shape
    for p in range(pp):
        cum = 0.0
        bud = budget[p] * a
        for jj in range(slots):
            j = order[jj, p]
            uu, c = u[j, p], cur[j, p]
            t_cur = flat[uu + c]
            out[j, p] = c
            cp = 0.0
            if raising:
                x = flat[uu + bound] - t_cur
                cp = a * cap[j, p]
                if cp < x or cp != cp:
                    x = cp
            else:
                x = t_cur - flat[uu + bound]
            cum = x if jj == 0 else cum + x
            left = bud - (cum - x)
            if raising:
                if cp < left or cp != cp:
                    left = cp
            if not (left > 0 and x > 0):
                continue
            if raising:
                lim = t_cur + left
                lo, hi = c, bound
            else:
                lim = t_cur - left
                lo, hi = bound, c
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if flat[uu + mid] <= lim:
                    lo = mid
                else:
                    hi = mid - 1
            out[j, p] = lo


@jit
def sensitivity_moves_pass(flat, units, cur, budget, cap, order, bound, raising, out):
    # dst_moves.cut_densities (raising False: budget the seconds to shed, bound i_min) and
    # raise_densities (True: budget the slack, cap each unit's float, bound i_max), row by row
    for r in range(units.shape[0]):
        moves_row(flat, units[r], cur[r], budget[r], cap[r] if raising else cap[0], 1.0,
                   order[r], bound, raising, out[r])


def sensitivity_moves(flat, units, cur, budget, cap, order, bound: int, raising: bool
                      ) -> np.ndarray:
    """``policy.dst_moves``' cut (``raising`` False) or raise in sensitivity order, in one
    compiled loop: [k, m, pp] grid indices (``units``, ``cur``, ``cap``, ``order`` [k, m, pp];
    ``budget`` [k, pp]; ``bound`` i_min or i_max)."""
    out = np.empty(units.shape, dtype=np.int64)
    sensitivity_moves_pass(f64(flat), i64(units), i64(cur), f64(budget), f64(cap), i64(order),
                           int(bound), bool(raising), out)
    return out


def highest_rows(flat: np.ndarray, first: np.ndarray, last: np.ndarray, limit: np.ndarray,
                 step: int) -> np.ndarray:
    """Flat positions [k, n] of ``policy.grid_search.highest_at_most`` for limits [k, n] over
    the same n units (``first``, ``last`` [n]; any elements as one row, k = 1): per element the
    highest position in [first, last] whose table entry is <= its limit (first if none), by
    steps ``step``, ``step / 2``, ... 1 from first - 1 (the numpy path's schedule), unit by
    unit."""
    return highest_rows_pass(f64(flat), i64(first), i64(last), f64(limit), int(step))


def fill_index(flat: np.ndarray, e: np.ndarray, b: np.ndarray, shift: np.ndarray,
               first: np.ndarray, lo: np.ndarray, hi: np.ndarray, low: float,
               high: float) -> np.ndarray:
    """[slots, n] grid indices of ``policy.dst_moves.water_fill`` at one lambda per column
    (``e`` [n], exp of its log): per unit clip(-(e x b), low, high) + shift searched (side
    right) in the stages' gain tables laid end to end (``flat``, ``GainIndex``), less the
    stage's first entry, clipped to [lo, hi]; every array [slots, n] but ``flat`` and ``e``."""
    return fill_index_pass(f64(flat), f64(e), f64(b), f64(shift), i64(first), i64(lo), i64(hi),
                           float(low), float(high))


def unit_tables(work: np.ndarray, per_pair: np.ndarray, fixed: np.ndarray, corr: np.ndarray,
                scale: bool, out: np.ndarray, total: np.ndarray) -> None:
    """``out`` [2, n, stages, g] = (work [n, g] x per_pair [2, stages] + fixed [2, n, stages])
    x corr [n, stages] (the last factor only with ``scale``), forward then backward, and
    ``total`` [n, stages, g] = forward + backward, in place: ``UnitCosts.from_latency``'s
    passes and the costs' total as one (each element the same multiply, add, multiply, add)."""
    unit_tables_pass(f64(work), f64(per_pair), f64(fixed), f64(corr), bool(scale), out, total)


def water_fill(t, u, b, lo, hi, limit, fill: Fill, iters: int) -> np.ndarray:
    """``policy.dst_moves.water_fill``'s search for n >= 2 (row, stage) columns, [slots, n]
    arrays (``u`` the units' table offsets, ``b`` their seconds per unit of density, ``lo`` /
    ``hi`` their grid bounds; ``fill``: ``GainIndex``'s search, its shift and first [slots,
    n]), limits [n]: ``iters`` bisection steps, then the common level. The lambdas' exps are
    numpy's (one table of the grid's); totals are summed as numpy sums the [slots, n] gather
    over axis 0 (in order from the first slot; with n = 1 numpy sums pairwise: not here)."""
    if u.shape[1] < 2 or not 0 <= iters <= FILL_GRID.bit_length() - 1:
        raise ValueError(f"water_fill kernel: {u.shape[1]} columns and {iters} steps, expected "
                         f">= 2 columns and at most {FILL_GRID.bit_length() - 1} steps (the "
                         f"bisection's lambdas must stay on the grid)")
    out = np.empty(u.shape[::-1], dtype=np.int64)                  # the kernel's [n, slots]
    cols = fill._replace(shift=f64(fill.shift.T), first=i64(fill.first.T))
    water_fill_pass(f64(t), i64(u.T), f64(b.T), i64(lo.T), i64(hi.T), f64(limit), cols,
                    int(iters), out)
    return out.T


def warm_up() -> None:
    """``kernels.warm_up`` for this room's kernels: each compiled (or loaded from the disk
    cache) with the argument types the planner passes, on one or two units."""
    i64 = np.int64
    flat, zero = np.arange(4.0), np.zeros(1, dtype=i64)
    highest_rows(flat, zero, np.array([3], dtype=i64), np.array([[1.5]]), 2)
    cols = dict(b=np.ones((1, 2)), shift=np.zeros((1, 2)), first=np.ones((1, 2), dtype=i64),
                lo=np.zeros((1, 2), dtype=i64), hi=np.ones((1, 2), dtype=i64))
    fill_index(flat, np.ones(2), cols["b"], cols["shift"], cols["first"], cols["lo"],
               cols["hi"], 0.0, 1.0)
    water_fill(flat, np.zeros((1, 2), dtype=i64), cols["b"], cols["lo"], cols["hi"],
               np.ones(2), Fill.of(flat, cols["shift"], cols["first"], 0.0, 1.0), 12)
    for raising in (False, True):
        sensitivity_moves(flat, np.zeros((1, 1, 1), dtype=i64), np.ones((1, 1, 1), dtype=i64),
                          np.ones((1, 1)), np.ones((1, 1, 1)), np.zeros((1, 1, 1), dtype=i64),
                          3 if raising else 0, raising)
    unit_tables(np.ones((1, 2)), np.ones((2, 1)), np.ones((2, 1, 1)), np.ones((1, 1)), True,
                np.empty((2, 1, 1, 2)), np.empty((1, 1, 2)))
