"""The quality model (quality.cost, quality.stages): its fitted convex curves per
layer group with a length term, an interaction and bootstrap replicates, validation that names the field, the mapping onto
pipeline stages and a step's units, and the one rule every plan check goes through."""

import json

import numpy as np
import pytest

from sparsebalance_megatron.policy.quality_bound import bind_quality
from sparsebalance_megatron.quality.cost import QualityCost, QualityCostError, curve


def doc(**over):
    d = {"kind": "sparsebalance-quality-cost", "version": 2, "model": "m",
         "reference_density": 0.5, "reference_loss": 3.0, "windows": 6, "window_tokens": 2048,
         "text": "essays",
         "groups": [{"depth": [0.0, 0.5], "layers": [1, 15],
                     "knots": [0.125, 0.25, 0.5, 0.75, 1.0],
                     "cost": [0.30, 0.08, 0.0, -0.01, -0.012]},
                    {"depth": [0.5, 1.0], "layers": [16, 30],
                     "knots": [0.125, 0.375, 0.5, 1.0], "cost": [0.20, 0.01, 0.0, -0.003]}]}
    d.update(over)
    return d


def test_cost_interpolates_extrapolates_below_and_is_flat_above():
    q = QualityCost.from_dict(doc())
    g = q.groups[1]

    def cost(d):
        return curve(g.knots, g.cost_at_knots, d)

    assert float(cost(0.5)) == 0.0
    assert float(cost(0.125)) == pytest.approx(0.20)
    assert float(cost(0.0625)) > float(cost(0.125))           # the first segment's slope
    assert float(cost(1.0)) == float(cost(0.99)) or float(cost(1.0)) <= float(cost(0.99))
    d = np.linspace(0.05, 1.0, 40)
    c = cost(d)
    assert np.all(np.diff(c) <= 1e-15)
    assert np.all(np.diff(c, 2) >= -1e-12)                        # convex on a uniform grid


def test_stages_hold_their_share_of_every_group():
    q = QualityCost.from_dict(doc())                     # groups [0, 0.5) and [0.5, 1]
    w = q.stage_weights([7, 8, 8, 1])                    # depths 0-7/24, 7/24-15/24, ...
    assert w.shape == (4, 2)
    np.testing.assert_allclose(w.sum(axis=0), [1.0, 1.0])          # every group held once
    np.testing.assert_allclose(w[0], [7 / 12, 0.0])
    np.testing.assert_allclose(w[1], [5 / 12, 3 / 12])             # it straddles the middle
    np.testing.assert_allclose(w[3], [0.0, 1 / 12])
    with pytest.raises(QualityCostError, match="stage_layers"):
        q.stage_weights([0, 0])


def test_save_load_round_trip(tmp_path):
    q = QualityCost.from_dict(doc())
    q.save(tmp_path / "q.json")
    again = QualityCost.load(str(tmp_path / "q.json"))
    assert again.as_dict() == q.as_dict()


@pytest.mark.parametrize("over, needle", [
    ({"kind": "latency"}, "kind='latency': expected 'sparsebalance-quality-cost'"),
    ({"version": 1}, "version=1: expected 2"),
    ({"reference_density": 0.0}, "reference_density=0.0: expected a number in (0, 1]"),
    ({"groups": []}, "groups: expected a non-empty list"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 0.4]), doc()["groups"][1]]},
     "group 1: depth [0.5, 1.0]: expected to start at 0.4"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 1.0], cost=[0.1])]},
     "group 0: knots (5) and cost (1) must have the same length"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 1.0], knots=[0, 0.25, 0.5, 0.75, 1])]},
     "group 0: knots [0.0, 0.25, 0.5, 0.75, 1.0]: expected increasing densities in (0, 1]"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 0.5])]}, "groups end at depth 0.5"),
])
def test_bad_files_name_the_field(over, needle, tmp_path):
    with pytest.raises(QualityCostError) as e:
        QualityCost.from_dict(doc(**over))
    assert needle in str(e.value)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc(**over)))
    with pytest.raises(QualityCostError, match=str(p)):
        QualityCost.load(str(p))


def test_missing_or_non_json_file(tmp_path):
    with pytest.raises(QualityCostError, match="not found .*scripts/bench.py plan_quality"):
        QualityCost.load(str(tmp_path / "none.json"))
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(QualityCostError, match="not JSON"):
        QualityCost.load(str(tmp_path / "x.json"))


def _costs(shape, docs=None):
    """Stand-in costs: what ``bind`` reads (their shape and documents)."""
    from types import SimpleNamespace
    return SimpleNamespace(shape=shape, unit_docs=docs)


