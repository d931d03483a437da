"""A rank's DST as rounds (policy/dst_rounds.py): one generator, driven alone (a DP group of
one: the same rounds, the band search over all rows, ``_bands.central_plan``, bit for bit) or in
lockstep with its peers; ranks whose rounds do not line up are named, not silently mixed."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, plan_dst
from sparsebalance_megatron.megatron.step.agreement import drive
from sparsebalance_megatron.policy.dst_rounds import (plan_rounds_in_process, rank_rounds,
                                                      reduce_in_process)
from sparsebalance_megatron.policy.quality_bound import bind_quality
from tests.unit._bands import central_plan, rule_free, without_adoption

from test_policy_dst import D0, DMAX, DMIN, _quality, synthetic_costs

FLOORS = dict(density_floor=0.9, stage_density_floor=0.75)


def test_one_rank_driven_alone_is_the_central_plan():
    """A rank driven alone keeps the central band plan, report and all, where its probed
    descent finds nothing faster (``probe`` -1), else the descent's plan; either way the plan
    the in-process driver makes."""
    kept = []
    for seed in range(9):                               # seed 8: no probe is faster
        costs = synthetic_costs(1, 5, 3, seed=seed, lm_head=1.5)
        sens = np.random.default_rng(seed).random((1, 5))
        s, q = rule_free(DSTSettings(D0, DMIN, DMAX, **FLOORS)), _quality(3)
        plan = drive(rank_rounds(costs, sens, s, quality=q),
                     lambda parts: reduce_in_process([parts]))
        central = central_plan(costs, sens, s, quality=bind_quality(q, costs))
        got = costs.densities[plan.grid_index]
        kept.append(plan.probe)
        if plan.probe < 0:
            np.testing.assert_array_equal(got, central.densities)
            assert without_adoption(plan.report) == central.report
        else:
            assert plan.report.step_time_planned_s < central.report.step_time_planned_s
        assert plan.cpu_s.sum() > 0 and plan.report.adopted == "dst"
        again = plan_dst(costs, sens, s, quality=q)        # driven in-process: the same rounds
        assert again.report == plan.report
        np.testing.assert_array_equal(again.densities, got)
    assert min(kept) < 0 <= max(kept), kept             # both cases met


def test_the_in_process_reduction_sums_and_maximises_key_by_key():
    parts = [{"sum": {"a": 1, "v": np.array([1.0, 2.0])}, "max": {"m": 3.0}},
             {"sum": {"a": 2, "v": np.array([0.5, 0.5])}, "max": {"m": 5.0}}]
    got = reduce_in_process(parts)
    assert got["a"] == 3 and got["m"] == 5.0
    np.testing.assert_array_equal(got["v"], [1.5, 2.5])


def test_ranks_whose_rounds_do_not_line_up_are_named():
    def short():
        yield {"sum": {"a": 1.0}, "max": {}}
        return "done"

    def long():
        yield {"sum": {"a": 1.0}, "max": {}}
        yield {"sum": {"a": 1.0}, "max": {}}
        return "done"

    with pytest.raises(RuntimeError, match="1 ended where 1 yielded another part"):
        plan_rounds_in_process([short(), long()])


@pytest.mark.parametrize("as_", ["lists", "csr", "features"])
def test_a_ranks_own_costs_are_its_rows_of_the_steps(as_):
    """``UnitCosts.from_latency(rank=r)``: DP rank r's units alone, calibrated as rank r (a slow
    GPU learned on rank 1), are its rows of the whole step's costs, bit for bit."""
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.policy.dst_ranks import rank_slice

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=4096), pp=2)
    for _ in range(30):
        lm.calibrate(1, [1.0, 1.0], [1.0, 1.2])
        lm.calibrate_stages(1, [1.0, 1.0], [1.0, 1.2])
    rng = np.random.default_rng(5)
    dp, m = 3, 4
    lens = [rng.integers(64, 1500, size=int(rng.integers(1, 5))) for _ in range(dp * m)]
    offsets = np.r_[0, np.cumsum([len(x) for x in lens])].astype(np.int64)
    csr = (offsets, np.concatenate(lens).astype(np.int64))
    units = {"lists": lens, "csr": csr, "features": lm.unit_features(csr)}[as_]
    kept = (offsets, np.maximum(csr[1] - 32, 1))            # the documents without padding
    grid = np.array([0.25, 0.5, 1.0])
    whole = UnitCosts.from_latency(lm, units, dp, m, grid, kept_units=kept)
    for r in range(dp):
        own = UnitCosts.from_latency(lm, units, dp, m, grid, kept_units=kept, rank=r)
        ref = rank_slice(whole, r)
        assert own.shape == (1, m, 2)
        for name in ("fwd_s", "bwd_s", "attn_work", "kept_grid", "total_s"):
            np.testing.assert_array_equal(getattr(own, name), getattr(ref, name), err_msg=name)
    with pytest.raises(ValueError, match="rank 3: expected a DP rank in"):
        UnitCosts.from_latency(lm, units, dp, m, grid, rank=3)


@pytest.mark.parametrize("flags", [dict(descent=False), dict(anchor="max"),
                                   dict(raise_to="static"), dict(density_floor=0.0)])
def test_the_quality_objective_without_the_descent_is_the_central_plan(flags):
    """Where no descent follows (descent off, the max anchor, raise to static, no density
    floor), the quality objective runs both objectives' band searches and keeps the one the
    quality cost prefers at the same speed: decomposed, every candidate of both planned at
    once and the verdicts replayed on the agreed sums, the central plan at every DP."""
    rng = np.random.default_rng(17)
    for dp in (1, 2, 3, 5):
        m, pp = int(rng.integers(2, 8)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=int(rng.integers(1 << 30)),
                                lm_head=float(rng.uniform(0.3, 3)))
        sens, q = rng.random((dp, m)), _quality(pp)
        s = rule_free(DSTSettings(D0, DMIN, DMAX, **dict(FLOORS, **flags)))
        central = central_plan(costs, sens, s, quality=bind_quality(q, costs))
        dec = plan_dst(costs, sens, s, quality=q)
        np.testing.assert_array_equal(dec.densities, central.densities)
        if dp == 1:
            assert without_adoption(dec.report) == central.report
        else:
            assert dec.report.quality_cost == pytest.approx(central.report.quality_cost,
                                                            rel=1e-9, abs=1e-15)


def test_a_slow_gpus_narrower_bands_are_guarded_by_the_agreed_quality_cost():
    """With a slow GPU the density order's narrower bands must not lose quality: the guard
    reads the whole step's agreed cost (a rank's rows alone would misjudge it)."""
    from dataclasses import replace

    from sparsebalance_megatron.policy.agreed_stats import straggler_present
    from test_dst_bands import BAND, _scale, _slow_rank_costs

    costs = _slow_rank_costs()
    q = _quality(costs.shape[2])
    narrow = straggler_present(_scale(), BAND.tolerance)
    for flags in (dict(descent=False), {}):
        s = rule_free(replace(BAND, **flags))
        central = central_plan(costs, None, s, quality=bind_quality(q, costs), narrow=narrow)
        dec = plan_dst(costs, None, s, quality=q, rank_scale=_scale())
        np.testing.assert_array_equal(dec.densities, central.densities)
        assert dec.report.quality_cost == pytest.approx(central.report.quality_cost, rel=1e-9)
