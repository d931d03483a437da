#!/usr/bin/env python
"""Whole training steps with context parallelism on CPU: CP=1 vs CP=2 through ``pretrain()``.

Runs the README's CPU job (``examples/run_cpu_demo.sh``: the tiny GPT, real data, ``torchrun``,
``--sparse-balance``) at PP=1 on long micro-batches of whole files, once on one process (CP=1) and
once on two (``--context-parallel-size 2 --cp-comm-type a2a``), one thread per process, both with
the same per-document padding (``--sb-seq-pad-multiple 4``) so they train on the same
micro-batches. Prints, per run: the median step time over the steps after the first two (the
plugin's metrics file), the loss of the last step, and the largest process's peak RSS
(``/usr/bin/time``: the most any rank held). CP=2 uses twice the cores of CP=1.

    .venv/bin/python scripts/bench_cp_step.py --json docs/results/context_parallel_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cp: int, args, out: str) -> dict:
    extra = ["--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--sb-doc-unit", "file", "--sb-seq-pad-multiple", "4",
             "--eval-iters", "0"]
    if cp > 1:
        extra += ["--context-parallel-size", str(cp), "--cp-comm-type", "a2a"]
    env = dict(os.environ, NPROC=str(cp), PP="1", OUT=out, TRAIN_ITERS=str(args.steps),
               OMP_NUM_THREADS="1", PY=sys.executable)
    cmd = ["/usr/bin/time", "-v", "bash", "examples/run_cpu_demo.sh", *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"CP={cp} run failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
    times = [r["step_time_s"] for r in rows[2:]]
    return {"cp": cp, "processes": cp, "steps": len(rows),
            "step_time_s_median": statistics.median(times), "step_times_s": times,
            "last_loss": rows[-1]["loss"], "tokens_per_step": rows[-1]["tokens"],
            "peak_rss_mib_largest_process": int(rss.group(1)) / 1024 if rss else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error(f"--steps {args.steps}: expected >= 4 (the first two steps are not timed)")
    if not os.path.exists("/usr/bin/time"):
        ap.error("/usr/bin/time not found: it measures the peak RSS (apt-get install time)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (1, 2):
            rows.append(run(cp, args, os.path.join(tmp, f"cp{cp}")))
    print(f"seq_length {args.seq_length}, {args.steps} steps, whole files, PP=1, 1 thread/process")
    print("| CP | processes | step (s, median) | last loss | peak RSS, largest process (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['processes']} | {r['step_time_s_median']:.2f} | "
              f"{r['last_loss']:.4f} | {r['peak_rss_mib_largest_process']:.0f} |")
    ratio = rows[0]["step_time_s_median"] / rows[1]["step_time_s_median"]
    print(f"CP=2 vs CP=1 step time: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "seq_length": args.seq_length,
                       "results": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