def test_a_plans_cost_looked_up_on_its_grid_is_the_interpolated_one():
    # DST's checks hold grid indices: a plan on its grid is costed from a table, the
    # interpolation's sum to float rounding (below the data, inside it, flat above), on any grid
    from sparsebalance_megatron.policy.costs import density_grid
    from sparsebalance_megatron.quality.stages import StageQuality

    q = StageQuality.from_cost(QualityCost.from_dict(doc()), [3, 5, 4], 0.25)
    rng = np.random.default_rng(2)
    b = bind_quality(q, _costs((4, 6, 3)))
    for grid in (density_grid(0.25, 0.0625, 1.0), density_grid(0.25, 0.125, 0.5)):
        for _ in range(20):
            i = rng.integers(0, grid.size, (4, 6, 3))
            assert float(b.sums_at(i, grid)) / b.tokens == pytest.approx(b.plan_cost(grid[i]),
                                                                         abs=1e-15)
    with pytest.raises(QualityCostError, match="one per stage"):
        b.plan_cost(np.full((4, 6, 2), 0.25))
    # uniform d0 costs nothing; every unit denser costs less, sparser more
    assert b.plan_cost(np.full((4, 6, 3), 0.25)) == 0.0
    assert b.plan_cost(np.full((4, 6, 3), 0.5)) < 0 < b.plan_cost(np.full((4, 6, 3), 0.125))


def v2(length_exponent=0.0, interaction=0.0, replicates=()):
    """A version-2 model of two groups (the second twice as sensitive)."""
    knots = [0.25, 0.5, 1.0]
    return QualityCost.from_dict({
        "kind": "sparsebalance-quality-cost", "version": 2, "model": "m",
        "reference_density": 0.5, "reference_loss": 3.0, "windows": 8, "window_tokens": 3000,
        "text": "t", "length_ref": 2000.0, "length_exponent": length_exponent,
        "interaction": interaction,
        "groups": [{"depth": [0.0, 0.5], "layers": [1, 15], "knots": knots,
                    "cost": [0.1, 0.03, 0.0]},
                   {"depth": [0.5, 1.0], "layers": [16, 30], "knots": knots,
                    "cost": [0.2, 0.06, 0.0]}],
        "bootstrap": [{"length_exponent": length_exponent, "interaction": interaction,
                       "cost": [[0.1 * f, 0.03 * f, 0.0], [0.2 * f, 0.06 * f, 0.0]]}
                      for f in replicates]})


def test_version_2_round_trips_and_refuses_a_curve_that_is_not_convex(tmp_path):
    q = v2(-0.5, 1.5, replicates=(0.9, 1.1))
    q.save(tmp_path / "q.json")
    again = QualityCost.load(str(tmp_path / "q.json"))
    assert again.as_dict() == q.as_dict() and len(again.bootstrap) == 2
    d = q.as_dict()
    d["groups"][0]["cost"] = [0.1, 0.09, 0.0]            # slope steeper above: concave
    with pytest.raises(QualityCostError, match="group 0: cost .* expected convex"):
        QualityCost.from_dict(d)
    d = q.as_dict()
    d["bootstrap"][1]["cost"] = [[0.1, 0.03, 0.0]]
    with pytest.raises(QualityCostError, match="bootstrap 1: 1 curves, expected one per group"):
        QualityCost.from_dict(d)


def test_one_rule_for_documents_and_units_length_interaction_and_uncertainty():
    """A document's change is rho(n) S + gamma rho^2 S (S + 2 S0) against uniform d0; a unit's is
    its documents' token-weighted sum (routed documents change nothing); every check (the
    documents', the units' sums, the plan cost) is that one rule."""
    from sparsebalance_megatron.quality.stages import StageQuality

    cost = v2(-0.5, 2.0, replicates=(0.8, 1.0, 1.2))
    q = StageQuality.from_cost(cost, [15, 15], 0.5)
    d = np.array([[0.25, 0.5], [0.5, 0.25], [1.0, 1.0]])
    s0 = 0.03 + 0.06
    s = np.array([0.1 + 0.06, 0.03 + 0.2, 0.0]) - s0
    for n in (1000, 2000, 8000):
        rho = (n / 2000.0) ** -0.5
        want = rho * s + 2.0 * rho * rho * s * (s + 2 * s0)
        np.testing.assert_allclose(q.doc_change(d, [n] * 3), want)
    # a longer document loses less per token here (length exponent < 0)
    assert q.doc_change(d[:1], [8000])[0] < q.doc_change(d[:1], [1000])[0]
    # outside the lengths measured a document counts as the nearest measured one
    from dataclasses import replace
    clipped = StageQuality.from_cost(replace(cost, length_range=(2000.0, 4000.0)), [15, 15],
                                     0.5)
    assert clipped.doc_change(d[:1], [500])[0] == q.doc_change(d[:1], [2000])[0]
    assert clipped.doc_change(d[:1], [32768])[0] == q.doc_change(d[:1], [4000])[0]
    # two units: one of documents 1000 + 3000 (and a routed one of 500), one of 2000 + 2000
    docs = (np.array([0, 3, 5]), np.array([1000, 3000, 500, 2000, 2000]),
            np.array([4500.0, 4000.0]), np.array([True, True, False, True, True]))
    b = bind_quality(q, _costs((1, 2, 2), docs))
    assert b.tokens == 8500.0
    plan = np.array([[[0.25, 0.5], [0.5, 0.25]]])                 # [1, 2, 2]
    per_doc = np.concatenate([q.doc_change(np.repeat(plan[0, u:u + 1], k, 0), n)
                              for u, (k, n) in enumerate(((2, [1000, 3000]), (2, [2000] * 2)))])
    want = (per_doc * np.array([1000, 3000, 2000, 2000])).sum() / 8500.0
    assert b.plan_cost(plan) == pytest.approx(want)
    grid = np.array([0.25, 0.5, 1.0])
    assert float(b.sums_at(np.array([[[0, 1], [1, 0]]]), grid)) / b.tokens == pytest.approx(want)
    # the bootstrap: each replicate's sums, their spread the uncertainty
    reps = b.replicate_sums_at(np.array([[[0, 1], [1, 0]]]), grid)
    assert reps.shape == (3,) and reps[0] < reps[1] < reps[2]
    assert float(b.uncertainty(reps, b.tokens)) == pytest.approx(reps.std(ddof=1) / 8500.0)
    assert float(bind_quality(q, _costs((1, 2, 2))).uncertainty(np.zeros(0), 1.0)) == 0.0


