"""Dynamic sparsity tuning (DST): one attention density per (dp_rank, micro-batch, stage), by
the rule of docs/DESIGN.md section 5.

``plan_dst``: every DP rank's rounds (``dst_ranks``, ``dst_rounds``) made in one process (the
studies and tests; a run drives the same rounds over the DP group,
``megatron/step/agreement.py``); ``dst_inputs``: its inputs from a ``SparseBalanceConfig``.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .bands import straggler_present
from .costs import UnitCosts
from .dst_band import DSTPlan
from .dst_ranks import rank_slice
from .dst_rounds import plan_rounds_in_process, rank_rounds
from .dst_settings import DSTSettings


def plan_dst(costs: UnitCosts, sensitivity: Optional[np.ndarray], settings: DSTSettings, *,
             quality=None, rank_scale=None) -> DSTPlan:
    """DST's plan of ``costs`` [dp, m, stages] (the module's rule), every DP rank's rounds made
    here and their reductions made in-process, as the DP group makes them in a run.

    ``sensitivity``: [dp, m] or [dp, m, stages], higher = loses more accuracy when sparsified
    (None: all equal); ``quality``: the quality objective's ``StageQuality`` (None: the density
    objective); ``rank_scale``: the calibration's [dp, pp] factors (a slow GPU gets narrower
    bands, ``bands.straggler_present``)."""
    dp = costs.shape[0]
    narrow = straggler_present(rank_scale, settings.tolerance)
    sens = [None if sensitivity is None else np.asarray(sensitivity)[r:r + 1] for r in range(dp)]
    plans = plan_rounds_in_process([rank_rounds(rank_slice(costs, r), sens[r], settings,
                                                quality=quality, narrow=narrow)
                                    for r in range(dp)])
    agreed = {(p.candidate, p.probe) for p in plans}
    assert len(agreed) == 1, agreed                 # every rank keeps the same plan
    idx = np.concatenate([p.grid_index for p in plans])
    return DSTPlan(costs.densities[idx], plans[0].report, idx)


def dst_inputs(config, stages: int, p2p_s: float = 0.0, raise_headroom: Optional[float] = None,
               stage_layers=None, quality_scales: Optional[tuple] = None) -> tuple:
    """(``DSTSettings``, the quality objective's ``StageQuality`` or None) of a
    ``SparseBalanceConfig`` for costs of ``stages`` (virtual) stages. ``raise_headroom``
    overrides the config's (the runtime passes the measured error when the config says 'auto';
    'auto' without one is ``DEFAULT_RAISE_HEADROOM``). With ``--sb-dst-objective quality`` (the
    default), ``stage_layers`` (the decoder layers of every (virtual) stage) maps the quality
    model onto the stages: without it a ``ValueError`` (no silent fall-back to the density
    objective); ``dst_objective="density"`` needs none. ``quality_scales``: the depth groups'
    scales of the run's last quality refresh (``quality_refresh``; None: the model as loaded)."""
    quality = None
    if config.dst_objective == "quality":
        from .quality_refresh import scaled_quality_cost
        from .quality_stages import StageQuality
        if stage_layers is None or len(stage_layers) != stages:
            raise ValueError(f"--sb-dst-objective quality (the default) needs the decoder "
                             f"layers of each of the {stages} stages, got "
                             f"{stage_layers!r}; pass stage_layers, or plan with "
                             f"--sb-dst-objective density, which needs none")
        cost = scaled_quality_cost(config.quality_cost,
                                   None if quality_scales is None else tuple(quality_scales))
        quality = StageQuality.from_cost(cost, stage_layers, config.density)
    return DSTSettings.from_config(config, p2p_s=p2p_s, raise_headroom=raise_headroom), quality
