"""The runtime's per-step plan under the do-no-harm rule (issue 27, ``policy.stand_down``).

``SparseBalanceCallback`` packs a step's documents with SAB and, when the rule is on
(``--sb-stand-down`` not ``off``), also the baseline's way; ``choose`` then races the packings
(``--sb-stand-down-compare``: DST's plans of both, or their static plans, DST planning the one
chosen; rank 0: the plan is broadcast) or, without DST, compares the static plans (every rank: the
latency model and the packings are identical on every rank, so is the choice), and returns
what to commit: the densities, DST's report describing the *committed* plan, and the stand-down
record the metrics count. The same ``choose_step`` decides in the simulated study.

No torch, no megatron: plain lists and arrays in and out.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...batching.sensitivity import batch_sensitivity
from ...config import DEFAULT_RAISE_HEADROOM, MAX_RAISE_HEADROOM, SparseBalanceConfig
from ...policy.costs import UnitCosts, density_grid
from ...policy.stand_down import choose_step


def wants_baseline_packing(sb: SparseBalanceConfig, latency) -> bool:
    """Whether a step also packs the baseline's way: SAB packing, the rule on, a latency model."""
    return sb.packing_method == "sab" and sb.stand_down != "off" and latency is not None


def raise_headroom(sb: SparseBalanceConfig, latency, dp: int) -> float:
    """--sb-raise-headroom, or for 'auto' the latency model's median error over the last
    8 steps (``DEFAULT_RAISE_HEADROOM`` before any), capped at ``MAX_RAISE_HEADROOM``."""
    fixed = sb.raise_headroom_value
    if fixed is not None:
        return fixed
    err = latency.recent_error(last=8 * dp)
    return DEFAULT_RAISE_HEADROOM if err is None else min(err, MAX_RAISE_HEADROOM)


def choose(sb: SparseBalanceConfig, latency, options: Sequence[tuple], dp: int, *,
           tracker=None, dst: bool, raise_headroom: Optional[float] = None,
           stage_layers=None, tables=None
           ) -> tuple[Optional[list], Optional[dict], Optional[dict]]:
    """(densities [dp][m][stages] or None, DST report or None, stand-down record or None).

    options: (BatchPlan, UnitFeatures) of SAB's packing and, if packed, the baseline's, SAB's
    first; dst: plan with DST (rank 0), else the static plans are compared (d0 with sparse
    attention, density 1 without). The stand-down record is ``StepChoice.as_dict()``:
    ``packing_index`` says which option to commit. tables: a ``TableMemory`` per option, the
    cost tables' memory kept between steps (None: fresh arrays)."""
    from ...policy.dst import plan_dst_from_config

    d0 = sb.density if sb.sparse_attention_enabled else 1.0
    grid = density_grid(sb.density, sb.min_density, sb.max_density) if dst else np.array([d0])
    costs = [UnitCosts.from_latency(latency, units, dp, batch.num_microbatches, grid,
                                    kept_units=batch.unit_csr() if dst else None,
                                    out=None if tables is None else tables[i])
             for i, (batch, units) in enumerate(options)]
    sens = {}

    def sensitivity(i):
        """Packing i's unit sensitivities, estimated once and only for a packing DST plans
        (ranks that draft without DST, and 'static' comparisons, need none for the other)."""
        if i not in sens:
            sens[i] = batch_sensitivity(options[i][0], tracker) if tracker is not None else None
        return sens[i]

    plan_fn = None
    if dst:
        def plan_fn(i, c):
            grid_fn = getattr(latency, "correction_grid", None)   # learned slow GPUs
            p = plan_dst_from_config(sb, c, sensitivity(i), latency.p2p_s,
                                     raise_headroom=raise_headroom, stage_layers=stage_layers,
                                     rank_scale=grid_fn(dp, c.pipeline_ranks) if grid_fn
                                     else None)
            return p.densities, p
    elif len(options) < 2:
        return None, None, None
    choice = choose_step(costs, d0, latency.p2p_s, plan_fn, enabled=sb.stand_down != "off",
                         compare=sb.stand_down_compare)
    record = choice.as_dict()
    if not dst:
        return None, None, record
    out = choice.outcome
    # the committed plan's uncorrected busy seconds, which every rank calibrates against after
    # the step: predicted once here, off the training thread, and broadcast with the plan
    busy = latency.busy_s(options[choice.index][1], out.densities)
    chosen = sensitivity(choice.index)
    report = dict(out.plan.report.as_dict(), raise_headroom=raise_headroom,
                  unit_sensitivity=None if chosen is None else np.round(chosen, 6).tolist(),
                  predicted_busy_s=busy.tolist(), stand_down=record)
    if out.dst_stood_down:      # the report describes the committed plan: the static one
        report.update(step_time_planned_s=out.step_s, speedup=1.0, units_cut=0,
                      units_raised=0, ranks_reverted=0, quality_cost=0.0,
                      imbalance_after=report["imbalance_before"],
                      mean_density=report["mean_density_static"], density_per_stage=None)
    return out.densities.tolist(), report, record
