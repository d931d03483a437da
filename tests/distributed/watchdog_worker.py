"""A tiny torchrun job for tests/distributed/test_watchdog.py: every rank ticks its watchdog and
all-reduces one number per step on gloo; at step 10 rank 1 prints its pid and then, by
``argv[1]``, sleeps forever (``sleep``), leaves with ``os._exit(0)`` (``exit``) or carries on
(``stop``: the test sends it SIGSTOP; ``none``: a healthy run). ``argv[2]``: the watchdog's
threshold in seconds. The process groups' timeout is 300 s: only the watchdog ends the job early.

    torchrun --standalone --nproc_per_node=3 tests/distributed/watchdog_worker.py sleep 4
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch

from sparsebalance_megatron.megatron import comm
from sparsebalance_megatron.megatron.watchdog import Watchdog, WatchdogTiming

STEPS = {"none": 60, "sleep": 3000, "exit": 3000, "stop": 3000}


def _hang_here():
    while True:
        time.sleep(3600)


def main() -> None:
    fault, threshold = sys.argv[1], float(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm.init_process_group("gloo", world, rank, datetime.timedelta(seconds=300))
    timing = WatchdogTiming.for_threshold(threshold)
    wd = Watchdog(comm.watchdog_store(), rank, world, lambda: timing, coords=dict(dp=rank))
    x = torch.ones(1)
    for step in range(STEPS[fault]):
        wd.tick(step, f"step {step + 1}")
        if rank == 1 and step == 10:
            print(f"rank 1 pid {os.getpid()} at step 10", flush=True)
            if fault == "sleep":
                _hang_here()
            if fault == "exit":
                os._exit(0)
        comm.all_reduce_sum_(x, None)
        time.sleep(0.02)
    wd.stop()
    comm.destroy_process_groups()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
