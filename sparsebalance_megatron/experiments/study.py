"""Simulated step-time study of the SparseBalance variants on a real length mix.

Shared by ``scripts/bench.py sim_study`` and the layout search. For one DP size: the corpus
lengths are cut into global batches by the data pipeline's ``GlobalBatchSampler`` (sequential
fill of dp x m micro-batches of ``seq_length`` tokens), packed by Megatron's sequential order, a
token balancer, Megatron's dp_balanced or SAB, timed by a latency model over a density grid
(``UnitCosts``) on a pipeline layout and stepped through the simulator (1F1B, or the interleaved
schedule for a layout with vp > 1). Variants (names are what the tables print):

- ``dense``: sequential packing, dense attention: every document through the dense kernel
  (``LatencyModel.all_dense``: the table's dense coefficients and dense call cost, what a user
  without the plugin runs; a table without dense coefficients falls back to the sparse kernel's
  per-pair cost at density 1; the analytic table has them: cuDNN measured on an H100);
- ``dense_sab``: SAB packing, dense attention (``--sb-batching`` without sparse attention): SAB
  packs by the dense model's costs; with do no harm it stands down to
  ``StudyConfig.dense_stand_down`` when SAB is predicted no faster;
- ``dense_token_balanced``, ``dense_dp_balanced``: dense attention, token-balanced or Megatron's
  own packer (``batching.dp_balanced``: its own micro-batch count per step, no fill to
  ``seq_length`` unless ``microbatch_multiple`` > 0, empty micro-batches where it would stop);
- ``static``: sequential packing, every unit at d0 (static sparse attention);
- ``token_balanced``: length-aware balancer at d0 (what a careful Megatron user runs);
- ``dp_balanced``: Megatron's dp_balanced packer at d0;
- ``sab``: SAB at d0;
- ``dst`` (= ``dst_mean``) and ``dst_<anchor>``: sequential packing + DST with that anchor;
- ``sab_dst`` (= ``sab_dst_mean``) and ``sab_dst_<anchor>``: SAB + DST with that anchor
  (``sab_dst_max`` never cuts: it only spends bubbles on density);
- any DST variant + ``_acc`` (e.g. ``sab_dst_acc``): ``--sb-raise-to static``, the raises go up
  to the static plan's step time: what balancing saved becomes density ("free accuracy").

DST is the runtime's own planner (``policy.plan_dst``: every DP rank's
rounds, reduced in-process) with the floors and the raise headroom of a ``SparseBalanceConfig``
(``StudyConfig.sb``, ``StudyConfig.policy``). Every run of a study is (variant, layout):
the same global batches and packings are timed on each run's layout. Do no harm (issue 27) is the
runtime's rule too (``policy.stand_down.choose_step``, ``--sb-stand-down``): a DST plan predicted
slower than the static plan of its micro-batches is replaced by it, and a SAB run packs the
baseline's way (``StudyConfig.sb.stand_down``) when SAB is predicted no faster (on DST's plans of
both by default, on the packings' static plans with ``stand_down_compare`` 'static'); the rows
say in what fraction of the steps each stood down (``dst_stood_down``, ``sab_stood_down``; the
tables' ``dst_sd`` / ``sab_sd`` columns).

Net of the plugin's own cost (issue 44, ``StudyConfig.plugin_cost``: ``plugin_cost.PluginCost``):
every run of SparseBalance's pays its critical-path cost per step at the flags the row names
(planning by ``--sb-planner``: ahead in a process by default, or in-line; the control plane at
the run's world size,
calibration); the baselines pay nothing. Rows then carry ``step_time_net_s``,
``speedup_vs_static_net``, ``plugin_cost_ms`` (mean per step, by part), the flags and the cost
source, and do no harm compares net times (``net_gate.NetGate``: ``net_stood_down``,
the fraction of steps that stood down without planning). Without a cost model: gross only.

Per run: step time (mean over steps), speedup vs the baseline run (sum of its step times / sum of
this run's), imbalance (max / mean of per-rank makespans, mean over steps), bubble fraction, mean
density weighted by layers x dense attention work (routed documents at 1.0; ``sparse_density``:
the sparse path's documents alone), the same per (virtual) stage and its minimum, micro-batches
per rank (Megatron's dp_balanced varies them),
the predicted LM-loss change against uniform d0 under the shipped quality cost mapped onto the run's
layout (``quality.cost``, what the quality objective plans with; mean over steps; the same
measure for both DST objectives) and the planning time. Sensitivities come from the length prior (nothing is measured in a
simulation).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from ..batching import (SensitivityTracker, dp_balanced_plan, latency_sample_cost_fn, sab_plan,
                        sequential_plan, token_balanced_plan, unit_sensitivity)
from ..config import STAND_DOWNS, SparseBalanceConfig
from ..data import GlobalBatchSampler
from ..latency.sparse_call import kernel_labels
from ..policy import UnitCosts, density_grid
from ..policy.dst_rounds import plan_dst
from ..policy.dst_settings import dst_inputs
from ..policy.stand_down import choose_step
from ..quality.cost import load_quality_cost
from ..quality.stages import StageQuality
from .heterogeneous import rank_scale, scale_costs
from .net_gate import NetGate
from .study_rows import VariantAccumulator, format_table  # noqa: F401  (format_table: re-exported)

_PACKING = {"dense": "sequential", "dense_sab": "sab", "static": "sequential",
            "token_balanced": "token_balanced", "sab": "sab", "sab_dst": "sab",
            "dp_balanced": "dp_balanced", "dense_token_balanced": "token_balanced",
            "dense_dp_balanced": "dp_balanced"}
DENSE_VARIANTS = ("dense", "dense_sab", "dense_token_balanced", "dense_dp_balanced")
"""Variants with dense attention: every document through the dense kernel."""
STAND_DOWN_PACKINGS = tuple(s for s in STAND_DOWNS if s != "off")
"""What --sb-stand-down can stand down to: Megatron's sequential fill, token-balanced packing,
or Megatron's dp_balanced (its own micro-batch count per step, as the runtime commits it)."""


