"""The decomposed DST (``dst_ranks``, issue 77) made in one process: every DP rank's rounds
(``dst_rounds.rank_rounds``) driven here in lockstep, the reductions made in-process (sums and
maxima, key by key) as the DP group's all-reduces make them in a run. The driver of the study
(``scripts/bench.py dst_decomposed``) and of the tests (``tests/unit/test_dst_ranks.py``); it
reports each rank's own CPU by phase.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .bands import straggler_present
from .costs import UnitCosts
from .dst_band import DSTPlan
from .dst_ranks import rank_slice
from .dst_rounds import plan_rounds_in_process, rank_rounds
from .dst_settings import DSTSettings


def plan_dst_decomposed(costs: UnitCosts, sensitivity, settings: DSTSettings, *, quality=None,
                        rank_scale=None, timer=None) -> DSTPlan:
    """The decomposed plan of ``costs`` [dp, m, stages] (module docstring), every rank's part
    made here and the reductions made in-process. At DP 1: ``dst.plan_dst_with_floor``'s plan
    bit for bit. ``timer`` (optional): called as ``timer(rank, seconds)`` with the thread CPU of
    every rank's own parts (its slice excluded), by the ``dst_ranks.PHASES`` between the
    reductions (a [6] array: the draft's wall time is their maxima over ranks, summed, plus the
    reductions')."""
    dp = costs.shape[0]
    narrow = straggler_present(rank_scale, settings.tolerance)
    sens = [None if sensitivity is None else np.asarray(sensitivity)[r:r + 1] for r in range(dp)]
    plans = plan_rounds_in_process([rank_rounds(rank_slice(costs, r), sens[r], settings,
                                                quality=quality, narrow=narrow)
                                    for r in range(dp)])
    agreed = {(p.candidate, p.probe) for p in plans}
    assert len(agreed) == 1, agreed                 # every rank keeps the same plan
    if timer is not None:
        for r, p in enumerate(plans):
            timer(r, p.cpu_s.copy())
    idx = np.concatenate([p.grid_index for p in plans])
    return DSTPlan(costs.densities[idx], plans[0].report, idx)
