"""The quality model refreshed from the network being trained (issue 84; the rule is docs/DESIGN.md
section 7, ``--sb-quality-refresh-interval``): group g's curve, and its bootstrap replicates,
scaled by the measured loss change over the predicted one (``predicted_changes``: the model's own
rule, ``StageQuality.change``, on the measured documents), clamped to [1 / max_scale, max_scale]
and shrunk towards 1 by ``shrink_weight``; with an interaction term the ratio is iterated to the
scale that reproduces the measurement (``ITERATIONS``). A run keeps the launch-time model and the
scales relative to it (``scaled``): they travel to the planner process, and the one cached object
per scales keeps ``StageQuality``'s cache serving it (``scaled_quality_cost``).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np

from .cost import GroupCost, QualityCost, QualityCostError, Replicate, load_quality_cost
from .stages import StageQuality

MAX_SCALE = 4.0         # a refresh moves a group's curve by at most this factor either way
ITERATIONS = 20         # fixed-point steps of the ratio where the interaction term is not 0


PROBE_RATIO = 0.8       # a refresh probes each group at this fraction of d0


def probe_density(d0: float) -> float:
    """The density a refresh moves each group to: ``PROBE_RATIO`` x d0, where DST's cuts go (about
    0.8 d0): the chord the plans pay. On trained SmolLM2 a probe at 0.9 d0 measured a third to
    two thirds of the model's change there and its rescaled model mis-priced the plans' larger
    moves; at 0.8 d0 it measured the model's own change within its noise
    (docs/results/plan_quality_refresh.json)."""
    return float(d0) * PROBE_RATIO


def group_of_layer(cost: QualityCost, layer: int, layers: int) -> int:
    """The depth group of 1-based decoder layer ``layer`` of a ``layers``-layer model: the group
    holding the layer's middle (``(layer - 0.5) / layers``)."""
    if layers < 1 or not 1 <= layer <= layers:
        raise QualityCostError(f"layer {layer!r} of {layers!r}: expected 1 <= layer <= layers")
    mid = (layer - 0.5) / layers
    for g, grp in enumerate(cost.groups):
        if grp.depth[0] <= mid < grp.depth[1]:
            return g
    return len(cost.groups) - 1


def predicted_changes(cost: QualityCost, d0: float, tested: Sequence[float],
                      lengths=None, tokens=None) -> np.ndarray:
    """[G] the model's per-token loss change when group g alone runs at ``tested[g]`` and the
    others at ``d0``, token-weighted over documents of ``lengths`` and ``tokens`` (None: one
    document of the model's reference length)."""
    g = len(cost.groups)
    n, t = _documents(cost, lengths, tokens)            # refused before any work
    widths = [grp.depth[1] - grp.depth[0] for grp in cost.groups]
    q = StageQuality.from_cost(cost, widths, d0)        # one stage per group: weights = I
    out = np.empty(g)
    for k in range(g):
        d = np.full((n.size, g), float(d0))
        d[:, k] = tested[k]
        out[k] = float(np.dot(q.doc_change(d, n), t) / t.sum())
    return out


def scaled(cost: QualityCost, scales: Sequence[float]) -> QualityCost:
    """``cost`` with group g's curve (the fit's and every bootstrap replicate's) times
    ``scales[g]`` (positive: each curve stays convex and non-increasing)."""
    s = _checked_vector(scales, len(cost.groups), "scales")
    if np.any(s <= 0):
        raise QualityCostError(f"scales={s.tolist()}: expected positive numbers")
    groups = tuple(GroupCost(g.depth, g.layers, g.knots, g.cost_at_knots * k)
                   for g, k in zip(cost.groups, s))
    reps = tuple(Replicate(r.length_exponent, r.interaction,
                           tuple(c * k for c, k in zip(r.cost, s))) for r in cost.bootstrap)
    return replace(cost, groups=groups, bootstrap=reps,
                   fit=dict(cost.fit, refresh_scales=s.tolist()))


