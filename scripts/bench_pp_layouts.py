"""Real CPU PP=2 runs: SparseBalance against the best static Megatron layout (issue 12).

1. Profile the model's CPU latency table once (pp=2: first, middle and last stage).
2. ``experiments.layout_search`` on that table and this run's length mix picks the best static
   configuration (every split Megatron's flags build x sequential / token-balanced packing, at
   d0) and the best layout for SAB + DST (plain 1F1B; every stage >= the stage floor x d0).
3. torchrun (2 processes, PP=2 x DP=1, gloo) of the training entry, in rounds whose order rotates:
   ``static_even`` (even split, sequential packing: Megatron's default), ``best_static`` (the
   chosen layout flags + packing, static sparse attention at d0) and ``sab_dst``
   (``--sparse-balance`` on its chosen layout).

Per variant: median step time over the steady steps of all rounds, speedup over best_static
(also paired: per step of the same round), layer-weighted mean density and per stage (from the
metrics). The simulated speedups of step 2 are printed next to the measured ones.

    python scripts/bench_pp_layouts.py --json docs/results/pp_layouts_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_end_to_end import (REPO, CpuRunConfig, _paired, rotated, run_variant,  # noqa: E402
                              write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--doc-unit", default="section", choices=("file", "section"))
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sim-steps", type=int, default=6, help="global batches the search simulates")
    p.add_argument("--out-dir", default="runs/bench_pp_layouts")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def search(cfg: CpuRunConfig, table: str, args) -> dict:
    from sparsebalance_megatron.data import load_corpus
    from sparsebalance_megatron.experiments import StudyConfig, best_layouts
    from sparsebalance_megatron.latency import LatencyModel

    lm = LatencyModel.load(table)
    corpus = load_corpus(tokenizer=cfg.tokenizer, compact_vocab=True, doc_unit=cfg.doc_unit)
    lengths = np.asarray(corpus.lengths, dtype=np.int64)
    study = StudyConfig(microbatches=cfg.global_batch_size, seq_length=cfg.seq_length,
                        density=cfg.density, steps=args.sim_steps)
    return best_layouts(lm, lengths, study, 1, pp=2, num_layers=cfg.num_layers, vps=(1,))


def main(argv=None):
    args = parse_args(argv)
    out_dir = REPO / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = CpuRunConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                       pp=2, tokenizer=args.tokenizer, doc_unit=args.doc_unit,
                       density=args.density, block_size=args.block_size)
    t0 = time.perf_counter()
    table, prof_s = cfg.ensure_latency_table(out_dir)
    found = search(cfg, table, args)
    best_s, best_sb, even = found["static"][0], found["sparsebalance"][0], found["even_static"]
    sim_static_s = best_s.step_time_s
    packing = ["--sb-packing", "token_balanced"] if best_s.variant == "token_balanced" else []
    variants = {
        "static_even": ["--sb-sparse-attention"],
        "best_static": ["--sb-sparse-attention", *packing, *best_s.flags],
        "sab_dst": ["--sparse-balance", *best_sb.flags, "--sb-latency-table", table],
    }
    sim = {"static_even": sim_static_s / even.step_time_s, "best_static": 1.0,
           "sab_dst": sim_static_s / best_sb.step_time_s}
    layouts = {"static_even": even.layout.describe(), "best_static": best_s.layout.describe(),
               "sab_dst": best_sb.layout.describe()}
    print(f"search: best static {layouts['best_static']} + {best_s.variant}; sab_dst "
          f"{layouts['sab_dst']}; simulated sab_dst / best static {sim['sab_dst']:.3f}x",
          flush=True)
    base = cfg.flags()
    runs = {v: [] for v in variants}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
        for v in rotated(list(variants), rnd):
            runs[v].append(run_variant(v, base + variants[v], steps=args.steps,
                                       timeout=args.timeout,
                                       metrics=out_dir / f"{v}_r{rnd}.jsonl",
                                       log=out_dir / f"{v}_r{rnd}.log"))
    rows = {}
    for v, rounds in runs.items():
        steady = [r for lines in rounds for r in lines if r["step"] > args.warmup]
        dens = [r["mean_density"] for r in steady if "mean_density" in r]
        stage = [r["density_per_stage"] for r in steady if "density_per_stage" in r]
        rows[v] = {"layout": layouts[v], "flags": variants[v],
                   "step_time_s": statistics.median(r["step_time_s"] for r in steady),
                   "step_times_s": [round(r["step_time_s"], 4) for r in steady],
                   "mean_density": float(np.mean(dens)) if dens else args.density,
                   "density_per_stage": (np.mean(stage, axis=0).tolist() if stage
                                         else [args.density, args.density]),
                   "simulated_speedup_vs_best_static": sim[v]}
    for v, row in rows.items():
        row["speedup_vs_best_static"] = rows["best_static"]["step_time_s"] / row["step_time_s"]
        row["speedup_paired_median"] = _paired(runs["best_static"], runs[v], args.warmup)
    print(f"\nreal: CPU torchrun PP=2 x DP=1, {args.num_layers} layers, hidden "
          f"{args.hidden_size}, seq {args.seq_length}, global batch {args.global_batch_size}, "
          f"{args.tokenizer} {args.doc_unit}s, d0 {args.density}; {args.rounds} rounds x "
          f"{args.steps} steps, first {args.warmup} dropped")
    print(f"{'variant':<12} {'layout':<8} {'step_s':>7} {'speedup':>8} {'paired':>7} "
          f"{'sim':>6} {'density':>8} per stage")
    for v, r in rows.items():
        st = " ".join(f"{x:.2f}" for x in r["density_per_stage"])
        print(f"{v:<12} {r['layout']:<8} {r['step_time_s']:>7.3f} "
              f"{r['speedup_vs_best_static']:>8.3f} {r['speedup_paired_median']:>7.3f} "
              f"{r['simulated_speedup_vs_best_static']:>6.3f} {r['mean_density']:>8.3f} {st}")
    wall = time.perf_counter() - t0
    print(f"\n({wall:.0f} s, of which {prof_s:.0f} s profiling)")
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "config": vars(args),
                               "latency_table": table, "rows": rows, "wall_s": wall,
                               "search": {"static_top5": [c.as_dict() for c in found["static"][:5]],
                                          "sparsebalance_top5": [c.as_dict() for c in
                                                                 found["sparsebalance"][:5]]}})


if __name__ == "__main__":
    main()
