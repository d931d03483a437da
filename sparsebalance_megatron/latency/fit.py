"""Least squares on relative error with non-negative work costs: the one fitter of the latency
model's coefficients (``model.LatencyModel.fit``) and of the sparse call's price
(``sparse_call.fit_price``), so that a table and a kernel table are fitted by the same rule.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def fit_nonneg(x: np.ndarray, y: np.ndarray, scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Least squares on relative error (rows scaled by 1/``scale``, default 1/y), dropping
    features whose coefficient comes out negative (a cost cannot shrink with more work); the
    intercept (column 0) may stay negative only if nothing else fits. ``scale``: the measured
    times when ``y`` is what is left of them after a known part (a priced sparse call,
    ``model.LatencyModel.fit``), so that the error stays relative to the measurement.

    A feature that does not vary over the grid cannot be told apart from the intercept: it gets
    0 and its cost stays in the intercept. A profiled grid at one token count (the profiler's
    grid for fixed-length micro-batches, ``megatron/launch/profile.default_mixes``) has
    ``tokens`` as such a feature, and a kernel table timed at one length gives its price no
    per-token part."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = 1.0 / np.maximum(y if scale is None else np.asarray(scale, dtype=np.float64), 1e-12)
    # features constant on this grid (zero, or one value for every micro-batch): unidentifiable
    active = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
    while True:
        a = x[:, active] * w[:, None]
        c, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        neg = [j for j, v in zip(active, c) if v < 0 and j != 0]
        if not neg:
            break
        worst = min(neg, key=lambda j: c[active.index(j)])
        active.remove(worst)
    out = np.zeros(x.shape[1])
    out[active] = c
    return out


__all__ = ["fit_nonneg"]
