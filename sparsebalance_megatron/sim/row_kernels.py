"""Compiled 1F1B simulation of one DP-rank row at a time (numba; ``sim.compiled``'s loader),
for the planner's kernels that plan row by row (``policy.band_kernels``): a row's makespan, its
event durations, earliest finishes and stages' busy seconds, and its units' floats. Each does
``sim.compiled``'s per-column operations on one column, in the same order (``EventGraph``'s
layouts: durations as ``EventGraph.durations`` lays out a [2, m * nv] table, the makespan as
np.max over the ranks' last events, NaN winning), so the numbers are the column passes'.

Pure numpy and numba; must not import torch, megatron or anything else from this package but
``sim``.
"""

from __future__ import annotations

import numpy as np

from .compiled import _start
from .pipeline import FWD

assert FWD == 0, "the row simulation below puts forward seconds first"


def _row_makespan(fwd, bwd, u, idx, unit_rows, prev, dep, cross, last, p, both, end):
    # one row's 1F1B makespan (units ``u`` at grid indices ``idx``, [slots, pp]): its units'
    # forward and backward seconds ([2, m * nv] in ``both``, as ``EventGraph.durations`` lays
    # them out), every event's earliest finish (``sim.compiled._earliest_finish`` on one
    # column), the latest of the ranks' last events (np.max: NaN wins)
    slots, pp = u.shape
    n = slots * pp
    for s in range(slots):
        for q in range(pp):
            j = s * pp + q
            f = u[s, q] + idx[s, q]
            both[j] = fwd[f]
            both[n + j] = bwd[f]
    return _events_makespan(both, unit_rows, prev, dep, cross, last, p, end)


def _events_makespan(both, unit_rows, prev, dep, cross, last, p, end):
    # _row_makespan's events: every event's earliest finish from the row's seconds ``both``
    # ([2, m * nv] as EventGraph.durations lays them out) and the latest of the ranks' last
    # events (np.max: NaN wins)
    add_p = p != 0.0
    for e in range(unit_rows.size):
        d, pr = dep[e], prev[e]
        v = _start(end[d] if d >= 0 else 0.0, end[pr] if pr >= 0 else 0.0, d, pr,
                   cross[e] != 0 and add_p, p)
        end[e] = v + both[unit_rows[e]]
    mk = end[last[0]]
    for i in range(1, last.size):
        x = end[last[i]]
        if x > mk or x != x:
            mk = x
    return mk


def _simulate_rows(fwd, bwd, units, idx, rows, unit_rows, prev, dep, cross, last, p, mk,
                   record, dur, ef, busy):
    # every row's makespan at idx[i] (units[rows[i]]); with ``record`` also its event
    # durations and earliest finishes (rows of [rows, E]) and its stages' busy seconds
    # (forward + backward summed over the slots in order)
    slots, pp = units.shape[1], units.shape[2]
    both = np.empty(2 * slots * pp)
    end = np.empty(unit_rows.size)
    for i in range(rows.size):
        mk[i] = _row_makespan(fwd, bwd, units[rows[i]], idx[i], unit_rows, prev, dep, cross,
                              last, p, both, end)
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


def _floats_rows(nxt, succ, cross, dur, ef, deadline, p, ev_f, ev_b, cap):
    # sim.compiled._unit_floats per row (rows of [rows, E] durations and earliest finishes,
    # every rank's last event due at deadline[row]): every unit's smaller float, then
    # np.maximum(float, 0) (NaN stays), into cap [rows, units]
    n_ev = dur.shape[1]
    ls = np.empty(n_ev)
    lf = np.empty(n_ev)
    for r in range(dur.shape[0]):
        for e in range(n_ev - 1, -1, -1):
            j, k = nxt[e], succ[e]
            v = deadline[r]
            if j >= 0:
                x = ls[j]
                if x < v or x != x:
                    v = x
            if k >= 0:
                x = ls[k] - p if cross[k] != 0 and p != 0.0 else ls[k]
                if x < v or x != x:
                    v = x
            lf[e] = v
            ls[e] = v - dur[r, e]
        for u in range(ev_f.size):
            a, b = ev_f[u], ev_b[u]
            x = lf[a] - ef[r, a]
            y = lf[b] - ef[r, b]
            m = x if (x < y or x != x) else y
            cap[r, u] = m if (m >= 0.0 or m != m) else 0.0
