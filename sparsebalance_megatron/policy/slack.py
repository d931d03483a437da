"""Float (slack) of every event of a 1F1B step: how much an event may grow before the step does.

DST raises densities where that costs no step time. A stage's busy time is a coarse guide (a
stage cheaper than the bottleneck has room), but some of its events sit on the critical path
anyway: in 1F1B the first stage's first forward and last backward open and close the pipeline,
so growing them grows the step whatever the other stages do. The float of an event is
``latest finish - earliest finish`` in the event graph, with every rank's latest finish of its
last event set to a common deadline (the bottleneck step time). A unit (one micro-batch on one
stage) may grow by at most the smaller float of its forward and backward without touching the
deadline (its forward precedes its backward, so both lie on one path).

Same event graph as ``sim/pipeline.py`` (Megatron's non-interleaved 1F1B), vectorised over DP.
Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..sim.pipeline import BWD, FWD, stage_order_1f1b


@lru_cache(maxsize=64)
def _events(m: int, pp: int):
    """Topological order of (stage, kind, microbatch, predecessor-on-stage index) plus, for the
    backward pass, each event's successors: (same-stage next event, cross-stage successor)."""
    orders = [stage_order_1f1b(m, pp, s) for s in range(pp)]
    pos, out, done = [0] * pp, [], set()
    while len(out) < 2 * m * pp:
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = (s - 1 if s > 0 else None) if kind == FWD else (s + 1 if s < pp - 1 else None)
                if dep is not None and (kind, i, dep) not in done:
                    break
                done.add((kind, i, s))
                nxt = orders[s][pos[s] + 1] if pos[s] + 1 < len(orders[s]) else None
                cross = None
                if kind == FWD and s < pp - 1:
                    cross = (FWD, i, s + 1)
                elif kind == BWD and s > 0:
                    cross = (BWD, i, s - 1)
                out.append((s, kind, i, dep, nxt, cross))
                pos[s] += 1
    return tuple(out)


def event_float_s(fwd_s: np.ndarray, bwd_s: np.ndarray, deadline_s: np.ndarray,
                  p2p_s: float = 0.0):
    """Float of every forward and backward event: two arrays [dp, m, pp] of seconds (>= 0 when
    the rank meets ``deadline_s`` [dp]).

    fwd_s, bwd_s: [dp, m, pp] seconds, already validated by the caller.
    """
    dp, m, pp = fwd_s.shape
    ev = _events(m, pp)
    dur = np.stack([np.moveaxis(fwd_s, 0, -1), np.moveaxis(bwd_s, 0, -1)])  # [2, m, pp, dp]
    ef = np.zeros((2, m, pp, dp))
    free = np.zeros((pp, dp))
    for s, k, i, dep, _, _ in ev:                    # earliest finish (forward pass)
        t0 = free[s]
        if dep is not None:
            t0 = np.maximum(t0, ef[k, i, dep] + p2p_s)
        ef[k, i, s] = free[s] = t0 + dur[k, i, s]
    lf = np.empty((2, m, pp, dp))
    deadline = np.asarray(deadline_s, dtype=np.float64)
    for s, k, i, _, nxt, cross in reversed(ev):      # latest finish (backward pass)
        t = deadline
        if nxt is not None:
            t = np.minimum(t, lf[nxt[0], nxt[1], s] - dur[nxt[0], nxt[1], s])
        if cross is not None:
            ck, ci, cs = cross
            t = np.minimum(t, lf[ck, ci, cs] - dur[ck, ci, cs] - p2p_s)
        lf[k, i, s] = t
    fl = np.moveaxis(lf - ef, -1, 1)                 # [2, dp, m, pp]
    return fl[FWD], fl[BWD]
