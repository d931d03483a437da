"""The per-step budget check compares what every rank's attention asked for and what it kept
with the broadcast plan: a rank that ignores the plan is caught, not averaged away."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron.megatron.callback import _min_kept, check_budgets
from sparsebalance_megatron.plan import BudgetPlan

pytestmark = pytest.mark.integration
PLAN = BudgetPlan(0, np.array([[[0.5], [0.25]], [[1.0], [0.5]]]))   # [dp 2, m 2, pp 1]


def _rank(dp, served, used):
    return dict(dp=dp, pp=0, served=served, used=used)


def test_a_consistent_step_passes():
    check_budgets(PLAN, [_rank(0, {0: 0.5, 1: 0.25}, {0: 0.5, 1: 0.3}),
                         _rank(1, {0: 1.0, 1: 0.5}, {0: 1.0, 1: 0.5})])


@pytest.mark.reliability(area="budget", case="a rank asks attention for another density",
                         expect="the step fails naming rank, stage, micro-batch and densities")
def test_a_rank_asking_for_another_density_is_caught():
    with pytest.raises(RuntimeError, match=r"\(dp 1, stage 0, micro-batch 1\): 0.25 != 0.5"):
        check_budgets(PLAN, [_rank(1, {1: 0.25}, {1: 0.5})])


@pytest.mark.reliability(area="budget", case="attention keeps fewer blocks than planned",
                         expect="the step fails: kept share and plan named")
def test_attention_keeping_fewer_blocks_than_planned_is_caught():
    with pytest.raises(RuntimeError, match=r"micro-batch 0\): kept 0.2000 of the blocks, plan 0.5"):
        check_budgets(PLAN, [_rank(0, {0: 0.5}, {0: 0.2})])
    # mass selection chooses its own density: only the request is checked then
    check_budgets(PLAN, [_rank(0, {0: 0.5}, {0: 0.2})], check_used=False)


def test_min_kept_is_the_smallest_share_of_any_sequence_and_layer():
    records = [(0, (5, 6), 1, [0.6, 0.5, 1.0], [0.9, 0.9, 1.0]),
               (0, (5, 6), 2, [0.7, 0.55, 1.0], [0.9, 0.9, 1.0]),
               (1, (7,), 1, [0.25], [0.8]), (None, (), 1, [0.1], [0.5])]   # None: evaluation
    assert _min_kept(records) == {0: 0.5, 1: 0.25}