@dataclass
class StudyConfig:
    """One simulated configuration (everything but the DP size, layout and latency model)."""

    microbatches: int = 8
    """Micro-batches per DP rank per step."""
    seq_length: int = 32768
    """Tokens per micro-batch (the packing capacity)."""
    steps: int = 3
    """Global batches per configuration."""
    seed: int = 1234
    """Seed of the sampler and of SAB."""
    sb: SparseBalanceConfig = field(default_factory=lambda: SparseBalanceConfig(
        sparse_balance=True))
    """The runs' flags (d0 = ``--sb-density``, the bounds, band, floors, raise headroom, DST's
    objective and descent, the stand-down packing and compare, the planner): the runtime's
    defaults unless given; ``--sb-stand-down off``: no stand-down (``policy.stand_down``)."""
    dense_stand_down: Optional[str] = None
    """--sb-stand-down of the ``dense_sab`` runs (one of ``STAND_DOWN_PACKINGS``; None:
    sequential; off with ``stand_down``)."""
    microbatch_multiple: int = 0
    """--sb-microbatch-multiple: 0 fixed-length micro-batches (the fill is padding every run
    pays), k > 0 each micro-batch its documents rounded up to a multiple of k tokens; every
    variant of a study runs with the same setting."""
    slow_ranks: tuple = ()
    """``heterogeneous.SlowRank``s: GPUs that compute that many times slower than predicted
    (every run of the study, static ones included; DST plans with the scaled costs, as after
    the runtime's per-rank calibration)."""
    device_memory_gib: Optional[float] = None
    """The layout search's device-memory limit (``latency.memory``'s estimate of the fullest
    rank, GiB); None: no limit."""
    plugin_cost: object = None
    """``plugin_cost.PluginCost``: every SparseBalance run pays its own per-step cost (module
    docstring); None: gross step times only."""

    def policy(self, anchor: str = "mean", raise_to: str = "bottleneck"
               ) -> SparseBalanceConfig:
        """The ``SparseBalanceConfig`` a run with these settings would plan with."""
        return replace(self.sb, anchor=anchor, raise_to=raise_to)

    def with_flags(self, **flags) -> "StudyConfig":
        """This configuration with ``SparseBalanceConfig`` fields ``flags`` changed."""
        return replace(self, sb=replace(self.sb, **flags))


def _base(variant: str) -> str:
    return variant[:-4] if variant.endswith("_acc") else variant


def packing_of(variant: str) -> str:
    """The packing a variant uses: sequential, token_balanced, dp_balanced or sab."""
    v = _base(variant)
    if v.startswith("sab_dst_"):
        return "sab"
    return _PACKING.get(v, "sequential")


