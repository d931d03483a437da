"""The per-step budget plan: a density for every (dp rank, micro-batch, pipeline stage) unit.

DST (``policy/``) produces it. In a run a DP rank holds its own rows (``first``: its DP rank;
with ``--sb-metrics-file``, which records every unit's density, every rank's). It reaches the
attention modules through the adapter's typed slots (``megatron/model/budget.py``), never through
globals.
Pure Python + numpy; must not import megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BudgetPlan:
    """Densities for one step: ``densities[dp_rank - first, microbatch, stage]`` of DP ranks
    ``first`` .. ``first + k - 1``."""

    step: int
    densities: np.ndarray  # [k, m, pp] float64
    first: int = 0         # the DP rank of its first row

    def __post_init__(self):
        d = np.asarray(self.densities, dtype=np.float64)
        if d.ndim != 3:
            raise ValueError(f"BudgetPlan.densities must be [dp, m, pp], got shape {d.shape}")
        if not np.all((d > 0) & (d <= 1)):
            raise ValueError(f"BudgetPlan densities must lie in (0, 1], got min={d.min()} max={d.max()}")
        self.densities = d

    def rows(self, dp_rank: int) -> np.ndarray:
        """[1, m, pp]: DP rank ``dp_rank``'s densities."""
        i = int(dp_rank) - self.first
        if not 0 <= i < self.densities.shape[0]:
            raise ValueError(f"DP rank {dp_rank!r}: the plan holds DP ranks {self.first} to "
                             f"{self.first + self.densities.shape[0] - 1}")
        return self.densities[i:i + 1]

    @classmethod
    def static(cls, step: int, density: float, dp: int, microbatches: int, stages: int) -> "BudgetPlan":
        return cls(step, np.full((dp, microbatches, stages), float(density)))

    def density(self, dp_rank: int, microbatch: int, stage: int) -> float:
        return float(self.rows(dp_rank)[0, microbatch, stage])
