"""The quality model refreshed from measurements of the model being trained
(``quality.refresh``): a scale is recovered from changes the scaled model itself
predicts, clamped and shrunk by noise, bad measurements are refused before any work, and DST
plans by the refreshed model (a group made dearer is cut less)."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, plan_dst
from sparsebalance_megatron.policy.quality_bound import bind_quality
from sparsebalance_megatron.quality.cost import (QualityCost, QualityCostError,
                                                   load_quality_cost)
from sparsebalance_megatron.quality.refresh import (
    MAX_SCALE, group_of_layer, predicted_changes, refresh_scales, scaled,
    scaled_quality_cost, probe_density)
from sparsebalance_megatron.quality.stages import StageQuality

from test_policy_dst import D0, DMAX, DMIN, synthetic_costs
from test_quality_cost import v2


@pytest.mark.parametrize("interaction,lengths", [(0.0, None), (0.8, None),
                                                 (0.0, [900.0, 2000.0, 5000.0])])
def test_recovers_the_scale_that_made_the_measurement(interaction, lengths):
    """Changes predicted by the model scaled by known factors are measured as such: the
    refresh recovers those factors (exactly without an interaction term, by its fixed point
    with one), and the refreshed model predicts the measurement."""
    cost = v2(length_exponent=-0.3, interaction=interaction, replicates=(0.9, 1.1))
    truth = np.array([2.5, 0.4])
    tested = [probe_density(0.5)] * 2
    tokens = None if lengths is None else [100.0, 300.0, 50.0]
    measured = predicted_changes(scaled(cost, truth), 0.5, tested, lengths, tokens)
    s = refresh_scales(cost, 0.5, tested, measured, lengths=lengths, tokens=tokens)
    assert s == pytest.approx(truth, rel=1e-6)
    fresh = scaled(cost, refresh_scales(cost, 0.5, tested, measured, lengths=lengths,
                                        tokens=tokens))
    assert predicted_changes(fresh, 0.5, tested, lengths, tokens) == pytest.approx(measured)


def test_the_refreshed_model_scales_curves_and_replicates_alike():
    cost = v2(replicates=(0.9, 1.1))
    fresh = scaled(cost, [3.0, 0.5])
    for g, k in zip(range(2), (3.0, 0.5)):
        assert fresh.groups[g].cost_at_knots == pytest.approx(cost.groups[g].cost_at_knots * k)
        assert np.array_equal(fresh.groups[g].knots, cost.groups[g].knots)
        for r0, r1 in zip(cost.bootstrap, fresh.bootstrap):
            assert r1.cost[g] == pytest.approx(r0.cost[g] * k)
    assert fresh.fit["refresh_scales"] == [3.0, 0.5]
    assert cost.groups[0].cost_at_knots[0] == pytest.approx(0.1)      # the original untouched


def test_a_scale_is_clamped_and_noise_shrinks_it_towards_one():
    cost = v2()
    tested = [0.45, 0.45]
    p = predicted_changes(cost, 0.5, tested)
    # 10x and a negative change (the cut helped: noise) stop at the clamp
    s = refresh_scales(cost, 0.5, tested, [10 * p[0], -p[1]])
    assert s == pytest.approx([MAX_SCALE, 1.0 / MAX_SCALE])
    # a change measured twice as large, within its standard error, moves the scale less
    sharp = refresh_scales(cost, 0.5, tested, 2 * p, stderr=[0.0, 0.0])
    noisy = refresh_scales(cost, 0.5, tested, 2 * p, stderr=2 * p)
    assert sharp == pytest.approx([2.0, 2.0])
    assert np.all(1.0 < noisy) and np.all(noisy < 2.0)
    assert noisy == pytest.approx(2.0 ** 0.5)      # signal to noise 1: half the log-ratio
    # an unknown error (one document measured: no spread) moves no scale, however large the
    # change; the other group moves as it would alone
    unknown = refresh_scales(cost, 0.5, tested, 2 * p, stderr=[float("inf"), 0.0])
    assert unknown == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize("args,needle", [
    (dict(d0=0.5, tested=[0.45], measured=[0.01, 0.01]), "tested densities"),
    (dict(d0=0.5, tested=[0.45, 0.5], measured=[0.01, 0.01]), "(0, d0 = 0.5)"),
    (dict(d0=0.5, tested=[0.0, 0.45], measured=[0.01, 0.01]), "(0, d0 = 0.5)"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, float("nan")]), "finite"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01, 0.01]), "measured changes"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01], stderr=[-1, 0]), "stderr"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01], stderr=[float("-inf"), 0]),
     "finite numbers or inf"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[float("inf"), 0.01]), "finite numbers"),
    (dict(d0=1.5, tested=[0.45, 0.45], measured=[0.01, 0.01]), "d0=1.5"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=["a", 0.01]), "measured changes"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01], lengths=[100.0, -1.0]),
     "document lengths"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01], lengths=[100.0, 200.0],
          tokens=[5.0]), "document tokens"),
    (dict(d0=0.5, tested=[0.45, 0.45], measured=[0.01, 0.01], lengths=[100.0],
          tokens=[0.0]), "summing to more than 0"),
    (dict(d0=True, tested=[0.45, 0.45], measured=[0.01, 0.01]), "d0=True"),
])
def test_bad_measurements_are_refused_naming_the_value(args, needle):
    with pytest.raises(QualityCostError) as e:
        refresh_scales(v2(), **args)
    assert needle in str(e.value)


def test_a_test_density_on_the_flat_part_is_refused():
    """Above its last knot a curve is flat: a test there measures nothing the model prices,
    so there is no ratio to scale by; a scale must be positive (a curve stays convex and
    non-increasing)."""
    d = v2().as_dict()
    for g in d["groups"]:
        g["knots"], g["cost"] = [0.25, 0.5], [g["cost"][0], 0.0]
    flat = QualityCost.from_dict(d)
    with pytest.raises(QualityCostError, match="predicts no loss"):
        refresh_scales(flat, 0.8, [0.7, 0.7], [0.01, 0.01])
    with pytest.raises(QualityCostError, match="positive"):
        scaled(v2(), [1.0, 0.0])


def test_layers_fall_in_the_group_holding_their_middle():
    cost = load_quality_cost(None)            # thirds of the depth
    assert [group_of_layer(cost, n, 6) for n in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert [group_of_layer(cost, n, 4) for n in range(1, 5)] == [0, 1, 1, 2]
    with pytest.raises(QualityCostError, match="layer 5 of 4"):
        group_of_layer(cost, 5, 4)


def test_one_object_per_refresh_serves_the_stages_cache():
    """DST asks for the stages' quality every step: the same scales give the same cost object
    (and so the same ``StageQuality``, its tables made once); other scales another."""
    base = scaled_quality_cost(None, None)
    assert base is load_quality_cost(None)
    a = scaled_quality_cost(None, (1.5, 1.0, 0.5))
    assert scaled_quality_cost(None, (1.5, 1.0, 0.5)) is a and a is not base
    qa = StageQuality.from_cost(a, [10, 10, 10], 0.5)
    assert StageQuality.from_cost(scaled_quality_cost(None, (1.5, 1.0, 0.5)),
                                  [10, 10, 10], 0.5) is qa
    qb = StageQuality.from_cost(scaled_quality_cost(None, (1.0, 1.0, 1.0)), [10, 10, 10], 0.5)
    assert qb is not qa and qb.curves(0.4) == pytest.approx(
        StageQuality.from_cost(base, [10, 10, 10], 0.5).curves(0.4))
    assert qa.curves(0.4) == pytest.approx(
        StageQuality.from_cost(base, [10, 10, 10], 0.5).curves(0.4) * [1.5, 1.0, 0.5])


def test_a_group_made_dearer_is_cut_less():
    """A heavy last stage (LM head) is cut by DST; the refresh measures the deeper group (that
    stage's layers) four times dearer than the model said: the refreshed plan cuts that stage
    less, and prices the old plan higher than the old model did."""
    base = load_quality_cost(None)
    dearer = scaled(base, refresh_scales(base, D0, [0.45] * 3,
                                         predicted_changes(base, D0, [0.45] * 3) * [1, 1, 4]))
    assert dearer.fit["refresh_scales"] == pytest.approx([1.0, 1.0, 4.0])
    settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75)
    cut_before = cut_after = 0.0
    for case in range(6):
        costs = synthetic_costs(2, 4, 2, seed=700 + case, lm_head=1.5)
        sens = np.ones((2, 4))
        old, new = (StageQuality.from_cost(c, [15, 15], D0) for c in (base, dearer))
        p_old = plan_dst(costs, sens, settings, quality=old)
        p_new = plan_dst(costs, sens, settings, quality=new)
        cut_before += float(np.maximum(D0 - p_old.densities[..., 1], 0).sum())
        cut_after += float(np.maximum(D0 - p_new.densities[..., 1], 0).sum())
        cut = np.full((2, 4, 2), D0)
        cut[..., 1] = 0.375
        assert bind_quality(new, costs).plan_cost(cut) > bind_quality(old, costs).plan_cost(cut) > 0
    assert cut_before > 0 and cut_after < cut_before
