"""DST policy: properties of the plan (never slower, bounds, max never cuts, determinism),
the cut/raise behaviour on hand-built cases, validation, large plans and the density floors;
the cases other planner tests share (``synthetic_costs``, ``_quality``). The quality
objective's own tests: ``test_dst_quality.py``."""


import numpy as np
import pytest

from sparsebalance_megatron.policy import (DSTSettings, UnitCosts, density_grid, dst_inputs,
                                           plan_dst, weighted_mean_density)
from sparsebalance_megatron.policy.quality_bound import bind_quality
from sparsebalance_megatron.sim.pipeline import simulate_1f1b
from tests.unit._bands import band_plan, band_plans
from tests.unit._costs import affine_costs

D0, DMIN, DMAX = 0.5, 0.125, 1.0


def synthetic_costs(dp, m, pp, seed, grid=None, lm_head=0.3, attn_scale=1.6):
    """Affine unit costs with a heavy-tailed attention part (packed 32K micro-batches of
    Pareto-length documents) and a heavier last stage (LM head + loss)."""
    rng = np.random.default_rng(seed)
    attn = np.zeros((dp, m))
    for r in range(dp):
        for j in range(m):
            lengths = np.minimum(rng.pareto(1.1, size=64) * 800 + 64, 32768)
            lengths = lengths[np.cumsum(lengths) <= 32768]
            attn[r, j] = (lengths ** 2).sum() / 32768 ** 2 + rng.random() * 0.02
    fixed = np.ones((dp, m, pp)) * (1 + 0.05 * rng.random((dp, m, pp)))
    fixed[..., -1] += lm_head
    attn_s = np.broadcast_to(attn[:, :, None] * attn_scale, (dp, m, pp)).copy()
    g = density_grid(D0, DMIN, DMAX) if grid is None else grid
    return affine_costs(g, fixed, attn_s)


def plan_dst_from_config(config, costs, sensitivity, p2p_s=0.0, raise_headroom=None,
                         stage_layers=None):
    """``plan_dst`` with the settings of a ``SparseBalanceConfig`` (``dst_inputs``)."""
    settings, quality = dst_inputs(config, costs.shape[2], p2p_s, raise_headroom, stage_layers)
    return plan_dst(costs, sensitivity, settings, quality=quality)


def step_time_of(costs, densities, rank=None):
    """Simulated step time of a plan, or the makespan of one DP rank."""
    idx = np.searchsorted(costs.densities, densities - 1e-12)
    assert np.allclose(costs.densities[idx], densities), "density off the grid"
    f = np.take_along_axis(costs.fwd_s, idx[..., None], axis=-1)[..., 0]
    b = np.take_along_axis(costs.bwd_s, idx[..., None], axis=-1)[..., 0]
    sim = simulate_1f1b(f, b)
    return sim.step_time_s if rank is None else float(sim.rank_time_s[rank])


def test_properties_over_random_cases():
    rng = np.random.default_rng(0)
    for case in range(40):
        dp, m, pp = int(rng.integers(1, 9)), int(rng.integers(1, 7)), int(rng.integers(1, 5))
        costs = synthetic_costs(dp, m, pp, seed=case)
        sens = rng.random((dp, m))
        anchor = ("mean", "max")[case % 2]
        tol = float(rng.choice([0.0, 0.05, 0.1, 0.3]))
        plan = band_plan(costs, sens, D0, DMIN, DMAX, anchor=anchor, tolerance=tol)
        d, rep = plan.densities, plan.report
        static = step_time_of(costs, np.full((dp, m, pp), D0))
        planned = step_time_of(costs, d)
        assert d.shape == (dp, m, pp)
        assert np.all(d >= DMIN - 1e-12) and np.all(d <= DMAX + 1e-12)
        assert planned <= static * (1 + 1e-9), (case, anchor, planned, static)
        assert rep.step_time_planned_s == pytest.approx(planned)
        assert rep.step_time_static_s == pytest.approx(static)
        if anchor == "max":
            assert np.all(d >= D0 - 1e-12) and rep.units_cut == 0
        assert rep.units_cut == int((d < D0 - 1e-12).sum())
        assert rep.units_raised == int((d > D0 + 1e-12).sum())
        again = band_plan(costs, sens.copy(), D0, DMIN, DMAX, anchor=anchor, tolerance=tol)
        assert np.array_equal(again.densities, d)


