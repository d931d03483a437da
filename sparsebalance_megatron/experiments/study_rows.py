"""A simulated run's steps accumulated into its row, and the text table of rows.

``experiments.study`` steps every run of a study through the pipeline simulator and hands each
step here (``VariantAccumulator.add``); ``row`` is what the study returns per run: step time and
speedup, imbalance, bubble fraction, densities (overall, the sparse path's, per stage),
micro-batches per rank, predicted loss, planning time, the do-no-harm counts, and with the
plugin's own cost (issue 44) the net step time and speedup beside the gross. ``format_table``
prints rows as the studies' tables, and ``summary_stats`` sums a column of speedups up.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..policy import UnitCosts
from ..policy.quality_bound import bind_quality
from ..policy.stand_down import StandDownCounts
from ..sim.pipeline import interleaved_refusal, simulate_1f1b


class VariantAccumulator:
    """Accumulates one run's simulated steps."""

    def __init__(self):
        self.step_s, self.imb, self.bubble, self.dw, self.w = 0.0, [], [], 0.0, 0.0
        self.sparse_dw, self.sparse_w, self.microbatches = 0.0, 0.0, []
        self.stage_dw = self.stage_w = None
        self.plan_ms, self.loss = [], []
        self.stood = StandDownCounts()
        self.charge, self.gate, self.cost_s, self.parts_ms = None, None, 0.0, {}
        self.refused = None   # why Megatron cannot run a step of this run (then it is never best)

    def add(self, costs: UnitCosts, densities: np.ndarray, p2p_s: float, plan_ms=None,
            quality=None, choice=None, cost_s: float = 0.0, parts_ms=None):
        """One step; ``quality``: a ``StageQuality`` of the run's layout (predicted loss);
        ``choice``: the step's ``policy.stand_down.StepChoice`` (None: no choice made);
        ``cost_s``: the plugin's own cost of the step (``parts_ms``: by part)."""
        if costs.vp > 1 and self.refused is None:
            self.refused = interleaved_refusal(costs.shape[1], costs.pipeline_ranks)
        if self.refused:     # dp_balanced's variable count at vp > 1: Megatron stops there
            return
        self.cost_s += cost_s
        for k, v in (parts_ms or {}).items():
            self.parts_ms[k] = self.parts_ms.get(k, 0.0) + v
        if choice is not None:
            self.stood.add(choice.dst_stood_down, choice.sab_stood_down)
        self.microbatches.append(costs.shape[1])
        idx = np.searchsorted(costs.densities, densities - 1e-12)
        f, b = costs.at(idx)
        if costs.vp > 1:
            sim = simulate_1f1b(f, b, p2p_s, pp=costs.pipeline_ranks)
        else:
            sim = simulate_1f1b(f, b, p2p_s)
        self.step_s += sim.step_time_s
        self.imb.append(sim.imbalance)
        self.bubble.append(sim.bubble_fraction)
        w = costs.attn_work
        dw = densities * w
        self.sparse_dw += float(dw.sum())
        self.sparse_w += float(w.sum())
        if costs.dense_work is not None:     # routed documents: density 1 whatever the plan
            dw, w = dw + costs.dense_work, w + costs.dense_work
        self.dw += float(dw.sum())
        self.w += float(w.sum())
        sdw, sw = dw.sum(axis=(0, 1)), w.sum(axis=(0, 1))
        self.stage_dw = sdw if self.stage_dw is None else self.stage_dw + sdw
        self.stage_w = sw if self.stage_w is None else self.stage_w + sw
        if plan_ms is not None:
            self.plan_ms.append(plan_ms)
        if quality is not None:
            self.loss.append(bind_quality(quality, costs).plan_cost(densities))

    def row(self, baseline_step_s: Optional[float], baseline_net_s: Optional[float] = None
            ) -> dict:
        if self.refused:
            nan = float("nan")
            out = {"step_time_s": float("inf"), "speedup_vs_static": 0.0, "imbalance": nan,
                   "bubble_fraction": nan, "mean_density": nan, "sparse_density": nan,
                   "microbatches_per_rank": nan, "density_per_stage": [], "min_stage_density":
                   nan, "refused": self.refused}
            if baseline_net_s is not None:
                out.update(step_time_net_s=float("inf"), plugin_cost_ms=0.0,
                           speedup_vs_static_net=0.0, plugin_cost_parts_ms={})
            return out
        stage = np.where(self.stage_w > 0, self.stage_dw / np.maximum(self.stage_w, 1e-300),
                         np.nan)
        n = max(len(self.imb), 1)
        out = {"step_time_s": self.step_s / n,
               "speedup_vs_static": (baseline_step_s / self.step_s
                                     if self.step_s and baseline_step_s else float("nan")),
               "imbalance": float(np.mean(self.imb)),
               "bubble_fraction": float(np.mean(self.bubble)),
               "mean_density": self.dw / self.w if self.w else float("nan"),
               "sparse_density": self.sparse_dw / self.sparse_w if self.sparse_w else np.nan,
               "microbatches_per_rank": float(np.mean(self.microbatches)),
               "density_per_stage": [float(x) for x in stage],
               "min_stage_density": float(np.nanmin(stage)) if np.any(self.stage_w > 0)
               else float("nan")}
        if self.loss:
            out["predicted_loss"] = float(np.mean(self.loss))
        if self.plan_ms:
            out["plan_ms_median"] = float(np.median(self.plan_ms))
        st = self.stood
        for part, j, k in (("dst", st.dst_stood_down, st.dst_steps),
                           ("sab", st.sab_stood_down, st.sab_steps)):
            if k:      # fraction of the steps where the part stood down (do no harm)
                out[f"{part}_stood_down"] = j / k
                out[f"{part}_stood_down_steps"] = [j, k]
        if baseline_net_s is not None:      # net of the plugin's own cost (issue 44)
            net = self.step_s + self.cost_s
            out.update(step_time_net_s=net / n, plugin_cost_ms=1e3 * self.cost_s / n,
                       speedup_vs_static_net=baseline_net_s / net if net else float("nan"),
                       plugin_cost_parts_ms={k: v / n for k, v in self.parts_ms.items()})
            if self.charge is not None:
                out.update(plugin_flags=self.charge.flags, plugin_cost_source=self.charge.source)
            if self.gate is not None:
                out["net_stood_down"] = self.gate.stood_down / max(self.gate.steps, 1)
        return out



