"""Where SAB's packed micro-batches run: the order of every DP rank's micro-batches (its pipeline
slots) and whole micro-batches swapped between ranks, chosen on the simulated pipeline.

A rank's micro-batches of one step go through the pipeline in slot order, and the order changes
the step: under 1F1B a heavy micro-batch in the warm-up delays every later stage's first forward,
while in the middle of the steady state the other stages' work overlaps it; the interleaved
schedule runs micro-batches in groups of ``pp`` through each model chunk and prefers the heavy
ones in its first group. No fixed rule is right for both schedules and every layout, so the slots
are chosen by predicted makespan (``sim.pipeline``, the simulator DST and the stand-down rule
use):

1. every rank's makespan under a few seed orders (as packed; heaviest in the middle; heaviest
   first), the best kept;
2. rounds of local search on the critical rank (the one that sets the step time): one of its
   heaviest micro-batches moved to another slot, two neighbouring slots swapped, or one of its
   micro-batches swapped with a lighter one of the least loaded ranks (any micro-batch fits any
   slot: each holds at most ``--seq-length`` tokens); the move that lowers the larger makespan
   of the ranks it touches the most is taken, until none lowers the critical rank's by
   ``MIN_GAIN`` (or ``ROUNDS`` rounds).

Micro-batches move whole: what each holds (SAB's sensitivity groups) does not change, every
segment stays in exactly one micro-batch, and the result is a pure function of the costs (ties to
the lowest index): every rank computes the same. The micro-batches' costs are the latency
model's, per stage, of each packed micro-batch with its padding (``packing.LatencyCost``).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np

from .. import kernels
from ..sim.pipeline import event_graph, pipeline_makespan_s

ROUNDS = 8
"""Local-search rounds on the critical rank (each: one batched simulation), at most."""
HEAVY_MOVES = 2
"""The critical rank's heaviest micro-batches each tried in every other slot per round."""
PARTNERS = 2
"""Least loaded ranks the critical rank may swap a micro-batch with per round."""
MIN_GAIN = 1e-3
"""A round's move is taken only if it shortens the critical rank by this fraction."""


def _seed_orders(c: np.ndarray) -> np.ndarray:
    """[dp, k, m] candidate slot orders from micro-batch costs c [dp, m]: as packed, heaviest
    in the middle (lightest at the ends), heaviest first."""
    dp, m = c.shape
    asc = np.argsort(c, axis=1, kind="stable")
    k = np.arange(m)
    pos = np.where(k % 2 == 0, k // 2, m - 1 - k // 2)      # k-th lightest -> its slot
    hill = np.empty_like(asc)
    hill[:, pos] = asc
    ident = np.broadcast_to(np.arange(m), (dp, m))
    return np.stack([ident, hill, asc[:, ::-1]], axis=1)


def arrange_slots(fwd_s, bwd_s, p2p_s: float = 0.0, pp: Optional[int] = None, *,
                  scale: Optional[np.ndarray] = None, rounds: int = ROUNDS
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(slots [dp, m], makespan_s [dp]): the index into the dp * m micro-batches (rank-major, as
    given) of the one that runs in each (rank, slot), by the module docstring's search, and
    every rank's predicted makespan with them. fwd_s, bwd_s: [dp, m, stages] seconds as
    packed; pp: pipeline ranks when the stages are the interleaved schedule's virtual stages;
    scale: [dp, stages] factor of each rank's times (the calibration's; a micro-batch moved to
    another rank takes that rank's factor)."""
    f = np.asarray(fwd_s, dtype=np.float64)
    b = np.asarray(bwd_s, dtype=np.float64)
    dp, m, nv = f.shape
    fu, bu = f.reshape(dp * m, nv), b.reshape(dp * m, nv)
    sc = np.ones((dp, nv)) if scale is None else np.asarray(scale, dtype=np.float64)
    cost = (fu + bu).sum(axis=1)                              # [dp * m] a micro-batch's weight

    def makespans(rows: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        s = sc[ranks][:, None, :]
        return pipeline_makespan_s(fu[rows] * s, bu[rows] * s, p2p_s, pp=pp)

    own = np.arange(dp * m).reshape(dp, m)
    seeds = np.take_along_axis(own[:, None, :], _seed_orders(cost[own]), axis=2)  # [dp, k, m]
    k = seeds.shape[1]
    t = makespans(seeds.reshape(dp * k, m), np.repeat(np.arange(dp), k)).reshape(dp, k)
    pick = t.argmin(axis=1)
    slots = seeds[np.arange(dp), pick].copy()                 # [dp, m]
    span = t[np.arange(dp), pick]
    if m < 2 and dp < 2:
        return slots, span
    ranks = nv if pp is None else pp
    kernels.slots.search(event_graph(m, ranks, nv // ranks).record(p2p_s), fu, bu, sc, cost,
                         slots, span, _moves(m), (rounds, HEAVY_MOVES, PARTNERS, MIN_GAIN))
    return slots, span


@lru_cache(maxsize=64)
def _moves(m: int) -> tuple[np.ndarray, np.ndarray]:
    """(insert [m, m - 1, m], neighbour [m - 1, m]) slot permutations of m slots: insert[i, k]
    moves slot i to the k-th other position; neighbour[i] swaps slots i and i + 1."""
    ins = np.empty((m, max(m - 1, 0), m), dtype=np.int64)
    for i in range(m):
        rest = [x for x in range(m) if x != i]
        for k, j in enumerate(x for x in range(m) if x != i):
            ins[i, k] = rest[:j] + [i] + rest[j:]
    nb = np.tile(np.arange(m), (max(m - 1, 0), 1))
    for i in range(m - 1):
        nb[i, i], nb[i, i + 1] = i + 1, i
    return ins, nb
