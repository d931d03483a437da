"""DST's two objectives side by side in the simulator: speed, densities and predicted quality.

For each d0 and DP size: the built-in corpus packed by SAB into 32K micro-batches, the analytic
Qwen2.5-0.5B table (PP4) on the best static layout of the first step (``layout_gap``) and on
Megatron's even split; per step, the runtime's DST call (``plan_dst_from_config``) with ``--sb-dst-
objective density`` (floors, sensitivity order) and ``quality`` (water-filling cuts/raises, no
predicted loss against uniform d0), each with ``--sb-raise-to bottleneck`` (speed) and ``static``
(accuracy). Reported per variant: step time against static d0 on the same layout and packing,
layer-weighted density, the lowest stage density, and the predicted loss change against uniform d0
under the shipped SmolLM2-135M quality cost mapped by depth (the cost the quality objective plans
with: ``scripts/bench.py dst_plans`` measures the plans on the model itself).

``quality/equal-cost`` answers "at equal quality cost, which objective is faster": per step, the
quality objective (raise to the bottleneck) at every tolerance of ``--equal-cost-tolerances`` (a
narrower band cuts more, so it is faster and costs more quality), and the fastest of those plans
whose predicted loss change is no higher than ``density/bottleneck``'s on the same step (the
default tolerance's plan if none is).

    .venv/bin/python scripts/bench.py dst_quality --json docs/results/dst_quality.json
"""

from __future__ import annotations

from .common import parser, write_result

import numpy as np


def run(dp: int, d0: float, layout: str, steps: int = 3, m: int = 8, seq: int = 32768,
        equal_cost_tolerances=(0.0, 0.025, 0.05, 0.1)) -> dict:
    from sparsebalance_megatron.batching import unit_sensitivity
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.policy import UnitCosts, density_grid
    from sparsebalance_megatron.policy.costs import stage_mean_densities, weighted_mean_density
    from sparsebalance_megatron.policy.dst import plan_dst_from_config
    from sparsebalance_megatron.policy.quality import load_quality_cost
    from sparsebalance_megatron.policy.quality_stages import StageQuality
    from sparsebalance_megatron.sim import pipeline_makespan_s

    corpus = corpus_steps(dp, m, d0, steps, seq=seq, layout=layout)
    lm, batches, tracker = corpus.lm, corpus.plans, corpus.tracker
    layers = lm.layout.layers
    quality = StageQuality.from_cost(load_quality_cost(), layers, d0)
    variants = {f"{obj}/{rt}": SparseBalanceConfig(sparse_balance=True, density=d0,
                                                   dst_objective=obj, raise_to=rt)
                for obj in ("density", "quality") for rt in ("bottleneck", "static")}
    grid = density_grid(d0, 0.125, 1.0)
    rows = {k: {"step_s": [], "static_s": [], "density": [], "min_stage": [], "quality": []}
            for k in list(variants) + ["quality/equal-cost"]}
    tolerances = []
    for plan in batches:
        costs = UnitCosts.from_latency(lm, lm.unit_features(plan.unit_csr(True)), dp, m, grid)
        sens = unit_sensitivity(plan.micro_batches, tracker)
        w = costs.weights()

        def step(dens):
            f, b = costs.at(np.searchsorted(costs.densities, dens - 1e-12))
            return float(pipeline_makespan_s(f, b, lm.p2p_s, pp=lm.layout.pp).max())
        static_s = step(np.full(costs.shape, d0))

        def plan(cfg):
            return plan_dst_from_config(cfg, costs, sens, lm.p2p_s, stage_layers=layers).densities
        plans = {name: plan(cfg) for name, cfg in variants.items()}
        cap = quality.plan_cost(plans["density/bottleneck"]) + 1e-12
        sweep = [(t, plan(SparseBalanceConfig(sparse_balance=True, density=d0, tolerance=t,
                                              dst_objective="quality"))) for t in
                 equal_cost_tolerances]
        within = [(step(d), t, d) for t, d in sweep if quality.plan_cost(d) <= cap]
        if within:
            _, t_best, plans["quality/equal-cost"] = min(within, key=lambda x: (x[0], -x[1]))
        else:
            t_best, plans["quality/equal-cost"] = None, plans["quality/bottleneck"]
        tolerances.append(t_best)
        for name, dens in plans.items():
            r = rows[name]
            r["step_s"].append(step(dens))
            r["static_s"].append(static_s)
            r["density"].append(weighted_mean_density(dens, w) / d0)
            r["min_stage"].append(float(stage_mean_densities(dens, w).min()) / d0)
            r["quality"].append(quality.plan_cost(dens))
    out = {}
    for name, r in rows.items():
        out[name] = {"speedup_vs_static": float(np.sum(r["static_s"]) / np.sum(r["step_s"])),
                     "density_x_d0": float(np.mean(r["density"])),
                     "min_stage_density_x_d0": float(np.min(r["min_stage"])),
                     "predicted_loss_change_nats": float(np.mean(r["quality"]))}
    return {"dp": dp, "d0": d0, "layout": lm.layout.describe(), "micro_batches": m,
            "steps": steps, "variants": out, "equal_cost_tolerance_per_step": tolerances}


def main(argv=None) -> int:
    ap = parser(__doc__, "dst_quality")
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--d0", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--equal-cost-tolerances", type=float, nargs="+",
                    default=[0.0, 0.025, 0.05, 0.1])
    args = ap.parse_args(argv)
    results = []
    print(f"{'d0':>5} {'dp':>4} {'layout':>9} {'variant':<22} {'speedup':>8} {'density':>8} "
          f"{'min stage':>9} {'pred. loss':>10}")
    for d0 in args.d0:
        for dp in args.dp:
            for layout in ("best", "even"):
                res = run(dp, d0, layout, args.steps,
                          equal_cost_tolerances=args.equal_cost_tolerances)
                results.append(res)
                for name, v in res["variants"].items():
                    print(f"{d0:>5} {dp:>4} {res['layout']:>9} {name:<22} "
                          f"{v['speedup_vs_static']:>8.3f} {v['density_x_d0']:>8.3f} "
                          f"{v['min_stage_density_x_d0']:>9.3f} "
                          f"{v['predicted_loss_change_nats']:>+10.4f}", flush=True)
    if args.json:
        write_result(args.json, {
            "results": results,
            "note": "speedup vs static d0 on the same layout and SAB packing; densities as "
                    "multiples of d0, layer x work weighted; predicted loss change vs uniform "
                    "d0 (nats/token), shipped SmolLM2 cost"})
    return 0
