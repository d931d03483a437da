"""The runtime's per-step plan under the do-no-harm rule (issue 27, ``policy.stand_down``).

``SparseBalanceCallback`` packs a step's documents with SAB and, when the rule is on
(``--sb-stand-down`` not ``off``), also the baseline's way; ``choose`` then races the packings
(``--sb-stand-down-compare``: DST's plans of both, or their static plans, DST planning the one
chosen; in a run every rank plans its own units, agreed over the DP group) or, without DST,
compares the static plans (every rank: the latency model and the packings are identical on
every rank, so is the choice), and returns
what to commit: the densities, DST's report describing the *committed* plan, and the stand-down
record the metrics count. The same ``choose_step`` decides in the simulated study.

No torch, no megatron: plain lists and arrays in and out.
"""

from __future__ import annotations

from typing import Generator, Optional, Sequence

import numpy as np

from ...batching.sensitivity import LazySensitivity
from ...config import DEFAULT_RAISE_HEADROOM, MAX_RAISE_HEADROOM, SparseBalanceConfig
from ...latency.features import unit_rows
from ...policy.costs import UnitCosts, density_grid
from ...policy.stand_down import choice_rounds, choose_step
from .agreement import drive


def wants_baseline_packing(sb: SparseBalanceConfig, latency) -> bool:
    """Whether a step also packs the baseline's way: SAB packing, the rule on, a latency model."""
    return sb.packing_method == "sab" and sb.stand_down != "off" and latency is not None


def raise_headroom(sb: SparseBalanceConfig, latency, dp: int) -> float:
    """--sb-raise-headroom, or for 'auto' the latency model's median error over the last
    8 steps (``DEFAULT_RAISE_HEADROOM`` before any), capped at ``MAX_RAISE_HEADROOM``."""
    fixed = sb.raise_headroom_value
    return fixed if fixed is not None else headroom(sb, latency.recent_error(last=8 * dp))


def headroom(sb: SparseBalanceConfig, error: Optional[float]) -> float:
    """--sb-raise-headroom, or for 'auto' ``error`` (the latency model's median error over the
    last 8 steps of every DP rank; ``DEFAULT_RAISE_HEADROOM`` before any), capped at
    ``MAX_RAISE_HEADROOM``."""
    fixed = sb.raise_headroom_value
    if fixed is not None:
        return fixed
    return DEFAULT_RAISE_HEADROOM if error is None else min(error, MAX_RAISE_HEADROOM)


def agreed_inputs(sb: SparseBalanceConfig, latency, scale, rank: int, dp: int
                  ) -> Generator[dict, dict, tuple[bool, Optional[float]]]:
    """The rounds of (a slow GPU stands out, the raise headroom: ``headroom``'s) where each DP
    rank calibrated only its own pipeline: both agreed over the group (``policy.agreed_stats``;
    no round where neither is wanted). ``scale``: this rank's [dp, pp] correction grid (its own
    row learned), None without calibration."""
    from ...policy.agreed_stats import agreed_rounds

    auto = sb.raise_headroom_value is None
    if scale is None and not auto:
        return False, headroom(sb, None)
    narrow, error = yield from agreed_rounds(
        None if scale is None else scale[rank], latency.recent_errors() if auto else (),
        dp=dp, tolerance=sb.tolerance, error_cap=MAX_RAISE_HEADROOM)
    return narrow, headroom(sb, error)


def choose(sb: SparseBalanceConfig, latency, options: Sequence[tuple], dp: int, *,
           agree=None, **kw) -> tuple[Optional[list], Optional[dict], Optional[dict]]:
    """``choose_rounds`` driven to its end (``agreement.drive``): with ``agree`` (a
    ``DPReducer`` over the DP group: collective) as a rank of a run, without it in one process
    (the studies and tests)."""
    return drive(choose_rounds(sb, latency, options, dp, agreed=agree is not None, **kw), agree)