def refresh_scales(cost: QualityCost, d0: float, tested: Sequence[float],
                   measured: Sequence[float], stderr: Optional[Sequence[float]] = None, *,
                   lengths=None, tokens=None) -> np.ndarray:
    """[G] each group's scale (the module's rule) from ``measured[g]``, the loss change (nats
    per token) of group g at ``tested[g]`` against uniform ``d0``, with its ``stderr`` (None:
    no shrinkage; inf: unknown, the group's scale stays); ``lengths`` and ``tokens``: the
    measured documents'."""
    g = len(cost.groups)
    if not (isinstance(d0, numbers.Real) and not isinstance(d0, bool) and 0.0 < d0 <= 1.0):
        raise QualityCostError(f"d0={d0!r}: expected a number in (0, 1]")
    t = _checked_vector(tested, g, "tested densities")
    if np.any(t <= 0) or np.any(t >= d0):
        raise QualityCostError(f"tested densities {t.tolist()}: expected numbers in (0, d0 = "
                               f"{d0:g})")
    m = _checked_vector(measured, g, "measured changes")
    se = np.zeros(g) if stderr is None else _checked_vector(stderr, g, "stderr", unknown=True)
    if np.any(se < 0):
        raise QualityCostError(f"stderr {se.tolist()}: expected numbers >= 0")
    p = predicted_changes(cost, d0, t, lengths, tokens)
    if np.any(p <= 0):
        raise QualityCostError(f"the model predicts no loss at the tested densities "
                               f"{t.tolist()} (changes {p.tolist()}): nothing to scale; "
                               f"test below the curves' flat part")
    s = np.ones(g)
    for _ in range(ITERATIONS if cost.interaction else 1):
        s = np.clip(s * m / p, 1.0 / MAX_SCALE, MAX_SCALE)   # a change <= 0: the lowest
        if cost.interaction:
            p = predicted_changes(scaled(cost, s), d0, t, lengths, tokens)
    return s ** shrink_weight(m, se)


def shrink_weight(measured, stderr) -> np.ndarray:
    """How far a group's scale moves from 1 (the exponent of ``refresh_scales``): m^2 / (m^2 +
    se^2) of its measured change m and standard error se, 0 where both are 0 or se is inf."""
    m, se = np.asarray(measured, dtype=np.float64), np.asarray(stderr, dtype=np.float64)
    return np.where(m * m + se * se > 0, m * m / np.maximum(m * m + se * se, 1e-300), 0.0)


@functools.lru_cache(maxsize=8)
def scaled_quality_cost(path: Optional[str], scales: Optional[tuple]) -> QualityCost:
    """``load_quality_cost(path)`` scaled by ``scales`` (None: as loaded): one object per
    (path, scales), so ``StageQuality.from_cost``'s cache (by the object) serves every step
    planned with the same refresh, and a new refresh a new object."""
    base = load_quality_cost(path)
    return base if scales is None else scaled(base, scales)


def _checked_vector(values, g: int, what: str, unknown: bool = False) -> np.ndarray:
    """``values`` as [g] finite numbers (``unknown``: +inf allowed too, an unmeasured error)."""
    try:
        v = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise QualityCostError(f"{what} {values!r}: expected {g} numbers, one per depth "
                               f"group") from None
    if v.shape != (g,):
        raise QualityCostError(f"{what} {np.asarray(values).tolist()}: expected {g} numbers, "
                               f"one per depth group")
    if not np.all(np.isfinite(v) | (unknown & np.isposinf(v))):
        raise QualityCostError(f"{what} {v.tolist()}: expected finite numbers"
                               + (" or inf (unknown)" if unknown else ""))
    return v


def _documents(cost: QualityCost, lengths, tokens) -> tuple:
    """(lengths [n], tokens [n]) of the measured documents: lengths > 0 (None: one document of
    the model's reference length), tokens >= 0 with a positive sum (None: one each)."""
    n = np.atleast_1d(np.asarray(cost.length_ref if lengths is None else lengths, np.float64))
    if n.ndim != 1 or n.size < 1 or not np.all(np.isfinite(n)) or np.any(n <= 0):
        raise QualityCostError(f"document lengths {np.asarray(lengths).tolist()}: expected "
                               f"finite numbers > 0, at least one")
    if tokens is None:
        return n, np.ones(n.size)
    t = np.atleast_1d(np.asarray(tokens, np.float64))
    if t.shape != n.shape or not np.all(np.isfinite(t)) or np.any(t < 0) or t.sum() <= 0:
        raise QualityCostError(f"document tokens {np.asarray(tokens).tolist()}: expected "
                               f"{n.size} finite numbers >= 0 (one per length), summing to more "
                               f"than 0")
    return n, t
