"""The critical-path descent's floor verdicts, compiled (``policy.density_means.FloorCheck``):
a plan's kept work summed in one pass, in an order of its own, with a bound on how far
any order's sum can be from it; a verdict within that bound of a floor is left to the floors'
own sums (-1), so the verdicts are theirs either way (``tests/unit/test_floor_check.py``).
Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .records import Floors

_EPS = float(np.finfo(np.float64).eps)   # the kernels' bounds (numba reads it as a constant)


@jit
def _verdict_of(value, bound, floor):
    # value >= floor as every summation order within ``bound`` of ``value`` decides it (1 or
    # 0), or -1 where the orders may disagree (NaN: -1)
    if value - bound >= floor:
        return 1
    if value + bound < floor:
        return 0
    return -1


@jit
def floors_verdict(grid, idx, floors, sums):
    # ``policy.density_means.FloorCheck._floors``' verdict on the plan at grid indices idx
    # (1, 0; -1: numpy's sums must decide): the kept work grid[idx] x w summed per stage (unit u's
    # stage: u mod nv) and, with ``plain`` (a stage without work: its plain mean), the
    # densities, in an order of their own (``floors``: a ``records.Floors``). Every term is
    # >= 0 (FloorCheck runs this only then), so a sum of n of them in any order is within
    # (n - 1) eps x the sum of the exact one, two orders within twice that, and adding the
    # routed work and dividing by the total round once each. ``sums`` [2 nv]: scratch
    w, nv, tot, dense, tot_s, dense_s, mean_floor, stage_floor, plain = floors
    for k in range(sums.size):
        sums[k] = 0.0
    s = 0
    for u in range(idx.size):
        j = idx[u]
        if j < 0 or j >= grid.size:                 # numpy's take raises: left to it
            return -1
        d = grid[j]
        sums[s] += d * w[u]
        if plain:
            sums[nv + s] += d
        s += 1
        if s == nv:
            s = 0
    kept = 0.0
    for s in range(nv):
        kept += sums[s]
    n = idx.size
    kept += dense
    mean = kept / tot
    got = _verdict_of(mean, 6.0 * n * _EPS * kept / tot + 4.0 * _EPS * mean, mean_floor)
    if got != 1:
        return got
    per = n // nv
    out = 1
    for s in range(nv):
        k_s, t_s = sums[s] + dense_s[s], tot_s[s]
        if not t_s > 0:                             # no work: the plain mean of densities
            k_s, t_s = sums[nv + s], float(per)
        value = k_s / t_s
        got = _verdict_of(value, 6.0 * per * _EPS * k_s / t_s + 4.0 * _EPS * value,
                          stage_floor)
        if got == 0:
            return 0
        if got < 0:
            out = -1
    return out


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    grid, idx, ones = np.array([0.5, 1.0]), np.array([0, 1], dtype=np.int64), np.ones(2)
    floors_verdict(grid, idx, Floors(ones, 2, 2.0, 0.0, ones, np.zeros(2), 0.5, 0.5, True),
                   np.empty(4))