def test_every_model_summed_in_one_gather_is_each_models_rule_bit_for_bit():
    """DST sums many plans under the fit and every bootstrap replicate in one gather
    (``BoundQuality._sums``): each model's sums are, bit for bit, its own rule
    (``StageQuality.change``) applied to its units' change looked up in its own grid table and
    summed over the units; a replicate without an interaction term has none, as a fit without
    one."""
    from dataclasses import replace

    from sparsebalance_megatron.quality.stages import StageQuality

    cost = v2(-0.5, 2.0, replicates=(0.8, 1.0, 1.2))
    reps = list(cost.bootstrap)
    reps[1] = replace(reps[1], interaction=0.0)
    q = StageQuality.from_cost(replace(cost, bootstrap=tuple(reps)), [15, 15], 0.5)
    docs = (np.array([0, 3, 5, 6, 8]), np.array([1000, 3000, 500, 2000, 2000, 700, 900, 4000]),
            np.array([4500.0, 4000.0, 700.0, 4900.0]),
            np.array([True, True, False, True, True, True, True, True]))
    b = bind_quality(q, _costs((2, 2, 2), docs))
    grid = np.array([0.25, 0.5, 1.0])
    idx = np.random.default_rng(0).integers(0, 3, (5, 2, 2, 2))        # 5 plans [dp, m, nv]
    got_reps = b.replicate_sums_at(idx, grid)                           # [5, B]
    for r in (None, 0, 1, 2):
        k = 0 if r is None else r + 1
        table = q.grid_tables(grid)[k]                                  # [nv, g]
        diff = table[np.arange(2), idx].sum(axis=-1)                    # [5, dp, m]
        want = q.change(diff, b.f1[k], b.f2[k], r).sum(axis=(-2, -1))
        got = b.sums_at(idx, grid) if r is None else got_reps[:, r]
        assert np.array_equal(got, want)
    assert np.array_equal(b.sums_at(idx[0], grid), b.sums_at(idx, grid)[0])


def test_stage_quality_is_made_once_per_cost_layers_and_d0():
    """DST asks for the stages' quality every step: the same cost object, layers and d0 give
    the same object (its grid tables made once), equal to a fresh one; another cost object,
    other layers or another d0 give another; a cost object freed and another loaded is never
    taken for it."""
    from sparsebalance_megatron.policy.costs import density_grid
    from sparsebalance_megatron.quality.stages import StageQuality

    cost = QualityCost.from_dict(doc())
    q = StageQuality.from_cost(cost, [3, 5, 4], 0.25)
    assert StageQuality.from_cost(cost, (3, 5, 4), 0.25) is q
    assert StageQuality.from_cost(cost, np.array([3, 5, 4]), 0.25) is q
    fresh = StageQuality(q.cost, q.weights, q.d0)
    grid = density_grid(0.25, 0.0625, 1.0)
    assert np.array_equal(q.marginal_gain(grid), fresh.marginal_gain(grid))
    assert np.array_equal(q.grid_tables(grid), fresh.grid_tables(grid))
    for other in (StageQuality.from_cost(cost, [3, 5, 5], 0.25),
                  StageQuality.from_cost(cost, [3, 5, 4], 0.5),
                  StageQuality.from_cost(QualityCost.from_dict(doc()), [3, 5, 4], 0.25)):
        assert other is not q
    changed = doc()
    changed["groups"][0]["cost"] = [0.6, 0.16, 0.0, -0.02, -0.024]
    for _ in range(4):                          # ids of freed costs may come back
        got = StageQuality.from_cost(QualityCost.from_dict(changed), [3, 5, 4], 0.25)
        assert got.cost.groups[0].cost_at_knots.tolist() == [0.6, 0.16, 0.0, -0.02, -0.024]
