"""Simulator study of DST and SAB (issues 4 and 5): DP ranks x PP=4 on the real length mix.

For every DP size and a few global batches (steps), the real corpus (CPython stdlib + Shakespeare,
qwen tokenizer; ``data.load_corpus``) is cut into global batches by the data pipeline's
``GlobalBatchSampler`` (sequential fill of dp x m micro-batches of --seq-length tokens), packed
by Megatron's sequential order or by SAB, timed by the latency model (default: the analytic
Qwen2.5-0.5B / 32K-token / H100 table, ``LatencyModel.analytic``; or a profiled table with
--table) and stepped through the 1F1B simulator. Variants:

- ``static``: sequential packing, every unit at d0 (static sparse attention; the baseline);
- ``dst_<anchor>``: sequential packing + DST with that anchor (mean, median, min, max);
- ``token_balanced``: length-aware balancer at d0; ``sab``: SAB at d0; ``sab_dst``: SAB + DST.

Per variant: step time summed over the steps, speedup vs static, imbalance (max / mean of the
per-rank makespans, averaged over steps), bubble fraction, mean density weighted by dense
attention work. Sensitivities come from the length prior (nothing has been measured in a
simulation). Prints a table; ``--json PATH`` writes everything.

    python scripts/bench_sim_study.py --json sim_study.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from sparsebalance_megatron.batching import (SensitivityTracker, latency_sample_cost_fn,
                                             sab_plan, sequential_plan, token_balanced_plan,
                                             unit_sensitivity)
from sparsebalance_megatron.data import GlobalBatchSampler, load_corpus
from sparsebalance_megatron.latency import LatencyModel
from sparsebalance_megatron.policy import UnitCosts, density_grid, plan_dst
from sparsebalance_megatron.sim.pipeline import simulate_1f1b

ANCHORS = ("mean", "median", "min", "max")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="DP sizes of the DST anchor study")
    p.add_argument("--sab-ranks", type=int, nargs="+", default=[8, 32, 256],
                   help="DP sizes of the SAB / SAB+DST comparison")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--seq-length", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--density", type=float, default=0.5, help="d0")
    p.add_argument("--min-density", type=float, default=0.125)
    p.add_argument("--max-density", type=float, default=1.0)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=3, help="global batches per configuration")
    p.add_argument("--table", default=None, help="profiled latency table (JSON); default: "
                   "the analytic Qwen2.5-0.5B H100 table")
    p.add_argument("--table-force", action="store_true")
    p.add_argument("--tokenizer", default="qwen")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="ranks 8 32, sab-ranks 8 32, 1 step")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Acc:
    """Accumulates one variant over steps."""

    def __init__(self):
        self.step_s, self.imb, self.bubble, self.dw, self.w = 0.0, [], [], 0.0, 0.0
        self.plan_ms = []

    def add(self, costs: UnitCosts, densities: np.ndarray, p2p_s: float, plan_ms=None):
        idx = np.searchsorted(costs.densities, densities - 1e-12)
        f = np.take_along_axis(costs.fwd_s, idx[..., None], axis=-1)[..., 0]
        b = np.take_along_axis(costs.bwd_s, idx[..., None], axis=-1)[..., 0]
        sim = simulate_1f1b(f, b, p2p_s)
        self.step_s += sim.step_time_s
        self.imb.append(sim.imbalance)
        self.bubble.append(sim.bubble_fraction)
        w = costs.attn_work
        self.dw += float((densities * w).sum())
        self.w += float(w.sum())
        if plan_ms is not None:
            self.plan_ms.append(plan_ms)

    def row(self, static_step_s: float) -> dict:
        out = {"step_time_s": self.step_s / max(len(self.imb), 1),
               "speedup_vs_static": static_step_s / self.step_s if self.step_s else float("nan"),
               "imbalance": float(np.mean(self.imb)),
               "bubble_fraction": float(np.mean(self.bubble)),
               "mean_density": self.dw / self.w if self.w else float("nan")}
        if self.plan_ms:
            out["plan_ms_median"] = float(np.median(self.plan_ms))
        return out


def run_config(dp, args, lm, lengths, variants, grid):
    m, cap, d0 = args.microbatches, args.seq_length, args.density
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                                 seed=args.seed, long_sample_policy="split")
    cost_fn = latency_sample_cost_fn(lm, d0)
    tracker = SensitivityTracker()
    acc = {v: Acc() for v in variants}
    bounds = (d0, args.min_density, args.max_density)
    for _ in range(args.steps):
        segs = sampler.next_global_batch()
        plans = {"sequential": sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap)}
        if any(v.startswith("sab") for v in variants):
            plans["sab"] = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                    cost_fn=cost_fn, sensitivity=tracker, seed=args.seed)
        if "token_balanced" in variants:
            plans["token_balanced"] = token_balanced_plan(segs, dp=dp, num_microbatches=m,
                                                          max_tokens=cap, seed=args.seed)
        costs = {k: UnitCosts.from_latency(lm, p.flat_lengths(), dp, m, grid)
                 for k, p in plans.items()}
        sens = {k: unit_sensitivity(p.micro_batches, tracker) for k, p in plans.items()}
        for v in variants:
            packing = {"static": "sequential", "token_balanced": "token_balanced",
                       "sab": "sab", "sab_dst": "sab"}.get(v, "sequential")
            c = costs[packing]
            if v.startswith("dst_") or v == "sab_dst":
                anchor = v[4:] if v.startswith("dst_") else "mean"
                t = time.perf_counter()
                plan = plan_dst(c, sens[packing], *bounds, anchor=anchor,
                                tolerance=args.tolerance, p2p_s=lm.p2p_s)
                acc[v].add(c, plan.densities, lm.p2p_s, (time.perf_counter() - t) * 1e3)
            else:
                acc[v].add(c, np.full(c.shape, d0), lm.p2p_s)
    static = acc["static"].step_s
    return {v: a.row(static) for v, a in acc.items()}


def print_table(title, results):
    print(f"\n{title}")
    print(f"{'ranks':>6} {'variant':<15} {'step_s':>8} {'speedup':>8} {'imbal':>6} "
          f"{'bubble':>7} {'density':>8} {'plan_ms':>8}")
    for dp, rows in results.items():
        for v, r in rows.items():
            pm = f"{r['plan_ms_median']:.1f}" if "plan_ms_median" in r else "-"
            print(f"{dp:>6} {v:<15} {r['step_time_s']:>8.3f} {r['speedup_vs_static']:>8.3f} "
                  f"{r['imbalance']:>6.3f} {r['bubble_fraction']:>7.3f} "
                  f"{r['mean_density']:>8.3f} {pm:>8}")


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.ranks, args.sab_ranks, args.steps = [8, 32], [8, 32], 1
    if args.table:
        lm = LatencyModel.load(args.table, force=args.table_force)
        source = f"table {args.table} ({lm.table.get('device')})"
    else:
        lm = LatencyModel.analytic(pp=args.pp)
        source = "ANALYTIC Qwen2.5-0.5B / 32K / H100 table (published throughputs, not measured)"
    if lm.pp != args.pp:
        sys.exit(f"--table has pp={lm.pp}: expected --pp {args.pp}")
    corpus = load_corpus(tokenizer=args.tokenizer)
    lengths = np.asarray(corpus.lengths, dtype=np.int64)
    grid = density_grid(args.density, args.min_density, args.max_density)
    print(f"latency: {source}\ncorpus: {corpus!r}\npp={args.pp} m={args.microbatches} "
          f"seq_length={args.seq_length} d0={args.density} [{args.min_density}, "
          f"{args.max_density}] tolerance={args.tolerance} steps={args.steps}")
    t0 = time.perf_counter()
    anchors = {str(dp): run_config(dp, args, lm, lengths,
                                   ["static"] + [f"dst_{a}" for a in ANCHORS], grid)
               for dp in args.ranks}
    print_table("DST anchors (sequential packing)", anchors)
    sab = {str(dp): run_config(dp, args, lm, lengths,
                               ["static", "token_balanced", "sab", "dst_mean", "sab_dst"], grid)
           for dp in args.sab_ranks}
    print_table("SAB and SAB+DST (DST anchor mean)", sab)
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"},
               "latency_source": source, "corpus": corpus.stats(),
               "anchors": anchors, "sab": sab}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
