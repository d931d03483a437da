#!/usr/bin/env python
"""What --sb-plan-ahead leaves on the critical path besides the join: the plan's broadcast.

Rank 0 broadcasts one step's DST payload at scale (densities of 64 DP x 16 micro-batches x 4
stages as lists, plus a report with the unit sensitivities), the way the runtime's commit does
(``torch.distributed.broadcast_object_list``, gloo); prints the pickled size and the median
time over 10 broadcasts after 2 warm-ups.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        scripts/bench_plan_broadcast.py
"""

from __future__ import annotations

import argparse
import pickle
import time

import numpy as np
import torch.distributed as dist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 16, 4], metavar=("DP", "M", "PP"))
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rng = np.random.default_rng(0)
    dp, m, pp = args.shape
    payload = (rng.choice(np.linspace(0.125, 1.0, 57), (dp, m, pp)).tolist(),
               {**{f"field{i}": 0.1 for i in range(20)},
                "unit_sensitivity": np.round(rng.random((dp, m)), 6).tolist()})
    times = []
    for _ in range(12):
        obj = [payload if dist.get_rank() == 0 else None]
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast_object_list(obj, src=0)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(f"plan payload {dp}x{m}x{pp}: {len(pickle.dumps(payload))} bytes, broadcast to "
              f"{dist.get_world_size()} ranks: median {1e3 * np.median(times[2:]):.2f} ms")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
