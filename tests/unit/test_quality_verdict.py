"""The quality studies' verdict (issue 73, ``eval.verdict``): synthetic per-seed results for each
outcome, the t quantiles against tabled values, and the power calculation against a seeded
simulation of the test it describes."""

import math
import random

import pytest

from sparsebalance_megatron.eval import verdict as V

# 10 seeds of a training study: the control (0.9 x d0 - d0) costs about 0.01 nats, margin 0.005
CONTROL = [0.011, 0.009, 0.012, 0.010, 0.008, 0.013, 0.010, 0.009, 0.011, 0.012]
MATCHED = dict(kept=[0.60] * 10, kept_reference=[0.603] * 10, tolerance=0.01)


@pytest.mark.parametrize("p,df,want", [(0.95, 1, 6.313752), (0.95, 4, 2.131847),
                                       (0.95, 9, 1.833113), (0.975, 2, 4.302653),
                                       (0.8, 9, 0.883404), (0.95, 200, 1.652508)])
def test_t_quantiles_match_the_tables(p, df, want):
    assert V.t_quantile(p, df) == pytest.approx(want, abs=2e-6)
    assert V.t_cdf(want, df) == pytest.approx(p, abs=1e-7)
    assert V.t_quantile(1 - p, df) == pytest.approx(-want, abs=2e-6)


def test_non_inferior_when_the_upper_bound_is_below_the_margin():
    diffs = [0.001, -0.002, 0.000, 0.002, -0.001, 0.001, -0.002, 0.000, 0.001, -0.001]
    v = V.verdict(diffs, CONTROL, 0.005, **MATCHED)
    assert v["verdict"] == "non-inferior", v["reason"]
    c = v["comparison"]
    sd = math.sqrt(sum((x - c["mean"]) ** 2 for x in diffs) / 9)
    assert c["upper"] == pytest.approx(c["mean"] + 1.833113 * sd / math.sqrt(10), abs=1e-7)
    assert v["control"]["detected"] and not v["worse_than_reference"]
    assert "non-inferior" in V.one_line(v)


def test_inferior_when_the_lower_bound_is_above_the_margin():
    diffs = [0.009, 0.010, 0.011, 0.008, 0.012, 0.010, 0.009, 0.011, 0.010, 0.010]
    v = V.verdict(diffs, CONTROL, 0.005, **MATCHED)
    assert v["verdict"] == "inferior", v["reason"]
    assert v["comparison"]["lower"] > 0.005 and v["worse_than_reference"]


def test_uninformative_when_the_control_is_not_detected():
    """The issue's CPU study: a paired SD of 0.0035 over 5 seeds hides a 0.002 control."""
    rng = random.Random(3)
    control = [0.002 + rng.gauss(0, 0.0035) for _ in range(5)]
    control[0] = -0.004                                 # as noisy seeds do
    diffs = [-0.0039, -0.0013, -0.0006, 0.0013, 0.0054]
    v = V.verdict(diffs, control, 0.001, kept=[0.6] * 5, kept_reference=[0.6] * 5,
                  tolerance=0.01)
    assert v["verdict"] == "uninformative" and "control was not detected" in v["reason"]
    assert not v["control"]["detected"]
    assert v["power"]["control_power"] < 0.8


def test_uninformative_when_the_interval_straddles_the_margin():
    diffs = [0.012, -0.004, 0.009, -0.002, 0.010, 0.001, 0.007, -0.003, 0.008, 0.002]
    v = V.verdict(diffs, CONTROL, 0.005, **MATCHED)
    assert v["verdict"] == "uninformative" and "straddles" in v["reason"]
    assert v["power"]["n_for_margin"] > 10


