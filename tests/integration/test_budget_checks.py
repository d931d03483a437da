"""The per-step budget check compares what every rank's attention asked for and what it kept
with the broadcast plan: a rank that ignores the plan is caught, not averaged away."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron.megatron.step.checks import check_budgets, min_kept
from sparsebalance_megatron.plan import BudgetPlan

pytestmark = pytest.mark.integration
PLAN = BudgetPlan(0, np.array([[[0.5], [0.25]], [[1.0], [0.5]]]))   # [dp 2, m 2, pp 1]


def _rank(dp, served, used, stage=0):
    """A rank's report; ``served``/``used`` by micro-batch, at plan stage ``stage``."""
    return dict(dp=dp, pp=0, served={(mb, stage): d for mb, d in served.items()},
                used={(mb, stage): d for mb, d in used.items()})


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
    assert min_kept(records, lambda layer: 0) == {(0, 0): 0.5, (1, 0): 0.25}
    # model chunks (interleaved schedule): each layer's virtual stage is its own key
    assert min_kept(records, lambda layer: 2 * (layer - 1)) == {(0, 0): 0.5, (0, 2): 0.55,
                                                                  (1, 0): 0.25}


def test_a_model_chunk_is_checked_against_its_own_virtual_stage():
    plan = BudgetPlan(0, np.array([[[0.5, 1.0, 0.25, 1.0]]]))   # [dp 1, m 1, pp 2 x vp 2]
    check_budgets(plan, [_rank(0, {0: 0.5}, {0: 0.5}, stage=0),
                         _rank(0, {0: 0.25}, {0: 0.25}, stage=2)])
    with pytest.raises(RuntimeError, match=r"\(dp 0, stage 2, micro-batch 0\): 0.5 != 0.25"):
        check_budgets(plan, [_rank(0, {0: 0.5}, {0: 0.5}, stage=2)])
