"""The budget plan and the context attention reads it through."""

import numpy as np
import pytest

from sparsebalance_megatron import plan


@pytest.fixture(autouse=True)
def clean_context():
    yield
    plan.set_step_plan(None)
    plan.set_current_microbatch(None)
    plan.pop_served_densities()
    plan.pop_attention_stats()


def test_plan_validates_shape_and_range():
    with pytest.raises(ValueError, match="shape"):
        plan.BudgetPlan(0, np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        plan.BudgetPlan(0, np.full((1, 1, 1), 1.5))


def test_current_density_reads_this_ranks_unit():
    d = np.arange(1, 13, dtype=float).reshape(2, 3, 2) / 20.0   # [dp, m, pp]
    plan.set_step_plan(plan.BudgetPlan(5, d), dp_rank=1, stage=1)
    assert plan.current_density(0.5) == 0.5                     # no micro-batch yet: default
    plan.set_current_microbatch(2, [7, 8])
    assert plan.current_density(0.5) == d[1, 2, 1]
    # A recomputed forward passes its own micro-batch, whatever the context says.
    assert plan.current_density(0.5, microbatch=0) == d[1, 0, 1]
    assert plan.pop_served_densities() == {2: d[1, 2, 1], 0: d[1, 0, 1]}
    assert plan.pop_served_densities() == {}


def test_stats_carry_the_microbatch_and_documents():
    plan.set_current_microbatch(1, [3, 4])
    plan.record_attention_stats(2, [0.5, 0.5, 1.0], [0.9, 0.8, 1.0])
    plan.record_attention_stats(2, [0.5], [0.7], microbatch=0, doc_ids=[9])
    stats = plan.pop_attention_stats()
    assert stats[0][:3] == (1, [3, 4], 2) and stats[1][:3] == (0, [9], 2)
    assert plan.pop_attention_stats() == []
