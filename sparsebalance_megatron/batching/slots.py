"""Where SAB's packed micro-batches run: the order of every DP rank's micro-batches (its pipeline
slots) and whole micro-batches swapped between ranks, chosen on the simulated pipeline.

The order changes the step: under 1F1B a heavy micro-batch in the warm-up delays every later
stage's first forward, while in the steady state the other stages' work overlaps it; the
interleaved schedule prefers the heavy ones in its first group of ``pp``. No fixed rule is right
for both schedules and every layout, so the slots are chosen by predicted makespan
(``sim.pipeline``): every rank's best seed order (``seed_slots``), then rounds of local search on
the critical rank (``search``; any micro-batch fits any slot: each holds at most
``--seq-length`` tokens), which reads only the ranks it can touch (``candidates``), so a rank
that packs its own micro-batches needs no other's but theirs (``batching.assignment``).

Micro-batches move whole: what each holds (SAB's sensitivity groups) does not change, every
segment stays in exactly one micro-batch, and the result is a pure function of the costs (ties to
the lowest index): every rank computes the same. The costs are the latency model's, per stage,
of each packed micro-batch with its padding (``packing.LatencyCost``).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .. import kernels
from ..kernels import f64
from ..sim.pipeline import event_graph, pipeline_makespan_s, pipeline_ranks

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
    another rank takes that rank's factor). The seed orders are every rank's own
    (``seed_slots``); the search reads only the ``candidates``' micro-batches."""
    f = np.asarray(fwd_s, dtype=np.float64)
    b = np.asarray(bwd_s, dtype=np.float64)
    dp, m, nv = f.shape
    sc = np.ones((dp, nv)) if scale is None else np.asarray(scale, dtype=np.float64)
    slots, span = seed_slots(f, b, p2p_s, pp, sc)
    slots += np.arange(dp)[:, None] * m
    c = candidates(span, rounds)
    slots[c], span[c] = search(c, f[c], b[c], slots[c] % m, span[c], sc[c], p2p_s, pp, rounds)
    return slots, span


def seed_slots(f: np.ndarray, b: np.ndarray, p2p_s: float, pp: Optional[int],
               sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slots [k, m], makespan_s [k]) of k ranks alone: each rank's own micro-batches (f, b
    [k, m, stages] seconds, sc [k, stages] its scale) in the best of the seed orders (indices
    0..m-1 into its own)."""
    k, m, nv = f.shape
    fu, bu = f.reshape(k * m, nv), b.reshape(k * m, nv)
    own = np.arange(k * m).reshape(k, m)
    seeds = np.take_along_axis(own[:, None, :], _seed_orders((fu + bu).sum(axis=1)[own]),
                               axis=2)                                    # [k, orders, m]
    n = seeds.shape[1]
    s = sc[np.repeat(np.arange(k), n)][:, None, :]
    rows = seeds.reshape(k * n, m)
    t = pipeline_makespan_s(fu[rows] * s, bu[rows] * s, p2p_s, pp=pp).reshape(k, n)
    pick = t.argmin(axis=1)
    return seeds[np.arange(k), pick] - own[:, :1], t[np.arange(k), pick]


def candidate_count(rounds: int = ROUNDS) -> int:
    """How many of the largest makespans, and of the smallest, ``candidates`` keeps."""
    return 2 * rounds + PARTNERS + 1


def candidates(span: np.ndarray, rounds: int = ROUNDS) -> np.ndarray:
    """The ranks (ascending) the search can touch in ``rounds`` rounds: the ``2 rounds +
    PARTNERS + 1`` largest makespans and as many smallest (ties to the lower rank). A round
    changes at most two ranks (the critical one and a partner); a rank outside these is never
    the first largest nor among the first ``PARTNERS`` smallest while it keeps its makespan,
    as as many ranks before it in that order keep theirs. So the search over them alone makes
    the same moves as over every rank, and a rank needs only their micro-batches."""
    k = candidate_count(rounds)
    return np.arange(span.size) if span.size <= 2 * k else extremes(span, np.arange(span.size), k)


def extremes(span: np.ndarray, ranks: np.ndarray, k: int) -> np.ndarray:
    """The ranks (ascending) of the k smallest and the k largest makespans ``span`` of
    ``ranks`` (ties to the lower rank)."""
    return np.union1d(ranks[np.lexsort((ranks, span))][:k], ranks[np.lexsort((ranks, -span))][:k])


def search(ranks: np.ndarray, f: np.ndarray, b: np.ndarray, slots: np.ndarray,
           span: np.ndarray, sc: np.ndarray, p2p_s: float, pp: Optional[int],
           rounds: int = ROUNDS) -> tuple[np.ndarray, np.ndarray]:
    """The local search among ``ranks`` (``candidates``, ascending; ``kernels.slots``' moves,
    the one that lowers the larger makespan of the ranks it touches the most taken): f, b [k,
    m, stages] their own micro-batches' seconds, slots [k, m] their seed slots (indices into
    their own), span [k], sc [k, stages]. Returns (the micro-batch of each (rank, slot) as an
    index into all dp * m, rank-major; makespans [k])."""
    k, m, nv = f.shape
    slots = slots + np.arange(k)[:, None] * m
    span = np.array(span, dtype=np.float64)
    if k > 1 or m > 1:
        fu, bu = f64(f.reshape(k * m, nv)), f64(b.reshape(k * m, nv))
        ranks_pp = pipeline_ranks(pp, nv)
        kernels.slots.rounds_pass(event_graph(m, ranks_pp, nv // ranks_pp).record(p2p_s), fu,
                                  bu, f64(sc), (fu + bu).sum(axis=1), slots, span,
                                  (int(rounds), HEAVY_MOVES, PARTNERS, MIN_GAIN))
    return np.asarray(ranks)[slots // m] * m + slots % m, span
