"""The event graph's two passes (``sim.pipeline.EventGraph.earliest_finish`` and
``policy.slack.latest_finish``) a wave at a time instead of an event at a time.

A pass over a step's events costs a few numpy calls per event whatever the number of columns,
and at the planner's sizes (a few hundred events, tens of DP ranks) those calls are most of its
time. A *wave* is a set of events none of which waits for another of the set: the events at the
same depth of the graph (the longest chain of events before them, along both the rank's own
order and the data dependencies). Every event of a wave only reads events of earlier waves, so
a wave is one gather of its events' predecessors' rows, one maximum (or minimum) and one add:
about 4 calls for the 3-4 events of a wave (one per pipeline rank) where the event loop makes
3 per event. The backward pass runs the same waves in reverse (an event's successors are all in
later waves).

The results are the event loop's, bit for bit: every event's row goes through the same floating
point operations (``max(dep + p2p, prev) + duration``; ``min(deadline, next's start,
successor's start - p2p) - duration``); a missing predecessor reads a row of zeros (finish
times are >= 0, so the maximum is the other operand) and a missing successor a row of +inf.
Rows are kept in wave order inside a pass (each wave a contiguous slice) and put back in event
order at the end, two whole-array gathers; with many columns those and the wave gathers cost
more than the per-event calls save, so only passes of at most ``WAVE_COLS`` columns go by
waves.

Pure numpy; must not import torch, megatron or anything else from this package.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

WAVE_COLS = 96
"""Passes of at most this many columns go by waves (on the planner's graphs, PP 4 with vp 1 and
2: about 0.75x the event loop's time at 64 columns, DST's float passes and one-band plans at
64 DP ranks; slower from about 128 columns, where the wave order's copies of the whole
[E, cols] arrays cost more than the calls saved)."""


class Waves(NamedTuple):
    order: np.ndarray       # [E] event of each row in wave order
    rank: np.ndarray        # [E] row of each event in wave order (order's inverse)
    # per wave: (first row, end row, events, [2 k] dep + prev rows, [k, 1] dep crosses ranks
    # or None, [2 k] next + successor rows, [k, 1] successor crosses or None); missing: row E
    steps: tuple


def build_waves(prev, dep, cross, nxt, succ) -> Waves:
    """The waves of an event graph given as per-event arrays in a topological order (-1: none;
    ``cross[e]``: e's dependency crosses ranks)."""
    prev, dep, nxt, succ = (np.asarray(a, dtype=np.int64) for a in (prev, dep, nxt, succ))
    cross = np.asarray(cross, dtype=bool)
    n = prev.size
    level = [0] * n
    for e in range(n):                                   # topological: predecessors first
        p, d = int(prev[e]), int(dep[e])
        level[e] = max(level[p] + 1 if p >= 0 else 0, level[d] + 1 if d >= 0 else 0)
    level = np.asarray(level, dtype=np.int64)
    order = np.argsort(level, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)

    def row(a):                                          # event ids -> wave rows, none -> n
        return np.where(a >= 0, rank[np.maximum(a, 0)], n)

    d_row, p_row, n_row, s_row = (row(a[order]) for a in (dep, prev, nxt, succ))
    dep_x = cross[order] & (dep[order] >= 0)
    succ_x = np.zeros(n, dtype=bool)
    has = succ >= 0
    succ_x[has] = cross[succ[has]]
    succ_x = succ_x[order]
    bounds = np.flatnonzero(np.diff(np.r_[-1, level[order], level.max() + 1 if n else 0]))
    steps = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        fx, bx = dep_x[a:b, None], succ_x[a:b, None]
        steps.append((a, b, b - a, np.r_[d_row[a:b], p_row[a:b]], fx if fx.any() else None,
                      np.r_[n_row[a:b], s_row[a:b]], bx if bx.any() else None))
    return Waves(order, rank, tuple(steps))


def earliest_finish(w: Waves, dur: np.ndarray, p2p_s: float,
                    start: Optional[np.ndarray] = None) -> np.ndarray:
    """``EventGraph.earliest_finish`` by waves: [E, cols] in event order."""
    n, cols = dur.shape
    d = dur.take(w.order, axis=0)
    end = np.empty((n + 1, cols))
    end[n] = 0.0
    st = np.empty((n, cols)) if start is not None else None
    p = float(p2p_s)
    for a, b, k, idx, x, _, _ in w.steps:
        g = end.take(idx, axis=0)                # a fresh gather beats one into a buffer
        if x is not None and p:
            np.add(g[:k], p, out=g[:k], where=x)
        row = end[a:b]
        np.maximum(g[:k], g[k:], out=row)
        if st is not None:
            st[a:b] = row
        row += d[a:b]
    if start is not None:
        start[...] = st.take(w.rank, axis=0)
    return end[:n].take(w.rank, axis=0)


def latest_finish(w: Waves, dur: np.ndarray, deadline: np.ndarray, p2p_s: float) -> np.ndarray:
    """``slack.latest_finish`` by waves: [E, cols] in event order."""
    n, cols = dur.shape
    d = dur.take(w.order, axis=0)
    lf = np.empty((n, cols))
    ls = np.empty((n + 1, cols))
    ls[n] = np.inf
    p = float(p2p_s)
    for a, b, k, _, _, idx, x in reversed(w.steps):
        g = ls.take(idx, axis=0)
        if x is not None and p:
            np.subtract(g[k:], p, out=g[k:], where=x)
        row = lf[a:b]
        np.minimum(deadline, g[:k], out=row)
        np.minimum(row, g[k:], out=row)
        np.subtract(row, d[a:b], out=ls[a:b])
    return lf.take(w.rank, axis=0)
