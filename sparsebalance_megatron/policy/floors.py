"""DST's floors checked on a plan many times a step (the critical-path descent's rounds): the
mean and per-stage density floors and the quality rule, with what does not change between the
checks computed once.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .costs import UnitCosts
from .density_means import WeightTotals


class FloorCheck:
    """The critical-path descent's floors (``critical_path.refine_plan``) on a plan, given by
    its densities or its grid indices (``*_at``): the work-weighted mean density >=
    ``mean_floor``, every stage's >= ``stage_floor`` (each less 1e-12) and, with ``quality``
    (a ``StageQuality``), no predicted loss against uniform d0. The floats
    ``weighted_mean_density``, ``stage_mean_densities`` and ``StageQuality.plan_cost`` give:
    the same sums of the same products, with what does not depend on the plan (the weights'
    totals, the routed work: ``WeightTotals``) summed once, not on every check of a descent's
    rounds."""

    def __init__(self, costs: UnitCosts, mean_floor: float, stage_floor: float, quality):
        self.grid, self.quality = costs.densities, quality
        self.totals = WeightTotals(costs.weights(), costs.dense_work)
        self.mean_floor, self.stage_floor = mean_floor - 1e-12, stage_floor - 1e-12

    def floors_at(self, idx: np.ndarray) -> bool:
        """The density floors of the plan at grid indices ``idx`` (non-decreasing in every
        density: rounding is monotone)."""
        return self._floors(self.grid.take(idx))

    def meets_at(self, idx: np.ndarray) -> bool:
        """``floors_at`` and the quality rule."""
        return self.floors_at(idx) and (self.quality is None or
                                        self.quality.plan_cost_at(idx, self.grid) <= 1e-12)

    def meets(self, dens: np.ndarray) -> bool:
        """``meets_at`` of a plan given by its densities."""
        return self._floors(np.asarray(dens, dtype=np.float64)) and (
            self.quality is None or self.quality.plan_cost(dens, self.grid) <= 1e-12)

    def _floors(self, d: np.ndarray) -> bool:
        kept = d * self.totals.w
        if not self.totals.mean(float(kept.sum()), lambda: float(d.mean())) >= self.mean_floor:
            return False
        stage = self.totals.stage(kept.sum(axis=(0, 1)), lambda: d.mean(axis=(0, 1)))
        return float(np.min(stage)) >= self.stage_floor
