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

from functools import lru_cache

import numpy as np

from ..sim.pipeline import FWD, _global_order


@lru_cache(maxsize=64)
def _events(m: int, pp: int, vp: int = 1):
    """The step's event graph in topological order (the simulator's): per event its rank,
    kind, micro-batch, virtual stage, the event it waits for and whether that wait crosses ranks,
    the next event on its rank and the event that waits for it (each -1 when none)."""
    ranks, kinds, mbs, vs, dks, dvs, crosses = _global_order(m, pp, vp)
    n = len(ranks)
    eid = np.empty((2, m, pp * vp), dtype=np.int64)
    eid[kinds, mbs, vs] = np.arange(n)
    dep = np.where(dvs >= 0, eid[dks, mbs, np.maximum(dvs, 0)], -1)
    nxt = np.full(n, -1, dtype=np.int64)
    last = {}
    for e in range(n - 1, -1, -1):
        r = int(ranks[e])
        nxt[e] = last.get(r, -1)
        last[r] = e
    succ = np.full(n, -1, dtype=np.int64)
    has = dep >= 0
    succ[dep[has]] = np.flatnonzero(has)
    return (ranks.tolist(), kinds, mbs, vs, dep.tolist(), crosses.astype(bool).tolist(),
            nxt.tolist(), succ.tolist())


def event_float_s(fwd_s: np.ndarray, bwd_s: np.ndarray, deadline_s: np.ndarray,
                  p2p_s: float = 0.0, pp=None):
    """Float of every forward and backward event: two arrays [dp, m, stages] of seconds (>= 0
    when the rank meets ``deadline_s`` [dp]).

    fwd_s, bwd_s: [dp, m, stages] seconds, already validated by the caller; with ``pp`` smaller
    than the stage axis, the virtual stages of the interleaved schedule.
    """
    dp, m, nv = fwd_s.shape
    pp = nv if pp is None else int(pp)
    ranks, kinds, mbs, vs, dep, cross, nxt, succ = _events(m, pp, nv // pp)
    dur = np.where((kinds == FWD)[:, None], fwd_s[:, mbs, vs].T, bwd_s[:, mbs, vs].T)  # [E, dp]
    n = len(ranks)
    ef = np.empty((n, dp))
    free = np.zeros((pp, dp))
    for e in range(n):                               # earliest finish (forward pass)
        r, d = ranks[e], dep[e]
        t0 = free[r]
        if d >= 0:
            t0 = np.maximum(t0, ef[d] + (p2p_s if cross[e] else 0.0))
        ef[e] = free[r] = t0 + dur[e]
    lf = np.empty((n, dp))
    deadline = np.asarray(deadline_s, dtype=np.float64)
    for e in range(n - 1, -1, -1):                   # latest finish (backward pass)
        t = deadline
        j = nxt[e]
        if j >= 0:
            t = np.minimum(t, lf[j] - dur[j])
        j = succ[e]
        if j >= 0:
            t = np.minimum(t, lf[j] - dur[j] - (p2p_s if cross[j] else 0.0))
        lf[e] = t
    fl = lf - ef                                     # [E, dp]
    out = np.empty((2, dp, m, nv))
    out[kinds, :, mbs, vs] = fl
    return out[FWD], out[1 - FWD]
