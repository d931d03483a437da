#!/usr/bin/env python
"""Cost of the per-step planning work on this machine: DST planning and batched latency prediction.

Prints a table and writes JSON (``--json``). These are speed targets, kept out of the unit tests
(no wall clock in tests):

- ``plan_dst`` of 64 DP ranks x 16 micro-batches x 4 stages (synthetic unit costs, the DST unit
  test's shape), median thread CPU time of 9 runs after a warm-up; target < 10 ms.
- ``LatencyModel.predict_many`` over a global batch of 4,096 micro-batches of 32K tokens
  (analytic table, PP=4), median of 5; target well under 250 ms.

    .venv/bin/python scripts/bench_planner_cost.py --json docs/results/planner_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def _median_ms(fn, repeats: int, clock=time.thread_time) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e3)
    return float(np.median(out))


def main(argv=None) -> int:
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.policy import UnitCosts, density_grid, plan_dst

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    rng = np.random.default_rng(7)
    grid = density_grid(0.5, 0.125, 1.0)
    fixed = rng.uniform(0.05, 0.2, (64, 16, 4))
    attn = rng.uniform(0.0, 0.4, (64, 16, 4))
    costs = UnitCosts.affine(grid, fixed, attn)
    sens = rng.random((64, 16))
    plan_ms = _median_ms(lambda: plan_dst(costs, sens, 0.5, 0.125, 1.0), 9)

    lm = LatencyModel.analytic(pp=4)
    units = [np.diff(np.r_[0, np.sort(rng.choice(32767, rng.integers(1, 30), replace=False) + 1),
                           32768]) for _ in range(4096)]
    d = rng.choice(np.linspace(0.125, 1.0, 8), 4096)
    predict_ms = _median_ms(lambda: lm.predict_many(units, d, 1), 5)

    rows = [("plan_dst 64 x 16 x 4", plan_ms, 10.0),
            ("predict_many 4,096 x 32K (pp 4)", predict_ms, 250.0)]
    print(f"{'what':<34} {'median ms':>10} {'target ms':>10}")
    for name, ms, target in rows:
        print(f"{name:<34} {ms:>10.2f} {target:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "clock": "thread CPU time",
                       "rows": [dict(what=n, median_ms=m, target_ms=t) for n, m, t in rows]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
