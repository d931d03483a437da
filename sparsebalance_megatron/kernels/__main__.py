"""``python -m sparsebalance_megatron.kernels [--jobs N]``: compile every room's kernels into
numba's disk cache (next to their sources), the rooms shared among N processes.

A fresh install's cache is empty, and the first planner process compiles about 50 s of one core
before its first draft; ``make test`` runs this first so the suite's planner processes load the
cache instead of each compiling it. Rooms compile independently, so two processes take about
half the time of one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from . import ROOMS, warm_up

# seconds of one core to compile each room from an empty cache (measured on a 2-core VM,
# 2026-11-27): only their ratios matter, to share the rooms evenly
COMPILE_S = {"band": 21.3, "descent": 18.7, "grid": 9.3, "packing": 5.0, "slots": 4.3,
             "graph": 3.6, "features": 1.1}


def share(rooms, jobs: int) -> list[list[str]]:
    """``rooms`` in ``jobs`` groups of about equal compile time (longest first, each to the
    lightest group); empty groups dropped."""
    groups = [[] for _ in range(max(1, jobs))]
    loads = [0.0] * len(groups)
    for room in sorted(rooms, key=lambda r: -COMPILE_S.get(r, 1.0)):
        k = loads.index(min(loads))
        groups[k].append(room)
        loads[k] += COMPILE_S.get(room, 1.0)
    return [g for g in groups if g]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsebalance_megatron.kernels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1, help="processes to share the rooms (default 1)")
    p.add_argument("--rooms", nargs="+", choices=ROOMS, default=list(ROOMS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: expected at least 1")
    groups = share(args.rooms, args.jobs)
    if len(groups) == 1:
        warm_up(groups[0])
        return 0
    procs = [subprocess.Popen([sys.executable, "-m", __package__, "--rooms", *g]) for g in groups]
    codes = [proc.wait() for proc in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
