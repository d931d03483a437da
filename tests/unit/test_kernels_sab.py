"""SAB's and the cost tables' compiled loops (``kernels.packing``, ``kernels.slots``,
``kernels.features``, ``kernels.grid.unit_tables``), each run in its Python form (``py_func``)
and compiled, on small cases, against brute-force oracles written here: the LPT as every rank
looked at for every item, a rank's contiguous cut as the rule it states (then first-fit
decreasing), the slots and the sequential fill as Python's own sort and loop, a slot-search
round as every move simulated, the run sums and tables as numpy's."""

import numpy as np
import pytest

from sparsebalance_megatron.kernels import features, grid, packing, slots
from sparsebalance_megatron.batching.slots import HEAVY_MOVES, MIN_GAIN, PARTNERS
from sparsebalance_megatron.sim.pipeline import event_graph, pipeline_makespan_s

FORMS = pytest.mark.parametrize("form", ["python", "compiled"])


def _form(fn, form):
    return fn.py_func if form == "python" else fn


@FORMS
def test_compensated_sum_is_pythons_sum(form):
    """CPython's sum() of floats (Neumaier's compensation, added only where non-zero and
    finite): magnitudes far apart, cancellations and an overflow."""
    rng = np.random.default_rng(0)
    differ = 0
    for case in range(200):
        n = int(rng.integers(0, 40))
        x = rng.random(n) * 10.0 ** rng.integers(-8, 8, n) * (rng.choice([-1.0, 1.0], n)
                                                                if case % 3 == 0 else 1.0)
        idx = rng.permutation(n)
        got, want = _form(packing.py_sum, form)(x, idx, 0, n), sum(x[idx].tolist())
        assert got == want or (np.isnan(got) and np.isnan(want)), (case, got, want)
        differ += float(np.cumsum(x[idx])[-1] if n else 0.0) != want
    assert differ > 10                                # the compensation mattered
    big = np.array([1e308, 1e308, -1e308])
    with np.errstate(over="ignore", invalid="ignore"):      # numpy's scalars warn, floats not
        assert _form(packing.py_sum, form)(big, np.arange(3), 0, 3) == sum(big.tolist())


