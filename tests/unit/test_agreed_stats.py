"""The group's straggler test and median error where each DP rank knows only its own
calibration (``policy.agreed_stats``), its rounds run in lockstep with in-process reductions:
exactly ``straggler_present`` and ``np.median`` where the values fit the exact block, and
within a histogram bin of them past it (a brute-force oracle over every rank's values)."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import agreed_stats as ags
from sparsebalance_megatron.policy.agreed_stats import straggler_present
from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

CAP = 0.5


def _agree(grid, errors, tolerance=0.1):
    """Every rank's (narrow, median error), rank r holding row r of ``grid`` and ``errors[r]``
    alone; the rounds' count of reductions."""
    dp = len(errors)
    count = []

    def counted(gen):
        parts = next(gen)
        try:
            while True:
                if gen is gens[0]:
                    count.append(1)
                parts = yield parts
                parts = gen.send(parts)
        except StopIteration as done:
            return done.value
    gens = [ags.agreed_rounds(None if grid is None else grid[r], errors[r], dp=dp,
                              tolerance=tolerance, error_cap=CAP) for r in range(dp)]
    out = plan_rounds_in_process([counted(g) for g in gens])
    assert all(o == out[0] for o in out), "the ranks disagree"
    return out[0], len(count)


@pytest.mark.parametrize("dp,pp", [(1, 1), (1, 4), (3, 2), (64, 4), (512, 4)])
def test_small_groups_agree_exactly(dp, pp):
    rng = np.random.default_rng(dp * 10 + pp)
    for trial in range(6):
        grid = 1.0 + 0.01 * rng.standard_normal((dp, pp))
        if trial % 2:
            grid[rng.integers(dp), rng.integers(pp)] *= 1.0 + 0.1 * trial
        errors = [rng.uniform(0, 0.2, rng.integers(0, 12)) for _ in range(dp)]
        (narrow, err), _ = _agree(grid, errors)
        assert narrow == straggler_present(grid, 0.1)
        kept = np.concatenate([e[-ags.ERRORS_PER_RANK:] for e in errors])
        want = float(np.median(kept)) if kept.size else None
        if dp * ags.ERRORS_PER_RANK <= ags.EXACT_VALUES or want is None:
            assert err == want
        else:                                  # 4,096 errors: the histogram's median
            assert abs(err - want) < CAP / ags.BINS


def test_no_errors_and_no_factors_agree_nothing_but_the_rounds():
    (narrow, err), rounds = _agree(None, [[]] * 3)
    assert (narrow, err, rounds) == (False, None, 1)


@pytest.mark.parametrize("dp", [1024, 4096])
def test_large_groups_agree_from_histograms(dp):
    """Past the exact block (dp x pp > 2,048 factors, dp x 8 > 2,048 errors): the median within
    a fraction of a bin, the straggler found where it stands clear of the threshold and not
    where none is, the spread's round made only where the excess matters."""
    pp, rng = 4, np.random.default_rng(dp)
    base = 1.0 + 0.01 * rng.standard_normal((dp, pp))
    errors = [rng.uniform(0, 0.2, 8) for _ in range(dp)]
    (narrow, err), rounds = _agree(base, errors)
    assert not narrow and not straggler_present(base, 0.1) and rounds == 1
    exact = float(np.median(np.concatenate(errors)))
    assert abs(err - exact) < CAP / ags.BINS
    slow = base.copy()
    slow[3, 1] = 1.3
    (narrow, _), rounds = _agree(slow, errors)
    assert narrow and straggler_present(slow, 0.1) and rounds == 2
    noisy = 1.0 + 0.05 * rng.standard_normal((dp, pp))    # its max excess is noise
    noisy[0, 0] = 1.08
    assert not straggler_present(noisy, 0.1)
    (narrow, _), rounds = _agree(noisy, errors)
    assert not narrow and rounds == 2


def test_the_histogram_median_is_within_a_bin():
    rng = np.random.default_rng(0)
    for n in (1, 7, 1001, 30000, 30001):     # (2 far-apart values: np.median averages them)
        x = rng.lognormal(0, 0.3, n)
        got = 2.0 ** ags.histogram_median(ags.histogram(np.log2(x), *ags.FACTOR_LOG2),
                                          *ags.FACTOR_LOG2)
        lo, hi = ags.FACTOR_LOG2
        assert abs(np.log2(got) - np.log2(np.median(x))) <= 2 * (hi - lo) / ags.BINS
    counts = ags.histogram(np.array([-np.inf, 1e9, 0.5]), 0.0, 1.0)
    assert counts[0] == 1 and counts[-1] == 1 and counts.sum() == 3
