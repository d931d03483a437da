"""DST's floors checked on a plan many times a step (the critical-path descent's rounds): the
mean and per-stage density floors and the quality rule, with what does not change between the
checks computed once.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .costs import UnitCosts


class FloorCheck:
    """The critical-path descent's floors (``critical_path.refine_plan``) on a plan, given by
    its densities or its grid indices (``*_at``): the work-weighted mean density >=
    ``mean_floor``, every stage's >= ``stage_floor`` (each less 1e-12) and, with ``quality``
    (a ``StageQuality``), no predicted loss against uniform d0. The floats
    ``weighted_mean_density``, ``stage_mean_densities`` and ``StageQuality.plan_cost`` give:
    the same sums of the same products, with what does not depend on the plan (the weights'
    totals, the routed work) summed once, not on every check of a descent's rounds."""

    def __init__(self, costs: UnitCosts, mean_floor: float, stage_floor: float, quality):
        self.grid, self.quality = costs.densities, quality
        self.w = np.asarray(costs.weights(), dtype=np.float64)
        self.mean_floor, self.stage_floor = mean_floor - 1e-12, stage_floor - 1e-12
        self.tot, self.tot_s = float(self.w.sum()), self.w.sum(axis=(0, 1))
        dense = costs.dense_work
        if dense is not None:
            dw = np.asarray(dense, dtype=np.float64)
            if dw.shape != self.w.shape:
                raise ValueError(f"dense_weights {dw.shape} must have the densities' shape "
                                 f"{self.w.shape}")
            self.dense, self.dense_s = float(dw.sum()), dw.sum(axis=(0, 1))
            self.tot, self.tot_s = self.tot + self.dense, self.tot_s + self.dense_s
        else:
            self.dense = self.dense_s = None
        self.stage_ok = self.tot_s > 0

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
        kept_all = d * self.w
        kept = float(kept_all.sum())
        if self.dense is not None:
            kept = kept + self.dense
        mean = kept / self.tot if self.tot > 0 else float(d.mean())
        if not mean >= self.mean_floor:
            return False
        kept_s = kept_all.sum(axis=(0, 1))
        if self.dense_s is not None:
            kept_s = kept_s + self.dense_s
        if self.stage_ok.all():
            stage = kept_s / self.tot_s
        else:
            stage = np.where(self.stage_ok, kept_s / np.where(self.stage_ok, self.tot_s, 1.0),
                             d.mean(axis=(0, 1)))
        return float(np.min(stage)) >= self.stage_floor
