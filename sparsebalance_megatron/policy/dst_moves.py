"""The vectorised moves DST's plan is made of (``policy.dst``): table look-ups on a density grid.

Every function takes unit index arrays over ``UnitCosts``' grid (``[rows, m * vp, pp]`` for a
batch of DP-rank rows) and returns new grid indices: the anchor of the load units, a straggler
stage's cut (least sensitive micro-batch first), a rank's raise into its slack (most sensitive
first), and the quality objective's water-filling (where density buys the most predicted quality
per second). No step of it simulates the pipeline: ``dst_band.py`` checks every move with the
simulator. Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..kernels.records import Fill
from .grid_search import highest_at_most, level_search

_NO_CAP = np.zeros((1, 1, 1))          # the compiled cut reads no float caps


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


def perm_along_m(order: np.ndarray):
    """Fancy-index tuple that reorders a [k, m, pp] array along m by order [k, m, pp]."""
    k, m, pp = order.shape
    return (np.arange(k)[:, None, None], order, np.arange(pp)[None, None, :])


def highest_index_within(t_grid, units, thr, lo, hi):
    """Per unit: the highest grid index i in [lo, hi] with t(i) <= thr (lo if none); costs are
    non-decreasing in density (``UnitCosts`` makes them so)."""
    return highest_at_most(t_grid, units, thr, lo, hi)


def cut_densities(t_grid, units, cur_i, excess_s, order, i_min):
    """Lower densities until each (rank, stage) sheds ``excess_s`` [k, pp] seconds, taking the
    micro-batches in ``order`` [k, m, pp] (least sensitive first), each at most down to d_min.

    t_grid [dp, m, pp, g] seconds; units [k, m, pp] flat unit ids; cur_i [k, m, pp] grid indices.
    """
    if kernels.enabled():              # one compiled loop, the same numbers
        return kernels.grid.sensitivity_moves(t_grid.reshape(-1), units, cur_i, excess_s,
                                              _NO_CAP, order, i_min, False)
    t_cur = lookup(t_grid, units, cur_i)                        # [k, m, pp]
    save_full = t_cur - lookup(t_grid, units, i_min)
    perm = perm_along_m(order)
    save_sorted = save_full[perm]
    cum_before = np.empty_like(save_full)
    cum_before[perm] = np.cumsum(save_sorted, axis=1) - save_sorted
    need = excess_s[:, None, :] - cum_before                       # seconds still to shed
    active = (need > 0) & (save_full > 0)
    new_i = cur_i.copy()
    new_i[active] = highest_index_within(t_grid, units[active], (t_cur - need)[active],
                                          i_min, cur_i[active])
    return new_i


def raise_densities(t_grid, units, cur_i, slack_s, cap_s, order, i_max):
    """Raise densities while each (rank, stage) stays within ``slack_s`` [k, pp] extra seconds
    and each unit within its own float ``cap_s`` [k, m, pp], micro-batches in ``order`` (most
    sensitive first), each at most up to d_max."""
    if kernels.enabled():              # one compiled loop, the same numbers
        return kernels.grid.sensitivity_moves(t_grid.reshape(-1), units, cur_i, slack_s,
                                              cap_s, order, i_max, True)
    t_cur = lookup(t_grid, units, cur_i)
    gain_full = np.minimum(lookup(t_grid, units, i_max) - t_cur, cap_s)
    perm = perm_along_m(order)
    gain_sorted = gain_full[perm]
    cum_before = np.empty_like(gain_full)
    cum_before[perm] = np.cumsum(gain_sorted, axis=1) - gain_sorted
    room = np.minimum(slack_s[:, None, :] - cum_before, cap_s)
    active = (room > 0) & (gain_full > 0)
    new_i = cur_i.copy()
    new_i[active] = highest_index_within(t_grid, units[active], (t_cur + room)[active],
                                          cur_i[active], i_max)
    return new_i


FILL_ITERS = 12          # bisection steps on log(lambda) in [-20, 20] (quality water-filling)


def water_fill(t_grid, units, gains, b, lo, hi, limit_s):
    """Quality water-filling of every (row, stage): each unit u takes the highest grid index in
    [lo_u, hi_u] whose marginal quality gain per unit of density, ``marg[u, i]`` (non-increasing
    in i: the cost is convex), is still worth its attention seconds, ``>= lambda x b_u``; lambda,
    per (row, stage), is the smallest that keeps the summed unit seconds within ``limit_s``
    [k, pp] (found by bisection on log lambda). So density goes where it buys the most quality
    per second: cuts fall first on units that save much time for little quality, raises go
    first to low densities on cheap units, and no unit is starved while another is spared.

    gains: a ``GainIndex`` (per unit the highest grid index whose marginal gain is >= x);
    units, b (attention seconds per unit of density), lo, hi (grid index bounds): [k, slots,
    pp]. Where every unit fits at hi, that is the answer; where even the largest lambda (every
    unit at lo) exceeds the limit, every unit is at lo. Only the (row, stage) pairs that do not
    fit at hi are searched, as [slots, pairs] arrays (each pair's seconds summed over its
    micro-batches in order, as a [k, slots, pp] sum over slots is)."""
    flat = t_grid.reshape(-1)
    out = hi.copy()
    rows, stages = np.nonzero(~(flat.take(units + hi).sum(axis=1) <= limit_s))
    if not rows.size:
        return out
    u, b, lo, hi = (np.ascontiguousarray(a[rows, :, stages].T) for a in (units, b, lo, hi))
    limit = limit_s[rows, stages]                                   # [n]
    if kernels.enabled() and rows.size >= 2:    # the whole search per column, compiled
        shift, first = gains.columns(stages)
        out[rows, :, stages] = kernels.grid.water_fill(
            flat, u, b, lo, hi, limit, Fill.of(gains.flat, shift, first, gains.low, gains.high),
            FILL_ITERS).T
        return out
    at = gains.for_stages(stages, b, lo, hi)     # at(log lambda): each unit's grid index

    def total(idx):
        return flat.take(u + idx).sum(axis=0)

    lo_l, hi_l = np.full(rows.size, -20.0), np.full(rows.size, 20.0)
    for _ in range(FILL_ITERS):
        mid = (lo_l + hi_l) / 2
        fits = total(at(mid)) <= limit
        hi_l = np.where(fits, mid, hi_l)
        lo_l = np.where(fits, lo_l, mid)
    # A piecewise-linear cost has equal marginal gains along a segment, so units cross it
    # together at one lambda; between the last lambda that does not fit and the first that does,
    # the units that move stop at one common density level, the highest that fits.
    fit, over = at(hi_l), at(lo_l)

    def level(L):
        return np.maximum(fit, np.minimum(over, L))

    L = level_search(fit.min(axis=0), over.max(axis=0), lambda L: total(level(L)) <= limit)
    out[rows, :, stages] = level(L).T
    return out


class GainIndex:
    """Per unit, the highest grid index whose marginal quality gain ``marg[v, i]`` ([nv, g],
    non-increasing in i, +inf at 0) is >= x, where a unit's virtual stage is v = chunk x pp +
    rank (slot = micro-batch x vp + chunk). One searchsorted over the stages' tables laid end
    to end, each shifted into its own band (a call per stage costs more than the search)."""

    def __init__(self, marg: np.ndarray, slots: int, pp: int, vp: int):
        nv, g = marg.shape
        neg = -np.asarray(marg, dtype=np.float64)                  # ascending, -inf at 0
        finite = neg[np.isfinite(neg)]
        self.low = (float(finite.min()) if finite.size else 0.0) - 1.0   # below every entry
        self.high = max(float(finite.max()) if finite.size else 0.0, 0.0) + 0.5
        self.width, self.g = self.high - self.low + 1.0, g
        self.flat = (np.clip(neg, self.low, None)
                     + np.arange(nv)[:, None] * self.width).reshape(-1)
        self.stage = (np.arange(slots) % vp)[:, None] * pp + np.arange(pp)[None, :]

    def columns(self, ranks: np.ndarray) -> tuple:
        """(shift, first entry) [slots, n] of units of pipeline rank ``ranks[j]`` in column j:
        where their stage's table sits in ``flat``."""
        stage = self.stage[:, ranks]
        return stage * self.width, stage * self.g + 1

    def for_stages(self, ranks: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray):
        """at(log_lam) -> [slots, n]: per unit clip(best_index(exp(log_lam) x b), lo, hi), for
        log_lam [n] (one per column), b, lo, hi [slots, n]: column j units of pipeline rank
        ``ranks[j]`` (one compiled loop where ``kernels`` run: the same numbers)."""
        shift, first = self.columns(ranks)
        low, high = self.low, self.high

        if kernels.enabled():
            def at(log_lam):
                return kernels.grid.fill_index(self.flat, np.exp(log_lam), b, shift, first, lo, hi,
                                           low, high)
            return at

        def at(log_lam):
            q = np.negative(np.exp(log_lam) * b)    # clip(-x, low, high) + shift, in place
            np.maximum(q, low, out=q)
            np.minimum(q, high, out=q)
            q += shift
            i = np.searchsorted(self.flat, q, side="right")
            i -= first
            np.maximum(i, lo, out=i)
            return np.minimum(i, hi, out=i)

        return at


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
