"""The quality model (``policy.quality``) on a pipeline's stages (``StageQuality``) and on one
step's units (``BoundQuality``): every check DST makes of a plan's quality goes through here.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .quality import QualityCost, QualityCostError, curve

UNCERTAINTY_Z = 1.0           # a plan's uncertainty: this many bootstrap standard deviations


@dataclass(frozen=True)
class StageQuality:
    """A quality model mapped onto a pipeline's (virtual) stages: stage s's layers at density d
    cost ``sum_g weights[s, g] c_g(d)`` (``QualityCost.stage_weights``). Planning binds it to a
    step's units (``bind``): their documents' lengths and tokens."""

    cost: QualityCost
    weights: np.ndarray         # [nv, G]
    d0: float

    @classmethod
    def from_cost(cls, cost: QualityCost, stage_layers: Sequence[int], d0: float
                  ) -> "StageQuality":
        """The stages' quality of ``cost``; the same object for the same cost object, layers
        and d0 (DST asks every step: its grid tables are then made once)."""
        return _stage_quality(cost, tuple(float(x) for x in stage_layers), float(d0))

    @property
    def stages(self) -> int:
        return self.weights.shape[0]

    def curves(self, density, rep: Optional[int] = None) -> np.ndarray:
        """[..., nv] every stage's cost against dense with all its layers at ``density`` [...]
        (a scalar or a grid); ``rep``: a bootstrap replicate's curves."""
        return _group_costs(self, np.asarray(density, dtype=np.float64), rep) @ self.weights.T

    def reference(self, rep: Optional[int] = None) -> np.ndarray:
        """[nv] every stage's cost against dense at d0."""
        return self.curves(self.d0, rep)

    def grid_tables(self, grid: np.ndarray) -> np.ndarray:
        """[1 + B, nv, g] every stage's change against d0 at every grid density (rho = 1) under
        the fit, then under every bootstrap replicate (cached per grid: DST sums plans by them
        many times a step, under every model at once)."""
        g = np.asarray(grid, dtype=np.float64)
        cache = self.__dict__.setdefault("_tables", {})     # frozen: not a field
        got = cache.get(g.tobytes())    # one read: a planner thread and a report may share it
        if got is None:
            if len(cache) > 8:
                cache.clear()
            reps = [None] + list(range(len(self.cost.bootstrap)))
            got = np.stack([self.curves(g, r).T - self.reference(r)[:, None] for r in reps])
            cache[g.tobytes()] = got
        return got

    @functools.cached_property
    def rule(self) -> tuple:
        """(gamma [1 + B], S0 [1 + B]): the interaction and the stages' summed cost at d0 of the
        fit, then of every bootstrap replicate (``change``'s constants)."""
        reps = [None] + list(range(len(self.cost.bootstrap)))
        return (np.array([self.cost.interaction] + [r.interaction for r in self.cost.bootstrap],
                         dtype=np.float64),
                np.array([float(self.reference(r).sum()) for r in reps]))

    def operands(self, models: slice, ndim: int, g: int) -> tuple:
        """``BoundQuality``'s gather of ``models`` (a slice of the fit 0 and replicate r r + 1)
        for plans of ``ndim`` dimensions on a grid of ``g`` densities (made once): the models'
        offsets in the flat ``grid_tables`` [R, 1, ..., 1, 1, nv] and their constants
        (``rule``; [R, 1, ..., 1, 1], gamma 0.0 where no model has an interaction)."""
        key = (models.start, models.stop, ndim, g)
        cache = self.__dict__.setdefault("_operands", {})       # frozen: not a field
        got = cache.get(key)
        if got is None:
            nv, (gamma, s0) = self.stages, self.rule
            first, stop, _ = models.indices(s0.size)
            lead = (stop - first,) + (1,) * (ndim - 3)
            at = (np.arange(first, stop) * (nv * g))[:, None] + np.arange(nv) * g      # [R, nv]
            got = (at.reshape(lead + (1, 1, nv)),
                   gamma[models].reshape(lead + (1, 1)) if gamma.any() else 0.0,
                   s0[models].reshape(lead + (1, 1)))
            cache[key] = got
        return got

    def marginal_gain(self, grid: np.ndarray) -> np.ndarray:
        """[nv, g] quality gained per unit of density by stepping up to each grid index from the
        one below (+inf at index 0), non-increasing along the grid (the cost is convex): what
        DST's quality water-filling weighs against attention seconds (scaled per unit by its
        documents, ``BoundQuality.unit_scale``)."""
        g = np.asarray(grid, dtype=np.float64)
        q = self.curves(g).T                                          # [nv, g]
        out = np.full(q.shape, np.inf)
        out[:, 1:] = np.maximum((q[:, :-1] - q[:, 1:]) / np.diff(g), 0.0)
        return np.minimum.accumulate(out, axis=1)

    def factors(self, lengths, tokens, rep: Optional[int] = None) -> tuple:
        """(rho, rho^2) summed over documents, token-weighted: ``lengths`` and ``tokens`` per
        document, any shape; a model without a length term gives the tokens themselves."""
        c = self.cost
        beta = c.length_exponent if rep is None else c.bootstrap[rep].length_exponent
        t = np.asarray(tokens, dtype=np.float64)
        if c.length_ref <= 0 or beta == 0:
            return t, t
        n = np.clip(np.asarray(lengths, dtype=np.float64), max(c.length_range[0], 1.0),
                    c.length_range[1])                  # no extrapolation past the measured
        rho = (n / c.length_ref) ** beta
        return t * rho, t * rho * rho

    def change(self, diff: np.ndarray, f1: np.ndarray, f2: np.ndarray,
               rep: Optional[int] = None) -> np.ndarray:
        """Loss change against d0 (nats, summed over tokens) of documents or units whose
        stage-summed cost against d0 is ``diff`` and whose factors are (f1, f2) (``factors``):
        ``f1 diff + gamma f2 diff (diff + 2 S0)``, S0 the stages' cost at d0. The one body of the
        model's rule: every check of a plan goes through it."""
        gamma, s0 = (float(x[0 if rep is None else rep + 1]) for x in self.rule)
        return _change(diff, f1, f2, gamma, s0)

    def summed_change(self, d: np.ndarray, rep: Optional[int] = None) -> np.ndarray:
        """[...] the stages' summed cost against d0 where stage s runs at ``d[..., s]``."""
        return (_group_costs(self, d, rep) * self.weights).sum(axis=-1).sum(axis=-1) \
            - self.reference(rep).sum()

    def doc_change(self, densities: np.ndarray, lengths, rep: Optional[int] = None
                   ) -> np.ndarray:
        """[n] per-token loss change against uniform d0 of documents of ``lengths`` [n] whose
        stages run at ``densities`` [n, nv]."""
        d = np.asarray(densities, dtype=np.float64)
        if d.ndim != 2 or d.shape[1] != self.stages:
            raise QualityCostError(f"densities shape {d.shape}: expected [n, {self.stages}] "
                                   f"(one per stage)")
        diff = self.summed_change(d, rep)
        f1, f2 = self.factors(lengths, np.ones(d.shape[0]), rep)
        return self.change(diff, f1, f2, rep)

    def bind(self, costs) -> "BoundQuality":
        """This model on ``costs``' units (a ``UnitCosts``): their documents' factors (each
        unit one token of the reference length where the costs carry no documents)."""
        docs = getattr(costs, "unit_docs", None)
        dp, m = costs.shape[:2]
        reps = [None] + list(range(len(self.cost.bootstrap)))
        if docs is None:
            ones = np.ones((len(reps), dp, m))
            return BoundQuality(self, ones, ones.copy(), float(dp * m))
        offsets, lengths, tokens, sparse = docs
        unit = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
        c, fs, made = self.cost, [], {}
        for r in reps:                  # a model's factors differ only by its length exponent
            beta = c.length_exponent if r is None else c.bootstrap[r].length_exponent
            key = beta if c.length_ref > 0 and beta != 0 else None
            if key not in made:
                f1, f2 = self.factors(lengths, lengths * sparse, r)
                made[key] = tuple(np.bincount(unit, x, minlength=dp * m).reshape(dp, m)
                                  for x in (f1, f2))
            fs.append(made[key])
        return BoundQuality(self, np.stack([f[0] for f in fs]), np.stack([f[1] for f in fs]),
                            max(float(np.asarray(tokens).sum()), 1.0))


