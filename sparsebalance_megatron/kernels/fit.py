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

from . import f64, i64, jit
from .graph import simulate_columns
from .records import NO_LOOKUP, Formula, Graph, Lookup, Tables, Tries

__all__ = ["first_fit", "first_fit_search", "highest_formula", "highest_formula_search",
           "tries", "unit_seconds", "warm_up"]


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
def _limit(look, c, u):
    # the total a unit's look-up at candidate c must stay within
    return (look.on[u] + look.fracs[c] * look.delta[u]) * look.scale + 1e-15


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
def _set_units(j, c, tries, tables, look, formula, places, at, buf):
    # column j of buf with rank j's units at their candidate c (a candidate rewrites only its
    # units' rows, so a rank's tries copy its column once); a candidate not given (at < 0) is
    # looked up: the unit's seconds moved by fracs[c] x its delta (a cut: minus its cuttable
    # time; a raise: its float). With the tables' formula (work given), every second is
    # computed from it as the tables were, instead of read from the tables
    if formula.work.shape[0] > 0:
        _set_units_formula(j, c, tries, look, formula, places, at, buf)
        return
    for u in range(tries.seg[j], tries.seg[j + 1]):
        a = at[c, u]
        if a < 0:
            a = _lift(tables.tot, look.u[u] + look.lo[u], _top(at, c, u, look.u[u] + look.hi[u]),
                      _limit(look, c, u))
            at[c, u] = a
        buf[tries.rows_f[u], j] = tables.fwd[a]
        buf[tries.rows_b[u], j] = tables.bwd[a]


@jit
def _set_units_formula(j, c, tries, look, formula, places, at, buf):
    # _set_units with each unit's seconds at grid index i computed as UnitCosts.from_latency's
    # kernel made its tables (kernels.grid.unit_tables_pass: the same operations in the same
    # order), from its micro-batch's work row (``places``: each unit's micro-batch and stage,
    # ``_unit_places``)
    work, per_pair, fixed, corr, scaled = formula
    mb_of, st_of = places
    for u in range(tries.seg[j], tries.seg[j + 1]):
        base = look.u[u]
        mb = mb_of[u]
        s = st_of[u]
        p0, p1 = per_pair[0, s], per_pair[1, s]
        f0, f1, cc = fixed[0, mb, s], fixed[1, mb, s], corr[mb, s]
        a = at[c, u]
        if a < 0:                                # _lift's walk down, on computed totals
            lim = _limit(look, c, u)
            first = base + look.lo[u]
            a = _top(at, c, u, base + look.hi[u])
            while a > first:
                v, x = unit_seconds(work[mb, a - base], p0, p1, f0, f1, cc, scaled)
                if v + x <= lim:
                    break
                a -= 1
            at[c, u] = a
        v, x = unit_seconds(work[mb, a - base], p0, p1, f0, f1, cc, scaled)
        buf[tries.rows_f[u], j] = v
        buf[tries.rows_b[u], j] = x


@jit
def _unit_places(offsets, formula):
    # every unit's micro-batch and stage (its table offset = (micro-batch x stages + stage) x
    # grid), worked out once per search instead of at every candidate it is tried at (two
    # integer divisions per unit and try were a tenth of the search); empty without the
    # formula
    n = offsets.size if formula.work.shape[0] > 0 else 0
    mb_of = np.empty(n, dtype=np.int64)
    st_of = np.empty(n, dtype=np.int64)
    if n:
        g, nv = formula.work.shape[1], formula.per_pair.shape[1]
        for u in range(n):
            q = offsets[u] // g
            mb_of[u] = q // nv
            st_of[u] = q - mb_of[u] * nv
    return mb_of, st_of


@jit
def first_fit_search(graph, dur, tries, tables, look, formula, at, probe_first, buf, end):
    # per rank a binary search over the candidates (makespans fall with c: every candidate
    # below a is over, every one from z fits; the first tried is the middle, or candidate 0
    # with probe_first, where it usually fits), the ranks' searches stepped together: each
    # step simulates every searching rank's next candidate side by side, in column j of buf
    # (durations) and end (finishes), [E, r], which end as the picks' (the outputs).
    # tries.z0 [r]: where each rank's search starts its z (a candidate known to fit; k: none
    # known). A rank whose column does not hold its pick when the search ends (its last try
    # did not fit, or its first fit is the z0 given, or none fits) is set and simulated again
    # at its pick: copying every fitting try aside cost more than that
    ranks, limit = tries.ranks, tries.limit
    k, r = at.shape[0], ranks.size
    n = dur.shape[0]
    places = _unit_places(look.u, formula)
    fits = np.empty(r, dtype=np.bool_)
    pick = np.empty(r, dtype=np.int64)
    mk = np.empty(r)
    t = np.empty(r)
    for e in range(n):
        for j in range(r):
            buf[e, j] = dur[e, ranks[j]]
    a, z = np.zeros(r, dtype=np.int64), tries.z0.copy()
    held = np.zeros(r, dtype=np.bool_)          # column j holds candidate z[j], simulated
    mid, cols = np.empty(r, dtype=np.int64), np.empty(r, dtype=np.int64)
    first = probe_first
    while True:
        na = 0
        for j in range(r):
            if a[j] < z[j]:
                mid[j] = 0 if first else (a[j] + z[j]) >> 1
                _set_units(j, mid[j], tries, tables, look, formula, places, at, buf)
                cols[na] = j
                na += 1
        first = False
        if na == 0:
            break
        simulate_columns(graph, buf, end, cols, na, t)
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
            _set_units(j, pick[j], tries, tables, look, formula, places, at, buf)
            cols[na] = j
            na += 1
    if na:
        simulate_columns(graph, buf, end, cols, na, t)
        for q in range(na):
            j = cols[q]
            mk[j] = t[j]
    return fits, pick, mk


