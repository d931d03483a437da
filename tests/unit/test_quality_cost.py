"""The quality-cost file (policy.quality): convex, non-increasing fit of measured loss
increases per layer group, validation that names the field, mapping onto pipeline stages."""

import json

import numpy as np
import pytest

from sparsebalance_megatron.policy.quality import (QualityCost, QualityCostError,
                                                      convex_fit)


def doc(**over):
    d = {"kind": "sparsebalance-quality-cost", "version": 1, "model": "m",
         "reference_density": 0.5, "reference_loss": 3.0, "windows": 6, "window_tokens": 2048,
         "text": "essays",
         "groups": [{"depth": [0.0, 0.5], "layers": [1, 15],
                     "densities": [0.125, 0.25, 0.75, 1.0],
                     "delta_loss": [0.30, 0.08, -0.01, -0.012], "stderr": [0.02] * 4},
                    {"depth": [0.5, 1.0], "layers": [16, 30],
                     "densities": [0.125, 0.25, 0.375, 0.75, 1.0],
                     "delta_loss": [0.20, 0.12, 0.01, 0.004, -0.003], "stderr": [0.01] * 5}]}
    d.update(over)
    return d


def test_fit_is_the_convex_non_increasing_envelope_through_the_reference():
    knots, cost = convex_fit([0.125, 0.25, 0.375, 0.75, 1.0], [0.20, 0.12, 0.01, 0.004, -0.003],
                             0.5)
    # (0.25, 0.12) lies above the chord from 0.125 to 0.375, (0.75, 0.004) above the one from
    # the reference (0.5, 0) to 1.0: both dropped
    assert knots.tolist() == [0.125, 0.375, 0.5, 1.0]
    assert cost[2] == 0.0 and np.all(np.diff(cost) <= 0)
    slopes = np.diff(cost) / np.diff(knots)
    assert np.all(np.diff(slopes) >= -1e-12)                      # convex
    # a measured rise above the reference is noise: flat after the minimum
    k2, c2 = convex_fit([0.25, 0.75, 1.0], [0.1, -0.02, 0.01], 0.5)
    assert k2.tolist() == [0.25, 0.5, 0.75] and c2[-1] == -0.02


def test_cost_interpolates_extrapolates_below_and_is_flat_above():
    q = QualityCost.from_dict(doc())
    g = q.groups[1]
    assert float(g.cost(0.5)) == 0.0
    assert float(g.cost(0.125)) == pytest.approx(0.20)
    assert float(g.cost(0.0625)) > float(g.cost(0.125))           # the first segment's slope
    assert float(g.cost(1.0)) == float(g.cost(0.99)) or float(g.cost(1.0)) <= float(g.cost(0.99))
    d = np.linspace(0.05, 1.0, 40)
    c = g.cost(d)
    assert np.all(np.diff(c) <= 1e-15)
    assert np.all(np.diff(c, 2) >= -1e-12)                        # convex on a uniform grid


def test_stages_take_the_group_at_their_middle_depth():
    q = QualityCost.from_dict(doc())
    # 24 layers as 7/8/8/1: middles at 0.15, 0.46, 0.79, 0.98
    got = q.stage_costs([7, 8, 8, 1])
    assert [g.layers for g in got] == [(1, 15), (1, 15), (16, 30), (16, 30)]
    with pytest.raises(QualityCostError, match="stage_layers"):
        q.stage_costs([0, 0])


def test_save_load_round_trip(tmp_path):
    q = QualityCost.from_dict(doc())
    q.save(tmp_path / "q.json")
    again = QualityCost.load(str(tmp_path / "q.json"))
    assert again.as_dict() == q.as_dict()


