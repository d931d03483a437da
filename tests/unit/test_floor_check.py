"""The descent's floor check (``policy.density_means.FloorCheck``) decides by the compiled sums
only where no summation order can change the verdict, and is numpy's verdict everywhere."""

import numpy as np

from sparsebalance_megatron.policy.density_means import stage_mean_densities, weighted_mean_density
from sparsebalance_megatron.policy.density_means import FloorCheck

from test_policy_dst import synthetic_costs


def _counting(monkeypatch, cls, name: str) -> tuple:
    """(calls, the method as it was): ``cls.name`` patched to count its calls, the compiled
    check's fall-back to numpy's sums."""
    calls, real = [], getattr(cls, name)

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return calls, real


def test_the_floor_checks_compiled_sums_decide_only_what_no_summation_order_can_change(
        monkeypatch):
    """A check by grid index sums the plan in a compiled pass of its own order and
    decides from it only where every order's sum falls on the same side of the floor (a bound
    on the difference): a plan whose mean or stage density is the floor itself, or within
    rounding of it, is checked with numpy's sums; one clearly off it is decided by the
    compiled sums alone; every verdict is numpy's (with routed work, and with a stage without
    work, whose density is its plain mean)."""
    numpy_checks, _ = _counting(monkeypatch, FloorCheck, "_floors")
    rng = np.random.default_rng(12)
    decided = fell_back = 0
    for case in range(16):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=950 + case)
        if case % 4 == 1:
            costs.dense_work = rng.random(costs.shape) * 0.3
        if case % 4 == 3:                     # no work on stage 0: its plain mean density,
            costs.attn_work = costs.weights().copy()          # the lowest
            costs.attn_work[..., 0] = 0.0
        w, dense, g = costs.weights(), costs.dense_work, costs.densities
        i = rng.integers(0, g.size, costs.shape)
        if case % 4 == 3:
            i[..., 0] = rng.integers(0, 3, i[..., 0].shape)
        d = g[i]
        mean = weighted_mean_density(d, w, dense)
        low = float(np.min(stage_mean_densities(d, w, dense)))
        for k, (mean_floor, stage_floor) in enumerate((
                (mean + 1e-12, 0.0),                          # the mean is the floor
                (np.nextafter(mean + 1e-12, 2.0), 0.0),       # within rounding of it
                (0.0, low + 1e-12),                           # the lowest stage is its floor
                (0.0, np.nextafter(low + 1e-12, 2.0)),
                (mean + 1e-12 - 1e-9 * mean, 0.0),            # clear either way
                (mean + 1e-12 + 1e-9 * mean, 0.0))):
            check = FloorCheck(costs, mean_floor, stage_floor, None)
            want = (weighted_mean_density(d, w, dense) >= mean_floor - 1e-12
                    and float(np.min(stage_mean_densities(d, w, dense)))
                    >= stage_floor - 1e-12)
            before = len(numpy_checks)
            assert check.floors_at(i) == want, (case, k)
            used_numpy = len(numpy_checks) > before
            if k < 4:
                fell_back += used_numpy
            else:
                decided += not used_numpy
    assert fell_back == 64 and decided == 32          # ties to numpy, clear cases not
