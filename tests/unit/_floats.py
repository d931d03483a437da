"""The event graph's floats as the tests read them (``kernels.graph.latest_finish`` and
``unit_floats`` on a ``sim.pipeline.EventGraph``): what an event or a unit may grow by before the
step passes a deadline. The planner reads floats inside its compiled passes only."""

from __future__ import annotations

import numpy as np

from sparsebalance_megatron import kernels
from sparsebalance_megatron.kernels import f64
from sparsebalance_megatron.sim.pipeline import event_graph


def _deadlines(deadline, cols: int) -> np.ndarray:
    return f64(np.broadcast_to(np.asarray(deadline, dtype=np.float64), (cols,)))


def latest_finish(g, dur, deadline_s, p2p_s: float) -> np.ndarray:
    """[E, cols] latest finish of every event with every rank's last event due at
    ``deadline_s`` ([cols] or one for all)."""
    d = f64(dur)
    lf = np.empty(d.shape)
    kernels.graph.latest_finish(g.record(p2p_s), d, _deadlines(deadline_s, d.shape[1]), lf)
    return lf


def unit_floats(g, dur, ef, deadline_s, p2p_s: float) -> np.ndarray:
    """[cols, m * nv] the smaller of every unit's forward and backward float of a simulation
    already run (``dur``, ``ef`` [E, cols])."""
    d = f64(dur)
    out = np.empty((d.shape[1], g.unit_events.shape[1]))
    kernels.graph.unit_floats(g.record(p2p_s), d, f64(ef), _deadlines(deadline_s, d.shape[1]),
                              out)
    return out


def event_float_s(fwd_s, bwd_s, deadline_s, p2p_s: float = 0.0, pp=None) -> tuple:
    """Float of every forward and backward event: two arrays [dp, m, stages] of seconds
    (``pp`` smaller than the stage axis: the interleaved schedule's virtual stages)."""
    f, b = np.asarray(fwd_s, dtype=np.float64), np.asarray(bwd_s, dtype=np.float64)
    dp, m, nv = f.shape
    ranks = nv if pp is None else int(pp)
    g = event_graph(m, ranks, nv // ranks)
    dur = g.durations(f, b)                                        # [E, dp]
    fl = latest_finish(g, dur, deadline_s, p2p_s) - g.earliest_finish(dur, p2p_s)
    return tuple(fl.take(ev, axis=0).T.reshape(dp, m, nv) for ev in g.unit_events)
