"""An event graph's two passes, compiled: the 1F1B simulator's earliest finishes and the float
pass's latest finishes, each one loop whatever the caller's layout (every column of a step, a
few columns of the descent's search, one column per band-pass row or slot candidate), and
``simulate``: plans' units laid into their events, then their finishes. NaN propagates as
``np.maximum`` / ``np.minimum`` propagate it.

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .records import NO_START, SAMPLE_GRAPH, SAMPLE_TABLES


@jit
def earliest_finish(graph, dur, cols, end, start):
    """Columns ``cols`` of durations ``dur`` [E, *] simulated into ``end`` [E, *], events in
    order, each over all the columns: an event starts at max(its dependency's finish + p2p,
    the previous event's finish), 0 where it waits for none; every event's start also into
    ``start`` where it has rows (``records.NO_START``: not kept)."""
    prev, dep, cross, p = graph.prev, graph.dep, graph.cross, graph.p2p
    record = start.shape[0] > 0
    for e in range(dur.shape[0]):
        d, pr = dep[e], prev[e]
        add = cross[e] != 0 and p != 0.0
        for j in cols:
            v = 0.0
            if d >= 0:
                v = end[d, j] + p if add else end[d, j]
                if pr >= 0 and (end[pr, j] > v or end[pr, j] != end[pr, j]):
                    v = end[pr, j]
            elif pr >= 0:
                v = end[pr, j]
            if record:
                start[e, j] = v
            end[e, j] = v + dur[e, j]


@jit
def makespan(last, end, j):
    """Column j's makespan: the latest of the ranks' last events ``last`` (NaN wins)."""
    x = end[last[0], j]
    for i in range(1, last.size):
        y = end[last[i], j]
        if y > x or y != y:
            x = y
    return x


@jit
def latest_finish(graph, dur, deadline, lf):
    """[E, cols] latest finishes into ``lf``, every rank's last event of column c due at
    ``deadline[c]``: events in reverse, each due by min(deadline, the next event's latest
    start, its successor's latest start - p2p)."""
    nxt, succ, cross, p = graph.nxt, graph.succ, graph.cross, graph.p2p
    n, cols = dur.shape
    start = np.empty((n, cols))                      # latest starts, lf - dur
    for e in range(n - 1, -1, -1):
        j, k = nxt[e], succ[e]
        sub = k >= 0 and cross[k] != 0 and p != 0.0
        for c in range(cols):
            v = deadline[c]
            if j >= 0 and (start[j, c] < v or start[j, c] != start[j, c]):
                v = start[j, c]
            if k >= 0:
                x = start[k, c] - p if sub else start[k, c]
                if x < v or x != x:
                    v = x
            lf[e, c] = v
            start[e, c] = v - dur[e, c]


@jit
def unit_floats(graph, dur, ef, deadline, out):
    """``out`` [cols, units]: every unit's smaller float, min(lf - ef) of its forward and
    backward events (NaN wins), the deadlines ``deadline`` [cols] (``latest_finish``)."""
    lf = np.empty(dur.shape)
    latest_finish(graph, dur, deadline, lf)
    ev_f, ev_b = graph.ev_f, graph.ev_b
    for u in range(ev_f.size):
        a, b = ev_f[u], ev_b[u]
        for c in range(dur.shape[1]):
            x = lf[a, c] - ef[a, c]
            y = lf[b, c] - ef[b, c]
            out[c, u] = x if (x < y or x != x) else y


@jit
def simulate(graph, tables, units, idx, rows, mk, dur, ef):
    """Plans simulated into columns i of ``dur`` and ``ef`` [E, rows] and their makespans
    into ``mk``: column i's units, ``units[rows[i] mod dp]`` (table offsets [dp, slots, pp]:
    unit s x pp + q), at grid indices ``idx[i]``, their seconds read from the flat ``tables``."""
    dp, slots, pp = units.shape
    for i in range(rows.size):
        u = units[rows[i] % dp]
        for s in range(slots):
            for q in range(pp):
                f = u[s, q] + idx[i, s, q]
                dur[graph.ev_f[s * pp + q], i] = tables.fwd[f]
                dur[graph.ev_b[s * pp + q], i] = tables.bwd[f]
    earliest_finish(graph, dur, np.arange(rows.size), ef, np.empty((0, 0)))
    for i in range(rows.size):
        mk[i] = makespan(graph.last, ef, i)


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    graph, dur = SAMPLE_GRAPH, np.ones((2, 2))
    end, cols = np.empty((2, 2)), np.arange(2)
    earliest_finish(graph, dur, cols, end, NO_START)
    earliest_finish(graph, dur, cols, end, np.empty((2, 2)))
    makespan(graph.last, end, 0)
    unit_floats(graph, dur, end, np.ones(2), np.empty((2, 1)))
    simulate(graph, SAMPLE_TABLES, np.zeros((1, 1, 1), dtype=np.int64),
             np.zeros((1, 1, 1), dtype=np.int64), np.arange(1), np.empty(1), dur, end)
