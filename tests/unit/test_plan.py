"""The budget plan: one density per (dp rank, micro-batch, stage), validated."""

import numpy as np
import pytest

from sparsebalance_megatron.plan import BudgetPlan


def test_plan_validates_shape_and_range():
    with pytest.raises(ValueError, match="shape"):
        BudgetPlan(0, np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        BudgetPlan(0, np.full((1, 1, 1), 1.5))


def test_density_reads_the_unit():
    d = np.arange(1, 13, dtype=float).reshape(2, 3, 2) / 20.0   # [dp, m, pp]
    plan = BudgetPlan(5, d)
    assert plan.density(1, 2, 1) == d[1, 2, 1]
    assert np.all(BudgetPlan.static(0, 0.25, 2, 3, 4).densities == 0.25)
    assert BudgetPlan.static(0, 0.25, 2, 3, 4).densities.shape == (2, 3, 4)


def test_a_ranks_own_rows_are_read_by_its_dp_rank_and_no_other():
    """In a run a DP rank holds its own rows (``first``: its DP rank): read by its DP rank;
    another DP rank's is refused naming the ranks the plan holds (a whole plan's index would
    have read the wrong unit)."""
    d = np.arange(1, 13, dtype=float).reshape(2, 3, 2) / 20.0
    own = BudgetPlan(5, d[1:], first=1)
    assert own.density(1, 2, 1) == d[1, 2, 1]
    np.testing.assert_array_equal(own.rows(1), d[1:])
    np.testing.assert_array_equal(BudgetPlan(5, d).rows(1), d[1:])
    for other in (0, 2):
        with pytest.raises(ValueError, match=f"DP rank {other}: the plan holds DP ranks 1 to 1"):
            own.density(other, 0, 0)