@jit
def highest_formula_search(formula, units, lo, hi, limit, out):
    # per element k: the highest grid index in [lo, hi] of unit units[k] whose total, computed
    # as _set_units_formula computes it, is <= limit[k] (lo if none), by bisection (the rows
    # are non-decreasing, so the answer is highest_at_most's)
    work, per_pair, fixed, corr, scaled = formula
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
    """``policy.grid_search.highest_at_most`` on the totals of ``UnitCosts.formula`` (the same
    numbers as the table's): per unit ``units`` [n] (flat unit ids) and limit ``limit`` [k, n],
    the highest grid index in [lo, hi] whose total is <= the limit (lo if none); ``lo``, ``hi``
    [n] or scalars. [k, n] grid indices."""
    rec = Formula.of(formula)
    lim = np.asarray(limit, dtype=np.float64)
    n = units.size
    lo_n, hi_n = (i64(np.broadcast_to(np.asarray(x, dtype=np.int64), (n,)))
                  for x in (lo, hi))
    u = i64(units)
    out = np.empty(lim.shape, dtype=np.int64)
    if not out.size:
        return out
    for row_lim, row_out in zip(lim.reshape(-1, n), out.reshape(-1, n)):
        highest_formula_search(rec, u, lo_n, hi_n, f64(row_lim), row_out)
    return out


def first_fit(graph: Graph, dur: np.ndarray, tries: Tries, tables: Tables, at: np.ndarray,
              lookup: Lookup = None, formula=None, probe_first: bool = False) -> tuple:
    """Per DP rank ``tries.ranks[j]`` (a column of ``dur`` [E, dp]), the first candidate c of
    ``at`` [k, n] whose makespan is <= ``tries.limit[j]``, the makespans falling with c (a
    binary search: a few simulated columns, not k): the rank's units take their durations
    ``tables.fwd[at[c]]`` / ``tables.bwd[at[c]]`` at their event rows (``Tries``). Returns
    (fits [r], pick [r] (0 where none fits), makespan [r], durations and earliest finishes
    [E, r] of each rank's pick), what simulating every candidate and taking np.argmax gives.

    ``lookup`` (optional, ``Lookup``): an entry of ``at`` < 0 (int64, written in place) is
    then looked up when its candidate is tried, as the critical-path descent's cut (delta: the
    unit's seconds at the lowest index less its seconds) or raise (delta: the unit's float):
    the highest grid index in [lowest, highest] whose total (``tables.tot``) is <= the
    lookup's limit (``highest_at_most``; the tables are non-decreasing along the grid),
    searched down from an earlier candidate's where one is known (the fractions make the
    limits fall with c). ``formula`` (optional, with ``lookup``): the tables' formula
    (``UnitCosts.formula``), which gives every unit's seconds as the tables hold them,
    computed from a few small arrays instead of read from three large tables.
    ``probe_first``: try the first candidate alone before the search (where it usually fits:
    one simulated column instead of a search's three); the same answer. ``tries.z0``: per
    rank a candidate known to fit (k: none), where its search starts (a narrower search, the
    same answer: candidates past a fit fit too)."""
    d = f64(dur)
    r = tries.ranks.size
    dur_out, ef_out = np.empty((d.shape[0], r)), np.empty((d.shape[0], r))
    if at.dtype != np.int64 or not at.flags.c_contiguous:
        raise ValueError(f"first_fit: at is {at.dtype}, C-contiguous {at.flags.c_contiguous}: "
                         f"expected a C-contiguous int64 array (it is written in place)")
    fits, pick, mk = first_fit_search(
        graph, d, tries, tables, NO_LOOKUP if lookup is None else lookup,
        Formula.of(formula if lookup is not None else None), at, bool(probe_first), dur_out,
        ef_out)
    return fits, pick, mk, dur_out, ef_out


def tries(ranks, seg, rows_f, rows_b, limit, k: int, fits_from=None) -> Tries:
    """The ``Tries`` record of a search of ``k`` candidates (``fits_from`` [r]: per rank a
    candidate known to fit, optional)."""
    return Tries(i64(ranks), i64(seg), i64(rows_f), i64(rows_b), f64(limit),
                 np.full(np.size(ranks), k, dtype=np.int64) if fits_from is None
                 else i64(fits_from))


def warm_up() -> None:
    """``kernels.warm_up`` for this room's search: compiled (or loaded from numba's disk
    cache) with the argument types a draft passes, on a two-event graph."""
    from types import SimpleNamespace

    i = np.int64
    links = np.array([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], dtype=i)  # e0 -> e1
    g = SimpleNamespace(links=links, last=np.array([1], dtype=i),
                        unit_events=np.array([[0], [1]], dtype=i), unit_rows=np.arange(2))
    graph, dur, one, none = Graph.of(g, 0.0), np.ones((2, 2)), np.ones(1), np.zeros(1, dtype=i)
    tables = Tables(np.ones(2), np.ones(2), np.ones(2), 2)
    lookup = Lookup(none, one, one, none, none, one, 1.0)
    formula = (np.ones((1, 2)), np.ones((2, 1)), np.ones((2, 1, 1)), np.ones((1, 1)), True)
    for look, form in ((None, None), (lookup, None), (lookup, formula)):
        first_fit(graph, dur, tries(none, [0, 1], none, [1], one, 1), tables,
                  np.full((1, 1), -1 if look else 0, dtype=i), look, form, look is None)
    highest_formula(formula, none, 0, 1, np.ones((1, 1)))
