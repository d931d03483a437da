"""DST on real CPU torchrun runs (issue 4, item 4): straggler, pipeline, overhead.

(a) **straggler**: DP=2, DP rank 1 computes ``--slowdown`` times slower (``--sb-straggler-rank 1
    --sb-straggler-slowdown X``: its forward sleeps in proportion to its compute, so a lower
    density makes it faster too). ``static`` and ``dst`` at the same d0, back to back in this one
    invocation (rounds with alternating order). Reported: the step-time ratio static / dst, the
    measured imbalance, the calibration DST learned per rank, and the plan's mean density per DP
    rank (weighted by attention work).
(b) **pipeline**: PP=2 x DP=1 with the qwen tokenizer (compact vocabulary 42K: the last stage
    carries a real LM head and loss, as in a real model). ``static``, ``dst`` (anchor mean) and
    ``dst_max`` (anchor max: never cut, only raise): the plan's mean density per stage (the
    non-bottleneck first stage should rise) and the step time (should not grow).
(c) **overhead**: ``sb_overhead_s / step_time_s`` per step of every DST run (planning,
    broadcast, gathering, calibration; target < 1%).

Every run is the training entry in Megatron's own ``pretrain()``; the per-step callback writes
each step's plan (densities [dp, m, pp], the dense attention work of every unit, its weight) and
measured times to ``--sb-metrics-file``, which this script reads. Nothing is patched.

    python scripts/bench_dst_runs.py --json runs/dst_runs.json
    python scripts/bench_dst_runs.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_end_to_end import REPO, CpuRunConfig, run_variant, write_json  # noqa: E402

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, one round (indicative)")
    p.add_argument("--json", default=None)
    p.add_argument("--parts", nargs="+", default=["straggler", "pipeline"],
                   choices=("straggler", "pipeline"))
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 8; quick 4)")
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps of each run left out (default 2; quick 1); DST needs one "
                        "measured step to calibrate the straggler")
    p.add_argument("--rounds", type=int, default=None, help="default 2; quick 1")
    p.add_argument("--density", type=float, default=0.5, help="d0")
    p.add_argument("--slowdown", type=float, default=2.0, help="straggler slowdown")
    p.add_argument("--straggler-seq-length", type=int, default=None,
                   help="default 4096; quick 2048")
    p.add_argument("--pipeline-seq-length", type=int, default=None,
                   help="default 2048; quick 1024")
    p.add_argument("--straggler-cut-only", action="store_true",
                   help="also run dst_cutonly in the straggler part: DST with --sb-max-density "
                        "d0 (cuts, never raises), to separate the cut from the raise")
    p.add_argument("--out-dir", default="runs/bench_dst_runs")
    p.add_argument("--timeout", type=int, default=900)
    args = p.parse_args(argv)
    for name, full, quick in (("steps", 8, 4), ("warmup", 2, 1), ("rounds", 2, 1),
                              ("straggler_seq_length", 4096, 2048),
                              ("pipeline_seq_length", 2048, 1024)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


# --- driver -----------------------------------------------------------------------------------

def run_pair(name: str, cfg: CpuRunConfig, extra: list, args, out_dir: Path,
             variants=("static", "dst")) -> dict:
    """static and the DST variants (``dst``: anchor mean, ``dst_<anchor>``) of one
    configuration at the same d0, ``args.rounds`` rounds, the order reversed every other round."""
    table, prof_s = cfg.ensure_latency_table(out_dir)
    runs = {v: [] for v in variants}
    plans = {v: [] for v in variants}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for v in order:
            if v == "static":
                vflags = ["--sb-sparse-attention"]
            elif v == "dst_cutonly":  # d_max = d0: DST may cut, never raise
                vflags = ["--sb-dst", "--sb-latency-table", table,
                          "--sb-max-density", cfg.density]
            else:
                vflags = ["--sb-dst", "--sb-latency-table", table,
                          "--sb-anchor", v[4:] if v.startswith("dst_") else "mean"]
            flags = cfg.flags() + extra + vflags
            lines = run_variant(v, flags, steps=args.steps, timeout=args.timeout,
                                metrics=out_dir / f"{name}_{v}_r{rnd}.jsonl",
                                log=out_dir / f"{name}_{v}_r{rnd}.log")
            runs[v].append(lines)
            plans[v].append([r for r in lines if "densities" in r])
    out = {"config": vars(cfg), "extra_flags": extra, "latency_table": table,
           "profile_s": prof_s, "wall_s": time.perf_counter() - t0}
    out.update(summarize(runs, plans, args.warmup))
    return out


def summarize(runs: dict, plans: dict, warmup: int) -> dict:
    rows = {}
    for v in runs:
        steady = [r for lines in runs[v] for r in lines if r["step"] > warmup]
        steady_plans = [p for lines in plans[v] for p in lines if p["step"] > warmup]
        d = np.asarray([p["densities"] for p in steady_plans])        # [n, dp, m, pp]
        w = np.asarray([p["attn_work"] for p in steady_plans])[..., None] * np.ones_like(d)
        rank_d = (d * w).sum(axis=(0, 2, 3)) / w.sum(axis=(0, 2, 3))
        stage_d = (d * w).sum(axis=(0, 1, 2)) / w.sum(axis=(0, 1, 2))
        busy = np.asarray([r["rank_busy_s"] for r in steady if r.get("rank_busy_s")])
        row = {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
               "step_time_mean_s": float(np.mean([r["step_time_s"] for r in steady])),
               "step_times_s": [round(r["step_time_s"], 4) for r in steady],
               "imbalance": statistics.median(r["measured_imbalance"] for r in steady
                                              if "measured_imbalance" in r),
               "rank_busy_s_median": np.median(busy, axis=0).tolist() if busy.size else None,
               "mean_density": float((d * w).sum() / w.sum()),
               "density_per_dp_rank": rank_d.tolist(),
               "density_per_stage": stage_d.tolist(),
               "overhead_fraction": [r["sb_overhead_s"] / r["step_time_s"] for r in steady],
               "steps": len(steady)}
        if v.startswith("dst"):
            row["calibration_last"] = [lines[-1].get("calibration") for lines in runs[v]]
            row["predicted_speedup_vs_static_plan"] = (
                sum(r["predicted_static_s"] for r in steady)
                / sum(r["predicted_step_s"] for r in steady))
            row["units_cut_mean"] = float(np.mean([r["units_cut"] for r in steady]))
            row["units_raised_mean"] = float(np.mean([r["units_raised"] for r in steady]))
        row["overhead_fraction_median"] = statistics.median(row["overhead_fraction"])
        row["overhead_fraction_max"] = max(row["overhead_fraction"])
        rows[v] = row
    st = rows["static"]
    for v, row in rows.items():
        paired = []
        for a, b in zip(runs["static"], runs[v]):
            sa = {r["step"]: r["step_time_s"] for r in a if r["step"] > warmup}
            paired += [sa[r["step"]] / r["step_time_s"] for r in b if r["step"] in sa]
        row["static_over_variant_median"] = st["step_time_s"] / row["step_time_s"]
        row["static_over_variant_mean"] = st["step_time_mean_s"] / row["step_time_mean_s"]
        row["static_over_variant_paired_median"] = statistics.median(paired)
    d = rows["dst"]
    return {"rows": rows,
            "step_time_ratio_static_over_dst": d["static_over_variant_median"],
            "step_time_ratio_mean": d["static_over_variant_mean"],
            "step_time_ratio_paired_median": d["static_over_variant_paired_median"]}


def print_part(name: str, res: dict) -> None:
    c = res["config"]
    print(f"\n{name}: pp={c['pp']} seq {c['seq_length']} layers {c['num_layers']} hidden "
          f"{c['hidden_size']} {c['tokenizer']} tokens, d0 {c['density']} "
          f"{' '.join(map(str, res['extra_flags']))}  (wall {res['wall_s']:.0f} s)")
    print(f"{'variant':<10} {'step_s':>7} {'mean_s':>7} {'static/v':>8} {'paired':>7} "
          f"{'imbal':>6} {'density':>8} {'per DP rank':>13} {'per stage':>13} {'pred':>6} "
          f"{'ovh% med/max':>13}")
    for v, r in res["rows"].items():
        ranks = "/".join(f"{x:.3f}" for x in r["density_per_dp_rank"])
        stages = "/".join(f"{x:.3f}" for x in r["density_per_stage"])
        pred = r.get("predicted_speedup_vs_static_plan")
        print(f"{v:<10} {r['step_time_s']:>7.3f} {r['step_time_mean_s']:>7.3f} "
              f"{r['static_over_variant_median']:>8.3f} "
              f"{r['static_over_variant_paired_median']:>7.3f} {r['imbalance']:>6.3f} "
              f"{r['mean_density']:>8.3f} {ranks:>13} {stages:>13} "
              f"{'-' if pred is None else format(pred, '.3f'):>6} "
              f"{100 * r['overhead_fraction_median']:>6.2f}/{100 * r['overhead_fraction_max']:.2f}")
        if v.startswith("dst"):
            print(f"{'':<10} calibration (last step of each run) {r['calibration_last']}; "
                  f"units cut/raised per step {r['units_cut_mean']:.1f}/"
                  f"{r['units_raised_mean']:.1f}")


def main(argv=None):
    args = parse_args(argv)
    out_dir = REPO / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"meta": {"command": " ".join(sys.argv), "quick": args.quick,
                       "config": {k: v for k, v in vars(args).items() if k != "json"}}}
    if "straggler" in args.parts:
        cfg = CpuRunConfig(seq_length=args.straggler_seq_length, density=args.density,
                           num_layers=1 if args.quick else 2, global_batch_size=8)
        extra = ["--sb-straggler-rank", 1, "--sb-straggler-slowdown", args.slowdown]
        print("(a) straggler run", flush=True)
        result["straggler"] = run_pair(
            "straggler", cfg, extra, args, out_dir,
            ("static", "dst", "dst_cutonly") if args.straggler_cut_only else ("static", "dst"))
    if "pipeline" in args.parts:
        cfg = CpuRunConfig(seq_length=args.pipeline_seq_length, density=args.density, pp=2,
                           tokenizer="qwen", doc_unit="file", global_batch_size=4)
        print("(b) pipeline run", flush=True)
        result["pipeline"] = run_pair("pipeline", cfg, [], args, out_dir,
                                      ("static", "dst", "dst_max"))
    ovh = [x for part in ("straggler", "pipeline") if part in result
           for v, row in result[part]["rows"].items() if v.startswith("dst")
           for x in row["overhead_fraction"]]
    result["overhead"] = {"dst_overhead_fraction_median": statistics.median(ovh),
                          "dst_overhead_fraction_max": max(ovh), "steps": len(ovh)}
    result["meta"]["wall_s"] = time.perf_counter() - t0
    if args.quick:
        print("\nQUICK: few steps, one round; these numbers are indicative only")
    for part in ("straggler", "pipeline"):
        if part in result:
            print_part(part, result[part])
    o = result["overhead"]
    print(f"\n(c) DST overhead per step (sb_overhead_s / step_time_s), {o['steps']} steady steps: "
          f"median {100 * o['dst_overhead_fraction_median']:.2f}%, max "
          f"{100 * o['dst_overhead_fraction_max']:.2f}% (target < 1%)")
    print(f"({result['meta']['wall_s']:.0f} s)")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