@functools.lru_cache(maxsize=16)
def _stage_quality(cost: QualityCost, stage_layers: tuple, d0: float) -> StageQuality:
    """``StageQuality.from_cost``'s objects, by the cost object (a ``QualityCost`` hashes by
    identity; the cache holds it, so its id is not reused meanwhile)."""
    return StageQuality(cost, cost.stage_weights(stage_layers), d0)


def _change(diff, f1, f2, gamma, s0) -> np.ndarray:
    """``StageQuality.change``'s rule with the model's constants given: ``gamma`` and ``s0``
    scalars, or arrays that broadcast against ``diff`` (several models at once; a model whose
    gamma is 0 has no interaction term, as a scalar one)."""
    out = f1 * diff
    if np.ndim(gamma) or gamma:
        out = np.where(np.asarray(gamma) != 0, out + gamma * f2 * diff * (diff + 2.0 * s0), out)
    return out


def _group_costs(q: StageQuality, d: np.ndarray, rep) -> np.ndarray:
    """[..., G] every depth group's cost against dense at ``d`` [...]: the fit's curves, or
    bootstrap replicate ``rep``'s."""
    costs = tuple(g.cost_at_knots for g in q.cost.groups) if rep is None \
        else q.cost.bootstrap[rep].cost
    return np.stack([curve(g.knots, c, d) for g, c in zip(q.cost.groups, costs)], axis=-1)


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
        return _change(diff, f1, f2, gamma, s0).sum(axis=(-2, -1))

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
