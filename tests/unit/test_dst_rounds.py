"""A rank's decomposed DST as rounds (policy/dst_rounds.py, issue 77): one generator, driven
alone (a DP group of one: the central plan bit for bit) or in lockstep with its peers; ranks
whose rounds do not line up are named, not silently mixed."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, plan_dst_with_floor
from sparsebalance_megatron.policy.dst_rounds import (plan_rounds_in_process, rank_rounds,
                                                      reduce_in_process, run_rounds)

from test_policy_dst import D0, DMAX, DMIN, _quality, synthetic_costs

FLOORS = dict(density_floor=0.9, stage_density_floor=0.75)


def test_one_rank_driven_alone_is_the_central_plan():
    for seed in range(4):
        costs = synthetic_costs(1, 5, 3, seed=seed, lm_head=1.5)
        sens = np.random.default_rng(seed).random((1, 5))
        s, q = DSTSettings(D0, DMIN, DMAX, **FLOORS), _quality(3)
        plan = run_rounds(rank_rounds(costs, sens, s, quality=q),
                          lambda parts: reduce_in_process([parts]))
        central = plan_dst_with_floor(costs, sens, s, quality=q)
        np.testing.assert_array_equal(costs.densities[plan.grid_index], central.densities)
        assert plan.report == central.report and plan.cpu_s.sum() > 0


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
