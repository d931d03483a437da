"""SAB's per-segment loops, compiled (``batching.assignment``): the LPT assignment of segments
to DP ranks, each rank's bins (its contiguous cut, else first-fit decreasing) handed on as one
CSR, the bins' slot order; and Megatron's sequential fill (``data.packing.sequential_bins``) and
the document stream's cut into bins (``data.packing.GlobalBatchSampler``).

Every sum of costs is CPython's ``sum()`` of floats (3.12+: Neumaier's compensated sum,
``py_sum``): a bin weighs what ``sum()`` of its items' costs weighs.

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import f64, i64, jit

__all__ = ["lpt_ranks", "py_sum", "py_sums", "rank_bins", "sequential_starts", "stream_pass"]


@jit
def py_sum(x, idx, lo, hi):
    # CPython 3.12's sum() of floats x[idx[lo:hi]] from the int 0: Neumaier's compensated sum,
    # the compensation added only where non-zero and finite
    s, c = 0.0, 0.0
    for k in range(lo, hi):
        v = x[idx[k]]
        t = s + v
        if abs(s) >= abs(v):
            c += (s - t) + v
        else:
            c += (v - t) + s
        s = t
    if c != 0.0 and abs(c) < np.inf:
        return s + c
    return s


@jit
def py_sums_pass(x, idx, offsets, out):
    # every run's py_sum: out[r] = sum of x[idx[offsets[r]:offsets[r + 1]]]
    for r in range(out.size):
        out[r] = py_sum(x, idx, offsets[r], offsets[r + 1])


@jit
def _replay(key, rank, leaf, value):
    # a winner tree (node k: the (load, rank) that wins its subtree, k's children 2k, 2k + 1):
    # ``leaf`` set to ``value``, the winners on its path to the root replayed against their
    # siblings, ties to the lower rank (as Python compares (load, rank) tuples)
    k = leaf
    wk, wr = value, rank[leaf]
    key[k] = wk
    while k > 1:
        sk, sr = key[k ^ 1], rank[k ^ 1]
        if sk < wk or (sk == wk and sr < wr):
            wk, wr = sk, sr
        k >>= 1
        key[k], rank[k] = wk, wr


@jit
def lpt_pass(cost, size, tie, at, rank, dp, cap, rank_of):
    # the items by rank[at[i]] ascending, then tie[i] (a permutation of 0..n-1, n < 2^31), each
    # to the least loaded rank with token room (ties to the lower rank); False if one fits
    # nowhere. The order: each item's (value, index) packed into one int64 at its tie
    # position, then counted in tie order into its value's run (a stable counting sort). The
    # ranks' (load, rank) in a winner tree: an item costs one path of log2(dp) comparisons; a
    # rank without room for it leaves (its load infinite) until the item is placed
    n = tie.size
    packed = np.empty(n, dtype=np.int64)
    start = np.zeros(rank.size + 1, dtype=np.int64)
    for i in range(n):
        v = rank[at[i]]
        packed[tie[i]] = (v << 32) | i
        start[v + 1] += 1
    for v in range(rank.size):
        start[v + 1] += start[v]
    order = np.empty(n, dtype=np.int64)
    co, zo, to = np.empty(n), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for t in range(n):                  # each item's cost and size gathered in that order
        v, i = packed[t] >> 32, packed[t] & 0xFFFFFFFF
        j = start[v]
        order[j], co[j], zo[j] = i, cost[i], size[i]
        start[v] += 1
    leaves = 1
    while leaves < dp:
        leaves <<= 1
    key = np.full(2 * leaves, np.inf)          # padding leaves never win over a rank
    tree = np.empty(2 * leaves, dtype=np.int64)
    for k in range(leaves):
        tree[leaves + k] = k
    for k in range(dp):
        _replay(key, tree, leaves + k, 0.0)
    load = np.zeros(dp)
    used = np.zeros(dp, dtype=np.int64)
    skip = np.empty(dp, dtype=np.int64)
    for j in range(n):
        c, z = co[j], zo[j]
        k = 0
        while True:
            r = tree[1]
            if key[1] == np.inf:                        # no rank left with room
                return False
            if used[r] + z <= cap:
                break
            skip[k] = r                                 # a rank without room leaves the tree
            k += 1
            _replay(key, tree, leaves + r, np.inf)
        to[j] = r
        used[r] += z
        load[r] = load[r] + c
        _replay(key, tree, leaves + r, load[r])
        for q in skip[:k]:                              # and come back
            _replay(key, tree, leaves + q, load[q])
    for j in range(n):
        rank_of[order[j]] = to[j]
    return True


@jit
def _bins(items, lo, hi, size, cost, m, cap, balance, bin_of):
    # a rank's contiguous cut of items[lo:hi] into at most m bins of <= cap tokens, each
    # item's bin into bin_of[lo:hi]: a bin closes where the next item does not fit, where
    # (``balance``) it reached the rank's mean cost per bin or the next item alone reaches it
    # (a long document gets a bin of its own), or where the items left are needed one per bin
    # left; False if it does not fit
    target = py_sum(cost, items, lo, hi) / m if balance else np.inf
    nb, count, tok, cc = 0, 0, 0, 0.0
    left = hi - lo
    for k in range(lo, hi):
        i = items[k]
        bins_left = m - nb
        full = tok + size[i] > cap
        at_target = (cc >= target or cost[i] >= target) and bins_left > 1
        must_spread = left <= bins_left - 1
        if count > 0 and (full or at_target or must_spread):
            nb += 1
            count, tok, cc = 0, 0, 0.0
            if nb >= m:
                return False
        bin_of[k] = nb
        count += 1
        tok += size[i]
        cc += cost[i]
        left -= 1
    return True


@jit
def slot_orders_pass(c, out):
    # every row's bins in slot order by their costs c [k, m]: the cheapest first, the second
    # cheapest last (ties to the lower bin), the others in their order
    k, m = c.shape
    for r in range(k):
        row, o = c[r], out[r]
        for j in range(m):
            o[j] = j
        if m < 3:
            continue
        first = 0
        for j in range(1, m):
            if row[j] < row[first]:
                first = j
        last = -1
        for j in range(m):
            if j != first and (last < 0 or row[j] < row[last]):
                last = j
        s = 1
        o[0] = first
        for j in range(m):
            if j != first and j != last:
                o[s] = j
                s += 1
        o[m - 1] = last


@jit
def _ffd(items, lo, hi, size, m, cap, seq, bin_of):
    # first-fit decreasing: items[lo:hi] by size descending (stable) into seq[lo:hi], each one's
    # bin (the first with room) into bin_of[lo:hi]; False if one fits nowhere
    neg = np.empty(hi - lo, dtype=np.int64)
    for k in range(lo, hi):
        neg[k - lo] = -size[items[k]]
    free = np.full(m, cap, dtype=np.int64)
    for j, o in enumerate(np.argsort(neg, kind="mergesort")):
        i = items[lo + o]
        b = 0
        while b < m and free[b] < size[i]:
            b += 1
        if b == m:
            return False
        seq[lo + j], bin_of[lo + j] = i, b
        free[b] -= size[i]
    return True


@jit
def rank_bins_pass(items, starts, size, cost, m, cap, seq, bin_of):
    # per rank (items[starts[r]:starts[r + 1]], by sensitivity): its contiguous cut (balanced,
    # else unbalanced), else first-fit decreasing; its items in the bins' order into seq, each
    # one's bin into bin_of. False where a rank fits none of them
    for r in range(starts.size - 1):
        lo, hi = starts[r], starts[r + 1]
        seq[lo:hi] = items[lo:hi]
        if not (_bins(items, lo, hi, size, cost, m, cap, True, bin_of)
                or _bins(items, lo, hi, size, cost, m, cap, False, bin_of)
                or _ffd(items, lo, hi, size, m, cap, seq, bin_of)):
            return False
    return True


@jit
def seq_starts_pass(size, cap, starts):
    # data.packing.sequential_bins' fill: the first segment of every bin (a new bin where the
    # next segment does not fit what is free) into starts (a slot per segment), their count;
    # -(i + 1): segment i is over cap. Without a branch: starts[n] = i kept where a bin opens
    n, free = 0, 0
    for i in range(size.size):
        z = size[i]
        if z > cap:
            return -(i + 1)
        new = z > free
        starts[n] = i
        n += new
        free = (cap if new else free) - z
    return n


@jit
def stream_pass(order, lo, n_positions, weights, capacity, positions, sizes, taken, state, out):
    # GlobalBatchSampler's stream: the next documents cut into bins of ``capacity`` positions.
    # order[lo[s] + i]: source s's i-th document this epoch, sizes[s] its documents;
    # state = [current source (-1: none), offset in its document, bins left, free positions,
    # rows of ``out`` [cap, 3] written]. Returns -1 (no bin left for the next piece), -2 (out
    # full) or s >= 0 (source s just ended its epoch: its order is renewed, then called again);
    # positions, taken and state carry on where it stopped.
    cur, off, left, free, n = state[0], state[1], state[2], state[3], state[4]
    k = sizes.size
    stop = -1
    while True:
        src = cur
        if src < 0:
            src = 0
            if k > 1:
                best = taken[0] / weights[0]
                for s in range(1, k):
                    v = taken[s] / weights[s]
                    if v < best:
                        best, src = v, s
        if n == out.shape[0]:
            stop = -2
            break
        doc = order[lo[src] + positions[src]]
        npos = n_positions[doc]
        end = min(npos, off + capacity)
        size = end - off
        if size > free:
            if left == 0:
                break
            left -= 1
            free = capacity
        if off == 0:
            taken[src] += npos
        out[n, 0], out[n, 1], out[n, 2] = doc, off, end
        n += 1
        free -= size
        off, cur = end, src
        if off == npos:
            off, cur = 0, -1
            positions[src] += 1
            if positions[src] == sizes[src]:
                positions[src] = 0
                stop = src
                break
    state[0], state[1], state[2], state[3], state[4] = cur, off, left, free, n
    return stop


def sequential_starts(size: np.ndarray, cap: int) -> np.ndarray:
    """[bins] int64: ``[b[0] for b in data.packing.sequential_bins(size, cap)]`` compiled (its
    ValueError for a segment over ``cap``)."""
    starts = np.empty(size.size, dtype=np.int64)
    n = seq_starts_pass(i64(size), int(cap), starts)
    if n < 0:
        raise ValueError(f"segment {-n - 1} has {int(size[-n - 1])} tokens > capacity {cap}")
    return starts[:n]


def slot_orders(c: np.ndarray) -> np.ndarray:
    """[k, m] the bins of every row of costs ``c`` [k, m] in slot order (``slot_orders_pass``)."""
    out = np.empty(c.shape, dtype=np.int64)
    slot_orders_pass(f64(c), out)
    return out


def py_sums(x: np.ndarray, idx: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[k] ``sum(x[idx[offsets[r]:offsets[r + 1]]].tolist())`` of every run r (``py_sum``)."""
    out = np.empty(offsets.size - 1)
    py_sums_pass(f64(x), i64(idx), i64(offsets), out)
    return out