def is_dense(variant: str) -> bool:
    """Whether a variant runs dense attention (``DENSE_VARIANTS``)."""
    return variant in DENSE_VARIANTS


def dst_anchor_of(variant: str):
    """The DST anchor of a variant, or None when the variant does not run DST."""
    v = _base(variant)
    if v in ("dst", "sab_dst"):
        return "mean"
    for prefix in ("dst_", "sab_dst_"):
        if v.startswith(prefix):
            return v[len(prefix):]
    return None


def raise_to_of(variant: str) -> str:
    """``static`` for the accuracy-first variants (``..._acc``), else ``bottleneck``."""
    return "static" if variant.endswith("_acc") and dst_anchor_of(variant) else "bottleneck"


def _plan_key(variant: str) -> str:
    """The packing plan a variant runs on: ``packing_of``, SAB by dense costs for dense_sab."""
    return "sab_dense" if variant == "dense_sab" else packing_of(variant)


def _layout_plan_key(variant: str, layout):
    """``_plan_key``, with the layout for SAB's packings (SAB arranges its micro-batches on the
    run's own pipeline) and for dp_balanced under VPP (``dp_balanced_key``)."""
    key = _plan_key(variant)
    if key == "dp_balanced":
        return dp_balanced_key(layout)
    return (key, layout) if key in ("sab", "sab_dense") else key


def dp_balanced_key(layout) -> str:
    """dp_balanced's plan key on ``layout``: under VPP Megatron passes
    ``microbatch_group_size_per_vp_stage`` (default pp) to its packer, which then makes a
    multiple of dp x pp groups (``dp_balanced_vpp_group``)."""
    vp = getattr(layout, "vp", 1) or 1
    return f"dp_balanced/vpp{layout.pp}" if vp > 1 else "dp_balanced"


def dp_balanced_vpp_group(key: str):
    """The ``microbatch_group_size_per_vp_stage`` of a dp_balanced plan key (None: no VPP)."""
    return int(key.split("/vpp")[1]) if "/vpp" in key else None


def check_variant(variant: str) -> None:
    from ..config import ANCHORS
    v = _base(variant)
    if variant.endswith("_acc") and dst_anchor_of(variant) is None:
        raise ValueError(f"variant {variant!r}: '_acc' (raise to the static step time) needs a "
                         f"DST variant")
    if v in _PACKING or v == "dst":
        return
    for prefix in ("dst_", "sab_dst_"):
        if v.startswith(prefix) and v[len(prefix):] in ANCHORS:
            return
    raise ValueError(f"variant {variant!r}: expected one of {sorted(_PACKING) + ['dst']}, "
                     f"dst_<anchor> or sab_dst_<anchor> with an anchor of {ANCHORS}, each DST "
                     f"one optionally with '_acc'")


