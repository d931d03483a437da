"""Discrete-event simulator of Megatron's 1F1B pipeline step (interleaved too), replicated over DP.

Input: forward and backward seconds per (dp_rank, micro-batch, stage) and a point-to-point latency.
Output: the step time (max over DP ranks of each rank's pipeline makespan), busy time per
(dp rank, stage), bubble fraction and imbalance (``StepSimulation``). The event order does not
depend on the durations, so it is built once per (m, pp, vp) (``event_graph``, after
megatron/core/pipeline_parallel/schedules.py); the passes over it, vectorised over the DP axis,
are ``kernels.graph``'s. A rank runs its own events in order, one at a time; sends are
asynchronous (the p2p latency is on the edge, it does not occupy the sender). Gradient
all-reduce, optimizer and data loading are outside the model.

Pure numpy; imports nothing else of this package but ``kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from .. import kernels
from ..kernels import f64
from ..kernels.records import NO_START, Graph

FWD, BWD = 0, 1


@dataclass
class StepSimulation:
    """One simulated training step."""

    step_time_s: float        # max over DP ranks of the pipeline makespan
    rank_time_s: np.ndarray   # [dp] makespan of each DP rank's pipeline
    busy_s: np.ndarray        # [dp, pp] busy seconds per (dp rank, stage)
    bubble_fraction: float    # 1 - busy_s.sum() / (step_time_s * dp * pp)
    imbalance: float          # max / mean of rank_time_s
    # [dp, m, pp, 2] start / end seconds of every event (last axis: 0 = fwd, 1 = bwd);
    # None unless record=True.
    start_s: Optional[np.ndarray] = None
    end_s: Optional[np.ndarray] = None


def interleaved_schedule_table(num_microbatches: int, vp: int, group: int) -> list:
    """Megatron's ``get_schedule_table``: (micro-batch, model chunk) of each virtual micro-batch."""
    table = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table.extend((i, c) for c in range(vp) for i in range(lo, hi))
    return table


def stage_order(num_microbatches: int, pp: int, stage: int, vp: int = 1
                ) -> list[tuple[int, int, int]]:
    """Megatron's 1F1B event order on one rank: (kind FWD/BWD, micro-batch, model chunk).
    Warm-up forwards ``pp - stage - 1``, or with vp model chunks (the interleaved schedule,
    ``microbatch_group_size_per_vp_stage`` at its default, pp) ``(pp - stage - 1) * 2 + (vp -
    1) * pp``; then steady 1F1B; backward k runs chunk ``vp - 1 - chunk(k)`` of micro-batch
    ``mb(k)``."""
    table = interleaved_schedule_table(num_microbatches, vp, pp)     # vp 1: in order
    total = num_microbatches * vp
    warmup = min(pp - stage - 1 if vp == 1 else (pp - stage - 1) * 2 + (vp - 1) * pp, total)
    fwd = [(FWD, i, c) for i, c in table]
    bwd = [(BWD, i, vp - 1 - c) for i, c in table]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order.append(fwd[warmup + k])
        order.append(bwd[k])
    order.extend(bwd[total - warmup:])
    return order


def interleaved_refusal(m: int, pp: int) -> Optional[str]:
    """Why Megatron's interleaved schedule refuses ``m`` micro-batches at ``pp`` stages (groups
    of pp micro-batches per virtual stage, its default), or None when it runs them
    (``forward_backward_pipelining_with_interleaving``'s checks: pp <= m, and the last group
    empty or at least pp micro-batches)."""
    if m < pp:
        return (f"{m} micro-batches: the interleaved schedule needs pp={pp} <= "
                f"microbatch_group_size_per_vp_stage={pp} <= micro-batches")
    rest = m % pp
    if rest:
        return (f"{m} micro-batches: the interleaved schedule's last group of {rest} is "
                f"smaller than pp={pp} (Megatron refuses it: dependency bubbles)")
    return None


def _check_times(fwd_s, bwd_s, p2p_s):
    f = np.asarray(fwd_s, dtype=np.float64)
    b = np.asarray(bwd_s, dtype=np.float64)
    if f.ndim != 3:
        raise ValueError(f"fwd_s must be [dp, m, pp], got shape {f.shape}")
    if b.shape != f.shape:
        raise ValueError(f"bwd_s shape {b.shape} must equal fwd_s shape {f.shape} ([dp, m, pp])")
    if min(f.shape) < 1:
        raise ValueError(f"fwd_s shape {f.shape}: every axis of [dp, m, pp] must be >= 1")
    for name, a in (("fwd_s", f), ("bwd_s", b)):
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            bad = a[~(np.isfinite(a) & (a >= 0))].ravel()[0]
            raise ValueError(f"{name} must be finite and >= 0 seconds, got {bad!r}")
    p = float(p2p_s)
    if not np.isfinite(p) or p < 0:
        raise ValueError(f"p2p_s={p2p_s!r}: expected a finite number of seconds >= 0")
    return f, b, p


