"""Heterogeneous ranks in the simulated study (issue 27): one GPU slower, applied to its units,
seen by DST (experiments.heterogeneous); deterministic, model timing only."""

import numpy as np
import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.experiments import StudyConfig, run_study
from sparsebalance_megatron.experiments.heterogeneous import (SlowRank, parse_slow_rank,
                                                              rank_scale, scale_costs)
from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout
from sparsebalance_megatron.policy import UnitCosts, density_grid
from sparsebalance_megatron.sim.pipeline import pipeline_makespan_s
from test_policy_dst import plan_dst_from_config


def test_parse_and_place_a_slow_rank():
    s = parse_slow_rank("3:1.1")
    assert s == SlowRank(3, 1.1) and s.describe() == "3:1.1"
    # R = dp_rank + dp * pipeline_rank (Megatron's global rank at TP = CP = 1)
    scale = rank_scale([s, SlowRank(0, 1.05)], dp=2, pp=2)
    assert scale.tolist() == [[1.05, 1.0], [1.0, 1.1]]
    with pytest.raises(ValueError, match="rank 8 is not one of the 8 ranks of DP=2 x PP=4"):
        rank_scale([SlowRank(8, 1.1)], dp=2, pp=4)


@pytest.mark.parametrize("text, needle", [("3", "expected RANK:FACTOR"),
                                          ("a:1.1", "expected RANK:FACTOR"),
                                          ("1:0.9", "factor 0.9: expected a number in [1, 100]"),
                                          ("-1:1.1", "rank -1: expected an integer >= 0")])
def test_bad_slow_rank_is_named(text, needle):
    with pytest.raises(ValueError, match=rf"--slow-rank .*{needle.replace('[', '.')}"):
        parse_slow_rank(text)


def test_interleaved_virtual_stages_slow_on_their_pipeline_rank():
    ones = np.ones((2, 1, 4, 2))                 # dp 2, m 1, pp 2 x vp 2, grid of 2
    c = UnitCosts(np.array([0.5, 1.0]), ones, ones, ones[..., 0], pipeline_ranks=2)
    s = scale_costs(c, [SlowRank(3, 2.0)])       # dp rank 1, pipeline rank 1: stages 1 and 3
    assert s.fwd_s[0].max() == 1.0
    assert s.fwd_s[1, 0, :, 0].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert scale_costs(c, ()) is c


def _plan(costs, sb, lm):
    plan = plan_dst_from_config(sb, costs, None, lm.p2p_s,
                                stage_layers=lm.layout.attention_layers)
    idx = np.searchsorted(costs.densities, plan.densities - 1e-12)
    static = np.full(costs.shape, costs.index_of(sb.density))
    step = [float(pipeline_makespan_s(*costs.at(i), lm.p2p_s).max()) for i in (static, idx)]
    return plan.densities, step[0] / step[1]


def test_dst_cuts_the_slow_gpu_and_gains_more_than_without_it():
    """At the default exchange rate (the step's uniform trade) DST cuts the slow GPU: the cut
    buys its 5% for far less predicted loss than lowering every unit's density would; where
    speed is worth nothing (rate 0) its peer's raises into the wait are kept instead, no cut
    (``test_dst_quality``: the rule)."""
    from dataclasses import replace

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=32768), pp=2)
    dp, m = 2, 4
    sb = SparseBalanceConfig(sparse_balance=True)
    free = replace(sb, exchange_rate="0")
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    costs = UnitCosts.from_latency(lm, [[32768]] * (dp * m), dp, m, grid)
    uniform, gain_uniform = _plan(costs, sb, lm)
    slow, gain_slow = _plan(scale_costs(costs, [SlowRank(3, 1.1)]), sb, lm)  # dp 1, stage 1
    assert slow[1, :, 1].mean() < uniform[1, :, 1].mean()      # the slow GPU is cut
    assert slow[0, :, 1].mean() > uniform[0, :, 1].mean()      # its peer waits: raised instead
    assert gain_slow > gain_uniform + 0.02                     # DST over static on one layout
    kept, gain_kept = _plan(scale_costs(costs, [SlowRank(3, 1.1)]), free, lm)
    assert np.all(kept >= sb.density) and gain_kept == pytest.approx(1.0)   # no cut
    assert kept[0, :, 1].mean() > uniform[0, :, 1].mean()      # the peer raised into the wait


def test_study_runs_every_variant_on_the_slow_gpu():
    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=4)
    lengths = np.full(200, 3000)
    lay = PipelineLayout.even(8, 4)
    runs = {"static": ("static", lay), "dst": ("dst", lay)}
    base = run_study(2, StudyConfig(microbatches=4, seq_length=8192, steps=1), lm, lengths, runs)
    cfg = StudyConfig(microbatches=4, seq_length=8192, steps=1, slow_ranks=(SlowRank(7, 1.1),))
    slow = run_study(2, cfg, lm, lengths, runs)
    # the LM-head stage (the bottleneck) of DP rank 1: the step waits for that replica
    ratio = slow["static"]["step_time_s"] / base["static"]["step_time_s"]
    assert 1.02 < ratio <= 1.1 + 1e-9
    with pytest.raises(ValueError, match="--slow-rank 9:1.1: rank 9 is not one of the 8"):
        run_study(2, StudyConfig(microbatches=4, seq_length=8192, steps=1,
                                 slow_ranks=(SlowRank(9, 1.1),)), lm, lengths, runs)