def choose_rounds(sb: SparseBalanceConfig, latency, options: Sequence[tuple], dp: int, *,
                  tracker=None, dst: bool, raise_headroom: Optional[float] = None,
                  stage_layers=None, rank: Optional[int] = None,
                  agreed: bool = False, own_rows: bool = False,
                  quality_scales: Optional[tuple] = None) -> Generator[dict, dict, tuple]:
    """The step's choice as its rounds with the other DP ranks; it returns (densities
    [dp][m][stages] or None, DST report or None, stand-down record or None).

    options: (BatchPlan, UnitFeatures) of SAB's packing and, if packed, the baseline's, SAB's
    first; dst: plan with DST, else the static plans are compared (d0 with sparse attention,
    density 1 without). DST is the decomposed planner (``policy.dst_rounds``): with ``rank``
    and ``agreed`` (the rounds reduced over the DP group) this rank plans only its own units,
    every step time and sum the choice reads is agreed over the group (the do-no-harm race:
    ``stand_down.choice_rounds``) and the ranks' rows are gathered into the whole plan (a run);
    ``own_rows``: the options are this rank's own micro-batches (one-row plans, SAB per rank),
    its rows are what it commits (densities [1][m][stages]) and the static comparison is
    agreed too; otherwise every DP rank's rounds are made here in lockstep and no round is
    yielded (the studies and tests: the same plan). The stand-down record is
    ``StepChoice.as_dict()``: ``packing_index`` says which option to commit.
    ``quality_scales``: the quality model's refreshed group scales (``dst_inputs``)."""
    from ...policy.dst_rounds import gathered, planned_rounds
    from ...policy.dst_rounds import plan_dst as plan_in_process
    from ...policy.dst_settings import dst_inputs

    own = rank is not None and agreed and (dst or own_rows)
    d0 = sb.density if sb.sparse_attention_enabled else 1.0
    grid = density_grid(sb.density, sb.min_density, sb.max_density) if dst else np.array([d0])
    costs = [UnitCosts.from_latency(latency, units, dp, batch.num_microbatches, grid,
                                    kept_units=batch.unit_csr() if dst else None,
                                    rank=rank if own else None, rank_units=own_rows)
             for batch, units in options]
    # each packing's unit sensitivities (this rank's rows where it plans its own), estimated
    # only for a packing DST plans, once
    sensitivity = [LazySensitivity(batch, tracker, rank if own and not own_rows else None)
                   for batch, _ in options]

    plans, plan_fn = None, None
    if dst:
        grid_fn = getattr(latency, "correction_grid", None)   # learned slow GPUs
        scale = grid_fn(dp, costs[0].pipeline_ranks) if grid_fn else None
        if own:         # each rank calibrated its own pipeline: the group's statistics
            narrow, raise_headroom = yield from agreed_inputs(sb, latency, scale, rank, dp)
        settings, quality = dst_inputs(sb, costs[0].shape[2], latency.p2p_s, raise_headroom,
                                       stage_layers, quality_scales)
        if own:         # this rank's rounds, driven where the rule plans the packing
            plans = [planned_rounds(c, sensitivity[i], settings, quality=quality,
                                    narrow=narrow) for i, c in enumerate(costs)]
        else:           # every rank's rounds here, in lockstep

            def plan_fn(i, c):
                p = plan_in_process(c, sensitivity[i](), settings, quality=quality,
                                    rank_scale=scale)
                return p.densities, p
    elif len(options) < 2:
        return None, None, None
    rule = dict(enabled=sb.stand_down != "off", compare=sb.stand_down_compare)
    choice = (yield from choice_rounds(costs, d0, latency.p2p_s, plans, **rule)) if own \
        else choose_step(costs, d0, latency.p2p_s, plan_fn, **rule)
    record = choice.as_dict()
    if not dst:
        return None, None, record
    out = choice.outcome
    units = options[choice.index][1]
    densities = out.densities
    # the committed plan's uncorrected busy seconds, which every rank calibrates against after
    # the step: predicted once here, with the plan
    if own_rows:                 # what this rank commits: its own rows
        busy = latency.busy_s(units, densities)
        chosen = sensitivity[choice.index]()
    elif own:
        m, pp = densities.shape[1:]
        busy = latency.busy_s(unit_rows(units, rank * m, (rank + 1) * m, dp * m), densities)
        chosen = sensitivity[choice.index]()
        rows = yield from gathered(np.concatenate([densities.reshape(-1), busy.reshape(-1)] + (
            [] if chosen is None else [np.asarray(chosen, dtype=np.float64).reshape(-1)])))
        densities = rows[:, :m * pp].reshape(dp, m, pp)
        busy = rows[:, m * pp:m * pp + busy.shape[1]]
        chosen = None if chosen is None else rows[:, m * pp + busy.shape[1]:]
    else:
        busy = latency.busy_s(units, densities)
        chosen = sensitivity[choice.index]()
    report = dict(out.plan.report.as_dict(), raise_headroom=raise_headroom,
                  unit_sensitivity=None if chosen is None else np.round(chosen, 6).tolist(),
                  predicted_busy_s=busy.tolist(), stand_down=record)
    if out.dst_stood_down:      # the report describes the committed plan: the static one
        report.update(step_time_planned_s=out.step_s, speedup=1.0, units_cut=0,
                      units_raised=0, ranks_reverted=0, quality_cost=0.0,
                      imbalance_after=report["imbalance_before"],
                      mean_density=report["mean_density_static"], density_per_stage=None)
    return densities.tolist(), report, record
