"""The quality model (``quality.stages``) bound to one step's units: every check DST makes of
a plan's quality (its change summed over the units, under the fit and every bootstrap replicate,
the uncertainty, the water-filling's per-unit scale) goes through here, as the latency model
reaches the planner through ``costs.UnitCosts``.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..quality.cost import QualityCostError
from ..quality.stages import StageQuality, change_rule

UNCERTAINTY_Z = 1.0           # a plan's uncertainty: this many bootstrap standard deviations


def bind_quality(stage: StageQuality, costs) -> "BoundQuality":
    """``stage`` on ``costs``' units (a ``UnitCosts``): their documents' factors (each
    unit one token of the reference length where the costs carry no documents)."""
    docs = getattr(costs, "unit_docs", None)
    dp, m = costs.shape[:2]
    reps = [None] + list(range(len(stage.cost.bootstrap)))
    if docs is None:
        ones = np.ones((len(reps), dp, m))
        return BoundQuality(stage, ones, ones.copy(), float(dp * m))
    offsets, lengths, tokens, sparse = docs
    unit = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    c, fs, made = stage.cost, [], {}
    for r in reps:                  # a model's factors differ only by its length exponent
        beta = c.length_exponent if r is None else c.bootstrap[r].length_exponent
        key = beta if c.length_ref > 0 and beta != 0 else None
        if key not in made:
            f1, f2 = stage.factors(lengths, lengths * sparse, r)
            made[key] = tuple(np.bincount(unit, x, minlength=dp * m).reshape(dp, m)
                              for x in (f1, f2))
        fs.append(made[key])
    return BoundQuality(stage, np.stack([f[0] for f in fs]), np.stack([f[1] for f in fs]),
                        max(float(np.asarray(tokens).sum()), 1.0))


@dataclass(frozen=True)
class BoundQuality:
    """A ``StageQuality`` on one step's units: every plan check DST makes (sums of the model's
    change over the units, their bootstrap spread, the water-filling's per-unit scale)."""

    stage: StageQuality
    f1: np.ndarray              # [1 + B, dp, m] the units' factors (``StageQuality.factors``):
    f2: np.ndarray              # the fit's, then each bootstrap replicate's
    tokens: float               # the units' tokens (the plan cost's denominator; at least 1)

    def unit_scale(self) -> np.ndarray:
        """[dp, m] how much a unit's quality weighs against another's at d0 (the derivative of
        ``change`` there per unit of stage-summed cost): the water-filling's per-unit factor."""
        gamma, s0 = (float(x[0]) for x in self.stage.rule)
        return self.f1[0] + 2.0 * gamma * self.f2[0] * s0

    def _sums(self, idx: np.ndarray, grid: np.ndarray, models: slice) -> np.ndarray:
        """[R, ...] the change summed over the units of plans at grid indices ``idx``
        [..., dp, m, nv] under a slice of the models (the fit 0, replicate r r + 1), every
        model in one gather."""
        tables = self.stage.grid_tables(grid)                            # [1 + B, nv, g]
        at, gamma, s0 = self.stage.operands(models, idx.ndim, tables.shape[2])
        diff = tables.reshape(-1).take(idx + at).sum(axis=-1)            # [R, ..., dp, m]
        shape = at.shape[:-3] + self.f1.shape[1:]                        # [R, 1, ..., dp, m]
        f1, f2 = self.f1[models].reshape(shape), self.f2[models].reshape(shape)
        return change_rule(diff, f1, f2, gamma, s0).sum(axis=(-2, -1))

    def sums_at(self, idx: np.ndarray, grid: np.ndarray) -> np.ndarray:
        """[...] the model's change summed over the units of plans at grid indices ``idx``
        [..., dp, m, nv] (nats; divide by ``tokens`` for the per-token change)."""
        return self._sums(idx, grid, slice(0, 1))[0]

    def replicate_sums_at(self, idx: np.ndarray, grid: np.ndarray) -> np.ndarray:
        """[..., B] ``sums_at`` under every bootstrap replicate (B may be 0)."""
        return np.moveaxis(self._sums(idx, grid, slice(1, None)), 0, -1)

    def plan_cost(self, densities: np.ndarray) -> float:
        """The per-token loss change against uniform d0 of a plan given by its densities
        [dp, m, nv], interpolated (``sums_at`` / ``tokens`` of a plan on the grid)."""
        d = np.asarray(densities, dtype=np.float64)
        if d.ndim != 3 or d.shape[2] != self.stage.stages:
            raise QualityCostError(f"densities shape {d.shape}: expected [dp, m, "
                                   f"{self.stage.stages}] (one per stage)")
        diff = self.stage.summed_change(d)
        return float(self.stage.change(diff, self.f1[0], self.f2[0]).sum()) / self.tokens

    def uncertainty(self, replicate_sums: np.ndarray, tokens: float) -> np.ndarray:
        """[...] the per-token uncertainty of plans whose ``replicate_sums`` [..., B] are given,
        summed over ``tokens`` (the whole step's): ``UNCERTAINTY_Z`` bootstrap SDs (0 without
        replicates)."""
        r = np.asarray(replicate_sums, dtype=np.float64)
        if r.shape[-1] < 2:
            return np.zeros(r.shape[:-1])
        return UNCERTAINTY_Z * r.std(axis=-1, ddof=1) / tokens
