"""Narrower tolerance bands (policy/bands.py, issue 27): a GPU persistently 10% slow sits inside
the default band (p = 0.1), so the configured band alone cuts nothing; the planner also plans
p/2, p/4 and 0 and keeps a narrower band's plan only when it meets the floors and the quality
condition and is predicted faster by more than ``NARROW_MARGIN``, and only where the calibration
says a GPU is persistently slow (``rank_scale``): otherwise ``--sb-tolerance`` keeps its
meaning."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, density_grid, plan_dst
from tests.unit._bands import band_plan
from sparsebalance_megatron.policy.agreed_stats import straggler_present
from sparsebalance_megatron.policy.bands import NARROW_MARGIN, band_ladder, pick_band
from tests.unit._costs import affine_costs

D0, DMIN, DMAX = 0.5, 0.125, 1.0
BAND = DSTSettings(D0, DMIN, DMAX, anchor="mean", tolerance=0.1)


def _scale(dp=4, pp=2, slow_rank=1, factor=1.1):
    """The calibration's [dp, pp] factors for ``_slow_rank_costs``."""
    s = np.ones((dp, pp))
    s[slow_rank] = factor
    return s


def _slow_rank_costs(dp=4, m=4, pp=2, slow_rank=1, factor=1.1):
    """Identical ranks, one computing ``factor`` x slower (what per-(DP rank, pipeline rank)
    calibration puts into the costs); equal stages, so every unit of the slow rank is 1.1 /
    1.025 of the mean: inside the default band."""
    fixed = np.ones((dp, m, pp))
    attn = np.full((dp, m, pp), 1.2)
    fixed[slow_rank] *= factor
    attn[slow_rank] *= factor
    return affine_costs(density_grid(D0, DMIN, DMAX), fixed, attn)


def test_band_ladder_configured_band_first_then_narrower():
    assert band_ladder("mean", 0.1) == [("mean", 0.1), ("mean", 0.05), ("mean", 0.025),
                                        ("mean", 0.0)]
    assert band_ladder("max", 0.1) == [("max", 0.1)]          # never cuts: nothing to narrow
    assert band_ladder("mean", 0.0) == [("mean", 0.0)]


class _Plan:
    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("times, want", [
    ([1.0, 1.0, 1.0, 1.0], 0),                                  # as fast: the widest band
    ([1.0, 1.0 - NARROW_MARGIN / 2, 0.99995, 1.0], 0),          # within the margin
    ([1.0, 0.99, 0.985, 0.95], 3),                              # each clearly faster
    ([1.0, 0.95, 0.9495, 0.96], 1),                             # a gain inside the margin
])
def test_pick_band_keeps_the_wider_band_unless_clearly_faster(times, want):
    plans = [_Plan(t) for t in times]
    assert pick_band(plans, step_time=lambda p: p.t) is plans[want]


@pytest.mark.reliability(area="fault", case="one GPU persistently 10% slow (calibrated factors), "
                         "inside the default --sb-tolerance 0.1 band", expect="a narrower band "
                         "cuts that GPU's units only; >1.05x over static; without calibration "
                         "news the configured band alone plans")