@FORMS
def test_lpt_gives_each_item_the_least_loaded_rank_with_room(form):
    """Items in ``np.lexsort((tie, rank[at]))``'s order (the kernel counts them into their
    values' ranks in tie order), each to the rank of least (load, rank) among those with token
    room; an item without room anywhere: no plan. Equal loads and equal costs included, the
    ranks as ``np.unique`` gives them for sizes' costs and for any costs (``at`` the items)."""
    rng = np.random.default_rng(3)
    nowhere = 0
    for case in range(150):
        dp, cap = int(rng.integers(1, 6)), int(rng.integers(50, 300))
        n = int(rng.integers(0, 4 * dp * 3))
        size = rng.integers(1, cap // 2, n).astype(np.int64)
        if case % 3 == 0:
            per = rng.integers(0, 4, 7).astype(np.float64)       # many equal costs
            at = rng.integers(0, per.size, n)
            rank = np.unique(-per, return_inverse=True)[1]
            cost = per[at]
        else:
            cost = (rng.integers(1, 4, n) if case % 3 == 1 else rng.random(n) * 10
                    ).astype(np.float64)
            at, rank = np.arange(n), np.unique(-cost, return_inverse=True)[1]
        tie = rng.permutation(n)
        order = np.lexsort((tie, rank[at]))
        load, used, want = [0.0] * dp, [0] * dp, np.zeros(n, np.int64)
        for i in order:
            room = [r for r in range(dp) if used[r] + size[i] <= 3 * cap]
            if not room:
                want = None
                break
            r = min(room, key=lambda r: (load[r], r))
            want[i], load[r], used[r] = r, load[r] + cost[i], used[r] + size[i]
        got = np.zeros(n, np.int64)
        ok = _form(packing.lpt_pass, form)(cost, size, tie, at, rank, dp, 3 * cap, got)
        assert ok == (want is not None)
        nowhere += want is None
        if want is not None:
            np.testing.assert_array_equal(got, want)
    assert 0 < nowhere < 150


def _cut_oracle(items, size, cost, m, cap, balance):
    """A rank's contiguous cut as its rule says: close a bin where the next item does not fit,
    where (balanced) it reached the rank's mean cost per bin or the next item alone reaches it,
    or where the items left are needed one per bin left; None past m bins."""
    target = sum(cost[i] for i in items) / m if balance else float("inf")
    bins, n_left = [[]], len(items)
    for i in items:
        tok, cst = sum(size[k] for k in bins[-1]), 0.0
        for k in bins[-1]:                            # the open bin's cost, added in order
            cst += cost[k]
        close = tok + size[i] > cap or ((cst >= target or cost[i] >= target)
                                        and m - len(bins) + 1 > 1) or n_left <= m - len(bins)
        if bins[-1] and close:
            if len(bins) == m:
                return None
            bins.append([])
        bins[-1].append(i)
        n_left -= 1
    return bins + [[] for _ in range(m - len(bins))]


def _ffd_oracle(items, size, m, cap):
    """First-fit decreasing: the items by size, largest first (Python's stable sort), each into
    the first bin with room; None where one fits nowhere."""
    bins, free = [[] for _ in range(m)], [cap] * m
    for i in sorted(items, key=lambda i: -size[i]):
        b = next((b for b in range(m) if free[b] >= size[i]), None)
        if b is None:
            return None
        bins[b].append(i)
        free[b] -= size[i]
    return bins


@FORMS
def test_a_ranks_bins_are_its_contiguous_cut_else_first_fit_decreasing(form):
    """Every rank's balanced cut, else its unbalanced cut, else first-fit decreasing, else none
    (the pass answers False): each rank alone, and all of them in one call."""
    rng = np.random.default_rng(4)
    seen = {"balanced": 0, "unbalanced": 0, "ffd": 0, "none": 0}
    run = _form(packing.rank_bins_pass, form)

    def got_bins(starts, seq, bin_of, r):
        lo, hi = starts[r], starts[r + 1]
        return [seq[lo:hi][bin_of[lo:hi] == j].tolist() for j in range(m)]

    for case in range(160):
        dp, m, cap = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(40, 200))
        n = int(rng.integers(0, dp * m * 3 + 1))
        size = rng.integers(1, cap, n).astype(np.int64)
        cost = (rng.integers(1, 4, n) if case % 2 else rng.random(n) * 10).astype(np.float64)
        rank = np.sort(rng.integers(0, dp, n))
        starts = np.r_[0, np.cumsum(np.bincount(rank, minlength=dp))]
        items = rng.permutation(n)
        want = []
        for r in range(dp):
            mine = items[starts[r]:starts[r + 1]]
            for kind, bins in (("balanced", _cut_oracle(mine.tolist(), size, cost.tolist(), m,
                                                         cap, True)),
                               ("unbalanced", _cut_oracle(mine.tolist(), size, cost.tolist(),
                                                          m, cap, False)),
                               ("ffd", _ffd_oracle(mine.tolist(), size.tolist(), m, cap)),
                               ("none", None)):
                if bins is not None:
                    break
            seen[kind] += 1
            seq, bin_of, one = np.zeros(mine.size, np.int64), np.zeros(mine.size, np.int64), \
                np.array([0, mine.size])
            assert run(mine, one, size, cost, m, cap, seq, bin_of) == (bins is not None)
            if bins is not None:
                assert got_bins(one, seq, bin_of, 0) == bins
            want.append(bins)
        seq, bin_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
        assert run(items, starts, size, cost, m, cap, seq, bin_of) == (None not in want)
        if None not in want:
            assert [got_bins(starts, seq, bin_of, r) for r in range(dp)] == want
    assert min(seen.values()) > 0, seen
    for case in range(10):       # first-fit decreasing alone: long runs of equal sizes, in order
        n, m = 300, 8
        size, items = rng.integers(1, 5, n) * 10, rng.permutation(n)
        cap = int(size.sum()) // m + 40
        seq, bin_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
        assert _form(packing._ffd, form)(items, 0, n, size, m, cap, seq, bin_of)
        assert [seq[bin_of == j].tolist() for j in range(m)] == \
            _ffd_oracle(items.tolist(), size.tolist(), m, cap)