def test_straggler_rank_is_cut_least_sensitive_first_and_others_raised():
    dp, m, pp = 4, 4, 1
    fixed = np.ones((dp, m, pp))
    attn = np.full((dp, m, pp), 0.4)
    attn[2] = 3.0                                   # rank 2 holds the long documents
    costs = affine_costs(density_grid(D0, DMIN, DMAX), fixed, attn)
    sens = np.tile(np.array([0.3, 0.1, 0.4, 0.2]), (dp, 1))
    plan = band_plan(costs, sens, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
    d, rep = plan.densities[..., 0], plan.report
    assert rep.step_time_planned_s < 0.8 * rep.step_time_static_s
    assert d[2].mean() < 0.5 * D0 and d[2].max() <= D0
    # least sensitive micro-batch (index 1) is cut deepest, the most sensitive (2) least
    assert d[2, 1] == d[2].min() and d[2, 2] == d[2].max()
    # the light ranks turn their slack into density, most sensitive first
    assert np.all(d[[0, 1, 3]] >= D0)
    assert d[0, 2] == d[0].max()
    assert rep.imbalance_after < rep.imbalance_before
    # never cut below d_min even if the band is unreachable
    hard = band_plan(costs, sens, D0, DMIN, DMAX, tolerance=0.0)
    assert hard.densities.min() >= DMIN


def test_cheaper_stage_is_raised_without_growing_step_time():
    dp, m, pp = 2, 6, 2
    fixed = np.ones((dp, m, pp))
    fixed[..., 1] = 1.8                             # last stage: LM head + loss
    attn = np.full((dp, m, pp), 0.6)
    costs = affine_costs(density_grid(D0, DMIN, DMAX), fixed, attn)
    plan = band_plan(costs, None, D0, DMIN, DMAX, anchor="max")
    d = plan.densities
    assert np.all(d[:, 1:-1, 0] > D0)               # first stage fills its bubble
    assert np.all(d[..., 0] >= D0)
    assert np.all(d[..., 1] == D0)                  # bottleneck stage unchanged
    assert plan.report.step_time_planned_s <= plan.report.step_time_static_s * (1 + 1e-9)
    assert plan.report.mean_density > D0


def test_mean_anchor_cuts_heavy_last_stage_and_raises_the_rest():
    costs = synthetic_costs(8, 8, 4, seed=3, lm_head=0.8)
    plan = band_plan(costs, None, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
    d = plan.densities
    assert d[..., -1].mean() < D0 < d[..., 0].mean()
    assert plan.report.speedup > 1.02


def test_weighted_mean_density():
    d = np.array([[[0.25], [1.0]]])
    w = np.array([[[3.0], [1.0]]])
    assert weighted_mean_density(d, w) == pytest.approx((0.75 + 1.0) / 4)
    with pytest.raises(ValueError):
        weighted_mean_density(d, w[:, :1])


@pytest.mark.parametrize("kw, flag", [
    (dict(anchor="average"), "--sb-anchor"),
    (dict(tolerance=-0.1), "--sb-tolerance"),
    (dict(tolerance=float("nan")), "--sb-tolerance"),
    (dict(tolerance=11.0), "--sb-tolerance"),
])
def test_bad_anchor_or_tolerance_names_the_flag(kw, flag):
    costs = synthetic_costs(2, 2, 2, seed=0)
    with pytest.raises(ValueError, match=flag):
        band_plan(costs, None, D0, DMIN, DMAX, **kw)


@pytest.mark.parametrize("kw, named", [
    (dict(density_floor=1.5), "--sb-density-floor=1.5"),
    (dict(stage_density_floor=-0.1), "--sb-stage-density-floor=-0.1"),
    (dict(p2p_s=float("nan")), "p2p_s=nan"),
    (dict(raise_to="later"), "--sb-raise-to='later'"),
])
def test_bad_settings_are_named_where_the_record_is_made(kw, named):
    with pytest.raises(ValueError, match=named):
        DSTSettings(D0, DMIN, DMAX, **kw)


def test_settings_from_config_are_the_configs_knobs():
    from sparsebalance_megatron.config import DEFAULT_RAISE_HEADROOM, SparseBalanceConfig
    cfg = SparseBalanceConfig(density=0.25, min_density=0.125, max_density=0.5, anchor="max",
                              tolerance=0.3, density_floor=0.8, stage_density_floor=0.5,
                              raise_to="static", dst_descent="off")
    assert DSTSettings.from_config(cfg, p2p_s=1e-3) == DSTSettings(
        0.25, 0.125, 0.5, anchor="max", tolerance=0.3, p2p_s=1e-3, density_floor=0.8,
        stage_density_floor=0.5, raise_headroom=DEFAULT_RAISE_HEADROOM, raise_to="static",
        descent=False)
    assert DSTSettings.from_config(cfg, raise_headroom=0.2).raise_headroom == 0.2


def test_bad_bounds_and_shapes():
    costs = synthetic_costs(2, 3, 2, seed=0)
    with pytest.raises(ValueError, match="--sb-density"):
        band_plan(costs, None, 0.05, DMIN, DMAX)
    with pytest.raises(ValueError, match="--sb-max-density"):
        density_grid(D0, DMIN, 1.5)
    with pytest.raises(ValueError, match="sensitivity"):
        band_plan(costs, np.zeros((3, 3)), D0, DMIN, DMAX)
    with pytest.raises(ValueError, match="not on the cost grid"):
        band_plan(costs, None, 0.51, DMIN, DMAX)
    with pytest.raises(ValueError, match="bwd_s"):
        UnitCosts(costs.densities, costs.fwd_s, costs.bwd_s[:, :1], costs.attn_work)
    with pytest.raises(ValueError, match="finite"):
        UnitCosts(costs.densities, -costs.fwd_s, costs.bwd_s, costs.attn_work)


def test_costs_are_made_monotone_in_density():
    g = np.array([0.25, 0.5, 1.0])
    f = np.array([1.0, 0.9, 1.2]).reshape(1, 1, 1, 3)
    c = UnitCosts(g, f, f, f[..., 0])
    assert np.all(np.diff(c.fwd_s, axis=-1) >= 0)


def test_planning_64_ranks_16_microbatches_4_stages_is_deterministic():
    """A large plan is well-formed and identical when repeated (its cost, about a millisecond,
    is measured by scripts/bench.py planner_cost, not here: no wall clock in tests)."""
    costs = synthetic_costs(64, 16, 4, seed=7)
    sens = np.random.default_rng(7).random((64, 16))
    a = band_plan(costs, sens, D0, DMIN, DMAX)
    b = band_plan(costs, sens, D0, DMIN, DMAX)
    assert a.densities.shape == (64, 16, 4)
    assert np.array_equal(a.densities, b.densities)
    assert np.all((a.densities >= DMIN - 1e-12) & (a.densities <= DMAX + 1e-12))


def test_unit_costs_from_latency_model_match_its_predictions():
    from sparsebalance_megatron.latency import LatencyModel
    lm = LatencyModel.analytic(pp=2)
    rng = np.random.default_rng(0)
    units = [rng.integers(64, 4000, size=int(rng.integers(1, 5))) for _ in range(6)]  # dp=3, m=2
    g = density_grid(D0, DMIN, DMAX)
    c = UnitCosts.from_latency(lm, units, dp=3, num_microbatches=2, densities=g)
    i = c.index_of(0.75)
    for u, lengths in enumerate(units):
        for s in range(2):
            f, b = lm.predict_fwd_bwd(lengths, 0.75, s)
            assert c.fwd_s[u // 2, u % 2, s, i] == pytest.approx(f)
            assert c.bwd_s[u // 2, u % 2, s, i] == pytest.approx(b)
    assert np.all(c.attn_work[..., 0] == c.attn_work[..., 1]) and np.all(c.attn_work > 0)
    with pytest.raises(ValueError, match="dp x m"):
        UnitCosts.from_latency(lm, units, dp=2, num_microbatches=2, densities=g)


def test_plan_from_config_uses_its_knobs():
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.config import DEFAULT_RAISE_HEADROOM
    # the density objective's plan is plan_dst's (the quality objective's default is tested below)
    cfg = SparseBalanceConfig(density=0.25, min_density=0.125, max_density=0.5, anchor="max",
                              dst_objective="density")
    costs = synthetic_costs(3, 4, 2, seed=2, grid=density_grid(0.25, 0.125, 0.5))
    plan = plan_dst_from_config(cfg, costs, None)
    assert plan.report.units_cut == 0 and plan.densities.max() <= 0.5
    # 'auto' headroom without a measured error: the default
    assert np.array_equal(plan.densities, band_plan(
        costs, None, 0.25, 0.125, 0.5, anchor="max",
        raise_headroom=DEFAULT_RAISE_HEADROOM).densities)
    fixed = SparseBalanceConfig(density=0.25, min_density=0.125, max_density=0.5, anchor="max",
                                raise_headroom="0", dst_objective="density")
    assert np.array_equal(plan_dst_from_config(fixed, costs, None).densities,
                          band_plan(costs, None, 0.25, 0.125, 0.5, anchor="max").densities)
    assert np.array_equal(plan_dst_from_config(fixed, costs, None, raise_headroom=0.2).densities,
                          band_plan(costs, None, 0.25, 0.125, 0.5, anchor="max",
                                   raise_headroom=0.2).densities)


def test_raise_headroom_keeps_raised_ranks_below_the_lowered_target():
    rng = np.random.default_rng(5)
    for case in range(20):
        dp, m, pp = int(rng.integers(2, 7)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
        costs = synthetic_costs(dp, m, pp, seed=300 + case)
        sens = rng.random((dp, m))
        prev_density = None
        for h in (0.0, 0.05, 0.2):
            plan = band_plan(costs, sens, D0, DMIN, DMAX, anchor="mean", tolerance=0.1,
                            raise_headroom=h)
            cut_only = band_plan(costs, sens, D0, DMIN, D0, anchor="mean", tolerance=0.1)
            t1 = plan.report.step_time_cut_s
            assert plan.report.step_time_cut_s == pytest.approx(cut_only.report.step_time_cut_s)
            assert plan.report.step_time_planned_s <= t1 * (1 + 1e-9)
            for r in range(dp):
                raised = plan.densities[r] > cut_only.densities[r] + 1e-12
                if raised.any():   # a raised rank stays within (1 - h) x T1, or does not grow
                    mk = step_time_of(costs, plan.densities, rank=r)
                    mk_cut = step_time_of(costs, cut_only.densities, rank=r)
                    assert mk <= max((1 - h) * t1, mk_cut) * (1 + 1e-9), (case, h, r)
            mean = plan.report.mean_density
            if prev_density is not None:   # more headroom never raises more on average
                assert mean <= prev_density + 1e-9, (case, h)
            prev_density = mean
    # One pipeline (DP=1) whose last stage is heavy: it is the bottleneck rank, and headroom
    # must not stop its light stages from filling their bubbles.
    costs = synthetic_costs(1, 4, 2, seed=7, lm_head=1.5)
    for h in (0.0, 0.05):
        plan = band_plan(costs, None, D0, DMIN, DMAX, anchor="max", raise_headroom=h)
        assert plan.report.units_raised > 0, h
        assert plan.densities[0, :, 0].mean() > D0 and np.all(plan.densities[0, :, 1] == D0)
        assert plan.report.step_time_planned_s <= plan.report.step_time_static_s * (1 + 1e-9)
    with pytest.raises(ValueError, match="--sb-raise-headroom=0.7"):
        band_plan(costs, None, D0, DMIN, DMAX, raise_headroom=0.7)


def test_density_floor_keeps_the_mean_budget_and_the_step_time():
    rng = np.random.default_rng(11)
    below = 0
    for case in range(30):
        dp, m, pp = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(2, 5))
        # A heavy last stage (LM head) that DST can only cut: the case the floor is for.
        costs = synthetic_costs(dp, m, pp, seed=100 + case, lm_head=float(rng.uniform(0.5, 3)))
        sens = rng.random((dp, m))
        raw = band_plan(costs, sens, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
        # the band search alone (the critical-path descent has its own tests)
        floored = plan_dst(costs, sens, DSTSettings(
            D0, DMIN, DMAX, anchor="mean", tolerance=0.1, density_floor=0.9, descent=False))
        static = step_time_of(costs, np.full((dp, m, pp), D0))
        mean = weighted_mean_density(floored.densities, costs.attn_work)
        assert mean >= 0.9 * D0 - 1e-9
        assert step_time_of(costs, floored.densities) <= static * (1 + 1e-9)
        assert np.all(floored.densities >= DMIN - 1e-12)
        assert np.all(floored.densities <= DMAX + 1e-12)
        if raw.report.mean_density < 0.9 * D0:
            below += 1
            assert floored.report.tolerance_used >= 0.1
        else:  # the floor does not touch plans that already meet it
            np.testing.assert_array_equal(floored.densities, raw.densities)
    assert below > 0  # the cases exercised the floor


def test_stage_floor_keeps_every_stage_fed_and_the_step_time():
    """A heavy last stage (LM head) is the bottleneck: DST cuts its attention while raising the
    other stages. The per-stage floor stops that concentration (quality is convex in per-layer
    density: docs/DESIGN.md section 7), and the step time still never exceeds the static plan's."""
    from tests.unit._bands import stage_mean_densities
    rng = np.random.default_rng(21)
    starved = 0
    for case in range(30):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=300 + case, lm_head=float(rng.uniform(0.5, 3)))
        sens = rng.random((dp, m))
        w = costs.attn_work
        raw = plan_dst(costs, sens, DSTSettings(D0, DMIN, DMAX, density_floor=0.9))
        fed = plan_dst(costs, sens, DSTSettings(D0, DMIN, DMAX, density_floor=0.9,
                                                           stage_density_floor=0.75))
        per_stage = stage_mean_densities(fed.densities, w)
        assert np.all(per_stage >= 0.75 * D0 - 1e-9), (case, per_stage)
        assert np.allclose(fed.report.density_per_stage, per_stage)
        assert weighted_mean_density(fed.densities, w) >= 0.9 * D0 - 1e-9
        static = step_time_of(costs, np.full((dp, m, pp), D0))
        assert step_time_of(costs, fed.densities) <= static * (1 + 1e-9)
        if min(stage_mean_densities(raw.densities, w)) < 0.75 * D0:
            starved += 1
        else:  # plans that already feed every stage are left alone
            np.testing.assert_array_equal(fed.densities, raw.densities)
    assert starved > 0  # the cases exercised the stage floor


def test_raise_to_static_spends_the_balance_gain_on_density():
    """--sb-raise-to static: the cuts still take the stragglers down, the raises then go up to
    the static plan's step time instead of the cut plan's: never slower than static, never less
    dense than the speed-first plan of the same step."""
    from sparsebalance_megatron.config import ConfigError

    gained = 0
    for case in range(12):
        costs = synthetic_costs(4, 6, 3, seed=100 + case)
        sens = np.random.default_rng(case).random((4, 6))
        fast = band_plan(costs, sens, D0, DMIN, DMAX)
        dense = band_plan(costs, sens, D0, DMIN, DMAX, raise_to="static")
        static = step_time_of(costs, np.full((4, 6, 3), D0))
        assert step_time_of(costs, dense.densities) <= static * (1 + 1e-9)
        assert dense.report.mean_density >= fast.report.mean_density - 1e-12
        gained += dense.report.mean_density > fast.report.mean_density + 1e-6
    assert gained >= 6, "raising to the static step time never added density"
    with pytest.raises(ConfigError, match="--sb-raise-to='later'"):
        band_plan(costs, None, D0, DMIN, DMAX, raise_to="later")


def test_both_objectives_in_one_pass_plan_what_each_plans_alone():
    """``water`` marks the candidates that water-fill by quality; a pass mixing both objectives
    (what the quality objective's two band searches send) gives every candidate the
    plan, bit for bit, of a pass of its objective alone (interleaved too, p2p, headroom)."""
    from sparsebalance_megatron.policy import UnitCosts

    for case, (dp, m, ranks, vp) in enumerate([(4, 6, 3, 1), (3, 4, 2, 2), (5, 8, 4, 1)]):
        costs = synthetic_costs(dp, m, ranks * vp, seed=40 + case, lm_head=2.0)
        if vp > 1:
            costs = UnitCosts(costs.densities, costs.fwd_s, costs.bwd_s, costs.attn_work,
                              pipeline_ranks=ranks)
        sens = np.random.default_rng(case).random((dp, m))
        q = bind_quality(_quality(ranks * vp), costs)
        mine = [("mean", 0.1), ("mean", 0.4), ("mean", 0.0)]
        theirs = [("max", 0.1), ("mean", 0.1), ("mean", 1.5)]
        settings = DSTSettings(D0, DMIN, DMAX, p2p_s=1e-3 * case, raise_headroom=0.05)
        mixed = band_plans(costs, sens, settings, mine + theirs, quality=q,
                           water=[True] * 3 + [False] * 3)
        alone = band_plans(costs, sens, settings, mine, quality=q) + \
            band_plans(costs, sens, settings, theirs)
        for got, want in zip(mixed, alone):
            np.testing.assert_array_equal(got.densities, want.densities)
            assert got.report == want.report


def _quality(pp):
    """A convex, measured-looking quality cost (deeper layers a little more sensitive)."""
    from sparsebalance_megatron.quality.cost import QualityCost
    from sparsebalance_megatron.quality.stages import StageQuality
    groups = [{"depth": [g / 2, (g + 1) / 2], "layers": [15 * g + 1, 15 * g + 15],
               "knots": [0.125, 0.25, 0.375, 0.5, 0.75, 1.0],
               "cost": [c * 0.085, c * 0.032, c * 0.014, 0.0, -c * 0.025, -c * 0.035]}
              for g, c in ((0, 1.0), (1, 1.4))]
    qc = QualityCost.from_dict({"kind": "sparsebalance-quality-cost", "version": 2,
                                "model": "synthetic", "reference_density": 0.5,
                                "reference_loss": 3.0, "windows": 6, "window_tokens": 2048,
                                "text": "essays", "groups": groups})
    return StageQuality.from_cost(qc, [6] * pp, D0)
