"""Searches along the density grid, shared by DST's cuts and raises (``dst_moves``) and the
critical-path descent: ``level_search`` (a vectorised binary search on a monotone predicate) and
``highest_at_most`` (the highest grid index whose cost fits a limit, as a binary lifting over
every element at once; compiled in ``kernels.grid`` where numba runs).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .. import kernels


def level_search(lo, hi, ok) -> np.ndarray:
    """Elementwise: the largest level L in [lo, hi] with ok(L) (lo if none); ok must be
    monotone (true up to some level). Vectorised binary search over grid indices, shared by DST's
    cut/raise and the critical-path descent."""
    lo = np.array(lo, dtype=np.int64)
    hi = np.array(hi, dtype=np.int64)
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi + 1) // 2
        fits = ok(mid)
        lo = np.where(open_ & fits, mid, lo)
        hi = np.where(open_ & ~fits, mid - 1, hi)


def highest_at_most(table: np.ndarray, units, limit, lo, hi) -> np.ndarray:
    """Elementwise: the highest grid index L in [lo, hi] with ``table[unit, L] <= limit`` (lo if
    none), for a table whose rows are non-decreasing along the grid (``UnitCosts`` makes its
    costs so). ``units``: flat offsets of the units' rows (unit id x g) in ``table.reshape(-1)``;
    ``units``, ``limit``, ``lo``, ``hi`` broadcast to one shape, the result's.

    ``level_search`` with the predicate a table look-up, as a binary lifting over every element
    at once: steps of 2^j down to 1 from lo - 1, each kept where the row at the probe (clamped
    to hi) still fits; one gather per step, no per-element bookkeeping."""
    flat = table.reshape(-1)
    if kernels.enabled():
        rows = _highest_rows(flat, units, limit, lo, hi)
        if rows is not None:
            return rows
    units, limit, lo, hi = np.broadcast_arrays(units, limit, lo, hi)
    shape = units.shape
    first = (units + lo).ravel()                                   # flat index of lo
    last = (units + hi).ravel()
    limit = limit.ravel()
    pos = first - 1
    step = _lift_step(first, last)
    if kernels.enabled() and pos.size:      # the same steps, one compiled loop: one row
        return (kernels.grid.highest_rows(flat, first, last, limit.reshape(1, -1), step)[0]
                - units.ravel()).reshape(shape)
    while step:
        probe = np.minimum(pos + step, last)
        np.add(pos, step, out=pos, where=flat.take(probe) <= limit)
        step >>= 1
    np.minimum(pos, last, out=pos)                                 # past hi: hi fits
    np.maximum(pos, first, out=pos)                                # none fits: lo
    return (pos - units.ravel()).reshape(shape)


def _highest_rows(flat, units, limit, lo, hi):
    """``highest_at_most``'s common case in one compiled loop without broadcasting: limits
    [k, n] (a row per candidate) over n units, their offsets and bounds [n] or scalars; the
    same step schedule (the largest hi - lo of the n units is that of the k x n elements).
    None for any other shape."""
    limit = np.asarray(limit)
    units, lo, hi = (np.asarray(a) for a in (units, lo, hi))
    if limit.ndim != 2 or not limit.size or limit.dtype != np.float64 \
            or units.dtype != np.int64 or any(
                a.ndim > 1 or (a.ndim == 1 and a.shape[0] != limit.shape[1])
                or a.dtype.kind not in "iu" for a in (units, lo, hi)):
        return None
    n = limit.shape[1]
    units = np.broadcast_to(units, (n,))
    first = np.broadcast_to(units + lo, (n,))
    last = np.broadcast_to(units + hi, (n,))
    return kernels.grid.highest_rows(flat, first, last, limit, _lift_step(first, last)) - units


def _lift_step(first: np.ndarray, last: np.ndarray) -> int:
    """The binary lifting's first step: the largest power of two <= the widest [first, last]
    span (0 for none)."""
    span = int((last - first).max()) + 1 if first.size else 0
    return 1 << (span.bit_length() - 1) if span > 0 else 0
