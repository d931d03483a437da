"""The typed records the kernels take instead of long positional lists: an event graph's links
(``Graph``), the cost tables (``Tables``) and their formula (``Formula``), the descent's
look-ups of a candidate's grid index (``Lookup``) and the ranks a search tries (``Tries``).
numba passes a ``NamedTuple`` of arrays by value and reads its fields by name, so a kernel's
signature says what it reads, not thirty arrays in a row.

Pure numpy; must not import torch, megatron or anything else from this package.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def _f(a) -> np.ndarray:
    return np.require(a, dtype=np.float64, requirements="CW")


def _i(a) -> np.ndarray:
    return np.require(a, dtype=np.int64, requirements="CW")


class Graph(NamedTuple):
    """An event graph as the passes step through it (``sim.pipeline.EventGraph``): per event
    [E] the one before on its rank, the one it waits for, whether that wait crosses ranks,
    and the reverse edges (-1: none); every rank's last event; every unit's forward and
    backward event; the p2p latency on a crossing edge."""

    prev: np.ndarray
    dep: np.ndarray
    cross: np.ndarray
    nxt: np.ndarray
    succ: np.ndarray
    last: np.ndarray
    ev_f: np.ndarray
    ev_b: np.ndarray
    unit_rows: np.ndarray
    p2p: float

    @classmethod
    def of(cls, g, p2p_s: float) -> "Graph":
        """The record of an ``EventGraph`` ``g`` (``links``, ``last``, ``unit_events``,
        ``unit_rows``: each event's row in a [2 x units] table of forward then backward
        seconds)."""
        links, ev = g.links, g.unit_events
        return cls(*(_i(a) for a in (links[0], links[1], links[2], links[3], links[4], g.last,
                                     ev[0], ev[1], g.unit_rows)), float(p2p_s))


class Floors(NamedTuple):
    """What a floor verdict weighs a plan's densities by (``policy.floors.FloorCheck``): per
    unit its weight [units], the stages (unit u's: u mod nv), the weights' total and the
    routed work's, the same per stage [nv], the mean and per-stage floors, and whether a stage
    without work takes its plain mean of densities."""

    w: np.ndarray
    nv: int
    tot: float
    dense: float
    tot_s: np.ndarray
    dense_s: np.ndarray
    mean_floor: float
    stage_floor: float
    plain: bool


class Formula(NamedTuple):
    """The cost tables' formula (``UnitCosts.formula``): a unit's seconds at grid index i are
    (work[mb, i] x per_pair[k, stage] + fixed[k, mb, stage]) x corr[mb, stage] (the factor
    only where ``scaled``), forward (k = 0) and backward (1). Empty: no formula."""

    work: np.ndarray
    per_pair: np.ndarray
    fixed: np.ndarray
    corr: np.ndarray
    scaled: bool

    @classmethod
    def of(cls, formula) -> "Formula":
        if formula is None:
            return NO_FORMULA
        work, per_pair, fixed, corr, scaled = formula
        return cls(_f(work), _f(per_pair), _f(fixed), _f(corr), bool(scaled))


NO_FORMULA = Formula(np.zeros((0, 0)), np.zeros((2, 0)), np.zeros((2, 0, 0)), np.zeros((0, 0)),
                     False)


class Tables(NamedTuple):
    """The cost tables, flat [units x g]: forward, backward and total seconds, and g, the
    grid's length."""

    fwd: np.ndarray
    bwd: np.ndarray
    tot: np.ndarray
    g: int


class Lookup(NamedTuple):
    """How a candidate's grid index is looked up where not given (``kernels.fit.first_fit``):
    per unit its table offset ``u``, seconds ``on``, delta, highest and lowest grid indices;
    per candidate its fraction; the scale. The limit at candidate c is (on + fracs[c] x delta)
    x scale + 1e-15."""

    u: np.ndarray
    on: np.ndarray
    delta: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    fracs: np.ndarray
    scale: float


NO_LOOKUP = Lookup(np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0),
                   np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0), 1.0)


FILL_GRID = 4096
"""water-filling's bisection on log lambda in [-20, 20] visits -20 + 40 k / FILL_GRID only"""
_EXPS: list = []


def fill_exps() -> np.ndarray:
    """exp of every log lambda on water-filling's bisection grid, -20 + 40 k / FILL_GRID (made
    once per process)."""
    if not _EXPS:
        _EXPS.append(np.exp(-20.0 + 40.0 * np.arange(FILL_GRID + 1) / FILL_GRID))
    return _EXPS[0]


class Fill(NamedTuple):
    """Water-filling's search (``policy.dst_moves.GainIndex``): the stages' gain tables laid
    end to end (``flat``), each unit's shift into them and its stage's first entry (arrays
    laid as the kernel's columns), the gains' clip ``low`` / ``high``, and the exps of the
    bisection's grid (``fill_exps``)."""

    flat: np.ndarray
    shift: np.ndarray
    first: np.ndarray
    low: float
    high: float
    exps: np.ndarray

    @classmethod
    def of(cls, flat, shift, first, low: float, high: float) -> "Fill":
        return cls(_f(flat), _f(shift), _i(first), float(low), float(high), fill_exps())


class Tries(NamedTuple):
    """The ranks a first-fit search tries: rank j is column ``ranks[j]`` of the durations, its
    units ``seg[j]:seg[j + 1]`` sit at event rows ``rows_f`` / ``rows_b``, its makespan must be
    <= ``limit[j]``, and ``z0[j]`` is a candidate known to fit (the candidates' count: none)."""

    ranks: np.ndarray
    seg: np.ndarray
    rows_f: np.ndarray
    rows_b: np.ndarray
    limit: np.ndarray
    z0: np.ndarray
