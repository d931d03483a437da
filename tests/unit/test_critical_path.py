"""Critical-path descent (policy/critical_path.py, issue 27's headroom): after the band search, DST
cuts the units on paths longer than the step's target and raises the units with float; the plan
is kept only when it meets the floors (and quality rule), spends no density (mean >= d0) and is
predicted faster."""

import numpy as np
import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.policy import (density_grid, plan_dst_from_config,
                                           plan_dst_with_floor, weighted_mean_density)
from sparsebalance_megatron.policy.costs import stage_mean_densities
from sparsebalance_megatron.policy.critical_path import descend

from test_policy_dst import D0, DMAX, DMIN, _quality, step_time_of, synthetic_costs

FLOORS = dict(density_floor=0.9, stage_density_floor=0.75)


def test_descent_never_slower_keeps_the_floors_and_quality():
    rng = np.random.default_rng(7)
    faster = 0
    for case in range(10):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=700 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens = rng.random((dp, m))
        q = _quality(pp) if case % 2 else None
        band = plan_dst_with_floor(costs, sens, D0, DMIN, DMAX, quality=q, descent=False,
                                   **FLOORS)
        plan = plan_dst_with_floor(costs, sens, D0, DMIN, DMAX, quality=q, **FLOORS)
        d, r = plan.densities, plan.report
        t, t_band = step_time_of(costs, d), step_time_of(costs, band.densities)
        assert t <= t_band * (1 + 1e-12)                      # never slower than the band plan
        assert t <= step_time_of(costs, np.full(d.shape, D0)) * (1 + 1e-12)
        assert np.all((d >= DMIN - 1e-12) & (d <= DMAX + 1e-12))
        w = costs.weights()
        assert weighted_mean_density(d, w) >= 0.9 * D0 - 1e-9
        assert stage_mean_densities(d, w).min() >= 0.75 * D0 - 1e-9
        if q is not None:
            assert q.plan_cost(d) <= 1e-12
        if not np.array_equal(d, band.densities):             # descended: spends no density
            assert weighted_mean_density(d, w) >= D0 - 1e-9
        # the report describes the plan returned
        assert r.step_time_planned_s == pytest.approx(t)
        assert r.mean_density == pytest.approx(weighted_mean_density(d, w))
        assert r.speedup == pytest.approx(r.step_time_static_s / t)
        faster += t < t_band * (1 - 1e-3)
    assert faster >= 3                                        # the descent does find time


def test_descent_only_under_a_floor_a_cut_and_the_bottleneck_target():
    """The paper's rule without a floor, the never-cut ``max`` anchor and the accuracy-first
    raise target are left as they were."""
    costs = synthetic_costs(3, 6, 4, seed=1)
    for kw in (dict(), dict(anchor="max", **FLOORS), dict(raise_to="static", **FLOORS)):
        on = plan_dst_with_floor(costs, None, D0, DMIN, DMAX, **kw)
        off = plan_dst_with_floor(costs, None, D0, DMIN, DMAX, descent=False, **kw)
        np.testing.assert_array_equal(on.densities, off.densities)
    on = plan_dst_with_floor(costs, None, D0, DMIN, DMAX, **FLOORS)
    off = plan_dst_with_floor(costs, None, D0, DMIN, DMAX, descent=False, **FLOORS)
    assert on.report.step_time_planned_s < off.report.step_time_planned_s * 0.99


def test_descend_keeps_the_start_when_nothing_meets():
    costs = synthetic_costs(2, 4, 3, seed=3)
    idx = np.full(costs.shape, costs.index_of(D0))
    out, step = descend(costs, idx, costs.index_of(DMIN), costs.index_of(DMAX), 0.0, 0.05,
                        meets=lambda d: False)
    np.testing.assert_array_equal(out, idx)
    assert step == pytest.approx(step_time_of(costs, np.full(costs.shape, D0)))


def test_config_flag_switches_the_descent_and_names_itself_on_bad_values():
    with pytest.raises(ConfigError, match="--sb-dst-descent='on'"):
        SparseBalanceConfig(dst_descent="on")
    assert SparseBalanceConfig().dst_descent == "critical_path"
    costs = synthetic_costs(3, 6, 4, seed=1, grid=density_grid(D0, DMIN, DMAX))
    kw = dict(sparse_balance=True, density=D0, min_density=DMIN, max_density=DMAX,
              dst_objective="density", raise_headroom="0.05")
    on = plan_dst_from_config(SparseBalanceConfig(**kw), costs, None)
    off = plan_dst_from_config(SparseBalanceConfig(dst_descent="off", **kw), costs, None)
    ref = plan_dst_with_floor(costs, None, D0, DMIN, DMAX, raise_headroom=0.05, descent=False,
                              **FLOORS)
    np.testing.assert_array_equal(off.densities, ref.densities)
    assert on.report.step_time_planned_s < off.report.step_time_planned_s


def test_issue27_long_tail_interleaved_case_gains_what_the_band_leaves():
    """The issue's case (long_tail seed 0, its best static layout, vp 2; 4 DP ranks to keep it
    cheap): SAB-free DST under the runtime's defaults (quality objective, floors, raise headroom)
    was within 0.2% of static; the descent finds the longest path's time, losing no predicted
    quality."""
    from sparsebalance_megatron.experiments import StudyConfig, run_study
    from sparsebalance_megatron.experiments.mixes import mix_lengths
    from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout
    from sparsebalance_megatron.latency.analytic import ideal_price

    # the ideal FLOP-priced kernel the case was found with (the descent is the subject here)
    lm = LatencyModel.analytic(ModelShape(seq_length=32768), pp=4, sparse_price=ideal_price())
    lengths = mix_lengths("long_tail", 0, total_tokens=4 * 8 * 32768, tokenizer="qwen")
    lay = PipelineLayout.from_string("Et*3|t*3|t*3|t*2|t*4|t*5|t*4|L", pp=4)  # [3+4]/[3+5]/..
    rows = {}
    for descent in ("off", "critical_path"):
        cfg = StudyConfig(steps=1, seed=0, dst_descent=descent)
        rows[descent] = run_study(4, cfg, lm, lengths, {"static": ("static", lay),
                                                        "dst": ("dst", lay)})["dst"]
    assert rows["off"]["speedup_vs_static"] < 1.02
    on = rows["critical_path"]
    assert on["speedup_vs_static"] > 1.05
    assert on["mean_density"] >= 0.5 - 1e-9 and on["min_stage_density"] >= 0.75 * 0.5 - 1e-9
    assert on["predicted_loss"] <= 1e-9
