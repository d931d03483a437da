"""Dense attention's packings against each other (issue 41): SAB packing (``--sb-batching`` alone)
against Megatron's own packer (``dp_balanced``), its sequential fill and token-balanced packing,
each on its own best layout, over the rows of a simulator study (``scripts/bench.py sim_study``).

SAB's ratios are stated gross and, where the study priced the plugin's own cost (issue 44), net:
``dense_sab`` pays its per-step cost (``experiments.plugin_cost``), the other packings nothing.

Targets (the issue's; every row reported, met or not): SAB >= ``TARGET_VS_DP_BALANCED`` x
dp_balanced as the median over the rows, never below it on any row, and never below the faster
of sequential and token-balanced packing. Dense runs do not depend on d0, so a study's rows at
several d0 give one dense row per (mix, DP size, CP size).

Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

import re

from ..batching import dp_balanced_plan
from ..data import GlobalBatchSampler
from .study_rows import summary_stats

TARGET_VS_DP_BALANCED = 1.15
DENSE_ROWS = {"sequential": "dense_sequential", "token_balanced": "dense_token_balanced",
              "dp_balanced": "dense_dp_balanced", "sab": "dense_sab"}
"""Packing -> the study row of dense attention with it, each on its own best layout."""


def dp_balanced_stops(lengths, cfg, dp: int) -> int:
    """How many of a study's global batches (``study.run_study``'s, for ``cfg`` and ``dp``)
    Megatron's own dp_balanced rule stops on: it runs out of groups holding more than one
    sequence before their count is a multiple of dp (an assertion in megatron-core; the study
    gives it empty micro-batches there)."""
    sampler = GlobalBatchSampler(lengths, capacity=cfg.seq_length, dp=dp,
                                 num_microbatches=cfg.microbatches, seed=cfg.seed,
                                 long_sample_policy="split")
    return sum(dp_balanced_plan(sampler.next_global_batch(), dp=dp,
                                num_microbatches=cfg.microbatches, max_tokens=cfg.seq_length,
                                empty_groups=True).fallback for _ in range(cfg.steps))


def packer_summary(results: dict) -> dict:
    """Per (mix, DP, CP) row of ``results`` ({key: study_one's result}) the dense step times of
    every packing, their layouts and dp_balanced's micro-batches per rank, SAB's ratios to
    dp_balanced and to the faster of sequential and token-balanced; and the targets' stats."""
    rows, seen = [], set()
    for key, r in results.items():
        got = {p: r["rows"][name] for p, name in DENSE_ROWS.items() if name in r["rows"]}
        if len(got) < len(DENSE_ROWS):
            continue
        dense_key = re.sub(r"/d0=[^/]+", "", key)       # the dense runs ignore d0
        if dense_key in seen:
            continue
        seen.add(dense_key)
        t = {p: row["step_time_s"] for p, row in got.items()}
        net = {p: row.get("step_time_net_s", row["step_time_s"]) for p, row in got.items()}
        if "step_time_net_s" in got["sab"]:     # net of the plugin's own cost (issue 44)
            extra = {"sab_net_s": net["sab"], "plugin_cost_ms": got["sab"]["plugin_cost_ms"],
                     "sab_vs_dp_balanced_net": net["dp_balanced"] / net["sab"],
                     "sab_vs_best_seq_tb_net": min(net["sequential"], net["token_balanced"])
                     / net["sab"], "best_dense_net": min(net, key=net.get)}
        else:
            extra = {}
        rows.append({"key": dense_key, "step_time_s": t, **extra,
                     "layouts": {p: r["layouts"].get(DENSE_ROWS[p]) for p in DENSE_ROWS},
                     "dp_balanced_microbatches_per_rank":
                         got["dp_balanced"].get("microbatches_per_rank"),
                     "dp_balanced_megatron_stops": r.get("dp_balanced_megatron_stops"),
                     "sab_stood_down": got["sab"].get("sab_stood_down"),
                     "sab_vs_dp_balanced": t["dp_balanced"] / t["sab"],
                     "sab_vs_best_seq_tb": min(t["sequential"], t["token_balanced"]) / t["sab"],
                     "best_dense": min(t, key=t.get)})
    out = {"rows": rows, "median_target": TARGET_VS_DP_BALANCED}
    for k in ("sab_vs_dp_balanced", "sab_vs_best_seq_tb", "sab_vs_dp_balanced_net",
              "sab_vs_best_seq_tb_net"):
        if rows and all(k in x for x in rows):
            out[k] = summary_stats([x[k] for x in rows], 1.0)
    return out


def format_packers(summary: dict) -> str:
    """Text table: every row's dense step time per packing (``stops``: global batches Megatron's
    own dp_balanced stops on, given empty micro-batches here), then the targets."""
    net = "sab_vs_dp_balanced_net" in summary
    lines = ["\ndense attention by packing, each on its own best layout (step s; SAB = "
             "--sb-batching alone" + ("; net: SAB pays the plugin's own cost" if net else "")
             + ")",
             f"{'row':<30} {'sequential':>10} {'token_bal':>10} {'dp_balanced':>11} "
             f"{'(mb/rank)':>9} {'stops':>5} {'sab':>8} {'sab/dp_bal':>10} {'sab/seq|tb':>10} "
             f"{'sab_sd':>6}" + (f" {'cost_ms':>7} {'net/dp_bal':>10} {'net/seq|tb':>10}"
                                 if net else "")]
    for r in summary["rows"]:
        t = r["step_time_s"]
        sd, stops = r["sab_stood_down"], r.get("dp_balanced_megatron_stops")
        lines.append(f"{r['key']:<30} {t['sequential']:>10.3f} {t['token_balanced']:>10.3f} "
                     f"{t['dp_balanced']:>11.3f} {r['dp_balanced_microbatches_per_rank']:>9.2f} "
                     f"{'-' if not stops else f'{stops[0]}/{stops[1]}':>5} "
                     f"{t['sab']:>8.3f} {r['sab_vs_dp_balanced']:>10.3f} "
                     f"{r['sab_vs_best_seq_tb']:>10.3f} "
                     f"{'-' if sd is None else f'{sd:.2f}':>6}"
                     + (f" {r['plugin_cost_ms']:>7.2f} {r['sab_vs_dp_balanced_net']:>10.3f} "
                        f"{r['sab_vs_best_seq_tb_net']:>10.3f}" if net else ""))
    for tag, suffix in (("", ""), (", net", "_net")):
        a = summary.get("sab_vs_dp_balanced" + suffix, {})
        b = summary.get("sab_vs_best_seq_tb" + suffix, {})
        if a.get("rows"):
            lines.append(f"SAB vs dp_balanced{tag}: median {a['median']:.3f}x (target >= "
                         f"{summary['median_target']:.2f}x: "
                         f"{'met' if a['median'] >= summary['median_target'] - 1e-12 else 'MISSED'}"
                         f"), worst {a['worst']:.3f}x, {a['met']} of {a['rows']} rows >= 1.00x; "
                         f"vs the faster of sequential / token-balanced: worst {b['worst']:.3f}x, "
                         f"median {b['median']:.3f}x, {b['met']} of {b['rows']} rows >= 1.00x")
    return "\n".join(lines)
