"""The critical-path descent's search, compiled: per DP rank, the
first of the descent's candidates (cut or raise fractions) whose makespan fits, by a binary
search that simulates a few columns instead of all of them (the makespans never rise from one
candidate to the next, so the first is the same), the ranks' searches stepped together so that
each step simulates their columns side by side; each unit's cut or raise looked up only at the
candidates its rank tries, and its seconds computed from the tables' formula where the costs
have it (``UnitCosts.formula``) instead of read from the tables.

The same floating point operations on the same operands as the numpy path
(``policy.critical_path._Step``; ``tests/unit/test_compiled_kernels.py`` and
``tests/unit/test_critical_path.py`` compare them). Pure numpy and numba; must not import torch,
megatron or anything else from this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import contiguous, f64, i64, jit
from .graph import event_start

__all__ = ["first_fit", "first_fit_search", "formula_args", "highest_formula",
           "highest_formula_search", "unit_seconds", "warm_up"]


@jit
def unit_seconds(w, p0, p1, f0, f1, c, scaled):
    # (forward, backward) seconds of a unit whose attention work is w: the cost tables' own
    # formula, (w x per pair + fixed) x correction (the factor only where scaled), each
    # operation as policy.kernels.grid.unit_tables_pass makes the tables (it calls this)
    v = w * p0
    v = v + f0
    x = w * p1
    x = x + f1
    if scaled:
        v = v * c
        x = x * c
    return v, x


@jit
def _limit(lazy_on, lazy_delta, fracs, scale, c, u):
    # the total a unit's look-up at candidate c must stay within
    return (lazy_on[u] + fracs[c] * lazy_delta[u]) * scale + 1e-15


@jit
def _top(at, c, u, top):
    # where a unit's look-up at candidate c starts: an earlier candidate's position where one
    # is known (the limits fall with c), else ``top``
    for c2 in range(c - 1, -1, -1):
        if at[c2, u] >= 0:
            return at[c2, u]
    return top


@jit
def _lift(tot, first, last, lim):
    # highest position in [first, last] with tot <= lim (first if none): ``tot`` is
    # UnitCosts.total_s, whose rows are non-decreasing (UnitCosts makes them so), so the first
    # from the top that fits is the one highest_at_most's lifting finds; a cut mostly moves a
    # few grid steps, so walking down beats the lifting's scattered probes
    pos = last
    while pos > first and not tot[pos] <= lim:
        pos -= 1
    return pos


@jit
def _set_units(j, c, lo, hi, rows_f, rows_b, fwd, bwd, tot, at, buf, lazy_u, lazy_on,
               lazy_delta, lazy_hi, lazy_lo, fracs, scale, work, per_pair, fixed, corr,
               scaled, mb_of, st_of):
    # column j of buf with units lo:hi at their candidate c (a candidate rewrites only its
    # units' rows, so a rank's tries copy its column once); a candidate not given (at < 0) is
    # looked up: the unit's seconds moved by fracs[c] x its delta (a cut: minus its cuttable
    # time; a raise: its float). With the tables' formula (work given), every second is
    # computed from it as the tables were, instead of read from the tables
    if work.shape[0] > 0:
        _set_units_formula(j, c, lo, hi, rows_f, rows_b, at, buf, lazy_u, lazy_on, lazy_delta,
                           lazy_hi, lazy_lo, fracs, scale, work, per_pair, fixed, corr, scaled,
                           mb_of, st_of)
        return
    for u in range(lo, hi):
        a = at[c, u]
        if a < 0:
            a = _lift(tot, lazy_u[u] + lazy_lo[u], _top(at, c, u, lazy_u[u] + lazy_hi[u]),
                      _limit(lazy_on, lazy_delta, fracs, scale, c, u))
            at[c, u] = a
        buf[rows_f[u], j] = fwd[a]
        buf[rows_b[u], j] = bwd[a]


@jit
def _set_units_formula(j, c, lo, hi, rows_f, rows_b, at, buf, lazy_u, lazy_on, lazy_delta,
                       lazy_hi, lazy_lo, fracs, scale, work, per_pair, fixed, corr, scaled,
                       mb_of, st_of):
    # _set_units with each unit's seconds at grid index i computed as UnitCosts.from_latency's
    # kernel made its tables (kernels.grid.unit_tables_pass: the same operations in the same
    # order), from its micro-batch's work row (``mb_of``, ``st_of``: each unit's micro-batch
    # and stage, ``_unit_places``)
    for u in range(lo, hi):
        base = lazy_u[u]
        mb = mb_of[u]
        s = st_of[u]
        p0, p1 = per_pair[0, s], per_pair[1, s]
        f0, f1, cc = fixed[0, mb, s], fixed[1, mb, s], corr[mb, s]
        a = at[c, u]
        if a < 0:                                # _lift's walk down, on computed totals
            lim = _limit(lazy_on, lazy_delta, fracs, scale, c, u)
            first = base + lazy_lo[u]
            a = _top(at, c, u, base + lazy_hi[u])
            while a > first:
                v, x = unit_seconds(work[mb, a - base], p0, p1, f0, f1, cc, scaled)
                if v + x <= lim:
                    break
                a -= 1
            at[c, u] = a
        v, x = unit_seconds(work[mb, a - base], p0, p1, f0, f1, cc, scaled)
        buf[rows_f[u], j] = v
        buf[rows_b[u], j] = x


@jit
def _unit_places(lazy_u, work, per_pair):
    # every unit's micro-batch and stage (its table offset lazy_u = (micro-batch x stages +
    # stage) x grid), worked out once per search instead of at every candidate it is tried at
    # (two integer divisions per unit and try were a tenth of the search); empty without the
    # formula
    n = lazy_u.size if work.shape[0] > 0 else 0
    mb_of = np.empty(n, dtype=np.int64)
    st_of = np.empty(n, dtype=np.int64)
    if n:
        g, nv = work.shape[1], per_pair.shape[1]
        for u in range(n):
            q = lazy_u[u] // g
            mb_of[u] = q // nv
            st_of[u] = q - mb_of[u] * nv
    return mb_of, st_of


@jit
def simulate_columns(prev, dep, cross, last, p, buf, end, cols, na, mk):
    # columns cols[:na] of buf simulated into end, side by side (each column's events in
    # order; the columns are independent, so a step runs over all of them at once), and
    # their makespans into mk[cols[:na]] (np.max over the ranks' last events, NaN wins)
    n = buf.shape[0]
    for e in range(n):
        d, pr = dep[e], prev[e]
        add = cross[e] != 0 and p != 0.0
        for q in range(na):
            j = cols[q]
            end[e, j] = event_start(end[d, j] if d >= 0 else 0.0, end[pr, j] if pr >= 0 else 0.0,
                               d, pr, add, p) + buf[e, j]
    for q in range(na):
        j = cols[q]
        x = end[last[0], j]
        for i in range(1, last.size):
            y = end[last[i], j]
            if y > x or y != y:
                x = y
        mk[j] = x


@jit
def first_fit_search(prev, dep, cross, last, p, dur, ranks, seg, rows_f, rows_b, fwd, bwd, tot,
               at, limit, buf, end, lazy_u, lazy_on, lazy_delta, lazy_hi, lazy_lo,
               fracs, scale, probe_first, work, per_pair, fixed, corr, scaled, z0):
    # per rank a binary search over the candidates (makespans fall with c: every candidate
    # below a is over, every one from z fits; the first tried is the middle, or candidate 0
    # with probe_first, where it usually fits), the ranks' searches stepped together: each
    # step simulates every searching rank's next candidate side by side, in column j of buf
    # (durations) and end (finishes), [E, r], which end as the picks' (the outputs). z0 [r]:
    # where each rank's search starts its z (a candidate known to fit; k: none known). A
    # rank whose column does not hold its pick when the search ends (its last try did not
    # fit, or its first fit is the z0 given, or none fits) is set and simulated again at
    # its pick: copying every fitting try aside cost more than that
    k, r = at.shape[0], ranks.size
    n = dur.shape[0]
    mb_of, st_of = _unit_places(lazy_u, work, per_pair)
    fits = np.empty(r, dtype=np.bool_)
    pick = np.empty(r, dtype=np.int64)
    mk = np.empty(r)
    t = np.empty(r)
    for e in range(n):
        for j in range(r):
            buf[e, j] = dur[e, ranks[j]]
    a, z = np.zeros(r, dtype=np.int64), z0.copy()
    held = np.zeros(r, dtype=np.bool_)          # column j holds candidate z[j], simulated
    mid, cols = np.empty(r, dtype=np.int64), np.empty(r, dtype=np.int64)
    first = probe_first
    while True:
        na = 0
        for j in range(r):
            if a[j] < z[j]:
                mid[j] = 0 if first else (a[j] + z[j]) >> 1
                _set_units(j, mid[j], seg[j], seg[j + 1], rows_f, rows_b, fwd, bwd, tot, at,
                           buf, lazy_u, lazy_on, lazy_delta, lazy_hi, lazy_lo, fracs, scale,
                           work, per_pair, fixed, corr, scaled, mb_of, st_of)
                cols[na] = j
                na += 1
        first = False
        if na == 0:
            break
        simulate_columns(prev, dep, cross, last, p, buf, end, cols, na, t)
        for q in range(na):
            j = cols[q]
            if t[j] <= limit[j]:                 # the last that fits is the first that fits
                z[j] = mid[j]
                mk[j] = t[j]
                held[j] = True
            else:
                a[j] = mid[j] + 1
                held[j] = False
    na = 0
    for j in range(r):
        fits[j] = a[j] < k
        pick[j] = a[j] if a[j] < k else 0
        if not held[j]:                          # none fits: the first, as np.argmax gives
            _set_units(j, pick[j], seg[j], seg[j + 1], rows_f, rows_b, fwd, bwd, tot, at, buf,
                       lazy_u, lazy_on, lazy_delta, lazy_hi, lazy_lo, fracs, scale, work,
                       per_pair, fixed, corr, scaled, mb_of, st_of)
            cols[na] = j
            na += 1
    if na:
        simulate_columns(prev, dep, cross, last, p, buf, end, cols, na, t)
        for q in range(na):
            j = cols[q]
            mk[j] = t[j]
    return fits, pick, mk


@jit
def highest_formula_search(work, per_pair, fixed, corr, scaled, units, lo, hi, limit, out):
    # per element k: the highest grid index in [lo, hi] of unit units[k] whose total, computed
    # as _set_units_formula computes it, is <= limit[k] (lo if none), by bisection (the rows
    # are non-decreasing, so the answer is highest_at_most's)
    nv = per_pair.shape[1]
    for k in range(units.size):
        mb = units[k] // nv
        s = units[k] - mb * nv
        p0, p1 = per_pair[0, s], per_pair[1, s]
        f0, f1, cc = fixed[0, mb, s], fixed[1, mb, s], corr[mb, s]
        a, b, lim = lo[k], hi[k], limit[k]
        while a < b:
            mid = (a + b + 1) >> 1
            v, x = unit_seconds(work[mb, mid], p0, p1, f0, f1, cc, scaled)
            if v + x <= lim:
                a = mid
            else:
                b = mid - 1
        out[k] = a


def highest_formula(formula: tuple, units: np.ndarray, lo, hi, limit: np.ndarray) -> np.ndarray:
    """``policy.costs.highest_at_most`` on the totals of ``UnitCosts.formula`` (the same
    numbers as the table's): per unit ``units`` [n] (flat unit ids) and limit ``limit`` [k, n],
    the highest grid index in [lo, hi] whose total is <= the limit (lo if none); ``lo``, ``hi``
    [n] or scalars. [k, n] grid indices."""
    work, per_pair, fixed, corr, scaled = formula_args(formula)
    lim = np.asarray(limit, dtype=np.float64)
    n = units.size
    lo_n, hi_n = (i64(np.broadcast_to(np.asarray(x, dtype=np.int64), (n,)))
                  for x in (lo, hi))
    u = i64(units)
    out = np.empty(lim.shape, dtype=np.int64)
    if not out.size:
        return out
    for row_lim, row_out in zip(lim.reshape(-1, n), out.reshape(-1, n)):
        highest_formula_search(work, per_pair, fixed, corr, scaled, u, lo_n, hi_n,
                               f64(row_lim), row_out)
    return out


_NO_LAZY = (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0),
            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0),
            1.0)                                 # first_fit, every candidate given


_NO_FORMULA = (np.zeros((0, 0)), np.zeros((2, 0)), np.zeros((2, 0, 0)), np.zeros((0, 0)), False)


def formula_args(formula) -> tuple:
    if formula is None:
        return _NO_FORMULA
    work, per_pair, fixed, corr, scaled = formula
    return f64(work), f64(per_pair), f64(fixed), f64(corr), bool(scaled)


def first_fit(links: np.ndarray, last: np.ndarray, dur: np.ndarray, p2p_s: float,
              ranks: np.ndarray, seg: np.ndarray, rows_f: np.ndarray, rows_b: np.ndarray,
              fwd: np.ndarray, bwd: np.ndarray, at: np.ndarray, limit: np.ndarray,
              lazy: tuple = None, probe_first: bool = False, formula: tuple = None,
              fits_from: np.ndarray = None) -> tuple:
    """Per DP rank ``ranks[j]`` (a column of ``dur`` [E, dp]), the first candidate c of ``at``
    [k, n] whose makespan is <= ``limit[j]``, the makespans falling with c (a binary search:
    a few simulated columns, not k): the rank's units ``seg[j]:seg[j + 1]`` take their
    durations ``fwd[at[c]]`` / ``bwd[at[c]]`` at event rows ``rows_f`` / ``rows_b``. Returns
    (fits [r], pick [r] (0 where none fits), makespan [r], durations and earliest finishes
    [E, r] of each rank's pick), what simulating every candidate and taking np.argmax gives.

    ``lazy`` (optional): (the cost table's totals, fwd + bwd (``UnitCosts.total_s``), flat
    like ``fwd``; unit offsets [n], unit seconds t [n], deltas [n], highest grid indices [n],
    lowest grid indices [n], fractions [k], scale): an entry of ``at`` < 0 (int64, written in
    place) is then looked up when its candidate is tried, as the critical-path descent's cut
    (delta: t at the lowest index less t) or raise (delta: the unit's float): the highest grid
    index in [lowest, highest] whose total is <= (t + fraction x delta) x scale + 1e-15
    (``highest_at_most``; the tables are non-decreasing along the grid), searched down from an
    earlier candidate's where one is known (the fractions make the limits fall with c).
    ``probe_first``: try the first candidate alone before the search (where it usually fits:
    one simulated column instead of a search's three); the same answer.
    ``formula`` (optional, with ``lazy``): the tables' formula (``UnitCosts.formula``), which
    gives every unit's seconds as the tables hold them, computed from a few small arrays
    instead of read from three large tables (``lazy``'s unit offsets say which unit).
    ``fits_from`` (optional, [r]): per rank a candidate known to fit (k: none), where its
    search starts (a narrower search, the same answer: candidates past a fit fit too)."""
    d = f64(dur)
    r = ranks.size
    dur_out, ef_out = np.empty((d.shape[0], r)), np.empty((d.shape[0], r))
    tot, u, on, delta, hi, lo, fracs, scale = _NO_LAZY if lazy is None else lazy
    if at.dtype != np.int64 or not at.flags.c_contiguous:
        raise ValueError(f"first_fit: at is {at.dtype}, C-contiguous {at.flags.c_contiguous}: "
                         f"expected a C-contiguous int64 array (it is written in place)")
    fits, pick, mk = first_fit_search(
        links[0], links[1], links[2], i64(last), float(p2p_s), d, i64(ranks), i64(seg),
        i64(rows_f), i64(rows_b), f64(fwd), f64(bwd), f64(tot), at, f64(limit), dur_out, ef_out,
        i64(u), f64(on), f64(delta), i64(hi), i64(lo), f64(fracs), float(scale),
        bool(probe_first), *formula_args(formula if lazy is not None else None),
        np.full(r, at.shape[0], dtype=np.int64) if fits_from is None else i64(fits_from))
    return fits, pick, mk, dur_out, ef_out


def warm_up() -> None:
    """``kernels.warm_up`` for this room's search: compiled (or loaded from numba's disk
    cache) with the argument types a draft passes, on a two-event graph."""
    i64 = np.int64
    links = np.array([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], dtype=i64)  # e0 -> e1
    dur, one, none = np.ones((2, 2)), np.ones(1), np.zeros(1, dtype=i64)
    args = (links, np.array([1], dtype=i64), dur, 0.0, none, np.array([0, 1], dtype=i64), none,
            np.array([1], dtype=i64), np.ones(2), np.ones(2))
    first_fit(*args, np.zeros((1, 1), dtype=i64), one, probe_first=True)
    first_fit(*args, np.full((1, 1), -1, dtype=i64), one,
              lazy=(np.ones(2), none, one, one, none, none, one, 1.0))
    formula = (np.ones((1, 2)), np.ones((2, 1)), np.ones((2, 1, 1)), np.ones((1, 1)), True)
    first_fit(*args, np.full((1, 1), -1, dtype=i64), one,
              lazy=(np.ones(2), none, one, one, none, none, one, 1.0), formula=formula)
    highest_formula(formula, none, 0, 1, np.ones((1, 1)))
