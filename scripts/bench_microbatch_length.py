#!/usr/bin/env python
"""Fixed- vs variable-length micro-batches (``--sb-microbatch-multiple``) in whole training steps.

Runs the README's CPU job (``examples/run_cpu_demo.sh``: the tiny GPT, real data, ``torchrun``,
PP=2 x DP=2 by default, ``--sparse-balance``; ``--cp``, ``--pp``, ``--nproc`` and
``--seq-length`` change that) twice on the same documents: with micro-batches of
``--seq-length`` tokens (the fill is padding every layer computes) and with micro-batches that
end at their documents, rounded up to ``--multiple`` tokens. Measured timings drive DST in both
(the job's default), so the plans may differ where the units differ. Prints, per run and
alternating the runs ``--repeats`` times: the median step time over the steps after the first
two (the plugin's metrics file), the positions computed per step against the documents' tokens,
and the last step's loss.

    .venv/bin/python scripts/bench_microbatch_length.py --json docs/results/microbatch_length_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from demo_runs import add_steps_arg, check_steps, run_demo, write_json


def run(multiple: int, args, out: str) -> dict:
    extra = ["--sb-doc-unit", args.doc_unit, "--eval-iters", "0"]
    if args.seq_length:
        extra += ["--seq-length", str(args.seq_length), "--max-position-embeddings",
                  str(args.seq_length)]
    if args.cp > 1:
        extra += ["--context-parallel-size", str(args.cp), "--cp-comm-type", "a2a"]
    if multiple:
        extra += ["--sb-microbatch-multiple", str(multiple)]
    rows, times, _ = run_demo(extra, out, f"multiple {multiple}", args.steps,
                              NPROC=args.nproc, PP=args.pp)
    return {"multiple": multiple, "steps": len(rows),
            "step_time_s_median": statistics.median(times), "step_times_s": times,
            "tokens": sum(r["tokens"] for r in rows),
            "positions": sum(r["positions"] for r in rows),
            "mean_density": statistics.mean(r["mean_density"] for r in rows),
            "last_loss": rows[-1]["loss"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--doc-unit", choices=("section", "file"), default="section")
    ap.add_argument("--seq-length", type=int, default=None, help="default: the job's 1024")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1, help="--context-parallel-size (a2a)")
    add_steps_arg(ap, 20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    check_steps(ap, args.steps)
    runs = {0: [], args.multiple: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for k in runs:
                runs[k].append(run(k, args, os.path.join(tmp, f"k{k}_r{rep}")))
    print(f"README CPU job ({args.nproc} processes on {os.cpu_count()} cores: PP={args.pp}, "
          f"CP={args.cp}), {args.seq_length or 1024}-token micro-batches of {args.doc_unit} "
          f"documents, {args.steps} steps x {args.repeats} runs each")
    print(f"{'micro-batches':<22} {'step s (median)':>16} {'positions/tokens':>17} "
          f"{'density':>8} {'last loss':>10}")
    out = {"config": vars(args), "runs": {}}
    for k, rs in runs.items():
        med = statistics.median(s for r in rs for s in r["step_times_s"])
        name = "fixed (--seq-length)" if k == 0 else f"variable (multiple {k})"
        ratio = rs[0]["positions"] / rs[0]["tokens"]
        print(f"{name:<22} {med:>16.3f} {ratio:>17.3f} {rs[0]['mean_density']:>8.3f} "
              f"{rs[-1]['last_loss']:>10.4f}")
        out["runs"][name] = {"step_time_s_median": med, "positions_per_token": ratio,
                             "repeats": rs}
    fixed, var = (out["runs"][n]["step_time_s_median"] for n in out["runs"])
    out["speedup"] = fixed / var
    print(f"speedup of variable-length micro-batches: {fixed / var:.3f}x")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