def run_study(dp: int, cfg: StudyConfig, lm, lengths, runs: dict,
              baseline: Optional[str] = None) -> dict:
    """{run name: row} for one DP size.

    runs: {name: (variant, layout)}; layout is a ``PipelineLayout`` or None (the latency
    model's own). ``baseline``: the run whose step time every speedup divides (default: the
    first run). Every run sees the same global batches; runs that share a packing share it.
    """
    if not runs:
        raise ValueError("runs is empty: expected at least one (variant, layout)")
    for variant, _ in runs.values():
        check_variant(variant)
    baseline = next(iter(runs)) if baseline is None else baseline
    if baseline not in runs:
        raise ValueError(f"baseline {baseline!r}: expected one of the runs {list(runs)}")
    m, cap, d0 = cfg.microbatches, cfg.seq_length, cfg.sb.density
    grid = density_grid(d0, cfg.sb.min_density, cfg.sb.max_density)
    if any(is_dense(v) for v, _ in runs.values()) and grid[-1] < 1.0:
        grid = np.append(grid, 1.0)  # above d_max: DST never plans there, dense reads it
    models, quality = {}, {}
    lm_dense = lm.all_dense()
    for variant, lay in runs.values():
        base = lm_dense if is_dense(variant) else lm
        if (base is lm_dense, lay) not in models:     # PipelineLayout is frozen: a dict key
            models[base is lm_dense, lay] = base if lay is None else base.with_layout(lay)
        if lay not in quality:
            quality[lay] = StageQuality.from_cost(load_quality_cost(None),
                                                  models[base is lm_dense, lay].layout.layers, d0)
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                                 seed=cfg.seed, long_sample_policy="split")
    tracker = SensitivityTracker()
    acc = {name: VariantAccumulator() for name in runs}
    if cfg.plugin_cost is not None:      # each SparseBalance run's own cost per step (issue 44)
        _charge_runs(cfg, acc, runs, models, dp, lm)
    policies = {}
    needed = {_layout_plan_key(v, lay) for v, lay in runs.values()}
    needed_feats = {(_layout_plan_key(v, lay), is_dense(v)) for v, lay in runs.values()}
    # SAB packs on each run's own layout, as the runtime's planner does (batching.slots);
    # sab_dense by the dense costs: every document dense
    cost_fns = {k: latency_sample_cost_fn(models[k[0] == "sab_dense", k[1]],
                                          1.0 if k[0] == "sab_dense" else d0)
                for k in needed if isinstance(k, tuple)}
    compare = cfg.policy().stand_down_compare    # what the packings are compared on
    fallback = cfg.policy().stand_down          # the packing SAB's runs stand down to
    fallback = None if fallback == "off" else fallback
    if cfg.dense_stand_down not in (None, *STAND_DOWN_PACKINGS):
        raise ValueError(f"dense_stand_down={cfg.dense_stand_down!r}: expected one of "
                         f"{', '.join(STAND_DOWN_PACKINGS)}")
    dense_fallback = None if fallback is None else (cfg.dense_stand_down or "sequential")

    def fallback_key(variant, layout):
        """The plan key SAB's run of ``variant`` on ``layout`` stands down to (None: none);
        dp_balanced's is the layout's (Megatron's VPP rule, ``dp_balanced_key``)."""
        back = {"sab": fallback, "sab_dense": dense_fallback}.get(_plan_key(variant))
        return dp_balanced_key(layout) if back == "dp_balanced" else back

    for v, lay in runs.values():
        back = fallback_key(v, lay)
        if back:
            needed.add(back)
            needed_feats.add((back, is_dense(v)))
    for _ in range(cfg.steps):
        segs = sampler.next_global_batch()
        plans = {"sequential": sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap)}
        for key, cost_fn in cost_fns.items():
            plans[key] = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                  cost_fn=cost_fn, sensitivity=tracker, seed=cfg.seed,
                                  length_multiple=cfg.microbatch_multiple)
        if "token_balanced" in needed:
            plans["token_balanced"] = token_balanced_plan(segs, dp=dp, num_microbatches=m,
                                                          max_tokens=cap, seed=cfg.seed)
        for key in needed:      # dp_balanced: its own lengths (no fill) unless every run's vary
            if isinstance(key, str) and key.startswith("dp_balanced"):
                plans[key] = dp_balanced_plan(
                    segs, dp=dp, num_microbatches=m, max_tokens=cap, empty_groups=True,
                    microbatch_group_size_per_vp_stage=dp_balanced_vpp_group(key))
        plans = {k: p.with_length_multiple(cfg.microbatch_multiple or p.length_multiple)
                 for k, p in plans.items()}
        feats = {(k, dense): (lm_dense if dense else lm).unit_features(
            p.flat_lengths(with_padding=True)) for k, p in plans.items() for dense in (False, True)
            if (k, dense) in needed_feats}
        sens = {k: unit_sensitivity(p, tracker) for k, p in plans.items()}
        costs = {}
        for name, (variant, lay) in runs.items():
            packing, dense = _layout_plan_key(variant, lay), is_dense(variant)
            # do no harm: SAB's packing competes with the baseline's (policy.stand_down)
            back = fallback_key(variant, lay)
            cands = [packing] + ([back] if back else [])
            for k in cands:
                if (k, dense, lay) not in costs:
                    costs[k, dense, lay] = scale_costs(UnitCosts.from_latency(
                        models[dense, lay], feats[k, dense], dp, plans[k].num_microbatches,
                        grid, kept_units=plans[k].unit_csr()), cfg.slow_ranks)
            cs = [costs[k, dense, lay] for k in cands]
            anchor = dst_anchor_of(variant)
            if anchor is None and len(cs) == 1:      # a baseline, or SAB with no stand-down
                ch = acc[name].charge
                acc[name].add(cs[0], np.full(cs[0].shape, 1.0 if dense else d0), lm.p2p_s,
                              quality=quality[lay], cost_s=ch.plan_s if ch else 0.0,
                              parts_ms=ch.parts_ms if ch else None)
                continue
            plan_fn = None
            if anchor is not None:
                pkey = (anchor, raise_to_of(variant))
                if pkey not in policies:
                    policies[pkey] = cfg.policy(*pkey)

                def plan_fn(i, c, pol=policies[pkey], layers=models[False, lay].layout.layers):
                    settings, q = dst_inputs(pol, c.shape[2], lm.p2p_s, None, layers)
                    # every DP rank's rounds, as the runtime's ranks make them; the slow GPUs'
                    # factors as the runtime's calibration learns them
                    plan = plan_dst(c, sens[cands[i]], settings, quality=q,
                                    rank_scale=rank_scale(cfg.slow_ranks, dp, c.pipeline_ranks)
                                    if cfg.slow_ranks else None)
                    return plan.densities, plan
            a = acc[name]
            if a.gate is not None and not a.gate.plans():   # do no harm, net: the baseline
                a.gate.skip()
                a.add(cs[-1], np.full(cs[-1].shape, 1.0 if dense else d0), lm.p2p_s,
                      quality=quality[lay])
                continue
            t = time.perf_counter()
            choice = choose_step(cs, d0, lm.p2p_s, plan_fn, enabled=fallback is not None,
                                 compare=compare)
            charged = a.charge.plan_s if a.charge is not None else 0.0
            parts = a.charge.parts_ms if a.charge is not None else None
            again = _refresh_s(cfg, cs[choice.index], d0, quality[lay]) \
                if a.charge is not None and anchor is not None else 0.0   # DST's refresh
            if again:
                charged, parts = charged + again, dict(parts, quality_refresh=1e3 * again)
            if a.gate is not None:
                a.gate.planned(choice, charged)
            a.add(cs[choice.index], choice.outcome.densities, lm.p2p_s,
                  (time.perf_counter() - t) * 1e3 if anchor is not None else None,
                  quality=quality[lay], choice=choice, cost_s=charged, parts_ms=parts)
    base = acc[baseline]
    base_net = base.step_s + base.cost_s if cfg.plugin_cost is not None else None
    labels = kernel_labels(lm.table)      # which kernel prices each row (issue 40)
    out = {}
    for name, a in acc.items():
        out[name] = a.row(base.step_s, base_net)
        short, long = labels["dense" if is_dense(runs[name][0]) else "sparse"]
        out[name].update(attention_kernel=short, attention_priced_by=long)
    return out