def lpt_ranks(cost: np.ndarray, size: np.ndarray, tie: np.ndarray, at: np.ndarray,
              rank: np.ndarray, dp: int, cap_tokens: int):
    """The LPT's rank of every item [n] (``lpt_pass``) in the order
    ``batching.plan.seeded_order(tie, rank[at])`` makes (``rank`` [k] the order of k values,
    ``at`` [n] each item's one), or None where one fits nowhere."""
    if cost.size >= 2 ** 31:
        raise ValueError(f"{cost.size} items: at most 2^31 - 1 in one LPT")
    rank_of = np.zeros(cost.size, dtype=np.int64)
    ok = lpt_pass(f64(cost), i64(size), i64(tie), i64(at), i64(rank), int(dp),
                     int(cap_tokens), rank_of)
    return rank_of if ok else None


def rank_bins(items: np.ndarray, starts: np.ndarray, size: np.ndarray, cost: np.ndarray,
              m: int, cap: int) -> Optional[tuple]:
    """Every rank's bins (``rank_bins_pass``) as a CSR: (their items, bin by bin, rank-major;
    counts [dp, m] of every (rank, bin)), or None where some rank's items fit in none."""
    seq, bin_of = np.empty(items.size, dtype=np.int64), np.empty(items.size, dtype=np.int64)
    if not rank_bins_pass(i64(items), i64(starts), i64(size), f64(cost), int(m), int(cap), seq,
                          bin_of):
        return None
    dp = starts.size - 1
    unit = np.repeat(np.arange(dp) * m, np.diff(starts)) + bin_of
    return seq[np.argsort(unit, kind="stable")], np.bincount(unit, minlength=dp * m
                                                                ).reshape(dp, m)


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    one, i1 = np.ones(2), np.ones(2, dtype=np.int64)
    lpt_ranks(one, i1, np.arange(2), np.arange(2), np.arange(2), 2, 4)
    rank_bins(np.arange(2), np.array([0, 1, 2]), i1, one, 3, 4)
    sequential_starts(i1, 4)
    stream_pass(np.arange(2), np.zeros(1, dtype=np.int64), i1, one[:1], 4, np.zeros(1, np.int64),
                np.array([2]), np.zeros(1, np.int64), np.array([-1, 0, 1, 0, 0]),
                np.zeros((4, 3), dtype=np.int64))
    slot_orders(np.ones((1, 3)))
    py_sums(one, np.arange(2), np.array([0, 1, 2]))
