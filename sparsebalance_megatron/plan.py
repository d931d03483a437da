"""The per-step budget plan: a density for every (dp rank, micro-batch, pipeline stage) unit.

DST (``policy/``) produces it; every rank holds the same ``BudgetPlan``. It reaches the attention
modules through the adapter's typed slots (``megatron/model/budget.py``), never through globals.
Pure Python + numpy; must not import megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BudgetPlan:
    """Densities for one step: ``densities[dp_rank, microbatch, stage]``, identical on all ranks."""

    step: int
    densities: np.ndarray  # [dp, m, pp] float64

    def __post_init__(self):
        d = np.asarray(self.densities, dtype=np.float64)
        if d.ndim != 3:
            raise ValueError(f"BudgetPlan.densities must be [dp, m, pp], got shape {d.shape}")
        if not np.all((d > 0) & (d <= 1)):
            raise ValueError(f"BudgetPlan densities must lie in (0, 1], got min={d.min()} max={d.max()}")
        self.densities = d

    @classmethod
    def static(cls, step: int, density: float, dp: int, microbatches: int, stages: int) -> "BudgetPlan":
        return cls(step, np.full((dp, microbatches, stages), float(density)))

    def density(self, dp_rank: int, microbatch: int, stage: int) -> float:
        return float(self.densities[dp_rank, microbatch, stage])