@pytest.mark.parametrize("over, needle", [
    ({"kind": "latency"}, "kind='latency': expected 'sparsebalance-quality-cost'"),
    ({"version": 2}, "version=2: expected 1"),
    ({"reference_density": 0.0}, "reference_density=0.0: expected a number in (0, 1]"),
    ({"groups": []}, "groups: expected a non-empty list"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 0.4]), doc()["groups"][1]]},
     "group 1: depth [0.5, 1.0]: expected to start at 0.4"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 1.0], stderr=[0.1])]},
     "group 0: densities (4), delta_loss (4) and stderr (1) must have the same length"),
    ({"groups": [dict(doc()["groups"][0], depth=[0.0, 1.0], densities=[0, 0.25, 0.75, 1])]},
     "group 0: densities [0.0, 0.25, 0.75, 1.0]: expected numbers in (0, 1]"),
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
    with pytest.raises(QualityCostError, match="not found .*scripts/bench.py quality_cost"):
        QualityCost.load(str(tmp_path / "none.json"))
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(QualityCostError, match="not JSON"):
        QualityCost.load(str(tmp_path / "x.json"))


def test_a_plans_cost_looked_up_on_its_grid_is_the_interpolated_one():
    # DST passes its density grid: a plan on it is costed from a table, bit for bit the
    # interpolation's sum (below the data, inside it, flat above); a plan off the grid, or a
    # grid of another planner, falls back to the interpolation
    from sparsebalance_megatron.policy.costs import density_grid
    from sparsebalance_megatron.policy.quality import StageQuality

    q = StageQuality.from_cost(QualityCost.from_dict(doc()), [3, 5, 4], 0.25)
    grid = density_grid(0.25, 0.0625, 1.0)
    rng = np.random.default_rng(2)
    for _ in range(20):
        d = grid[rng.integers(0, grid.size, (4, 6, 3))]
        assert q.plan_cost(d, grid) == q.plan_cost(d)
        off = d.copy()
        off[0, 0, 0] = 0.3
        assert q.plan_cost(off, grid) == q.plan_cost(off)
    other = density_grid(0.25, 0.125, 0.5)
    d = other[rng.integers(0, other.size, (2, 6, 3))]
    assert q.plan_cost(d, other) == q.plan_cost(d) and q.plan_cost(d, grid) == q.plan_cost(d)
    with pytest.raises(QualityCostError, match="one per stage"):
        q.plan_cost(np.full((2, 6, 2), 0.25), grid)
    # the planner's checks hold grid indices: the same floats without the search
    for _ in range(20):
        i = rng.integers(0, grid.size, (3, 5, 3))
        assert q.plan_cost_at(i, grid) == q.plan_cost(grid[i], grid) == q.plan_cost(grid[i])


def test_stage_quality_is_made_once_per_cost_layers_and_d0():
    """DST asks for the stages' quality every step: the same cost object, layers and d0 give
    the same object (its grid tables made once), equal to a fresh one; another cost object,
    other layers or another d0 give another; a cost object freed and another loaded is never
    taken for it."""
    from sparsebalance_megatron.policy.costs import density_grid
    from sparsebalance_megatron.policy.quality import StageQuality

    cost = QualityCost.from_dict(doc())
    q = StageQuality.from_cost(cost, [3, 5, 4], 0.25)
    assert StageQuality.from_cost(cost, (3, 5, 4), 0.25) is q
    assert StageQuality.from_cost(cost, np.array([3, 5, 4]), 0.25) is q
    fresh = StageQuality(*(getattr(q, f) for f in ("groups", "scale", "d0")))
    grid = density_grid(0.25, 0.0625, 1.0)
    assert np.array_equal(q.marginal_gain(grid), fresh.marginal_gain(grid))
    assert np.array_equal(q.grid_table(grid), fresh.grid_table(grid))
    for other in (StageQuality.from_cost(cost, [3, 5, 5], 0.25),
                  StageQuality.from_cost(cost, [3, 5, 4], 0.5),
                  StageQuality.from_cost(QualityCost.from_dict(doc()), [3, 5, 4], 0.25)):
        assert other is not q
    changed = doc()
    changed["groups"][0]["delta_loss"] = [0.6, 0.16, -0.02, -0.024]
    for _ in range(4):                          # ids of freed costs may come back
        got = StageQuality.from_cost(QualityCost.from_dict(changed), [3, 5, 4], 0.25)
        assert got.groups[0].delta_loss == (0.6, 0.16, -0.02, -0.024)
