"""Megatron's dp_balanced packer reimplemented (``batching/dp_balanced.py``): its rule on known
lengths, its plans on the study's global batches, and, where megatron-core ships
``DpBalancedScheduler`` (0.20, Megatron-LM main: ``make mcore020``), the same groups as
``get_groups_and_subsamples`` on the same lengths."""

import numpy as np
import pytest

from _plans import check_plan_covers
from sparsebalance_megatron.batching import (BatchingError, dp_balanced_groups,
                                             dp_balanced_plan, sequential_plan)
from sparsebalance_megatron.batching.dp_balanced import megatron_order
from sparsebalance_megatron.data import GlobalBatchSampler


def test_groups_fill_in_order_then_move_single_sequences_to_a_multiple_of_dp():
    # cap 100: [30, 60] [50, 40] [90] -> 3 groups; dp 2 needs 4: the last sequence of the last
    # group holding more than one (group 1's 40) moves into a group of its own, at the end
    got = dp_balanced_groups([30, 60, 50, 40, 90], max_seqlen_per_dp_cp_rank=100, dp=2)
    assert got == [[[0, 1], [2]], [[4], [3]]]
    # already a multiple: nothing moves; group g -> rank g % dp, micro-batch g // dp
    assert dp_balanced_groups([60, 60, 60, 60], max_seqlen_per_dp_cp_rank=100, dp=2) == \
        [[[0], [1]], [[2], [3]]]
    # vpp: a multiple of dp x microbatch_group_size_per_vp_stage
    vpp = dp_balanced_groups([10] * 6, max_seqlen_per_dp_cp_rank=25, dp=1,
                             microbatch_group_size_per_vp_stage=4)
    assert [g[0] for g in vpp] == [[0, 1], [2, 3], [4], [5]]


def test_too_few_sequences_for_the_groups_is_one_clear_error():
    with pytest.raises(BatchingError, match="cannot make a multiple of 4 groups"):
        dp_balanced_groups([10, 10], max_seqlen_per_dp_cp_rank=100, dp=4)
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank=0"):
        dp_balanced_groups([10], max_seqlen_per_dp_cp_rank=0, dp=1)


def test_megatron_order_deals_samples_round_robin_then_gathers_rank_by_rank():
    assert megatron_order(7, 2).tolist() == [0, 2, 4, 6, 1, 3, 5]


def _batches(dp=4, m=4, cap=4096, steps=3, seed=5):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(20, 600, 400), rng.integers(2000, 9000, 30)])
    s = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m, seed=seed)
    return [s.next_global_batch() for _ in range(steps)]


def test_in_the_samplers_order_its_groups_are_megatrons_sequential_fill():
    for segs in _batches():
        groups = dp_balanced_groups([e - s for _, s, e in segs], max_seqlen_per_dp_cp_rank=4096,
                                    dp=4)
        seq = sequential_plan(segs, dp=4, num_microbatches=4, max_tokens=4096)
        assert [[[segs[i] for i in groups[j][r]] for j in range(len(groups))]
                for r in range(4)] == seq.micro_batches


def test_in_megatrons_order_every_token_once_and_a_variable_micro_batch_count():
    counts = []
    for segs in _batches(steps=4):
        plan = dp_balanced_plan(segs, dp=4, num_microbatches=4, max_tokens=4096)
        check_plan_covers(plan, segs, 4096)
        counts.append(plan.num_microbatches)
        assert plan.num_microbatches >= 4          # the sampler's order fills the fewest
        # no fill up to the capacity: each micro-batch is its documents' positions
        assert np.array_equal(plan.packed_lengths(), np.maximum(plan.tokens(), 1))
    assert max(counts) > 4, counts


def _megatron_scheduler():
    try:
        from megatron.core.datasets.data_schedule import DpBalancedScheduler
    except ImportError:
        return None
    return DpBalancedScheduler


@pytest.mark.skipif(_megatron_scheduler() is None,
                    reason="megatron-core here ships no DpBalancedScheduler (0.19.2 has none; "
                           "Megatron-LM main, 0.20: `make mcore020 MEGATRON_LM=...` then "
                           "`SB_MEGATRON_CORE_020=.mcore020 pytest ...`)")
@pytest.mark.parametrize("dp, vpp, cap", [(1, None, 4096), (4, None, 4096), (8, None, 2048),
                                          (4, 2, 4096), (8, 4, 8192)])
