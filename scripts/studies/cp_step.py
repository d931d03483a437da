"""Whole training steps with context parallelism on CPU: CP=1 vs CP=2 through ``pretrain()`` (the
README's CPU job at PP=1 on whole files; median step time, last loss, largest peak RSS)."""

from __future__ import annotations

import os
import re
import statistics
import tempfile

from .common import add_steps_arg, check_steps, parser, run_demo, write_result


def run(cp: int, args, out: str) -> dict:
    extra = ["--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--sb-doc-unit", "file", "--sb-seq-pad-multiple", "4",
             "--eval-iters", "0"]
    if cp > 1:
        extra += ["--context-parallel-size", str(cp), "--cp-comm-type", "a2a"]
    rows, times, p = run_demo(extra, out, f"CP={cp}", args.steps,
                              prefix=("/usr/bin/time", "-v"), NPROC=cp, PP=1)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    return {"cp": cp, "processes": cp, "steps": len(rows),
            "step_time_s_median": statistics.median(times), "step_times_s": times,
            "last_loss": rows[-1]["loss"], "tokens_per_step": rows[-1]["tokens"],
            "peak_rss_mib_largest_process": int(rss.group(1)) / 1024 if rss else None}


def main(argv=None) -> int:
    ap = parser(__doc__, "cp_step")
    ap.add_argument("--seq-length", type=int, default=8192)
    add_steps_arg(ap, 8)
    args = ap.parse_args(argv)
    check_steps(ap, args.steps)
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
    write_result(args.json, {"seq_length": args.seq_length, "results": rows})
    return 0

