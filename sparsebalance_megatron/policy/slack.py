"""Float (slack) of every event of a 1F1B step: how much an event may grow before the step does.

DST raises densities where that costs no step time. A stage's busy time is a coarse guide (a
stage cheaper than the bottleneck has room), but some of its events sit on the critical path
anyway: in 1F1B the first stage's first forward and last backward open and close the pipeline,
so growing them grows the step whatever the other stages do. The float of an event is
``latest finish - earliest finish`` in the event graph, with every rank's latest finish of its
last event set to a common deadline (the bottleneck step time). A unit (one micro-batch on one
stage) may grow by at most the smaller float of its forward and backward without touching the
deadline (its forward precedes its backward, so both lie on one path).

Same event graph as ``sim/pipeline.py`` (Megatron's 1F1B, plain or interleaved), vectorised over
DP.
Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..sim.pipeline import FWD, EventGraph, event_graph


def event_float_s(fwd_s: np.ndarray, bwd_s: np.ndarray, deadline_s: np.ndarray,
                  p2p_s: float = 0.0, pp=None):
    """Float of every forward and backward event: two arrays [dp, m, stages] of seconds (>= 0
    when the rank meets ``deadline_s`` [dp]).

    fwd_s, bwd_s: [dp, m, stages] seconds, already validated by the caller; with ``pp`` smaller
    than the stage axis, the virtual stages of the interleaved schedule.
    """
    dp, m, nv = fwd_s.shape
    g = event_graph(m, nv if pp is None else int(pp), nv // (nv if pp is None else int(pp)))
    dur = g.durations(fwd_s, bwd_s)                                # [E, dp]
    return floats_from(g, dur, g.earliest_finish(dur, p2p_s), deadline_s, p2p_s, (dp, m, nv))


def floats_from(g: EventGraph, dur: np.ndarray, ef: np.ndarray, deadline_s, p2p_s: float,
                shape) -> tuple:
    """``event_float_s`` from a simulation already run: durations ``dur`` and earliest
    finishes ``ef`` [E, cols] (``EventGraph.earliest_finish``), so a caller that simulated the
    plan pays only the backward pass. Returns the forward and backward floats [cols, m, nv]."""
    _, m, nv = shape
    return tuple(f.T.reshape(-1, m, nv)
                 for f in _unit_event_floats(g, dur, ef, deadline_s, p2p_s))


def unit_floats_from(g: EventGraph, dur: np.ndarray, ef: np.ndarray, deadline_s,
                     p2p_s: float) -> np.ndarray:
    """The smaller of every unit's forward and backward float (what a unit may grow by), as
    ``floats_from`` gives them, [m * nv, cols] (unit mb x nv + v; ``.T`` is [cols, m * nv])."""
    if kernels.enabled():                     # one compiled call, the same numbers
        return kernels.graph.unit_floats(g.links, dur, ef, deadline_s, p2p_s, g.unit_events).T
    return np.minimum(*_unit_event_floats(g, dur, ef, deadline_s, p2p_s))


def _unit_event_floats(g: EventGraph, dur, ef, deadline_s, p2p_s: float) -> tuple:
    """Forward and backward float of every unit, each [m * nv, cols], gathered from the event
    rows (``EventGraph.unit_events``)."""
    fl = latest_finish(g, dur, deadline_s, p2p_s)
    fl -= ef                                                       # [E, cols]
    ev = g.unit_events
    return fl.take(ev[FWD], axis=0), fl.take(ev[1 - FWD], axis=0)


def latest_finish(g: EventGraph, dur: np.ndarray, deadline_s, p2p_s: float) -> np.ndarray:
    """[E, cols] latest finish of every event with every rank's last event due at
    ``deadline_s`` [cols]: before the next event on its rank starts, and before the event that
    waits for it starts (less p2p when that wait crosses ranks)."""
    deadline = np.asarray(deadline_s, dtype=np.float64)
    if kernels.enabled():                     # one compiled loop, the same numbers
        return kernels.graph.latest_finish(g.links, dur, deadline, p2p_s)
    lf = np.empty_like(dur)
    ls = np.empty_like(dur)                          # latest start: lf - dur
    lfs, lss, durs = list(lf), list(ls), list(dur)   # row views made once
    nxt, succ, cross = g.nxt, g.succ, g.cross
    p = float(p2p_s)
    for e in range(g.size - 1, -1, -1):
        row = lfs[e]
        j, k = nxt[e], succ[e]
        if j >= 0:
            np.minimum(deadline, lss[j], out=row)
        else:
            row[...] = deadline
        if k >= 0:
            np.minimum(row, lss[k] - p if cross[k] and p else lss[k], out=row)
        np.subtract(row, durs[e], out=lss[e])
    return lf
