"""The local search of ``batching.slots.arrange_slots``, compiled: every round's candidate
rows (the critical rank's heaviest micro-batches moved, neighbouring slots swapped, swaps with
the least loaded ranks; stable orders, ties to the lower index), their makespans (a
micro-batch's per-stage seconds times its rank's scale, simulated by ``kernels.graph``) and the
move taken.

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .graph import earliest_finish, makespan
from .records import SAMPLE_GRAPH


@jit
def _put_row(graph, fu, bu, sc, row, rank, dur, i):
    # column i of durations: micro-batches ``row`` [m] (rows of fu, bu [dp * m, nv]) on rank
    # ``rank`` (their seconds x sc[rank])
    nv = fu.shape[1]
    for s in range(row.size):
        for v in range(nv):
            dur[graph.ev_f[s * nv + v], i] = fu[row[s], v] * sc[rank, v]
            dur[graph.ev_b[s * nv + v], i] = bu[row[s], v] * sc[rank, v]


@jit
def _heaviest(cost, own, k, out):
    # np.argsort(-cost[own], kind="stable")[:k]: the k heaviest slots, ties to the lower slot
    m = own.size
    taken = np.zeros(m, dtype=np.bool_)
    n = min(k, m)
    for h in range(n):
        best = -1
        for j in range(m):
            if not taken[j] and (best < 0 or cost[own[j]] > cost[own[best]]):
                best = j
        taken[best] = True
        out[h] = best
    return n


@jit
def rounds_pass(graph, fu, bu, sc, cost, slots, span, rules):
    # arrange_slots' local search on ``slots`` [dp, m] and ``span`` [dp], in place (``graph``:
    # the ``Graph`` record of a rank's m micro-batches; ``rules``: rounds, heavy moves,
    # partners, min gain)
    rounds, heavy_moves, partners, min_gain = rules
    dp, m = slots.shape
    n_max = heavy_moves * (m - 1) + (m - 1) + 2 * partners * m
    rows = np.empty((n_max, m), dtype=np.int64)
    ranks = np.empty(n_max, dtype=np.int64)
    mate = np.full(n_max, -1, dtype=np.int64)       # a swap's other row
    got = np.empty(n_max)
    heavy = np.empty(heavy_moves, dtype=np.int64)
    dur, end = np.empty((graph.prev.size, n_max)), np.empty((graph.prev.size, n_max))
    for _ in range(rounds):
        r = 0
        for i in range(1, dp):                   # np.argmax: the first largest
            if span[i] > span[r]:
                r = i
        own = slots[r]
        k = 0
        for h in range(_heaviest(cost, own, heavy_moves, heavy)):
            i = heavy[h]
            for j in range(m):                   # slot i's micro-batch to every other slot j
                if j == i:
                    continue
                for s in range(m):               # the others keep their order around it
                    t = s if s < j else s - 1
                    rows[k, s] = own[i] if s == j else own[t if t < i else t + 1]
                ranks[k], mate[k] = r, -1
                k += 1
        for j in range(m - 1):                   # neighbouring slots j, j + 1 swapped
            rows[k, :] = own
            rows[k, j], rows[k, j + 1] = own[j + 1], own[j]
            ranks[k], mate[k] = r, -1
            k += 1
        done = np.zeros(dp, dtype=np.bool_)      # partners: least loaded first, ties to the lower
        done[r] = True
        for _ in range(min(partners, dp - 1)):
            q = -1
            for i in range(dp):
                if not done[i] and (q < 0 or span[i] < span[q]):
                    q = i
            done[q] = True
            theirs = slots[q]
            light = 0
            for s in range(1, m):                # np.argmin: the first smallest
                if cost[theirs[s]] < cost[theirs[light]]:
                    light = s
            for js in range(m):
                if not cost[own[js]] > cost[theirs[light]]:
                    continue
                for s in range(m):
                    rows[k, s] = own[s]
                    rows[k + 1, s] = theirs[s]
                rows[k, js] = theirs[light]
                rows[k + 1, light] = own[js]
                ranks[k], ranks[k + 1] = r, q
                mate[k], mate[k + 1] = k + 1, k
                k += 2
        if k == 0:
            break
        for i in range(k):
            _put_row(graph, fu, bu, sc, rows[i], ranks[i], dur, i)
        earliest_finish(graph, dur, np.arange(k), end, np.empty((0, 0)))
        for i in range(k):
            got[i] = makespan(graph.last, end, i)
        best, best_v = 0, 0.0
        for i in range(k):                       # a swap is worth the larger of its makespans
            v = got[i]
            if mate[i] >= 0 and got[mate[i]] > v:
                v = got[mate[i]]
            if i == 0 or v < best_v:
                best, best_v = i, v
        if not best_v < span[r] * (1.0 - min_gain):
            break
        for i in (best, mate[best]):
            if i >= 0:
                for s in range(m):
                    slots[ranks[i], s] = rows[i, s]
                span[ranks[i]] = got[i]


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    f = np.array([[2.0], [1.0]])
    rounds_pass(SAMPLE_GRAPH, f, f.copy(), np.ones((2, 1)), f[:, 0].copy(),
                np.arange(2).reshape(2, 1), np.array([2.0, 1.0]), (1, 2, 2, 1e-3))