def _refresh_s(cfg: StudyConfig, costs, d0: float, quality) -> float:
    """A DST run's quality refresh per step (``plugin_cost.refresh_s``; the quality objective's
    alone: it refreshes that objective's model)."""
    from .plugin_cost import refresh_s

    pol = cfg.policy()
    return refresh_s(costs, d0, pol.quality_refresh_interval if pol.dst_objective == "quality"
                     else 0, len(quality.cost.groups), pol.quality_refresh_microbatches)


def _charge_runs(cfg: StudyConfig, acc: dict, runs: dict, models: dict, dp: int, lm) -> None:
    """Each SparseBalance run's per-step cost (``cfg.plugin_cost.charge`` at the run's shape and
    the policy's flags) and, with the do-no-harm rule on, its ``NetGate``."""
    from .plugin_cost import Shape

    pol = cfg.policy()
    stand_down = pol.stand_down != "off"
    for name, (variant, lay) in runs.items():
        model = models[is_dense(variant), lay]
        shape = Shape(dp, cfg.microbatches, model.layout.pp, model.num_stages, cfg.seq_length,
                      lm.cp)
        a = acc[name]
        a.charge = cfg.plugin_cost.charge(shape, sab=_plan_key(variant) in ("sab", "sab_dense"),
                                          dst=dst_anchor_of(variant) is not None,
                                          planner=pol.planner, stand_down=stand_down,
                                          compare=pol.stand_down_compare)
        if a.charge is not None and stand_down:
            a.gate = NetGate(quality=pol.dst_objective == "quality")


def run_config(dp: int, cfg: StudyConfig, lm, lengths, variants) -> dict:
    """{variant: row} for one DP size on the latency model's own layout; ``variants`` must
    contain ``static`` (the baseline of the speedups)."""
    if "static" not in variants:
        raise ValueError(f"variants {list(variants)} must include 'static' (the baseline)")
    return run_study(dp, cfg, lm, lengths, {v: (v, None) for v in variants}, baseline="static")