def test_ten_percent_slow_rank_is_cut_under_the_default_tolerance():
    costs = _slow_rank_costs()
    # the configured band alone: the slow rank sits inside (1 + 0.1) x the mean, nothing is cut
    alone = band_plan(costs, None, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
    assert (alone.densities[1] < D0).sum() == 0
    assert alone.report.speedup == pytest.approx(1.0)
    unknown = plan_dst(costs, None, BAND)
    np.testing.assert_array_equal(unknown.densities, alone.densities)   # no calibration: as set
    plan = plan_dst(costs, None, BAND, rank_scale=_scale())
    rep, d = plan.report, plan.densities
    assert rep.tolerance_used < 0.1
    assert (d[1] < D0).sum() > 0                     # the slow rank is cut ...
    assert np.all(np.delete(d, 1, axis=0) >= D0)     # ... and only it
    assert rep.speedup > 1.05                        # most of the 10% comes back
    assert rep.step_time_planned_s <= rep.step_time_static_s


def test_slow_rank_is_absorbed_under_the_default_floors_and_quality_objective():
    """The runtime's defaults (density floor 0.9, stage floor 0.75, quality objective): the cut
    on the slow rank is paid back by raises on the others, so the narrower band qualifies; it
    is adopted where its speed pays at the exchange rate for the quality the plan without
    cuts (the other ranks raised up to the slow one) would have bought, and not otherwise; the
    default rate ('auto') is the step's own uniform trade."""
    from dataclasses import replace

    from sparsebalance_megatron.quality.cost import load_quality_cost
    from sparsebalance_megatron.quality.stages import StageQuality
    costs = _slow_rank_costs()
    q = StageQuality.from_cost(load_quality_cost(None), [12, 12], D0)
    floors = DSTSettings(D0, DMIN, DMAX, anchor="mean", tolerance=0.1, density_floor=0.9,
                         stage_density_floor=0.75)
    fast = plan_dst(costs, None, replace(floors, exchange_rate=1.0), quality=q,
                    rank_scale=_scale())
    assert fast.report.adopted == "dst" and fast.report.speedup > 1.03
    assert fast.report.quality_cost <= 1e-12
    assert fast.report.mean_density >= 0.9 * D0
    free = plan_dst(costs, None, replace(floors, exchange_rate=0.0), quality=q,
                    rank_scale=_scale())
    assert free.report.adopted == "no_cuts" and free.report.units_cut == 0
    assert free.report.quality_cost < fast.report.quality_cost
    assert free.report.step_time_planned_s <= free.report.step_time_static_s
    # the default rate keeps whichever is worth more at it
    plan = plan_dst(costs, None, floors, quality=q, rank_scale=_scale())

    rate = plan.report.exchange_rate                   # 'auto': the step's uniform trade
    assert 0 < rate < 1

    def value(r):
        return rate * 100 * (1 - 1 / r.speedup) - r.quality_cost

    assert value(plan.report) == pytest.approx(max(value(fast.report), value(free.report)))
    uniform = plan_dst(_slow_rank_costs(factor=1.0), None, floors, quality=q,
                       rank_scale=_scale(factor=1.0))
    assert uniform.report.speedup == pytest.approx(1.0)      # nothing to absorb


def test_uniform_ranks_keep_the_configured_band():
    """No straggler: no narrower band is meaningfully faster, so the plan is the configured
    band's, as before the ladder."""
    costs = _slow_rank_costs(factor=1.0)
    plan = plan_dst(costs, None, BAND, rank_scale=_scale(factor=1.0))
    alone = band_plan(costs, None, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
    assert plan.report.tolerance_used == 0.1
    np.testing.assert_array_equal(plan.densities, alone.densities)


def test_a_heavier_stage_inside_the_band_stays_uncut_without_a_slow_gpu():
    """Structural imbalance the user tolerates (the LM-head stage 5% heavier, --sb-tolerance
    0.1): a narrower band would cut it, but no GPU is slow, so the configured band decides."""
    fixed = np.ones((2, 4, 2))
    fixed[..., 1] *= 1.05
    costs = affine_costs(density_grid(D0, DMIN, DMAX), fixed, np.full((2, 4, 2), 1.2))
    alone = band_plan(costs, None, D0, DMIN, DMAX, anchor="mean", tolerance=0.1)
    for scale in (None, np.ones((2, 2)), np.array([[1.0, 1.04], [1.0, 1.0]])):
        plan = plan_dst(costs, None, BAND, rank_scale=scale)
        np.testing.assert_array_equal(plan.densities, alone.densities)
        assert plan.report.units_cut == 0
    # the same costs with a GPU the calibration says is slow: the narrower band cuts that stage
    slow = plan_dst(costs, None, BAND, rank_scale=np.array([[1.0, 1.2], [1.0, 1.0]]))
    assert slow.report.units_cut > 0 and slow.report.tolerance_used < 0.1


def test_straggler_present_needs_a_gpu_half_a_band_slower_than_the_median():
    assert not straggler_present(None, 0.1)
    assert not straggler_present(np.ones((4, 2)), 0.1)
    assert not straggler_present(_scale(factor=1.04), 0.1)
    assert straggler_present(_scale(factor=1.1), 0.1)
    assert straggler_present(_scale(factor=1.02), 0.02)          # a tight band: 1% is enough
    assert not straggler_present(np.full((4, 2), 1.3), 0.1)      # all equally slow: no straggler
    with pytest.raises(ValueError, match="rank_scale"):
        straggler_present(np.array([[1.0, np.nan]]), 0.1)


def test_straggler_present_ignores_the_largest_of_many_noisy_factors():
    """Per-step timing noise leaves every calibrated factor a little off: the largest of 256
    factors spread by 2.4% lies 6-7% above the median, past the half band, but it is noise, and
    the narrow bands would cut density for it. A GPU slow well beyond the noise still counts;
    noise-free factors need only the half band."""
    rng = np.random.default_rng(3)
    noisy = rng.normal(1.0, 0.024, (64, 4))
    assert noisy.max() > np.median(noisy) * 1.05            # the half band alone would fire
    assert not straggler_present(noisy, 0.1)
    slow = noisy.copy()
    slow[5, 2] = np.median(noisy) * 1.2                      # 8 sigmas up: a real straggler
    assert straggler_present(slow, 0.1)
    quiet = rng.normal(1.0, 0.002, (64, 4))                  # quiet timings: the band decides
    quiet[7, 1] = 1.06
    assert straggler_present(quiet, 0.1)
    quiet[7, 1] = 1.04
    assert not straggler_present(quiet, 0.1)


@pytest.mark.parametrize("dense", [False, True])
def test_a_pass_reports_each_candidates_density_as_the_per_plan_functions_do(dense):
    """A band pass reports every candidate's mean and per-stage density from one
    [k, ...] pass (``dst_band._density_stats``): the floats of ``weighted_mean_density`` and
    ``stage_mean_densities`` on that candidate alone, routed dense work or none, zero weights
    (the plain mean) included."""
    from sparsebalance_megatron.policy.density_means import weighted_mean_density
    from tests.unit._bands import stage_mean_densities
    from sparsebalance_megatron.policy.dst_band import _density_stats

    rng = np.random.default_rng(8)
    for k, dp, m, pp in ((6, 64, 16, 4), (3, 2, 5, 3), (1, 4, 8, 1)):
        dens = rng.choice(density_grid(0.5, 0.125, 1.0), (k, dp, m, pp))
        w = rng.random((dp, m, pp)) * (rng.random((dp, m, pp)) > 0.2)
        w[..., -1] = 0.0                                       # a stage without weight
        dw = rng.random((dp, m, pp)) * 0.1 if dense else None
        mean, stage, kept_s = _density_stats(dens, w, dw)
        for c in range(k):
            assert mean[c] == weighted_mean_density(dens[c], w, dw)
            assert stage[c] == tuple(float(x) for x in stage_mean_densities(dens[c], w, dw))
            np.testing.assert_array_equal(kept_s[c], (dens[c] * w).sum(axis=(0, 1)))
        zero_mean = _density_stats(dens, np.zeros_like(w), None)[0]
        assert zero_mean == [weighted_mean_density(d, np.zeros_like(w)) for d in dens]
