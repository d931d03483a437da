#!/usr/bin/env python
"""Run real DST plans on a real model: the LM loss of each objective's plan, paired.

Plans come from the simulator setup of ``bench_dst_quality.py`` (built-in corpus, SAB, analytic
Qwen2.5-0.5B PP4 table, one step at d0). A plan's unit (DP rank, micro-batch) gives a density per
pipeline stage; on SmolLM2-135M (30 layers) each layer takes the density of the stage at its
relative depth, set through the attention's own budget and checked against the kept density the
kernel reports. Every unit of every plan runs (a density vector shared by several units or plans
runs once) on the same text windows; a plan's loss change against uniform d0 is the mean over
its units, paired per window across plans (mean and standard error over windows). Also: how
well the quality cost model (``policy.quality``) predicts each allocation's measured change.

    .venv/bin/python scripts/eval_dst_plans.py --json docs/results/dst_plans_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def plans_for(dp: int, m: int, d0: float, layout: str, seed: int = 1):
    """{variant: densities [dp, m, stages]} of one step, and the stage layer counts."""
    from sparsebalance_megatron.batching import (SensitivityTracker, latency_sample_cost_fn,
                                                 sab_plan, unit_sensitivity)
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.data import GlobalBatchSampler, load_corpus
    from sparsebalance_megatron.experiments.layout_search import layout_gap
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.policy import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst import plan_dst_from_config

    lm = LatencyModel.analytic(pp=4)
    lengths = np.asarray(load_corpus(tokenizer="qwen").lengths, dtype=np.int64)
    sampler = GlobalBatchSampler(lengths, capacity=32768, dp=dp, num_microbatches=m, seed=seed,
                                 long_sample_policy="split")
    tracker = SensitivityTracker()
    plan = sab_plan(sampler.next_global_batch(), dp=dp, num_microbatches=m, max_tokens=32768,
                    cost_fn=latency_sample_cost_fn(lm, d0), sensitivity=tracker, seed=seed)
    if layout == "best":
        _, best = layout_gap(lm, plan.unit_csr(True), dp, m, lm.layout, d0)
        lm = lm.with_layout(best)
    costs = UnitCosts.from_latency(lm, lm.unit_features(plan.unit_csr(True)), dp, m,
                                   density_grid(d0, 0.125, 1.0))
    sens = unit_sensitivity(plan.micro_batches, tracker)
    out = {}
    for obj in ("density", "quality"):
        for rt in ("bottleneck", "static"):
            cfg = SparseBalanceConfig(sparse_balance=True, density=d0, dst_objective=obj,
                                      raise_to=rt)
            out[f"{obj}/{rt}"] = plan_dst_from_config(cfg, costs, sens, lm.p2p_s,
                                                      stage_layers=lm.layout.layers).densities
    return out, lm.layout


def layer_densities(stage_d, stage_layers, n_layers: int) -> dict:
    """{layer: density} of a model with n_layers: each layer at its relative depth's stage."""
    edges = np.cumsum(stage_layers) / float(np.sum(stage_layers))
    out = {}
    for j in range(1, n_layers + 1):
        s = int(np.searchsorted(edges, (j - 0.5) / n_layers, side="right"))
        out[j] = float(stage_d[min(s, len(stage_d) - 1)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d0", type=float, default=0.5)
    ap.add_argument("--layout", default="even", choices=["even", "best"])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--text", default="essays", choices=["essays", "shakespeare"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from profile_quality_cost import load_model, window_loss, windows_of

    from sparsebalance_megatron.policy.quality import StageQuality, load_quality_cost

    t0 = time.perf_counter()
    plans, layout = plans_for(args.dp, args.microbatches, args.d0, args.layout)
    quality = StageQuality.from_cost(load_quality_cost(), layout.layers, args.d0)
    model, tok, budget, n_layers = load_model(None, args.d0, args.block_size)
    wins = windows_of(tok, args.text, args.windows, args.window_tokens)
    # every unit of every plan; a density vector shared by units (or plans) runs once per window
    vectors = sorted({tuple(v) for d in plans.values() for v in d.reshape(-1, d.shape[2])})
    print(f"layout {layout.describe()}: {len(vectors)} distinct unit allocations over "
          f"{len(plans)} plans, {len(wins)} windows ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    uniform = {j: args.d0 for j in range(1, n_layers + 1)}
    ref = [window_loss(model, budget, w, uniform, args.block_size) for w in wins]
    measured = {}
    for n, vec in enumerate(vectors):
        alloc = layer_densities(vec, layout.layers, n_layers)
        measured[vec] = [window_loss(model, budget, w, alloc, args.block_size) - base
                         if any(x != args.d0 for x in vec) else 0.0
                         for w, base in zip(wins, ref)]
        if (n + 1) % 10 == 0:
            print(f"  {n + 1}/{len(vectors)} allocations ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    results = {}
    for name, dens in plans.items():
        units = [tuple(v) for v in dens.reshape(-1, dens.shape[2])]
        per_window = np.mean([measured[u] for u in units], axis=0)       # [windows]
        results[name] = {"delta_loss": float(per_window.mean()),
                         "stderr": float(per_window.std(ddof=1) / math.sqrt(per_window.size)),
                         "per_window": per_window.tolist(),
                         "predicted": quality.plan_cost(dens),
                         "stage_density": dens.mean(axis=(0, 1)).tolist(),
                         "min_unit_density": float(dens.min())}
        r = results[name]
        print(f"{name:<22} measured {r['delta_loss']:+.4f} +- {r['stderr']:.4f} nats, predicted "
              f"{r['predicted']:+.4f}; stage densities "
              f"{' '.join(f'{x:.3f}' for x in r['stage_density'])}", flush=True)
    names = list(results)
    pairs = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = np.asarray(results[a]["per_window"]) - np.asarray(results[b]["per_window"])
            pairs[f"{a} - {b}"] = [float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))]
            print(f"  {a} - {b}: {d.mean():+.4f} +- {pairs[f'{a} - {b}'][1]:.4f}")
    pred = np.asarray([quality.unit_costs(np.asarray(v)[None, None, :]).sum() for v in vectors])
    meas = np.asarray([np.mean(measured[v]) for v in vectors])
    moved = np.abs(pred) > 0
    fit = {"pearson": float(np.corrcoef(pred[moved], meas[moved])[0, 1]) if moved.sum() > 2
           else None,
           "measured_over_predicted": float(meas[moved].sum() / pred[moved].sum())
           if moved.any() else None, "allocations": int(moved.sum())}
    print(f"cost model per allocation: Pearson {fit['pearson']}, measured / predicted "
          f"{fit['measured_over_predicted']} over {fit['allocations']} allocations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "layout": layout.describe(),
                       "reference_loss": float(np.mean(ref)), "results": results,
                       "pairs": pairs, "cost_model_fit": fit,
                       "allocations": [{"densities": list(v), "measured": measured[v],
                                        "predicted": float(p)}
                                       for v, p in zip(vectors, pred)]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
