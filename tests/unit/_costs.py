"""Unit costs of a closed form, for tests that need costs without a latency model."""

from __future__ import annotations

import numpy as np

from sparsebalance_megatron.policy.costs import UnitCosts


def affine_costs(densities, fixed_s, attn_s_dense) -> UnitCosts:
    """t(d) = fixed_s + d * attn_s_dense per unit ([dp, m, pp] each), a third of it forward
    (backward costs about twice the forward); attention work ``attn_s_dense``."""
    g = np.asarray(densities, dtype=np.float64)
    fixed = np.asarray(fixed_s, dtype=np.float64)
    attn = np.asarray(attn_s_dense, dtype=np.float64)
    assert fixed.shape == attn.shape and fixed.ndim == 3, (fixed.shape, attn.shape)
    t = fixed[..., None] + attn[..., None] * g                  # [dp, m, pp, g]
    fwd_fraction = 1.0 / 3.0
    return UnitCosts(g, fwd_fraction * t, (1.0 - fwd_fraction) * t, attn)
