"""DST's floors checked on a plan many times a step (the critical-path descent's rounds): the
mean and per-stage density floors and the quality rule, with what does not change between the
checks computed once.

A check by grid index first sums the plan's kept work and quality cost in one compiled pass
(``kernels.floors``), in its own order, with a bound on how far any order's sum can be from
it; only a plan whose sums lie within that bound of a floor is checked again with the floors'
own sums (``density_means``). The verdicts are theirs either way (a check returns a verdict,
never a sum), and the rule itself lives in ``density_means`` alone.

Pure numpy and numba; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..kernels import f64
from ..kernels.records import Floors
from .costs import UnitCosts
from .density_means import WeightTotals


class FloorCheck:
    """The critical-path descent's floors (``critical_path.refine_plan``) on a plan, given by
    its densities or its grid indices (``*_at``): the work-weighted mean density >=
    ``mean_floor``, every stage's >= ``stage_floor`` (each less 1e-12) and, with ``quality``
    (a ``quality.BoundQuality``), no predicted loss against uniform d0. The verdicts
    ``weighted_mean_density``, ``stage_mean_densities`` and ``BoundQuality.plan_cost`` give:
    the same sums of the same products, with what does not depend on the plan (the weights'
    totals, the routed work: ``WeightTotals``) summed once, not on every check of a descent's
    rounds; by grid index, first from a compiled pass's sums and their bound (module
    docstring)."""

    def __init__(self, costs: UnitCosts, mean_floor: float, stage_floor: float, quality):
        self.grid, self.quality = costs.densities, quality
        self.totals = WeightTotals(costs.weights(), costs.dense_work)
        self.mean_floor, self.stage_floor = mean_floor - 1e-12, stage_floor - 1e-12
        t = self.totals
        self._fast = t.tot > 0 and bool(np.all(t.w >= 0)) and bool(
            np.all(self.grid > 0)) and (t.dense is None or bool(np.all(t.dense_s >= 0)))
        if self._fast:
            self._w, self._g, self._nv = f64(t.w.reshape(-1)), f64(self.grid), t.w.shape[-1]
            self._sums = np.empty(2 * self._nv)
            self._record = Floors(
                self._w, self._nv, float(t.tot), float(t.dense or 0.0), f64(t.tot_s),
                np.zeros(self._nv) if t.dense is None else f64(t.dense_s),
                float(self.mean_floor), float(self.stage_floor), not bool(np.all(t.tot_s > 0)))

    def floors_at(self, idx: np.ndarray) -> bool:
        """The density floors of the plan at grid indices ``idx`` (non-decreasing in every
        density: rounding is monotone): from the compiled sums (``kernels.floors``) where they
        decide, else numpy's."""
        i = np.asarray(idx).reshape(-1)
        if self._fast and i.dtype == np.int64 and i.size == self._w.size:
            got = kernels.floors.floors_verdict(self._g, i, self._record, self._sums)
            if got >= 0:
                return bool(got)
        return self._floors(self.grid.take(idx))

    def meets_at(self, idx: np.ndarray) -> bool:
        """``floors_at`` and the quality rule."""
        return self.floors_at(idx) and (
            self.quality is None or self.quality.plan_cost_at(idx, self.grid) <= 1e-12)

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
