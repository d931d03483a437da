"""What DST's moves are made of (``policy.dst_band``): the anchor of the load units, the units'
table offsets and look-ups on ``UnitCosts``' grid, the sensitivities by unit, and the quality
objective's gain tables (``gain_fill``). The moves themselves (a straggler stage's cut, a
rank's raise into its slack, in sensitivity order or by quality water-filling) are
``kernels.band``'s. Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from ..kernels.records import Fill

FILL_ITERS = 12          # bisection steps on log(lambda) in [-20, 20] (quality water-filling)


def anchor_s(busy_s: np.ndarray, anchor: str) -> float:
    if anchor == "mean":
        return float(busy_s.mean())
    if anchor == "median":
        return float(np.median(busy_s))
    if anchor == "min":
        return float(busy_s.min())
    return float(busy_s.max())


def unit_base(shape, rows: np.ndarray, g: int) -> np.ndarray:
    """[k, m, pp] offsets of the units of DP ranks ``rows`` in a flat [dp, m, pp, g] table
    (flat unit id x g): "units" below always means these offsets."""
    _, m, pp = shape
    return ((rows[:, None, None] * m + np.arange(m)[None, :, None]) * pp
            + np.arange(pp)[None, None, :]) * g


def lookup(a: np.ndarray, units: np.ndarray, idx) -> np.ndarray:
    """a[unit, idx] for a [dp, m, pp, g] table, unit offsets (``unit_base``) and grid indices."""
    return a.reshape(-1).take(units + idx)


def gain_fill(marg: np.ndarray, slots: int, pp: int, vp: int) -> Fill:
    """Quality water-filling's gain tables (``kernels.band.water_fill``) for units laid
    [slots, pp]: per unit the highest grid index whose marginal quality gain ``marg[v, i]``
    ([nv, g], non-increasing in i, +inf at 0) is >= x is found by one search over the stages'
    negated tables laid end to end, each shifted into its own band (``flat``), a unit's key
    shifted into its stage's (virtual stage v = chunk x pp + rank; slot = micro-batch x vp +
    chunk) and its answer less its stage's first entry."""
    nv, g = marg.shape
    neg = -np.asarray(marg, dtype=np.float64)                  # ascending, -inf at 0
    finite = neg[np.isfinite(neg)]
    low = (float(finite.min()) if finite.size else 0.0) - 1.0   # below every entry
    high = max(float(finite.max()) if finite.size else 0.0, 0.0) + 0.5
    width = high - low + 1.0
    flat = (np.clip(neg, low, None) + np.arange(nv)[:, None] * width).reshape(-1)
    stage = (np.arange(slots) % vp)[:, None] * pp + np.arange(pp)[None, :]
    return Fill.of(flat, stage * width, stage * g + 1, low, high)


def broadcast_sensitivity(sensitivity, shape) -> np.ndarray:
    dp, m, pp = shape
    if sensitivity is None:
        return np.zeros(shape)
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.shape == (dp, m):
        s = np.broadcast_to(s[:, :, None], shape)
    if s.shape != shape:
        raise ValueError(f"sensitivity must be [dp, m]={(dp, m)} or [dp, m, pp]={shape}, "
                         f"got {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("sensitivity must be finite")
    return s
