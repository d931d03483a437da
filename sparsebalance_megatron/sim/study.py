"""Simulated step-time study of the SparseBalance variants on a real length mix.

Shared by ``scripts/bench_sim_study.py`` (DST anchors, SAB) and ``scripts/bench_end_to_end.py``
(the sim half of the end-to-end comparison). For one DP size: the corpus lengths are cut into
global batches by the data pipeline's ``GlobalBatchSampler`` (sequential fill of dp x m
micro-batches of ``seq_length`` tokens), packed by Megatron's sequential order, a token balancer or
SAB, timed by a latency model over a density grid (``UnitCosts``) and stepped through the 1F1B
simulator. Variants (names are what the tables print):

- ``dense``: sequential packing, every unit at density 1;
- ``static``: sequential packing, every unit at d0 (static sparse attention; the baseline);
- ``token_balanced``: length-aware balancer at d0; ``sab``: SAB at d0;
- ``dst`` (= ``dst_mean``) and ``dst_<anchor>``: sequential packing + DST with that anchor;
- ``sab_dst``: SAB + DST (anchor mean).

Per variant: step time (mean over steps), speedup vs static (sum of static step times / sum of the
variant's), imbalance (max / mean of per-rank makespans, mean over steps), bubble fraction, mean
density weighted by dense attention work. Sensitivities come from the length prior (nothing is
measured in a simulation).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..batching import (SensitivityTracker, latency_sample_cost_fn, sab_plan, sequential_plan,
                        token_balanced_plan, unit_sensitivity)
from ..data import GlobalBatchSampler
from ..policy import UnitCosts, density_grid, plan_dst
from .pipeline import simulate_1f1b

_PACKING = {"dense": "sequential", "static": "sequential", "token_balanced": "token_balanced",
            "sab": "sab", "sab_dst": "sab"}


@dataclass
class StudyConfig:
    """One simulated configuration (everything but the DP size and the latency model)."""

    microbatches: int = 8
    """Micro-batches per DP rank per step."""
    seq_length: int = 32768
    """Tokens per micro-batch (the packing capacity)."""
    density: float = 0.5
    """d0: the density of static sparse attention and the base of DST."""
    min_density: float = 0.125
    """d_min: the lowest density DST may cut to."""
    max_density: float = 1.0
    """d_max: the highest density DST may raise to."""
    tolerance: float = 0.1
    """DST tolerance p."""
    steps: int = 3
    """Global batches per configuration."""
    seed: int = 1234
    """Seed of the sampler and of SAB."""


def packing_of(variant: str) -> str:
    """The packing a variant uses: sequential, token_balanced or sab."""
    return _PACKING.get(variant, "sequential")


def dst_anchor_of(variant: str):
    """The DST anchor of a variant, or None when the variant does not run DST."""
    if variant in ("dst", "sab_dst"):
        return "mean"
    if variant.startswith("dst_"):
        return variant[4:]
    return None


class VariantAccumulator:
    """Accumulates one variant's simulated steps."""

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


def run_config(dp: int, cfg: StudyConfig, lm, lengths, variants) -> dict:
    """{variant: row} for one DP size; ``variants`` must contain ``static`` (the baseline)."""
    if "static" not in variants:
        raise ValueError(f"variants {list(variants)} must include 'static' (the baseline)")
    m, cap, d0 = cfg.microbatches, cfg.seq_length, cfg.density
    grid = density_grid(d0, cfg.min_density, cfg.max_density)
    if "dense" in variants and grid[-1] < 1.0:
        grid = np.append(grid, 1.0)  # above d_max: DST never plans there, dense reads it
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                                 seed=cfg.seed, long_sample_policy="split")
    cost_fn = latency_sample_cost_fn(lm, d0)
    tracker = SensitivityTracker()
    acc = {v: VariantAccumulator() for v in variants}
    bounds = (d0, cfg.min_density, cfg.max_density)
    needed = {packing_of(v) for v in variants}
    for _ in range(cfg.steps):
        segs = sampler.next_global_batch()
        plans = {"sequential": sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap)}
        if "sab" in needed:
            plans["sab"] = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                    cost_fn=cost_fn, sensitivity=tracker, seed=cfg.seed)
        if "token_balanced" in needed:
            plans["token_balanced"] = token_balanced_plan(segs, dp=dp, num_microbatches=m,
                                                          max_tokens=cap, seed=cfg.seed)
        costs = {k: UnitCosts.from_latency(lm, p.flat_lengths(with_padding=True), dp, m, grid)
                 for k, p in plans.items()}
        sens = {k: unit_sensitivity(p.micro_batches, tracker) for k, p in plans.items()}
        for v in variants:
            packing = packing_of(v)
            c = costs[packing]
            anchor = dst_anchor_of(v)
            if anchor is not None:
                t = time.perf_counter()
                plan = plan_dst(c, sens[packing], *bounds, anchor=anchor,
                                tolerance=cfg.tolerance, p2p_s=lm.p2p_s)
                acc[v].add(c, plan.densities, lm.p2p_s, (time.perf_counter() - t) * 1e3)
            else:
                acc[v].add(c, np.full(c.shape, 1.0 if v == "dense" else d0), lm.p2p_s)
    static = acc["static"].step_s
    return {v: a.row(static) for v, a in acc.items()}


def format_table(title: str, results: dict) -> str:
    """Text table of {dp: {variant: row}}, preceded by a blank line and the title."""
    lines = [f"\n{title}",
             f"{'ranks':>6} {'variant':<15} {'step_s':>8} {'speedup':>8} {'imbal':>6} "
             f"{'bubble':>7} {'density':>8} {'plan_ms':>8}"]
    for dp, rows in results.items():
        for v, r in rows.items():
            pm = f"{r['plan_ms_median']:.1f}" if "plan_ms_median" in r else "-"
            lines.append(f"{dp:>6} {v:<15} {r['step_time_s']:>8.3f} "
                         f"{r['speedup_vs_static']:>8.3f} {r['imbalance']:>6.3f} "
                         f"{r['bubble_fraction']:>7.3f} {r['mean_density']:>8.3f} {pm:>8}")
    return "\n".join(lines)