@dataclass(frozen=True)
class EventGraph:
    """The events of one step in ``event_graph``'s topological order: event e runs on
    ``ranks[e]`` and is row ``unit_rows[e]`` of the [2 * m * nv] (kind, micro-batch, virtual
    stage) units' table (``unit_events`` the inverse); ``links`` [5, E] per event the one
    before it on its rank, the one it waits for (its data), whether that wait crosses ranks
    (p2p latency on the edge), and the reverse edges (-1 where none); ``last[r]`` rank r's last
    event. Built once per (m, pp, vp); the passes over it are ``kernels.graph``'s, its floats
    (how much an event may grow before the step does, with every rank's last event due at a
    common deadline) among them."""

    ranks: np.ndarray
    last: np.ndarray
    unit_rows: np.ndarray           # [E] row of each event in a [2 * m * nv] (kind, mb, v) table
    unit_events: np.ndarray         # [2, m * nv] event of each (kind, unit): unit_rows' inverse
    links: np.ndarray               # [5, E] int64 prev, dep, cross, nxt, succ

    def record(self, p2p_s: float = 0.0) -> Graph:
        """The ``kernels.records.Graph`` of this graph with p2p latency ``p2p_s``."""
        rec = self.__dict__.get("_record")
        if rec is None:
            rec = Graph.of(self.links, self.last, self.unit_events)
            object.__setattr__(self, "_record", rec)
        return rec._replace(p2p=float(p2p_s))

    def durations(self, f: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[E, cols] duration of every event from fwd/bwd seconds [cols, m, nv]."""
        cols, m, nv = f.shape
        both = np.empty((2, m, nv, cols))          # one transposing copy, then whole rows
        both[FWD] = f.transpose(1, 2, 0)
        both[1 - FWD] = b.transpose(1, 2, 0)
        return both.reshape(2 * m * nv, cols).take(self.unit_rows, axis=0)

    def earliest_finish(self, dur: np.ndarray, p2p_s: float,
                        start: Optional[np.ndarray] = None) -> np.ndarray:
        """[E, cols] earliest finish of every event (durations ``dur`` [E, cols]): an event
        starts when its rank's previous event and its dependency (+ p2p when it crosses ranks)
        have finished; ``start`` ([E, cols] float64, C order, optional) receives every
        event's start."""
        d = f64(dur)
        end = np.empty(d.shape)
        kernels.graph.earliest_finish(self.record(p2p_s), d, np.arange(d.shape[1]), end,
                                      NO_START if start is None else start)
        return end

    def makespan(self, end: np.ndarray) -> np.ndarray:
        """[cols] makespan: the latest of the ranks' last events."""
        return end[self.last].max(axis=0)


@lru_cache(maxsize=256)
def event_graph(m: int, pp: int, vp: int = 1) -> EventGraph:
    """The ``EventGraph`` of m micro-batches on pp ranks with vp model chunks each: the ranks'
    ``stage_order``s merged into one topological order of all 2 x m x pp x vp events (an event
    waits for its data: the forward of the virtual stage ``v = chunk * pp + rank`` before it,
    the backward of the one after it, the last stage's backward its own forward)."""
    nv = pp * vp
    why = interleaved_refusal(m, pp) if vp > 1 else None
    if why:
        raise ValueError(why)
    orders = [stage_order(m, pp, s, vp) for s in range(pp)]
    pos = [0] * pp
    eid = np.full((2, m, nv), -1, dtype=np.int64)      # event of each (kind, mb, v) placed
    out = []
    total = 2 * m * nv
    while len(out) < total:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, i, c = orders[r][pos[r]]
                v = c * pp + r
                if kind == FWD:
                    dk, dv = FWD, (v - 1 if v > 0 else -1)
                elif v < nv - 1:
                    dk, dv = BWD, v + 1
                else:
                    dk, dv = FWD, v
                dep = eid[dk, i, dv] if dv >= 0 else -1
                if dv >= 0 and dep < 0:
                    break
                eid[kind, i, v] = len(out)
                out.append((r, kind, i, v, dep, int(dv >= 0 and dv % pp != r)))
                pos[r] += 1
                progressed = True
        if not progressed:  # cannot happen for Megatron's schedules; guards a future one
            raise RuntimeError(f"1F1B order deadlocks for m={m}, pp={pp}, vp={vp}")
    ranks, kinds, mbs, vs, dep, crosses = np.asarray(out, dtype=np.int64).T.copy()
    n = len(ranks)
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    last = np.full(pp, -1, dtype=np.int64)
    for e in range(n):
        r = int(ranks[e])
        if last[r] >= 0:
            prev[e], nxt[last[r]] = last[r], e
        last[r] = e
    succ = np.full(n, -1, dtype=np.int64)
    has = dep >= 0
    succ[dep[has]] = np.flatnonzero(has)
    unit_rows = (kinds * m + mbs) * nv + vs
    unit_events = np.empty(n, dtype=np.int64)
    unit_events[unit_rows] = np.arange(n)
    return EventGraph(ranks, last, unit_rows, unit_events.reshape(2, -1),
                      np.stack([prev, dep, crosses, nxt, succ]))


def pipeline_ranks(pp, nv: int, name: str = "pp") -> int:
    """The pipeline ranks of ``nv`` (virtual) stages: nv where ``pp`` is None (1F1B), else
    ``pp``, nv or an integer >= 2 dividing it (interleaved); else a ValueError naming ``name``."""
    if pp is None:
        return nv
    if isinstance(pp, bool) or not isinstance(pp, (int, np.integer)) or pp < 1 or nv % pp \
            or (pp < nv and pp < 2):
        raise ValueError(f"{name}={pp!r}: expected an integer >= 2 dividing the {nv} (virtual) "
                         f"stages, or None")
    return int(pp)


def _run(fwd_s, bwd_s, p2p_s, pp, record: bool) -> tuple:
    """(fwd, bwd [dp, m, stages] checked, the physical ranks, every DP rank's makespan [dp],
    and where ``record`` every event's start and end [dp, m, stages, kind]). The stage axis
    holds one stage per rank (1F1B), or with ``pp`` smaller than it the virtual stages of the
    interleaved schedule (``pipeline_ranks``; the micro-batch counts Megatron refuses are
    refused with the events, ``interleaved_refusal``)."""
    f, b, p = _check_times(fwd_s, bwd_s, p2p_s)
    dp, m, nv = f.shape
    ranks = pipeline_ranks(pp, nv)
    g = event_graph(m, ranks, nv // ranks)
    dur = g.durations(f, b)                                        # [E, dp]
    start = np.empty_like(dur) if record else None
    end = g.earliest_finish(dur, p, start)
    if not record:
        return f, b, ranks, g.makespan(end), None, None
    out = np.zeros((2, dp, 2 * m * nv))          # start, end of each [dp, kind, m, nv]
    out[:, :, g.unit_rows] = np.stack([start, end]).transpose(0, 2, 1)
    out = np.moveaxis(out.reshape(2, dp, 2, m, nv), 2, -1)          # [2, dp, m, nv, kind]
    return f, b, ranks, g.makespan(end), out[0], out[1]


def pipeline_makespan_s(fwd_s, bwd_s, p2p_s: float = 0.0, pp: Optional[int] = None
                        ) -> np.ndarray:
    """[dp] makespan of each DP rank's pipeline (``_run``'s stages); the fast path used by the
    policies."""
    return _run(fwd_s, bwd_s, p2p_s, pp, False)[3]


def simulate_1f1b(fwd_s, bwd_s, p2p_s: float = 0.0, *, pp: Optional[int] = None,
                  record: bool = False) -> StepSimulation:
    """Simulate one step; fwd_s, bwd_s: [dp, m, stages] seconds per (dp_rank, micro-batch,
    stage). With ``pp``, Megatron's interleaved 1F1B (virtual pipeline,
    ``microbatch_group_size_per_vp_stage`` = pp): the stages are the virtual stages ``v = chunk
    * pp + rank``, busy_s is per (dp rank, physical rank)."""
    f, b, ranks, rank_time, start, end = _run(fwd_s, bwd_s, p2p_s, pp, record)
    dp, _, nv = f.shape
    busy = (f + b).sum(axis=1).reshape(dp, nv // ranks, ranks).sum(axis=1)   # [dp, ranks]
    step = float(rank_time.max())
    mean = float(rank_time.mean())
    return StepSimulation(step, rank_time, busy,
                          1.0 - float(busy.sum()) / (step * dp * ranks) if step > 0 else 0.0,
                          step / mean if mean > 0 else 1.0, start, end)
