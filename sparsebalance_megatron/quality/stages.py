"""The quality model (``quality.cost``) on a pipeline's (virtual) stages: what a stage's layers
at a density cost, a plan's change against uniform d0, the tables and marginal gains DST plans
by on its density grid. The planner binds it to one step's units in ``policy.quality_bound``.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .cost import QualityCost, QualityCostError, curve


@dataclass(frozen=True)
class StageQuality:
    """A quality model mapped onto a pipeline's (virtual) stages: stage s's layers at density d
    cost ``sum_g weights[s, g] c_g(d)`` (``QualityCost.stage_weights``). The planner binds it to
    a step's units, their documents' lengths and tokens (``policy.quality_bound``)."""

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
        """The planner's gather (``policy.quality_bound``) of ``models`` (a slice of the fit 0
        and replicate r r + 1) for plans of ``ndim`` dimensions on a grid of ``g`` densities
        (made once): the models' offsets in the flat ``grid_tables`` [R, 1, ..., 1, 1, nv] and
        their constants (``rule``; [R, 1, ..., 1, 1], gamma 0.0 where no model has an
        interaction)."""
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
        return change_rule(diff, f1, f2, gamma, s0)

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


@functools.lru_cache(maxsize=16)
def _stage_quality(cost: QualityCost, stage_layers: tuple, d0: float) -> StageQuality:
    """``StageQuality.from_cost``'s objects, by the cost object (a ``QualityCost`` hashes by
    identity; the cache holds it, so its id is not reused meanwhile)."""
    return StageQuality(cost, cost.stage_weights(stage_layers), d0)


def change_rule(diff, f1, f2, gamma, s0) -> np.ndarray:
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
