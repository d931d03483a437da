"""DST's default objective, quality (``--sb-dst-objective quality``): water-filling spreads a
stage's cut over its micro-batches, a plan keeps predicted quality and speed against the density
objective's, which competes where water-filling loses; the objective needs the stages' layers
and the density objective stays selectable; with the descent the quality search runs alone."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, UnitCosts, density_grid, plan_dst
from sparsebalance_megatron.policy.dst import SPEED_TIE

from test_policy_dst import D0, DMAX, DMIN, _quality, step_time_of, synthetic_costs


def test_quality_water_filling_spreads_cuts_over_equal_micro_batches():
    """Four identical micro-batches on a heavy last stage: the order rule cuts the least
    sensitive ones to d_min and leaves the rest; quality water-filling cuts all of them to
    about the same density (convex cost: no starved micro-batch) and sheds the same excess."""
    from sparsebalance_megatron.policy.dst import BandCache, plan_dst_candidates
    g = density_grid(D0, DMIN, DMAX)
    fixed = np.ones((1, 4, 2))
    fixed[..., 1] += 0.6                                   # LM-head stage
    costs = UnitCosts.affine(g, fixed, np.full((1, 4, 2), 1.0))
    sens = np.asarray([[0.1, 0.2, 0.3, 0.4]])
    q = _quality(2)
    fill = plan_dst_candidates(costs, sens, DSTSettings(D0, DMIN, DMAX), [("mean", 0.0)],
                               quality=q)[0]
    order = plan_dst(costs, sens, D0, DMIN, DMAX, tolerance=0.0)
    last_fill, last_order = fill.densities[0, :, 1], order.densities[0, :, 1]
    assert np.ptp(last_fill) <= 1.0 / 64 + 1e-12 and last_fill.max() < D0
    assert np.ptp(last_order) > 0.25                       # concentrated
    assert fill.report.step_time_cut_s <= order.report.step_time_cut_s * (1 + 0.02)
    assert q.plan_cost(fill.densities) < q.plan_cost(order.densities)


def test_quality_objective_keeps_predicted_quality_and_speed():
    from sparsebalance_megatron.policy import plan_dst_with_floor
    rng = np.random.default_rng(5)
    cheaper = 0
    for case in range(12):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=500 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens = rng.random((dp, m))
        q = _quality(pp)
        # the choice between the objectives' plans (each descended alone would end elsewhere:
        # tests/unit/test_critical_path.py)
        floors = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                             descent=False)
        plan = plan_dst_with_floor(costs, sens, floors, quality=q)
        assert plan.report.quality_cost == pytest.approx(q.plan_cost(plan.densities))
        assert plan.report.quality_cost <= 1e-12
        static = step_time_of(costs, np.full((dp, m, pp), D0))
        assert step_time_of(costs, plan.densities) <= static * (1 + 1e-9)
        dens = plan_dst_with_floor(costs, sens, floors)
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
    from sparsebalance_megatron.policy import plan_dst_with_floor
    from sparsebalance_megatron.policy.dst import BandCache, _plan_with_floor
    rng = np.random.default_rng(11)
    swapped = 0
    for case in range(40):
        dp, m, pp = int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=900 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens, q = rng.random((dp, m)), _quality(pp)
        settings = DSTSettings(D0, DMIN, DMAX, anchor="mean", tolerance=0.1, p2p_s=0.0,
                               density_floor=0.9, search_steps=6, raise_headroom=0.0,
                               stage_density_floor=0.75, raise_to="static")
        filled = _plan_with_floor(costs, sens, settings, quality=q, static=BandCache())
        order = plan_dst_with_floor(costs, sens, settings)
        plan = plan_dst_with_floor(costs, sens, settings, quality=q)
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
    from sparsebalance_megatron.policy import plan_dst_from_config
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
    the density objective, still selectable, plans plan_dst_with_floor without a quality cost."""
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.policy import plan_dst_from_config, plan_dst_with_floor
    from sparsebalance_megatron.policy.dst import DEFAULT_RAISE_HEADROOM
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
        assert np.array_equal(dens.densities, plan_dst_with_floor(costs, sens, DSTSettings(
            D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
            raise_headroom=DEFAULT_RAISE_HEADROOM)).densities)
        assert np.isnan(dens.report.quality_cost)             # no quality cost was evaluated
        moved += not np.array_equal(got.densities, dens.densities)
    assert moved >= 1, "the two objectives planned alike in every case: nothing was compared"


def test_with_the_descent_the_quality_objective_searches_its_band_alone():
    """Where the critical-path descent refines the band plan, the quality objective's
    water-filling search runs alone (every row of every pass water-fills); without the descent
    the density objective's search runs beside it (half the rows) and its plan competes."""
    import sparsebalance_megatron.policy.dst as dst

    costs = synthetic_costs(3, 6, 3, seed=8, lm_head=3.0)
    sens, q = np.random.default_rng(8).random((3, 6)), _quality(3)
    water = []
    real = dst.plan_dst_candidates

    def seen(*a, **k):
        water.append(list(k["water"]))
        return real(*a, **k)

    for extra, both in ((dict(), False), (dict(descent=False), True),
                        (dict(raise_to="static"), True)):
        water.clear()
        settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                               **extra)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dst, "plan_dst_candidates", seen)
            plan = dst.plan_dst_with_floor(costs, sens, settings, quality=q)
        assert water and all(any(w) for w in water)
        assert all(not all(w) for w in water) == both, (extra, water)
        assert plan.report.quality_cost <= 1e-12