@FORMS
def test_the_slots_put_the_cheapest_bin_first_and_the_second_cheapest_last(form):
    """Every row's slot order: the cheapest bin first, the second cheapest last (Python's sort,
    ties to the lower bin), the others as they were."""
    rng = np.random.default_rng(6)
    for m in range(1, 7):
        c = rng.integers(0, 4, (40, m)).astype(np.float64)      # many ties
        out = np.zeros(c.shape, np.int64)
        _form(packing.slot_orders_pass, form)(c, out)
        for row, got in zip(c.tolist(), out.tolist()):
            order = sorted(range(m), key=lambda j: (row[j], j))
            assert got == (list(range(m)) if m < 3 else [order[0]] + [
                j for j in range(m) if j not in order[:2]] + [order[1]]), (row, got)


@FORMS
def test_sequential_starts_are_megatrons_fill(form):
    """Fill in order, a new bin where the next segment does not fit what is free: exact fits,
    a segment of the whole capacity; one over it is named."""
    rng = np.random.default_rng(5)
    for case in range(60):
        cap = int(rng.integers(1, 300))
        size = np.maximum(rng.integers(1, cap + 1, int(rng.integers(1, 200))), 1)
        if case % 3 == 0:                   # runs that fill a bin exactly
            size = np.maximum(np.resize([cap // 2, cap - cap // 2, cap], size.size), 1)
        want, free = [], 0
        for i, x in enumerate(size.tolist()):
            if x > free:
                want.append(i)
                free = cap
            free -= x
        starts = np.empty(size.size, np.int64)
        n = _form(packing.seq_starts_pass, form)(size, cap, starts)
        assert starts[:n].tolist() == want
    assert _form(packing.seq_starts_pass, form)(np.array([3, 4, 9, 1]), 8, starts) == -3
    with pytest.raises(ValueError, match="segment 2 has 9 tokens > capacity 8"):
        packing.sequential_starts(np.array([3, 4, 9, 1]), 8)


def _round_oracle(fu, bu, sc, cost, rows, span, p2p, pp):
    """One round of the slot search: every move the search may take from ``rows`` [dp, m]
    (the critical rank's heaviest micro-batches to every other slot, neighbouring slots
    swapped, a heavier one of its micro-batches swapped with a partner's lightest), each
    simulated; the value of the best one (a swap: the larger of its two makespans)."""
    dp, m = rows.shape
    r = int(np.argmax(span))

    def mk(row, rank):
        s = sc[rank][None, None, :]
        return pipeline_makespan_s(fu[row][None] * s, bu[row][None] * s, p2p, pp=pp)[0]

    own = rows[r].tolist()
    heavy = sorted(range(m), key=lambda j: (-cost[own[j]], j))[:HEAVY_MOVES]
    values = []
    for i in heavy:
        rest = own[:i] + own[i + 1:]
        values += [mk(rest[:j] + [own[i]] + rest[j:], r) for j in range(m) if j != i]
    values += [mk(own[:i] + [own[i + 1], own[i]] + own[i + 2:], r) for i in range(m - 1)]
    for p in sorted((x for x in range(dp) if x != r), key=lambda x: (span[x], x))[:PARTNERS]:
        theirs = rows[p].tolist()
        q = min(range(m), key=lambda s: (cost[theirs[s]], s))
        for js in range(m):
            if cost[own[js]] > cost[theirs[q]]:
                mine, other = list(own), list(theirs)
                mine[js], other[q] = theirs[q], own[js]
                values.append(max(mk(mine, r), mk(other, p)))
    return min(values, default=np.inf)


@FORMS
def test_a_slot_search_round_takes_the_best_move(form):
    """From the seed orders, one round takes the move of least value when it shortens the
    critical rank by ``MIN_GAIN``, else none (1F1B and interleaved, scales, ties)."""
    from sparsebalance_megatron.batching.slots import arrange_slots

    rng = np.random.default_rng(6)
    moved = 0
    for case in range(16):
        dp, m, ranks, vp = (2, 4, 2, 1) if case % 2 else (3, 4, 2, 2)
        nv = ranks * vp
        f = (rng.choice([1.0, 2.0, 3.0], (dp, m, 1)) if case % 3 == 0
             else rng.uniform(0.5, 1.5, (dp, m, 1))) * rng.uniform(0.8, 1.2, (1, 1, nv))
        sc = rng.uniform(0.8, 1.3, (dp, nv)) if case % 4 > 1 else np.ones((dp, nv))
        kw = dict(p2p_s=1e-3 * (case % 2), pp=ranks if vp > 1 else None, scale=sc)
        rows, span = arrange_slots(f, 2 * f, rounds=0, **kw)
        fu, bu = f.reshape(dp * m, nv), 2 * f.reshape(dp * m, nv)
        cost = (fu + bu).sum(axis=1)
        best = _round_oracle(fu, bu, sc, cost, rows, span, kw["p2p_s"], kw["pp"])
        got_rows, got_span = rows.copy(), span.copy()
        _form(slots.rounds_pass, form)(event_graph(m, ranks, vp).record(kw["p2p_s"]), fu, bu,
                                       sc, cost, got_rows, got_span,
                                       (1, HEAVY_MOVES, PARTNERS, MIN_GAIN))
        r = int(np.argmax(span))
        if best < span[r] * (1 - MIN_GAIN):
            moved += 1
            changed = np.flatnonzero((got_rows != rows).any(axis=1))
            assert r in changed and got_span[changed].max() == best
        else:
            np.testing.assert_array_equal(got_rows, rows)
    assert 0 < moved < 16


@FORMS
def test_run_sums_and_cost_tables_are_numpys(form):
    """The latency features' sums over runs of equal documents (np.add.at), and the cost
    tables (work x per pair + fixed) x correction, forward and backward, and their total."""
    rng = np.random.default_rng(7)
    table_t = rng.integers(0, 50, (9, 4)).astype(np.float64)
    blocks, unit = rng.integers(0, 9, 30), np.sort(rng.integers(0, 6, 30))
    count = rng.integers(1, 5, 30).astype(np.float64)
    out, want = np.zeros((6, 4)), np.zeros((6, 4))
    _form(features.run_sums, form)(table_t, blocks, unit, count, out)
    np.add.at(want, unit, table_t[blocks] * count[:, None])
    np.testing.assert_array_equal(out, want)
    work, per_pair = np.sort(rng.random((5, 7)), axis=1), rng.random((2, 3))
    fixed, corr = rng.random((2, 5, 3)), rng.uniform(0.8, 1.2, (5, 3))
    for scaled in (False, True):
        fb, total = np.empty((2, 5, 3, 7)), np.empty((5, 3, 7))
        _form(grid.unit_tables, form)(work, per_pair, fixed, corr, scaled, fb, total)
        for k in range(2):
            t = work[:, None, :] * per_pair[k][None, :, None] + fixed[k][:, :, None]
            np.testing.assert_array_equal(fb[k], t * corr[:, :, None] if scaled else t)
        np.testing.assert_array_equal(total, fb[0] + fb[1])