def format_table(title: str, results: dict) -> str:
    """Text table of {dp: {run: row}}, preceded by a blank line and the title: the kernel that
    prices each row's attention (issue 40; 'est.': an estimate), and with the plugin's cost
    (issue 44) its ms per step, the net step time and the net speedups beside the gross."""
    rows_all = [r for rows in results.values() for r in rows.values()]
    vs_dense = any("speedup_vs_dense" in r for r in rows_all)
    net = any("step_time_net_s" in r for r in rows_all)
    lines = [f"\n{title}",
             f"{'ranks':>6} {'run':<26} {'kernel':<11} {'step_s':>8} {'speedup':>8} {'imbal':>6} "
             f"{'bubble':>7} {'density':>8} {'min_st':>7} {'loss':>8} {'plan_ms':>8} "
             f"{'dst_sd':>6} {'sab_sd':>6}" + (f" {'vs_dense':>8}" if vs_dense else "")
             + (f" {'cost_ms':>8} {'net_s':>8} {'net_x':>7} {'net_sd':>6}"
                + (f" {'net_vs_d':>8}" if vs_dense else "") if net else "")]
    for dp, rows in results.items():
        for v, r in rows.items():
            pm = f"{r['plan_ms_median']:.1f}" if "plan_ms_median" in r else "-"
            pl = f"{r['predicted_loss']:+.4f}" if "predicted_loss" in r else "-"
            vd = f" {r['speedup_vs_dense']:>8.3f}" if "speedup_vs_dense" in r else ""
            sd = " ".join(f"{r[k]:>6.2f}" if k in r else f"{'-':>6}"
                          for k in ("dst_stood_down", "sab_stood_down"))
            nt = ""
            if "step_time_net_s" in r:
                nsd = f"{r['net_stood_down']:>6.2f}" if "net_stood_down" in r else f"{'-':>6}"
                nt = (f" {r['plugin_cost_ms']:>8.1f} {r['step_time_net_s']:>8.3f} "
                      f"{r['speedup_vs_static_net']:>7.3f} {nsd}"
                      + (f" {r['speedup_vs_dense_net']:>8.3f}" if "speedup_vs_dense_net" in r
                         else ""))
            lines.append(f"{dp:>6} {v:<26} {r.get('attention_kernel', '-'):<11} "
                         f"{r['step_time_s']:>8.3f} "
                         f"{r['speedup_vs_static']:>8.3f} {r['imbalance']:>6.3f} "
                         f"{r['bubble_fraction']:>7.3f} {r['mean_density']:>8.3f} "
                         f"{r['min_stage_density']:>7.3f} {pl:>8} {pm:>8} {sd}{vd}{nt}")
    return "\n".join(lines)


def summary_stats(values, target: float) -> dict:
    """A column of speedups summed up: its rows, worst, median and best, and how many meet
    ``target``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"rows": 0}
    return {"rows": int(v.size), "worst": float(v.min()), "median": float(np.median(v)),
            "best": float(v.max()), "met": int(np.sum(v >= target - 1e-12)), "target": target}