def test_groups_equal_megatron_cores_get_groups_and_subsamples(dp, vpp, cap):
    cls = _megatron_scheduler()
    rng = np.random.default_rng(dp * 31 + (vpp or 0))
    compared = 0
    for trial in range(20):
        n = int(rng.integers(dp * (vpp or 1) * 2, 300))
        lengths = np.where(rng.random(n) < 0.1, rng.integers(cap // 2, cap + 1, n),
                           rng.integers(1, cap // 8, n)).tolist()
        try:
            ref = cls(cap, 1, dp, vpp).get_groups_and_subsamples(list(enumerate(lengths)))
        except AssertionError:   # main stops before group 0 where dev (and we) move from it
            continue
        compared += 1
        assert dp_balanced_groups(lengths, max_seqlen_per_dp_cp_rank=cap, dp=dp,
                                  microbatch_group_size_per_vp_stage=vpp) == ref, trial
    assert compared >= 15, f"only {compared} of 20 trials compared"


def test_where_megatrons_rule_stops_the_study_gets_empty_groups_and_is_told():
    """Single long sequences (a long-document mix split at the capacity): the groups cannot be
    made a multiple of dp by moving sequences, where megatron-core asserts; ``empty_groups``
    pads with empty groups and the plan's ``fallback`` records it."""
    lengths = [4096] * 9                       # 9 groups of one: dp 8 needs 16
    with pytest.raises(BatchingError, match="cannot make a multiple of 8 groups"):
        dp_balanced_groups(lengths, max_seqlen_per_dp_cp_rank=4096, dp=8)
    groups = dp_balanced_groups(lengths, max_seqlen_per_dp_cp_rank=4096, dp=8,
                                empty_groups=True)
    assert [len(g) for mb in groups for g in mb] == [1] * 9 + [0] * 7
    plan = dp_balanced_plan(np.asarray(lengths), dp=8, num_microbatches=2, max_tokens=4096,
                            empty_groups=True)
    assert plan.fallback and plan.num_microbatches == 2
    ok = dp_balanced_plan(np.asarray([100] * 16), dp=8, num_microbatches=1, max_tokens=4096,
                          empty_groups=True)
    assert not ok.fallback


def test_under_vpp_the_plan_interleaves_as_megatron_makes_it():
    """Megatron's ``wrap_data_iterator`` passes ``microbatch_group_size_per_vp_stage`` (default
    pp) under VPP, and its packer then makes a multiple of dp x that many groups: 18 sequences of
    5 at cap 10 fill 9 groups; dp 2 alone makes 10 (5 micro-batches a rank, which the interleaved
    schedule refuses at pp 4), dp 2 x pp 4 makes 16 (8 a rank, which it runs). The study keys
    the plan by the layout's vp."""
    from sparsebalance_megatron.experiments.study import dp_balanced_key, dp_balanced_vpp_group
    from sparsebalance_megatron.latency.layout import PipelineLayout
    from sparsebalance_megatron.sim.pipeline import interleaved_refusal
    segs = np.full(18, 5)
    plain = dp_balanced_plan(segs, dp=2, num_microbatches=5, max_tokens=10)
    vpp = dp_balanced_plan(segs, dp=2, num_microbatches=5, max_tokens=10,
                           microbatch_group_size_per_vp_stage=4)
    assert plain.num_microbatches == 5 and interleaved_refusal(5, 4)
    assert vpp.num_microbatches == 8 and interleaved_refusal(8, 4) is None
    check_plan_covers(vpp, segs, 10)
    groups = dp_balanced_groups([5] * 18, max_seqlen_per_dp_cp_rank=10, dp=2,
                                microbatch_group_size_per_vp_stage=4)
    flat = [g for mb in groups for g in mb]
    assert flat[:2] == [[0, 1], [2, 3]] and all(len(g) == 1 for g in flat[2:])
    assert dp_balanced_key(PipelineLayout(4, 2, (1,) * 8)) == "dp_balanced/vpp4"
    assert dp_balanced_key(PipelineLayout(4, 1, (2,) * 4)) == "dp_balanced"
    assert dp_balanced_vpp_group("dp_balanced/vpp4") == 4
    assert dp_balanced_vpp_group("dp_balanced") is None
