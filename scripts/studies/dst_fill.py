"""Water-filling alone against the density order, across pipeline layouts (simulator).

Why the quality objective also plans the density objective's way (``policy.dst.
plan_dst_with_floor``): for one step of the built-in corpus (SAB, 32K micro-batches, analytic
Qwen2.5-0.5B PP4 table), on Megatron's even split and on layouts between it and the best static
one, prints each plan's step time against the best static layout's (static d0, same packing)
and its predicted loss change under the shipped quality cost: the density objective, quality
water-filling alone, and the quality objective (the better of the two at the same speed).

    .venv/bin/python scripts/bench.py dst_fill
"""

from __future__ import annotations

import numpy as np


from .common import parser


def main(argv=None) -> int:
    ap = parser(__doc__, "dst_fill", json_arg=False)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d0", type=float, default=0.5)
    ap.add_argument("--raise-to", default="static", choices=["bottleneck", "static"])
    ap.add_argument("--layouts", nargs="+", default=["6/6/6/6", "6/7/7/4", "7/7/7/3", "8/6/6/4",
                                                     "7/7/8/2", "6/8/8/2", "7/8/7/2"])
    args = ap.parse_args(argv)
    from sparsebalance_megatron.batching import unit_sensitivity
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.experiments.layout_search import layout_gap
    from sparsebalance_megatron.latency.layout import PipelineLayout
    from sparsebalance_megatron.policy import DSTSettings, UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst import (BandCache, _plan_with_floor,
                                                   plan_dst_from_config)
    from sparsebalance_megatron.policy.quality import load_quality_cost
    from sparsebalance_megatron.policy.quality_stages import StageQuality
    from sparsebalance_megatron.sim import pipeline_makespan_s

    dp, m, d0 = args.dp, args.microbatches, args.d0
    run = corpus_steps(dp, m, d0)
    plan = run.plans[0]
    sens = unit_sensitivity(plan.micro_batches, run.tracker)
    _, best = layout_gap(run.lm, run.lm.unit_features(plan.unit_csr(True)), dp, m,
                         run.lm.layout, d0)

    def setup(layout):
        lm = run.lm.with_layout(layout)
        return lm, UnitCosts.from_latency(lm, lm.unit_features(plan.unit_csr(True)), dp, m,
                                          density_grid(d0, 0.125, 1.0))

    def step(lm, costs, dens):
        f, b = costs.at(np.searchsorted(costs.densities, dens - 1e-12))
        return float(pipeline_makespan_s(f, b, lm.p2p_s, pp=lm.layout.pp).max())

    lm_b, c_b = setup(best)
    t_best = step(lm_b, c_b, np.full(c_b.shape, d0))
    print(f"best static layout {best.describe()}; step time / best static's and predicted loss "
          f"change vs uniform d0 (raise to {args.raise_to}):")
    print(f"{'layout':>9} {'density':>18} {'water-fill alone':>18} {'quality objective':>18}")
    for text in args.layouts:
        lay = PipelineLayout(4, 1, tuple(int(x) for x in text.split("/")))
        lm, costs = setup(lay)
        q = StageQuality.from_cost(load_quality_cost(), lay.layers, d0)
        cfg = {o: SparseBalanceConfig(sparse_balance=True, density=d0, dst_objective=o,
                                      raise_to=args.raise_to) for o in ("density", "quality")}
        dens = plan_dst_from_config(cfg["density"], costs, sens, lm.p2p_s,
                                    stage_layers=lay.layers).densities
        qual = plan_dst_from_config(cfg["quality"], costs, sens, lm.p2p_s,
                                    stage_layers=lay.layers).densities
        fill = _plan_with_floor(costs, sens, DSTSettings.from_config(cfg["quality"], lm.p2p_s),
                                static=BandCache(), quality=q).densities
        cells = [f"{step(lm, costs, d) / t_best:.3f} {q.plan_cost(d):+.4f}"
                 for d in (dens, fill, qual)]
        print(f"{text:>9} " + " ".join(f"{x:>18}" for x in cells))
    return 0
