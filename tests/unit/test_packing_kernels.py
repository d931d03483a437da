"""SAB's compiled packing loops (``kernels.packing``) make the Python loops' decisions:
the same LPT ranks, contiguous bins, slots and compensated sums, so a plan does not depend on
whether numba is installed."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron import kernels
from sparsebalance_megatron.batching import packing
from sparsebalance_megatron.batching.packing import sab_plan, token_balanced_plan

pytestmark = pytest.mark.skipif(not kernels.packing_enabled(),
                                reason="numba is not installed (or Python < 3.12)")


@pytest.fixture
def python_paths(monkeypatch):
    """Call ``fn`` with the compiled kernels off (the Python loops)."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(kernels, "enabled", lambda: False)
            assert not kernels.packing_enabled()
            return fn(*args, **kwargs)
    return run


def test_compensated_sum_is_pythons_sum():
    """``_py_sum`` is CPython's sum() of floats (Neumaier's compensation, added only where
    non-zero and finite): on sums whose plain left-to-right total differs, magnitudes far
    apart, cancellations and an overflow."""
    fn = kernels.packing.py_sum
    rng = np.random.default_rng(0)
    differ = 0
    for case in range(300):
        n = int(rng.integers(0, 40))
        x = rng.random(n) * 10.0 ** rng.integers(-8, 8, n)
        if case % 3 == 0:
            x *= rng.choice([-1.0, 1.0], n)
        idx = rng.permutation(n)
        want = sum(x[idx].tolist())
        got = fn(x, idx, 0, n)
        assert got == want or (np.isnan(got) and np.isnan(want)), (case, got, want)
        plain = 0.0
        for v in x[idx].tolist():
            plain += v
        differ += plain != want
    assert differ > 10                                # the compensation mattered
    big = np.array([1e308, 1e308, -1e308])
    assert fn(big, np.arange(3), 0, 3) == sum(big.tolist())


def _segments(rng, n, longest):
    return [(i, 0, int(x)) for i, x in enumerate(rng.integers(1, longest, n))]


@pytest.mark.parametrize("dp, m, n, longest", [(8, 16, 300, 4000), (4, 2, 40, 3000),
                                               (16, 4, 90, 8192), (3, 5, 15, 8192),
                                               (2, 8, 100, 200)])
def test_sab_plans_are_the_python_loops(python_paths, dp, m, n, longest):
    """Whole SAB and token-balanced plans with the kernels and without: every micro-batch the
    same, at shapes with many documents per bin, two bins per rank, near-full capacity (ranks
    without token room skipped by the LPT, contiguous cuts that do not fit and take the
    first-fit-decreasing fallback) and more bins than documents."""
    rng = np.random.default_rng(dp * m + n)
    for rep in range(4):
        segs = _segments(rng, n, longest)
        cost = (lambda L, p=rng.uniform(1.0, 2.0): np.asarray(L, dtype=np.float64) ** p)
        sens = rng.random(n)
        kw = dict(dp=dp, num_microbatches=m, max_tokens=8192, seed=rep)
        for fn, extra in ((sab_plan, dict(cost_fn=cost, sensitivity=lambda ids, L: sens)),
                          (token_balanced_plan, {})):
            try:
                want = python_paths(fn, segs, **kw, **extra)
            except Exception as e:                    # the Python path's error, the same
                with pytest.raises(type(e)):
                    fn(segs, **kw, **extra)
                continue
            got = fn(segs, **kw, **extra)
            assert got.micro_batches == want.micro_batches
            assert got.fallback == want.fallback
            np.testing.assert_array_equal(got.predicted_rank_cost_s, want.predicted_rank_cost_s)


def test_lpt_and_bins_match_the_python_loops_step_by_step(python_paths):
    """The two kernels against ``_lpt_ranks`` and ``_pack_rank`` + ``_order_slots`` directly:
    equal loads (ties to the lowest rank), ranks without room, an LPT that fits nowhere (None),
    ranks whose balanced cut fails (unbalanced cut) or whose cuts both fail (the fallback)."""
    rng = np.random.default_rng(3)
    fallback = unbalanced = ties = 0
    for case in range(200):
        dp, m = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        cap = int(rng.integers(50, 400))
        n = int(rng.integers(0, dp * m * 4 + 1))
        size = rng.integers(1, cap + 1, n).astype(np.int64)
        cost = (rng.integers(1, 5, n) if case % 2 else rng.random(n) * 10).astype(np.float64)
        ties += case % 2
        order = np.lexsort((rng.permutation(n), -cost))
        want = packing._lpt_ranks(cost, size, order, dp, m * cap)
        got = kernels.packing.lpt_ranks(cost, size, order, dp, m * cap)
        assert (got is None) == (want is None), case
        if want is None:
            continue
        np.testing.assert_array_equal(got, want)
        by_rank = np.lexsort((rng.random(n), want))
        starts = np.r_[0, np.cumsum(np.bincount(want, minlength=dp))]
        bin_of, slot_of, ok = kernels.packing.rank_bins(by_rank, starts, size, cost, m, cap,
                                                        True)
        for r in range(dp):
            items = by_rank[starts[r]:starts[r + 1]].tolist()
            bal = packing._contiguous_bins(items, size.tolist(), cost.tolist(), m, cap, True)
            bins = packing._pack_rank(items, size.tolist(), cost.tolist(), m, cap)
            assert ok[r] == (bal is not None or packing._contiguous_bins(
                items, size.tolist(), cost.tolist(), m, cap, False) is not None)
            if not ok[r]:
                fallback += 1
                continue
            unbalanced += bal is None
            got_bins = [[items[k] for k in range(len(items)) if bin_of[starts[r] + k] == j]
                        for j in slot_of[r]]
            assert got_bins == packing._order_slots(bins, cost.tolist()), (case, r)
    assert fallback and unbalanced and ties


def test_the_kernels_warm_up():
    kernels.packing.warm_up()
    assert all(kernels.packing.__dict__[k].signatures for k in ("lpt_pass", "rank_bins_pass"))


def test_sequential_starts_are_megatrons_fill():
    """The compiled fill opens a bin exactly where ``data.packing.sequential_bins`` does (exact
    fits, a segment of the whole capacity, one segment), and names a segment over it alike."""
    from sparsebalance_megatron.kernels.packing import sequential_starts
    from sparsebalance_megatron.data.packing import sequential_bins

    rng = np.random.default_rng(4)
    for case in range(60):
        cap = int(rng.integers(1, 300))
        size = rng.integers(1, cap + 1, int(rng.integers(1, 400)))
        if case % 3 == 0:                   # runs that fill a bin exactly
            size = np.repeat(np.array([cap // 2, cap - cap // 2, cap]), 50)[:size.size]
            size = np.maximum(size, 1)
        want = [b[0] for b in sequential_bins(size.tolist(), cap)]
        assert sequential_starts(size, cap) == want
    with pytest.raises(ValueError, match="segment 2 has 9 tokens > capacity 8"):
        sequential_starts(np.array([3, 4, 9, 1]), 8)
    with pytest.raises(ValueError, match="segment 2 has 9 tokens > capacity 8"):
        sequential_bins([3, 4, 9, 1], 8)
