"""Work-weighted mean densities of a plan: over every unit and per pipeline stage, a density
weighted by its unit's attention work (layers x kept block pairs at density 1), routed
documents counting at density 1. What every report, floor and study reads as "the density".

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np


class WeightTotals:
    """What a work-weighted mean density divides by: the weights' sum over every unit
    (``tot``) and, for [dp, m, pp] weights, per stage (``tot_s``), with the work of documents
    routed dense (``dense_weights``, at density 1) added in; the routed work's own sums
    (``dense``, ``dense_s``; None without routing) are added to a plan's kept work as well.
    ``weighted_mean_density`` makes one per call; ``of_sums`` one of a DP group's agreed sums.
    ``mean`` and ``stage`` take a plan's kept work, float((d x w).sum()) and (d x
    w).sum(axis=(0, 1)), and a function giving the plain mean, read only where the weights
    are zero."""

    def __init__(self, weights: np.ndarray, dense_weights: Optional[np.ndarray] = None):
        self.w = np.asarray(weights, dtype=np.float64)
        self.tot, self.dense = float(self.w.sum()), None
        if dense_weights is not None:
            self._dw = np.asarray(dense_weights, dtype=np.float64)
            if self._dw.shape != self.w.shape:
                raise ValueError(f"dense_weights {self._dw.shape} must have the densities' "
                                 f"shape {self.w.shape}")
            self.dense = float(self._dw.sum())
            self.tot = self.tot + self.dense

    @classmethod
    def of_sums(cls, weight_s: np.ndarray, dense_s: Optional[np.ndarray] = None
                ) -> "WeightTotals":
        """The totals from per-stage sums made elsewhere (a DP group's all-reduced sums, where
        no rank holds every unit's weights): ``weight_s`` [pp] the weights', ``dense_s`` [pp]
        the routed work's (None without routing). No ``w``: ``mean`` and ``stage`` only."""
        t = cls.__new__(cls)
        t.w, ws = None, np.asarray(weight_s, dtype=np.float64)
        t.dense_s = None if dense_s is None else np.asarray(dense_s, dtype=np.float64)
        t.dense = None if dense_s is None else float(t.dense_s.sum())
        t.tot = float(ws.sum()) + (t.dense or 0.0)
        t.tot_s = ws if dense_s is None else ws + t.dense_s
        return t

    @functools.cached_property
    def tot_s(self) -> np.ndarray:
        tot = self.w.sum(axis=(0, 1))
        return tot if self.dense is None else tot + self.dense_s

    @functools.cached_property
    def dense_s(self) -> Optional[np.ndarray]:
        return None if self.dense is None else self._dw.sum(axis=(0, 1))

    def mean(self, kept: float, plain) -> float:
        """The mean density of a plan whose kept work is ``kept``."""
        if self.dense is not None:
            kept = kept + self.dense
        return kept / self.tot if self.tot > 0 else plain()

    def stage(self, kept_s: np.ndarray, plain) -> np.ndarray:
        """Every stage's mean density of a plan (or plans: [..., pp]) whose per-stage kept
        work is ``kept_s``."""
        if self.dense is not None:
            kept_s = kept_s + self.dense_s
        ok = self.tot_s > 0
        if ok.all():
            return kept_s / self.tot_s
        return np.where(ok, kept_s / np.where(ok, self.tot_s, 1.0), plain())


def weighted_mean_density(densities: np.ndarray, weights: np.ndarray,
                          dense_weights: Optional[np.ndarray] = None) -> float:
    """Mean of densities [dp, m, pp] weighted by attention work [dp, m, pp] (plain mean if all
    weights are zero); ``dense_weights``: work of documents routed dense, at density 1."""
    d = np.asarray(densities, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if d.shape != w.shape:
        raise ValueError(f"densities {d.shape} and weights {w.shape} must have the same shape")
    return WeightTotals(w, dense_weights).mean(float((d * w).sum()), lambda: float(d.mean()))