def test_not_matched_refuses_a_verdict_whatever_the_losses():
    """The issue's d0 0.5 study: sparse_balance kept 0.6061 against static's 0.5946."""
    diffs = [0.0] * 9 + [0.0001]
    v = V.verdict(diffs, CONTROL, 0.005, kept=0.6061, kept_reference=0.5946, tolerance=0.01)
    assert v["verdict"] == "not matched"
    assert v["density"]["gaps"][0] == pytest.approx(0.0115) and not v["density"]["matched"]
    per_seed = V.verdict(diffs, CONTROL, 0.005, kept=[0.60] * 9 + [0.62],
                         kept_reference=[0.60] * 10, tolerance=0.01)
    assert per_seed["verdict"] == "not matched"     # one seed beyond the tolerance is enough


def test_identical_arms_test_nothing():
    """An arm that made no move equals its reference: the old 'met with the floor' row."""
    v = V.verdict([0.0] * 10, CONTROL, 0.005, **MATCHED)
    assert v["verdict"] == "uninformative" and "no move" in v["reason"]


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match="margin"):
        V.verdict([0.1, 0.2], CONTROL, 0.0, **MATCHED)
    with pytest.raises(ValueError, match="finite"):
        V.paired_bound([0.1, float("nan")])
    with pytest.raises(ValueError, match="kept densities"):
        V.density_match([0.5, 0.5], [0.5], 0.01)
    with pytest.raises(ValueError, match="no harm"):
        V.margin_from_pilot([-0.01, 0.0, 0.005])


def test_margin_from_pilot_is_half_the_control_harm():
    assert V.margin_from_pilot(CONTROL) == pytest.approx(0.5 * sum(CONTROL) / 10)


def test_n_needed_is_the_first_n_that_detects_the_effect():
    for sd, effect in ((1.0, 0.5), (0.0035, 0.0021), (0.3, 0.02)):
        n = V.n_needed(sd, effect)
        assert V.detectable_effect(sd, n) <= effect < V.detectable_effect(sd, n - 1)
    # the figure, two-sided at 95% (alpha 0.025 a side): SD 0.0035 over 5 seeds
    # detects about 0.0059 nats at 80% power; one-sided at 95%, 0.0048
    assert V.detectable_effect(0.0035, 5, alpha=0.025) == pytest.approx(0.0059, abs=2e-4)
    assert V.detectable_effect(0.0035, 5) == pytest.approx(0.0048, abs=1e-4)


def test_power_calculation_matches_a_simulation_of_the_test():
    """At the smallest detectable effect the one-sided t test rejects in about 80% of seeded
    replications; at effect 0 in about 5%."""
    rng, n, sd = random.Random(0), 10, 1.0
    effect = V.detectable_effect(sd, n)
    for true, want in ((effect, 0.80), (0.0, 0.05)):
        hits = sum(V.paired_bound([rng.gauss(true, sd) for _ in range(n)])["lower"] > 0
                   for _ in range(3000))
        assert hits / 3000 == pytest.approx(want, abs=0.03)
    assert V.power_at(effect, sd, n) == pytest.approx(0.8, abs=1e-6)


def test_superiority_says_better_or_worse_only_past_zero_and_with_the_control():
    control = [0.02, 0.03, 0.025, 0.028]                    # detected: lower bound above 0
    assert V.superiority([-0.02, -0.03, -0.025, -0.022], control)["verdict"] == "better"
    assert V.superiority([0.02, 0.03, 0.025, 0.022], control)["verdict"] == "worse"
    assert V.superiority([-0.02, 0.03, -0.01, 0.004], control)["verdict"] == \
        "no difference shown"
    assert V.superiority([-0.02, -0.03, -0.025, -0.022], [0.02, -0.03, 0.01, -0.01])[
        "verdict"] == "uninformative (control not detected)"
    assert V.superiority([-0.02], control)["verdict"] == "uninformative"


def test_at_most_matching_counts_only_a_gap_above_the_reference():
    assert V.density_match([0.9, 1.004], [1.0, 1.0], 0.005, at_most=True)["matched"]
    assert not V.density_match([0.9, 1.004], [1.0, 1.0], 0.005)["matched"]
    assert not V.density_match([1.0, 1.006], [1.0, 1.0], 0.005, at_most=True)["matched"]
