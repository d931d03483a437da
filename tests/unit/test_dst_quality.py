"""DST's default objective, quality (``--sb-dst-objective quality``): water-filling spreads a
stage's cut over its micro-batches, a plan keeps predicted quality and speed against the density
objective's, which competes where water-filling loses; the objective needs the stages' layers
and the density objective stays selectable; with the descent the quality search runs alone."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, density_grid, plan_dst
from sparsebalance_megatron.policy.dst_band import SPEED_TIE
from sparsebalance_megatron.policy.quality_bound import bind_quality
from tests.unit._bands import band_plan, band_plans, central_plan, rule_free
from tests.unit._costs import affine_costs

from test_policy_dst import (D0, DMAX, DMIN, _quality, plan_dst_from_config, step_time_of,
                             synthetic_costs)


def test_quality_water_filling_spreads_cuts_over_equal_micro_batches():
    """Four identical micro-batches on a heavy last stage: the order rule cuts the least
    sensitive ones to d_min and leaves the rest; quality water-filling cuts all of them to
    about the same density (convex cost: no starved micro-batch) and sheds the same excess."""
    g = density_grid(D0, DMIN, DMAX)
    fixed = np.ones((1, 4, 2))
    fixed[..., 1] += 0.6                                   # LM-head stage
    costs = affine_costs(g, fixed, np.full((1, 4, 2), 1.0))
    sens = np.asarray([[0.1, 0.2, 0.3, 0.4]])
    q = bind_quality(_quality(2), costs)
    fill = band_plans(costs, sens, DSTSettings(D0, DMIN, DMAX), [("mean", 0.0)], quality=q)[0]
    order = band_plan(costs, sens, D0, DMIN, DMAX, tolerance=0.0)
    last_fill, last_order = fill.densities[0, :, 1], order.densities[0, :, 1]
    assert np.ptp(last_fill) <= 1.0 / 64 + 1e-12 and last_fill.max() < D0
    assert np.ptp(last_order) > 0.25                       # concentrated
    assert fill.report.step_time_cut_s <= order.report.step_time_cut_s * (1 + 0.02)
    assert q.plan_cost(fill.densities) < q.plan_cost(order.densities)


def test_quality_objective_keeps_predicted_quality_and_speed():
    """The searches' plan (the last rule left out: ``rule_free``)."""
    rng = np.random.default_rng(5)
    cheaper = 0
    for case in range(12):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=500 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens = rng.random((dp, m))
        q = bind_quality(_quality(pp), costs)
        # the choice between the objectives' plans (each descended alone would end elsewhere:
        # tests/unit/test_critical_path.py)
        floors = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                             descent=False)
        plan = plan_dst(costs, sens, rule_free(floors), quality=_quality(pp))
        assert plan.report.quality_cost == pytest.approx(q.plan_cost(plan.densities))
        assert plan.report.quality_cost <= 1e-12
        static = step_time_of(costs, np.full((dp, m, pp), D0))
        assert step_time_of(costs, plan.densities) <= static * (1 + 1e-9)
        dens = plan_dst(costs, sens, floors)
        cheaper += q.plan_cost(plan.densities) < q.plan_cost(dens.densities) - 1e-9
        # never slower (beyond the tie) and costlier than the density objective's plan
        t_q, t_d = step_time_of(costs, plan.densities), step_time_of(costs, dens.densities)
        if q.plan_cost(dens.densities) <= 1e-12:
            assert t_q <= t_d * (1 + SPEED_TIE) + 1e-12
            assert t_q < t_d or q.plan_cost(plan.densities) <= q.plan_cost(dens.densities) + 1e-12
    assert cheaper >= 3


def test_quality_objective_takes_the_order_plan_when_water_filling_loses():
    """Water-filling spreads the LM-head stage's cut over many micro-batches, which can leave
    less room to raise the other stages than the order rule's concentrated cut: then the
    quality objective returns the order plan, which the quality cost prefers."""
    rng = np.random.default_rng(11)
    swapped = 0
    for case in range(40):
        dp, m, pp = int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=900 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens, q = rng.random((dp, m)), bind_quality(_quality(pp), costs)
        settings = rule_free(DSTSettings(D0, DMIN, DMAX, anchor="mean", tolerance=0.1,
                                         p2p_s=0.0, density_floor=0.9,
                                         raise_headroom=0.0, stage_density_floor=0.75,
                                         raise_to="static"))
        filled = central_plan(costs, sens, settings, quality=q, objectives=[True])
        order = plan_dst(costs, sens, settings)
        plan = plan_dst(costs, sens, settings, quality=_quality(pp))
        c_f, c_o = q.plan_cost(filled.densities), q.plan_cost(order.densities)
        t_f, t_o = filled.report.step_time_planned_s, order.report.step_time_planned_s
        if c_o > 1e-12 or t_o > t_f * (1 + SPEED_TIE):      # order plan not eligible / slower
            want = filled
        elif t_f > t_o * (1 + SPEED_TIE):                    # water-filling slower
            want = order
        else:                                                # as fast: the cheaper one
            want = order if c_o < c_f else filled
        assert np.array_equal(plan.densities, want.densities)
        assert plan.report.quality_cost == pytest.approx(q.plan_cost(want.densities))
        swapped += want is order and c_o < c_f - 1e-9
    assert swapped >= 1


