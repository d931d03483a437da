"""An event graph's passes, compiled: the 1F1B simulator's earliest finishes, the float pass's
latest finishes and every unit's float, and the same on one DP-rank row at a time (the band
pass's and SAB's rows).

The planner steps through a step's event graph hundreds of times per draft (the simulator,
the float pass, the critical-path descent's candidates). In numpy those are a few calls per
event, and at the planner's sizes (a few hundred events, tens to hundreds of columns) the calls
are most of the time. Here each is one compiled loop:

- ``earliest_finish``: ``max(dep + p2p, prev) + duration`` per event and column, in event order
  (numpy reference: ``sim.pipeline.EventGraph.earliest_finish``);
- ``latest_finish``: ``min(deadline, next's start, successor's start - p2p)`` and its start
  (``policy.slack.latest_finish``);
- ``unit_floats``: the latest finishes and every unit's smaller float in one pass
  (``policy.slack.unit_floats_from``);
- ``simulate_columns``: the earliest finishes and makespans of a few columns (the descent's
  search, ``kernels.fit``);
- ``row_makespan`` / ``simulate_rows`` / ``floats_rows``: the same on one column per row, with
  a row's seconds laid out as ``EventGraph.durations`` lays them out (forward first).

Every earliest-finish loop takes an event's start from ``event_start`` and every latest-finish
loop its latest finish from ``event_deadline``: one body per rule, the loops differing only in
the layout they walk (all columns, a few columns, one row).

Every kernel does the numpy path's floating point operations, on the same operands, in the same
order (maxima, minima, one add or subtract, comparisons: each exact given its operands), and
propagates NaN as ``np.maximum`` / ``np.minimum`` do, so the results are the numpy path's bit for
bit (``tests/unit/test_compiled_kernels.py``).

Pure numpy and numba; must not import torch, megatron or anything else from this package but
``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import contiguous, f64, i64, jit


@jit
def event_start(vd, vpr, d, pr, add, p):
    """An event's start: max(its dependency's finish ``vd`` (+ p2p ``p`` when ``add``: it
    crosses ranks), its rank's previous event's finish ``vpr``), as np.maximum (NaN wins); 0
    with neither (``d``, ``pr`` -1: none)."""
    if d >= 0:
        v = vd + p if add else vd
        if pr >= 0 and (vpr > v or vpr != vpr):
            v = vpr
        return v
    return vpr if pr >= 0 else 0.0


@jit
def event_deadline(v, ls_next, ls_succ, j, k, sub, p):
    """An event's latest finish: min(``v`` (its deadline), its rank's next event's latest
    start ``ls_next``, its successor's latest start ``ls_succ`` (- p2p ``p`` when ``sub``: the
    wait crosses ranks)), as np.minimum (NaN wins); ``j``, ``k`` -1: no next event, no
    successor."""
    if j >= 0:
        if ls_next < v or ls_next != ls_next:
            v = ls_next
    if k >= 0:
        x = ls_succ - p if sub else ls_succ
        if x < v or x != x:
            v = x
    return v


@jit
def earliest_finish_pass(prev, dep, cross, dur, p, start, record):
    """[E, cols] earliest finishes, column by column in event order (``start`` receives the
    starts where ``record``)."""
    n, cols = dur.shape
    end = np.empty((n, cols))
    for e in range(n):
        d, pr = dep[e], prev[e]
        add = cross[e] != 0 and p != 0.0
        for j in range(cols):
            v = event_start(end[d, j] if d >= 0 else 0.0, end[pr, j] if pr >= 0 else 0.0, d,
                            pr, add, p)
            if record:
                start[e, j] = v
            end[e, j] = v + dur[e, j]
    return end


@jit
def simulate_columns(graph, buf, end, cols, na, mk):
    """Columns cols[:na] of durations ``buf`` [E, *] simulated into ``end``, side by side
    (each column's events in order; the columns are independent, so a step runs over all of
    them at once), and their makespans into mk[cols[:na]] (np.max over the ranks' last
    events, NaN wins): ``earliest_finish_pass`` on a few columns (the descent's search)."""
    prev, dep, cross, last, p = graph.prev, graph.dep, graph.cross, graph.last, graph.p2p
    n = buf.shape[0]
    for e in range(n):
        d, pr = dep[e], prev[e]
        add = cross[e] != 0 and p != 0.0
        for q in range(na):
            j = cols[q]
            end[e, j] = event_start(end[d, j] if d >= 0 else 0.0,
                                    end[pr, j] if pr >= 0 else 0.0, d, pr, add, p) + buf[e, j]
    for q in range(na):
        j = cols[q]
        x = end[last[0], j]
        for i in range(1, last.size):
            y = end[last[i], j]
            if y > x or y != y:
                x = y
        mk[j] = x


@jit
def latest_finish_pass(nxt, succ, cross, dur, deadline, p):
    """[E, cols] latest finishes, every rank's last event due at ``deadline`` [cols]."""
    n, cols = dur.shape
    lf = np.empty((n, cols))
    ls = np.empty((n, cols))
    for e in range(n - 1, -1, -1):
        j, k = nxt[e], succ[e]
        sub = k >= 0 and cross[k] != 0 and p != 0.0
        for c in range(cols):
            v = event_deadline(deadline[c], ls[j, c] if j >= 0 else 0.0,
                               ls[k, c] if k >= 0 else 0.0, j, k, sub, p)
            lf[e, c] = v
            ls[e, c] = v - dur[e, c]
    return lf


@jit
def unit_floats_pass(nxt, succ, cross, dur, ef, deadline, p, ev_f, ev_b):
    """[cols, units] every unit's smaller float, min(lf - ef) of its forward and backward
    events, as np.minimum gives it (NaN wins)."""
    lf = latest_finish_pass(nxt, succ, cross, dur, deadline, p)
    cols, n = dur.shape[1], ev_f.size
    out = np.empty((cols, n))
    for u in range(n):
        a, b = ev_f[u], ev_b[u]
        for c in range(cols):
            x = lf[a, c] - ef[a, c]
            y = lf[b, c] - ef[b, c]
            out[c, u] = x if (x < y or x != x) else y
    return out


@jit
def events_makespan(graph, both, end):
    """One row's makespan: every event's earliest finish (into ``end`` [E]) from the row's
    seconds ``both`` ([2, m * nv] as ``EventGraph.durations`` lays them out, forward first;
    ``graph.unit_rows``: each event's entry) and the latest of the ranks' last events (np.max:
    NaN wins)."""
    unit_rows, prev, dep, cross, last, p = (graph.unit_rows, graph.prev, graph.dep,
                                            graph.cross, graph.last, graph.p2p)
    add_p = p != 0.0
    for e in range(unit_rows.size):
        d, pr = dep[e], prev[e]
        v = event_start(end[d] if d >= 0 else 0.0, end[pr] if pr >= 0 else 0.0, d, pr,
                        cross[e] != 0 and add_p, p)
        end[e] = v + both[unit_rows[e]]
    mk = end[last[0]]
    for i in range(1, last.size):
        x = end[last[i]]
        if x > mk or x != x:
            mk = x
    return mk


@jit
def row_makespan(graph, tables, u, idx, both, end):
    """One row's 1F1B makespan, its units ``u`` at grid indices ``idx`` ([slots, pp]) read
    from the flat tables (``Tables``) into ``both`` (``events_makespan``'s layout)."""
    slots, pp = u.shape
    n = slots * pp
    for s in range(slots):
        for q in range(pp):
            j = s * pp + q
            f = u[s, q] + idx[s, q]
            both[j] = tables.fwd[f]
            both[n + j] = tables.bwd[f]
    return events_makespan(graph, both, end)


@jit
def simulate_rows(graph, tables, units, idx, rows, mk, record, dur, ef, busy):
    """Every row's makespan at idx[i] (units[rows[i]]) into ``mk``; with ``record`` also its
    event durations and earliest finishes (rows of [rows, E]) and its stages' busy seconds
    (forward + backward summed over the slots in order)."""
    slots, pp = units.shape[1], units.shape[2]
    unit_rows = graph.unit_rows
    both = np.empty(2 * slots * pp)
    end = np.empty(unit_rows.size)
    for i in range(rows.size):
        mk[i] = row_makespan(graph, tables, units[rows[i]], idx[i], both, end)
        if record:
            n = slots * pp
            for e in range(unit_rows.size):
                dur[i, e] = both[unit_rows[e]]
                ef[i, e] = end[e]
            for q in range(pp):
                acc = 0.0
                for s in range(slots):
                    v = both[s * pp + q] + both[n + s * pp + q]
                    acc = v if s == 0 else acc + v
                busy[i, q] = acc


@jit
def floats_rows(graph, dur, ef, deadline, cap):
    """``unit_floats_pass`` per row (rows of [rows, E] durations and earliest finishes, every
    rank's last event due at deadline[row]): every unit's smaller float, then
    np.maximum(float, 0) (NaN stays), into cap [rows, units]."""
    nxt, succ, cross, p, ev_f, ev_b = (graph.nxt, graph.succ, graph.cross, graph.p2p,
                                       graph.ev_f, graph.ev_b)
    n_ev = dur.shape[1]
    ls = np.empty(n_ev)
    lf = np.empty(n_ev)
    for r in range(dur.shape[0]):
        for e in range(n_ev - 1, -1, -1):
            j, k = nxt[e], succ[e]
            v = event_deadline(deadline[r], ls[j] if j >= 0 else 0.0, ls[k] if k >= 0 else 0.0,
                               j, k, k >= 0 and cross[k] != 0 and p != 0.0, p)
            lf[e] = v
            ls[e] = v - dur[r, e]
        for u in range(ev_f.size):
            a, b = ev_f[u], ev_b[u]
            x = lf[a] - ef[r, a]
            y = lf[b] - ef[r, b]
            m = x if (x < y or x != x) else y
            cap[r, u] = m if (m >= 0.0 or m != m) else 0.0


_NO_START = np.empty((0, 0))


def earliest_finish(links: np.ndarray, dur: np.ndarray, p2p_s: float, start=None) -> np.ndarray:
    """[E, cols] earliest finishes of an event graph (``links``: [5, E] int64 rows prev, dep,
    cross, next, successor, ``EventGraph.links``) with durations ``dur`` [E, cols]; ``start``
    ([E, cols], optional) receives every event's start."""
    d = f64(dur)
    rec = start is not None
    buf = np.empty(d.shape) if rec else _NO_START
    end = earliest_finish_pass(links[0], links[1], links[2], d, float(p2p_s), buf, rec)
    if rec:
        start[...] = buf
    return end


def _deadlines(deadline, cols: int) -> np.ndarray:
    return contiguous(np.broadcast_to(np.asarray(deadline, dtype=np.float64), (cols,)),
                      np.float64)


def latest_finish(links: np.ndarray, dur: np.ndarray, deadline, p2p_s: float) -> np.ndarray:
    """[E, cols] latest finishes with every rank's last event due at ``deadline`` ([cols] or a
    scalar), as ``policy.slack.latest_finish``."""
    d = f64(dur)
    return latest_finish_pass(links[3], links[4], links[2], d, _deadlines(deadline, d.shape[1]),
                              float(p2p_s))


def unit_floats(links: np.ndarray, dur: np.ndarray, ef: np.ndarray, deadline, p2p_s: float,
                unit_events: np.ndarray) -> np.ndarray:
    """[cols, units] the smaller of every unit's forward and backward float, lf - ef, with
    every rank's last event due at ``deadline`` ([cols] or a scalar): ``latest_finish`` and
    ``policy.slack.unit_floats_from``'s gather in one call (``unit_events``: [2, units] the
    event rows of each unit's forward and backward, ``EventGraph.unit_events``)."""
    d = f64(dur)
    return unit_floats_pass(links[3], links[4], links[2], d, f64(ef),
                            _deadlines(deadline, d.shape[1]), float(p2p_s),
                            i64(unit_events[0]),
                            i64(unit_events[1]))


def warm_up() -> None:
    """Compile this room's column passes (or load them from numba's disk cache) with the
    argument types a draft passes, on a two-event graph (the row passes warm up with their
    callers', ``band`` and ``slots``)."""
    i64 = np.int64
    links = np.array([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], dtype=i64)  # e0 -> e1
    dur = np.ones((2, 2))
    earliest_finish(links, dur, 0.0)
    earliest_finish(links, dur, 0.0, np.empty((2, 2)))
    latest_finish(links, dur, np.ones(2), 0.0)
    unit_floats(links, dur, dur, np.ones(2), 0.0, np.array([[0], [1]], dtype=i64))
