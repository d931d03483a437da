"""Shared by the studies that time the README's job (``examples/run_cpu_demo.sh``): one run
with extra Megatron / plugin flags, its per-step metrics, and the timed steps (the first two
steps warm up and are not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNTIMED_STEPS = 2


def add_steps_arg(ap, default: int) -> None:
    ap.add_argument("--steps", type=int, default=default,
                    help=f"training steps per run (>= 4; the first {UNTIMED_STEPS} are not timed)")


def check_steps(ap, steps: int) -> None:
    if steps < UNTIMED_STEPS + 2:
        ap.error(f"--steps {steps}: expected >= {UNTIMED_STEPS + 2} (the first "
                 f"{UNTIMED_STEPS} steps are not timed)")


def run_demo(extra: list, out: str, label: str, steps: int, prefix=(), **env) -> tuple:
    """Run the README job with ``extra`` flags into ``out`` (``env``: NPROC, PP, ...).
    Returns (per-step metrics rows, the timed steps' seconds, the finished process); a failed
    run stops the benchmark with its output."""
    env = dict(os.environ, OUT=out, TRAIN_ITERS=str(steps), OMP_NUM_THREADS="1",
               PY=sys.executable, **{k: str(v) for k, v in env.items()})
    p = subprocess.run([*prefix, "bash", "examples/run_cpu_demo.sh", *extra], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{label} run failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
    return rows, [r["step_time_s"] for r in rows[UNTIMED_STEPS:]], p

