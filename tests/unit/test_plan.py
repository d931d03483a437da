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