def test_quality_objective_from_config_needs_the_stage_layers():
    from sparsebalance_megatron.config import SparseBalanceConfig
    costs = synthetic_costs(2, 4, 2, seed=3)
    cfg = SparseBalanceConfig(sparse_balance=True, dst_objective="quality")
    with pytest.raises(ValueError, match="needs the decoder layers of each of the 2 stages"):
        plan_dst_from_config(cfg, costs, None)
    with pytest.raises(ValueError, match="needs the decoder layers"):
        plan_dst_from_config(cfg, costs, None, stage_layers=[12, 12, 12])   # 3 for 2 stages
    plan = plan_dst_from_config(cfg, costs, None, stage_layers=[12, 12])   # the shipped cost
    assert plan.report.quality_cost <= 1e-12


def test_the_default_objective_is_quality_and_density_stays_selectable():
    """Quality is the default (issue 16's measurements); a default config plans exactly what an
    explicit dst_objective="quality" plans, refuses to plan without the stages' layer counts
    (with a message naming the density objective, which needs none: no silent fall-back), and
    the density objective, still selectable, plans without a quality cost."""
    from sparsebalance_megatron.config import DEFAULT_RAISE_HEADROOM, SparseBalanceConfig
    assert SparseBalanceConfig().dst_objective == "quality"
    rng = np.random.default_rng(16)
    moved = 0
    for case in range(6):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=1600 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens, layers = rng.random((dp, m)), [int(x) for x in rng.integers(1, 9, size=pp)]
        default = SparseBalanceConfig(sparse_balance=True)
        with pytest.raises(ValueError, match=r"\(the default\) needs the decoder layers.*"
                                             r"--sb-dst-objective density"):
            plan_dst_from_config(default, costs, sens)
        got = plan_dst_from_config(default, costs, sens, stage_layers=layers)
        want = plan_dst_from_config(SparseBalanceConfig(sparse_balance=True,
                                                        dst_objective="quality"),
                                    costs, sens, stage_layers=layers)
        assert np.array_equal(got.densities, want.densities)
        assert got.report.quality_cost <= 1e-12               # predicted no worse than uniform d0
        density = SparseBalanceConfig(sparse_balance=True, dst_objective="density")
        dens = plan_dst_from_config(density, costs, sens)     # needs no layer counts
        assert np.array_equal(dens.densities, plan_dst(costs, sens, DSTSettings(
            D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
            raise_headroom=DEFAULT_RAISE_HEADROOM)).densities)
        assert np.isnan(dens.report.quality_cost)             # no quality cost was evaluated
        moved += not np.array_equal(got.densities, dens.densities)
    assert moved >= 1, "the two objectives planned alike in every case: nothing was compared"


def test_with_the_descent_the_quality_objective_searches_its_band_alone():
    """Where the critical-path descent refines the band plan, the quality objective's
    water-filling search runs alone (every row water-fills); without the descent the density
    objective's search runs beside it (half the rows) and its plan competes."""
    from sparsebalance_megatron.policy.dst_ranks import RankDST, rank_slice

    costs = synthetic_costs(3, 6, 3, seed=8, lm_head=3.0)
    sens, q = np.random.default_rng(8).random((3, 6)), _quality(3)
    for extra, both in ((dict(), False), (dict(descent=False), True),
                        (dict(raise_to="static"), True)):
        settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                               **extra)
        rk = RankDST(rank_slice(costs, 0), sens[:1], settings, quality=q)
        assert rk.water.any() and (not rk.water.all()) == both, extra
        assert plan_dst(costs, sens, settings, quality=q).report.quality_cost <= 1e-12


def test_a_cut_is_adopted_only_where_it_pays_and_the_model_is_sure():
    """The quality objective's last rule: the searched plan is kept only where its predicted
    loss change plus the model's uncertainty is at most 0 and its speed gain, at the exchange
    rate, pays for what its cuts add over the plan without cuts (the ``max`` band: raises into
    bubbles only); else that plan, never slower than static and never worse than uniform d0."""
    from dataclasses import replace

    rng = np.random.default_rng(31)
    seen = set()
    for case in range(16):
        dp, m, pp = int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(2, 4))
        costs = synthetic_costs(dp, m, pp, seed=3100 + case, lm_head=float(rng.uniform(0.5, 3)))
        sens, q = rng.random((dp, m)), _quality(pp)
        base = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75)
        searched = plan_dst(costs, sens, rule_free(base), quality=q)
        nocut = band_plans(costs, sens, base, [("max", base.tolerance)],
                           quality=bind_quality(q, costs))[0]
        assert nocut.report.units_cut == 0 and nocut.report.quality_cost <= 1e-12
        for rate in (0.0, 0.002, 0.02, 1e9):
            plan = plan_dst(costs, sens, replace(base, exchange_rate=rate), quality=q)

            def value(r):
                return rate * 100 * (1 - r.step_time_planned_s / r.step_time_static_s) \
                    - r.quality_cost

            r = plan.report
            assert r.quality_sd == 0.0                           # a model without replicates
            if searched.report.quality_cost <= 1e-12 and \
                    value(searched.report) >= value(nocut.report) - 1e-15:   # u is 0 here
                assert r.adopted == "dst"
                np.testing.assert_array_equal(plan.densities, searched.densities)
            else:
                assert r.adopted == "no_cuts" and r.units_cut == 0
                np.testing.assert_array_equal(plan.densities, nocut.densities)
                assert r.step_time_planned_s <= r.step_time_static_s * (1 + 1e-9)
            seen.add((rate, r.adopted))
    assert (0.0, "no_cuts") in seen and (1e9, "dst") in seen
