"""Run real DST plans on a real model: the LM loss and needle retrieval of each plan, paired.

Plans come from the simulator setup of ``bench_dst_quality.py`` (built-in corpus, SAB, analytic
Qwen2.5-0.5B PP4 table, one step at d0). A plan's unit (DP rank, micro-batch) gives a density per
pipeline stage; on SmolLM2-135M (30 layers) each layer takes the density of the stage at its
relative depth, set through the attention's own budget and checked against the kept density the
kernel reports. Every unit of every plan runs (a density vector shared by several units or plans
runs once) on the same text windows; a plan's loss change against uniform d0 is the mean over
its units, paired per window across plans (mean and standard error over windows). Also: how
well the quality cost model (``policy.quality``) predicts each allocation's measured change.
``--plans-from`` takes the plans of real runs instead (their ``--sb-metrics-file``).

    .venv/bin/python scripts/bench.py dst_plans --json docs/results/dst_plans_smollm2.json
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

from .common import parser, write_result


def plans_for(dp: int, m: int, d0: float, layout: str, seed: int = 1):
    """{variant: densities [dp, m, stages]} of one step, and the stage layer counts."""
    from sparsebalance_megatron.batching import unit_sensitivity
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.policy import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst import plan_dst_from_config

    run = corpus_steps(dp, m, d0, layout=layout, seed=seed)
    lm, plan, tracker = run.lm, run.plans[0], run.tracker
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


def plans_from(specs) -> tuple:
    """{name: densities [steps x dp, m, stages]} of real runs, from ``NAME=FILE`` specs naming
    ``--sb-metrics-file`` outputs (every step's per-unit plan), and the runs' stage layers (one
    pipeline layout for all)."""
    from sparsebalance_megatron.latency.layout import PipelineLayout

    out, layers = {}, None
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--plans-from {spec!r}: expected NAME=METRICS.jsonl")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [r for r in rows if r.get("densities") is not None]
        if not rows:
            raise SystemExit(f"--plans-from {spec!r}: no step with per-unit densities (run with "
                             f"--sb-metrics-file and DST on)")
        lay = tuple(int(x) for x in rows[0]["layers_per_stage"])
        if layers not in (None, lay):
            raise SystemExit(f"--plans-from {spec!r}: stage layers {list(lay)}, the other runs "
                             f"have {list(layers)}: one pipeline layout expected")
        layers = lay
        out[name] = np.concatenate([np.asarray(r["densities"], dtype=np.float64)
                                    for r in rows])
    return out, PipelineLayout(len(layers), 1, layers)


def layer_densities(stage_d, stage_layers, n_layers: int) -> dict:
    """{layer: density} of a model with n_layers: each layer at its relative depth's stage."""
    edges = np.cumsum(stage_layers) / float(np.sum(stage_layers))
    out = {}
    for j in range(1, n_layers + 1):
        s = int(np.searchsorted(edges, (j - 0.5) / n_layers, side="right"))
        out[j] = float(stage_d[min(s, len(stage_d) - 1)])
    return out


def _summary(per_item) -> dict:
    per_item = np.asarray(per_item, dtype=float)
    return {"mean": float(per_item.mean()),
            "stderr": float(per_item.std(ddof=1) / math.sqrt(per_item.size))
            if per_item.size > 1 else None, "per_item": per_item.tolist()}


METRICS = ("loss", "answer_nll", "token_accuracy", "exact")


def main(argv=None) -> int:
    ap = parser(__doc__, "dst_plans")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d0", type=float, default=0.5)
    ap.add_argument("--layout", default="even", choices=["even", "best"])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--text", default="essays", choices=["essays", "shakespeare"])
    ap.add_argument("--retrieval-samples", type=int, default=4,
                    help="needle prompts (needle_single, needle_multikey alternating; 0: none)")
    ap.add_argument("--retrieval-length", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--plans-from", nargs="+", default=None, metavar="NAME=METRICS.jsonl",
                    help="plans of real runs (their --sb-metrics-file, every step) instead of "
                         "the simulator's; --d0 must be the runs' --sb-density")
    args = ap.parse_args(argv)
    if args.windows < 2 or args.retrieval_samples < 0:
        ap.error("--windows >= 2 and --retrieval-samples >= 0 expected")
    from .quality_cost import answer_scores, load_model, window_loss, windows_of

    from sparsebalance_megatron.eval import make_sample
    from sparsebalance_megatron.policy.quality import load_quality_cost
    from sparsebalance_megatron.policy.quality_stages import StageQuality

    t0 = time.perf_counter()
    plans, layout = plans_from(args.plans_from) if args.plans_from else \
        plans_for(args.dp, args.microbatches, args.d0, args.layout)
    quality = StageQuality.from_cost(load_quality_cost(), layout.layers, args.d0)
    model, tok, budget, n_layers = load_model(None, args.d0, args.block_size)
    wins = windows_of(tok, args.text, args.windows, args.window_tokens)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [make_sample(("needle_single", "needle_multikey")[k % 2], args.retrieval_length,
                           (0.25, 0.75)[(k // 2) % 2], k // 4, encode)
               for k in range(args.retrieval_samples)]
    # every unit of every plan; a density vector shared by units (or plans) runs once
    vectors = sorted({tuple(v) for d in plans.values() for v in d.reshape(-1, d.shape[2])})
    print(f"layout {layout.describe()}: {len(vectors)} distinct unit allocations over "
          f"{len(plans)} plans, {len(wins)} windows, {len(prompts)} retrieval prompts "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    def scores(alloc: dict) -> dict:
        """{metric: [per window or per prompt]} of one per-layer allocation."""
        out = {"loss": [window_loss(model, budget, w, alloc, args.block_size) for w in wins]}
        rs = [answer_scores(model, budget, p, alloc, args.block_size) for p in prompts]
        for k in METRICS[1:]:
            out[k] = [r[k] for r in rs]
        return out

    uniform_vec = tuple([args.d0] * len(layout.layers))
    ref = scores({j: args.d0 for j in range(1, n_layers + 1)})
    measured = {}
    for n, vec in enumerate(vectors):
        measured[vec] = ref if vec == uniform_vec else scores(
            layer_densities(vec, layout.layers, n_layers))
        if (n + 1) % 10 == 0:
            print(f"  {n + 1}/{len(vectors)} allocations ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    metrics = [k for k in METRICS if len(ref[k])]
    results = {"uniform": {k: _summary(np.zeros(len(ref[k]))) for k in metrics}}
    results["uniform"].update(predicted=0.0, stage_density=[args.d0] * len(layout.layers),
                              min_unit_density=args.d0)
    for name, dens in plans.items():
        units = [tuple(v) for v in dens.reshape(-1, dens.shape[2])]
        results[name] = {k: _summary(np.mean([measured[u][k] for u in units], axis=0)
                                     - np.asarray(ref[k])) for k in metrics}
        results[name].update(predicted=quality.plan_cost(dens),
                             stage_density=dens.mean(axis=(0, 1)).tolist(),
                             min_unit_density=float(dens.min()))
    absolute = {k: float(np.mean(ref[k])) for k in metrics}
    print(f"uniform d0 = {args.d0}: " + ", ".join(f"{k} {v:.4f}" for k, v in absolute.items()))
    for name, r in results.items():
        print(f"{name:<20} " + "  ".join(
            f"{k} {r[k]['mean']:+.4f}" + ("" if r[k]["stderr"] is None else
                                          f" +- {r[k]['stderr']:.4f}") for k in metrics)
              + f"  predicted {r['predicted']:+.4f}; stage densities "
              + " ".join(f"{x:.3f}" for x in r["stage_density"]), flush=True)
    names = list(results)
    pairs = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs[f"{a} - {b}"] = {}
            for k in metrics:
                d = np.asarray(results[a][k]["per_item"]) - np.asarray(results[b][k]["per_item"])
                pairs[f"{a} - {b}"][k] = [float(d.mean()),
                                          float(d.std(ddof=1) / math.sqrt(d.size))]
            print(f"  {a} - {b}: " + "  ".join(f"{k} {v[0]:+.4f} +- {v[1]:.4f}"
                                                for k, v in pairs[f"{a} - {b}"].items()))
    pred = np.asarray([quality.unit_costs(np.asarray(v)[None, None, :]).sum() for v in vectors])
    meas = np.asarray([np.mean(measured[v]["loss"]) - np.mean(ref["loss"]) for v in vectors])
    moved = np.abs(pred) > 0
    fit = {"pearson": float(np.corrcoef(pred[moved], meas[moved])[0, 1]) if moved.sum() > 2
           else None,
           "measured_over_predicted": float(meas[moved].sum() / pred[moved].sum())
           if moved.any() else None, "allocations": int(moved.sum())}
    print(f"cost model per allocation (LM loss): Pearson {fit['pearson']}, measured / predicted "
          f"{fit['measured_over_predicted']} over {fit['allocations']} allocations")
    if args.json:
        write_result(args.json, {
            "settings": vars(args), "layout": layout.describe(), "reference": absolute,
            "results": results, "pairs": pairs, "cost_model_fit": fit,
            "prompts": [{"task": p.task, "length": p.length, "depth": p.depth, "seed": p.seed}
                        for p in prompts],
            "allocations": [{"densities": list(v), "measured": measured[v],
                             "predicted": float(p)} for v, p in zip(vectors, pred)]})
    return 0
