"""The density grid's compiled rules: the grid search every DST move makes
(``highest_within``: the highest grid index whose seconds fit under a limit, ``fit_limit``) and
a unit's seconds at a grid index (``unit_seconds``: the cost tables' formula, which
``unit_tables`` tabulates for ``UnitCosts.from_latency``).

A unit's seconds along the grid come from its source: its row of the flat tables (``row_of``:
the seconds at grid index i at its offset + i), or the tables' formula where they carry one
(its micro-batch's work row and its stage's factors: a few small arrays that stay in the cache
where the tables do not; the descent's). Both give the same numbers, non-decreasing along the
grid (``UnitCosts`` makes them so).

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import jit, slack

fit_limit = jit(slack.fit_limit, inline=True)      # the float slack, compiled (``slack``)


@jit(inline=True)
def row_of(row):
    """The source of a unit whose seconds are read from the tables' row at offset ``row``."""
    return row, -1, 0.0, 0.0, 0.0, 0.0, 0.0, False


@jit(inline=True)
def source(tables, q):
    """The source of flat unit ``q``'s seconds in ``tables`` (``records.Tables``): computed by
    their formula as micro-batch q // nv on stage q % nv where they carry one, else read
    (``row_of``)."""
    row, nv = q * tables.g, tables.per_pair.shape[1]
    if tables.work.shape[0] > 0:
        mb, s = q // nv, q % nv
        return (row, mb, tables.per_pair[0, s], tables.per_pair[1, s], tables.fixed[0, mb, s],
                tables.fixed[1, mb, s], tables.corr[mb, s], tables.scaled)
    return row_of(row)


@jit(inline=True)
def seconds(fwd, bwd, work, src, i):
    """A unit's (forward, backward) seconds at grid index i from its source ``src``."""
    row, mb, p0, p1, f0, f1, c, scaled = src
    if mb >= 0:
        return unit_seconds(work[mb, i], p0, p1, f0, f1, c, scaled)
    return fwd[row + i], bwd[row + i]


@jit(inline=True)
def total(tot, work, src, i):
    """A unit's total seconds at grid index i from its source ``src``: (its row's offset in
    the flat totals ``tot``, micro-batch (< 0: read ``tot``), per pair forward and backward,
    fixed forward and backward, correction, scaled), the formula's on ``work``."""
    if src[1] >= 0:
        v, x = seconds(tot, tot, work, src, i)
        return v + x
    return tot[src[0] + i]


@jit
def highest_within(tot, work, src, lo, hi, lim):
    """The highest grid index i in [lo, hi] whose total seconds (``total``: non-decreasing in
    i) are <= ``lim`` (``lo`` if none, NaN fitting nowhere): down from ``hi`` by doubling steps
    (a move mostly goes a few grid steps), then bisection."""
    if total(tot, work, src, hi) <= lim:
        return hi
    top, step = hi, 1                               # total(top) > lim
    while top - step > lo and not total(tot, work, src, top - step) <= lim:
        top -= step
        step *= 2
    a = max(top - step, lo)
    if not total(tot, work, src, a) <= lim:
        return lo
    while top - a > 1:                              # total(a) <= lim < total(top)
        mid = (a + top) >> 1
        if total(tot, work, src, mid) <= lim:
            a = mid
        else:
            top = mid
    return a


@jit
def unit_seconds(w, p0, p1, f0, f1, c, scaled):
    """(forward, backward) seconds of a unit whose attention work is w: (w x per pair +
    fixed) x correction (the factor only where ``scaled``)."""
    v = w * p0 + f0
    x = w * p1 + f1
    if scaled:
        v = v * c
        x = x * c
    return v, x


@jit
def unit_tables(work, per_pair, fixed, corr, scaled, out, tot):
    """``UnitCosts.from_latency``'s tables: ``out`` [2, n, stages, g] (forward, backward) of
    every micro-batch's work [n, g] on every stage (``unit_seconds``), and ``tot`` [n, stages,
    g] = forward + backward."""
    n, pp, g = out.shape[1:]
    for i in range(n):
        for s in range(pp):
            for j in range(g):
                v, x = unit_seconds(work[i, j], per_pair[0, s], per_pair[1, s], fixed[0, i, s],
                                    fixed[1, i, s], corr[i, s], scaled)
                out[0, i, s, j] = v
                out[1, i, s, j] = x
                tot[i, s, j] = v + x


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    from .records import SAMPLE_TABLES

    highest_within(SAMPLE_TABLES.tot, SAMPLE_TABLES.work, row_of(0), 0, 1, 1.5)
    unit_tables(np.ones((1, 2)), np.ones((2, 1)), np.ones((2, 1, 1)), np.ones((1, 1)), True,
                np.empty((2, 1, 1, 2)), np.empty((1, 1, 2)))
