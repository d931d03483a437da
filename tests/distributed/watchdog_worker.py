"""A tiny torchrun job for tests/distributed/test_watchdog.py: every rank ticks its watchdog and
all-reduces one number per step on gloo; at step 10 rank 1 prints its pid and then, by
``argv[1]``, sleeps forever (``sleep``), leaves with ``os._exit(0)`` (``exit``) or carries on
(``stop``: the test sends it SIGSTOP; ``none``: a healthy run). ``argv[2]``: the watchdog's
threshold in seconds. The process groups' timeout is 300 s: only the watchdog ends the job early.

``healthy DIR``: a healthy run shaped like the ones the watchdog once killed (issue 34), each
delay injected, in units of the threshold T: a slow last stage (rank 2 computes 0.4 T before each
of three all-reduces in a forward step: the others wait 1.2 T between their progress points, in
three collectives), two evaluation steps of 0.6 T on rank 1 inside Megatron's 'evaluate' timer
(1.2 T in the timer),
and a checkpoint save inside its 'save-checkpoint' timer in which rank 0 writes ``DIR/ckpt.bin``
for 1.5 T while the others wait in the save's barrier. The timers are the watchdog's
``PhaseTimers`` around a stand-in for Megatron's ``Timers`` (start/stop with a barrier).

    torchrun --standalone --nproc_per_node=3 tests/distributed/watchdog_worker.py sleep 4
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch

from sparsebalance_megatron.megatron.runtime import comm
from sparsebalance_megatron.megatron.runtime.watchdog import Watchdog, WatchdogTiming
from sparsebalance_megatron.megatron.runtime.watchdog_megatron import PhaseTimers

STEPS = {"none": 60, "sleep": 3000, "exit": 3000, "stop": 3000}
CKPT_CHUNKS = 10


def _hang_here():
    while True:
        time.sleep(3600)


class _Timer:
    """Megatron's timer as the phases see it: start and stop may hold a barrier."""

    def start(self, barrier=False):
        if barrier:
            comm.barrier()

    def stop(self, barrier=False):
        if barrier:
            comm.barrier()


def _healthy(wd: Watchdog, rank: int, threshold: float, out: Path) -> None:
    timers = PhaseTimers(lambda name, log_level=None: _Timer(), wd)
    x = torch.ones(1)
    wd.tick(0, "forward step, iteration 1")     # a slow last stage
    for _ in range(3):
        if rank == 2:
            time.sleep(0.4 * threshold)
        comm.all_reduce_sum_(x, None)
    timers("evaluate").start(barrier=True)      # slow evaluation forwards
    for _ in range(2):
        wd.tick(None, "evaluation")
        if rank == 1:
            time.sleep(0.6 * threshold)
        comm.all_reduce_sum_(x, None)
    timers("evaluate").stop()
    timers("save-checkpoint").start(barrier=False)   # a slow save, as save_checkpoint_and_time
    if rank == 0:
        part = out / "ckpt.bin.partial"
        with open(part, "wb") as f:
            for _ in range(CKPT_CHUNKS):
                f.write(b"\0" * 1024)
                f.flush()
                time.sleep(1.5 * threshold / CKPT_CHUNKS)
        part.rename(out / "ckpt.bin")
    comm.barrier()                              # Megatron's save ends in collectives too
    timers("save-checkpoint").stop(barrier=False)
    wd.tick(1, "forward step, iteration 2")
    comm.all_reduce_sum_(x, None)


def main() -> None:
    fault, threshold = sys.argv[1], float(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm.init_process_group("gloo", world, rank, datetime.timedelta(seconds=300))
    timing = WatchdogTiming.for_threshold(threshold)
    wd = Watchdog(comm.watchdog_store(), rank, world, lambda: timing, coords=dict(dp=rank))
    x = torch.ones(1)
    if fault == "healthy":
        _healthy(wd, rank, threshold, Path(sys.argv[3]))
    for step in range(STEPS.get(fault, 0)):
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
