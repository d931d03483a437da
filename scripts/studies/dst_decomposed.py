"""DST planned per DP rank (``policy.dst_ranks``) against the central plan (issue 77 items 2-3;
the design: docs/DESIGN.md section 6, "DST and SAB at scale"), on the runtime's own drafts.

For each step of the control-plane study's shape (Qwen2.5-0.5B analytic table, best static
layout, 32K tokens, 16 micro-batches, built-in corpus, default flags) and each of the draft's
packings (SAB's and the baseline's), the cost tables the central draft plans (``choice.choose``'s)
are planned twice:

- **central**: ``plan_dst_from_config`` over all DP ranks (today's draft);
- **decomposed**: ``dst_ranks_local.plan_dst_decomposed``: every DP rank plans its own [1, m, stages]
  slice, the ranks coupled only by fixed-size sums and maxima (reduced in-process here; in a run,
  all-reduces): the band search's every candidate planned at once and chosen on the agreed
  verdicts, then the probed critical-path descent (``policy.dst_probes``: each rank's raises
  and descents toward ``PROBES`` agreed steps, the slack over the floors split on agreed supply
  and demand), the fastest plan whose sums meet the global floors kept.

Per packing: both predicted steps (the simulator's, ``plan_step_time_s``), their ratio, the
work-weighted mean density and quality cost of each; per draft the do-no-harm choice (the faster
packing, each no slower than its static plan) of each. CPU: the thread CPU of the central plan
and of every rank's own part (its slice's band search and descent; the slice itself, which a rank
would tabulate from its own units, is not counted; and, as the ranks wait for each other at
every reduction, the phases' maxima over ranks summed: the draft's DST wall time less the
reductions'), each the min of ``--repeat`` runs, with the
garbage collector paused (in a run every rank is its own process: a collection here would walk
every other rank's objects too). At DP 1 the decomposed plan must be the central plan bit for bit
(checked: the study stops otherwise).

    .venv/bin/python scripts/bench.py dst_decomposed --json docs/results/dst_decomposed.json
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from .common import parser, write_result


def timed_min(f, repeat: int):
    """(f's result, the min over ``repeat`` runs of its thread CPU), the collector paused."""
    best, out = float("inf"), None
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            c0 = time.thread_time()
            out = f()
            best = min(best, time.thread_time() - c0)
    finally:
        gc.enable()
    return out, best


def decomposed(costs, sens, settings, quality, rank_scale, repeat: int) -> tuple:
    """``policy.dst_ranks_local.plan_dst_decomposed``'s plan and every rank's thread CPU by phase
    [dp, phases] (the min of ``repeat`` runs, rank by rank and phase by phase)."""
    from sparsebalance_megatron.policy.dst_ranks import PHASES
    from sparsebalance_megatron.policy.dst_ranks_local import plan_dst_decomposed

    cpu = np.full((costs.shape[0], len(PHASES)), np.inf)

    def timer(r, s):
        cpu[r] = np.minimum(cpu[r], s)

    plan = None
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            plan = plan_dst_decomposed(costs, sens, settings, quality=quality,
                                       rank_scale=rank_scale, timer=timer)
    finally:
        gc.enable()
    return plan, cpu


def compare(sb, lm, drafter, options, repeat: int) -> dict:
    """Both plans of every packing of one draft, and the do-no-harm choice of each."""
    from sparsebalance_megatron.batching.sensitivity import batch_sensitivity
    from sparsebalance_megatron.megatron.step.choice import raise_headroom
    from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
    from sparsebalance_megatron.policy.density_means import weighted_mean_density
    from sparsebalance_megatron.policy.dst import plan_dst_from_config
    from sparsebalance_megatron.policy.dst_settings import DSTSettings
    from sparsebalance_megatron.policy.quality import StageQuality, load_quality_cost
    from sparsebalance_megatron.policy.stand_down import plan_step_time_s

    dp = drafter.dp
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    h = raise_headroom(sb, lm, dp)
    layers = drafter.attention_layers
    quality = StageQuality.from_cost(load_quality_cost(sb.quality_cost), layers, sb.density) \
        if sb.dst_objective == "quality" else None
    settings = DSTSettings.from_config(sb, p2p_s=lm.p2p_s, raise_headroom=h)
    scale = lm.correction_grid(dp, lm.layout.pp)
    out = []
    for batch, units in options:
        costs = UnitCosts.from_latency(lm, units, dp, batch.num_microbatches, grid,
                                       kept_units=batch.unit_csr())
        sens = batch_sensitivity(batch, drafter.tracker)
        central, central_cpu = timed_min(
            lambda: plan_dst_from_config(sb, costs, sens, lm.p2p_s, raise_headroom=h,
                                         stage_layers=layers, rank_scale=scale), repeat)
        dec, phases = decomposed(costs, sens, settings, quality, scale, repeat)
        cpu = phases.sum(axis=1)
        dens = dec.densities
        if dp == 1 and not (np.array_equal(dens, central.densities)
                            and dec.report == central.report):
            raise SystemExit("DP 1: the decomposed plan is not the central plan")
        w, dw = costs.weights(), costs.dense_work
        row = {"static_s": central.report.step_time_static_s,
               "central_s": plan_step_time_s(costs, central.densities, lm.p2p_s),
               "decomposed_s": plan_step_time_s(costs, dens, lm.p2p_s),
               "decomposed_planned_s": dec.report.step_time_planned_s,
               "central_planned_s": central.report.step_time_planned_s,
               "central_density": weighted_mean_density(central.densities, w, dw),
               "decomposed_density": weighted_mean_density(dens, w, dw),
               "central_cpu_s": central_cpu,
               "rank_cpu_s": {"max": float(cpu.max()), "median": float(np.median(cpu)),
                              "p90": float(np.quantile(cpu, 0.9)),
                              "phase_max_sum": float(phases.max(axis=0).sum())}}
        row["ratio"] = row["decomposed_s"] / row["central_s"]
        if quality is not None:
            row["central_quality"] = quality.plan_cost(central.densities, grid)
            row["decomposed_quality"] = quality.plan_cost(dens, grid)
        out.append(row)
    chosen = {k: min(min(r[k], r["static_s"]) for r in out) for k in ("central_s",
                                                                        "decomposed_s")}
    return {"packings": out, "chosen": chosen,
            "ratio": chosen["decomposed_s"] / chosen["central_s"]}


def measure(dp: int, m: int, pp: int, steps: int, repeat: int, seq: int = 32768) -> dict:
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps

    from ._drafts import make_drafter

    sb = SparseBalanceConfig(sparse_balance=True)               # the default flags
    corpus = corpus_steps(dp, m, sb.density, steps, seq=seq, layout="best", pp=pp)
    lm = corpus.lm
    drafter = make_drafter(lm, sb, dp, seq)
    rows = []
    for k, segs in enumerate(corpus.segments):
        d = drafter.draft(k, 0, segs, m, with_dst=False)     # the packings only
        options = [d.packing(i) for i in range(d.options)]
        rows.append(compare(sb, lm, drafter, options, repeat))
    ratios = [r["ratio"] for r in rows]
    per = [x["ratio"] for r in rows for x in r["packings"]]
    cpu = [x["rank_cpu_s"]["max"] for r in rows for x in r["packings"]]
    return {"dp": dp, "m": m, "pp": pp, "seq": seq, "layout": lm.layout.describe(), "steps": rows,
            "ratio_max": max(ratios), "ratio_median": statistics.median(ratios),
            "packing_ratio_max": max(per), "packing_ratio_min": min(per),
            "rank_cpu_max_s": max(cpu),
            "phase_max_sum_s": max(x["rank_cpu_s"]["phase_max_sum"] for r in rows
                                   for x in r["packings"])}


def main(argv=None) -> int:
    p = parser(__doc__, "dst_decomposed")
    p.add_argument("--dp", default="1,2,4,8,32,128,512", help="DP sizes, comma-separated")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="global batches per DP")
    p.add_argument("--repeat", type=int, default=3, help="runs per plan (CPU: the min)")
    p.add_argument("--seq", type=int, default=32768, help="tokens per micro-batch")
    a = p.parse_args(argv)
    points = []
    for dp in (int(x) for x in a.dp.split(",")):
        pt = measure(dp, a.microbatches, a.pp, a.steps, a.repeat, a.seq)
        points.append(pt)
        for k, r in enumerate(pt["steps"]):
            pk = r["packings"]
            print(f"DP {dp:5d} step {k}: chosen decomposed / central {r['ratio']:.5f}; "
                  + "; ".join(f"packing {i}: {x['decomposed_s']:.4f} / {x['central_s']:.4f} s "
                              f"(static {x['static_s']:.4f}), density "
                              f"{x['decomposed_density']:.4f} / {x['central_density']:.4f}, "
                              f"rank CPU max {1e3 * x['rank_cpu_s']['max']:.1f} / median "
                              f"{1e3 * x['rank_cpu_s']['median']:.1f} ms, central "
                              f"{1e3 * x['central_cpu_s']:.0f} ms"
                              for i, x in enumerate(pk)), flush=True)
    for pt in points:
        print(f"DP {pt['dp']:5d}: per packing decomposed / central {pt['packing_ratio_min']:.4f}"
              f" .. {pt['packing_ratio_max']:.4f}; chosen max {pt['ratio_max']:.4f}; a rank's "
              f"CPU max {1e3 * pt['rank_cpu_max_s']:.1f} ms, phases' maxima summed "
              f"{1e3 * pt['phase_max_sum_s']:.1f} ms")
    write_result(a.json, {"points": points})
    return 0
