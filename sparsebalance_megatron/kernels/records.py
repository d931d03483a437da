"""The typed records the kernels take instead of long positional lists: an event graph
(``Graph``), the cost tables and their formula (``Tables``), water-filling's gain tables
(``Fill``); and the inputs the warm-ups compile with (``SAMPLE_GRAPH``, ``SAMPLE_TABLES``).
numba passes a ``NamedTuple`` of arrays by value and reads its fields by name, so a kernel's
signature says what it reads, not thirty arrays in a row.

Pure numpy; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import f64, i64


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
    p2p: float

    @classmethod
    def of(cls, links, last, unit_events, p2p_s: float = 0.0) -> "Graph":
        """The record of an event graph's ``links`` ([5, E]: prev, dep, cross, next,
        successor), ``last`` [ranks] and ``unit_events`` [2, units] (forward, backward)."""
        return cls(*(i64(a) for a in (*links, last, *unit_events)), float(p2p_s))


class Tables(NamedTuple):
    """The cost tables, flat [units x g]: forward, backward and total seconds, and g, the
    grid's length; and their formula where the costs carry one (``UnitCosts.formula``;
    ``kernels.grid.unit_seconds``): unit (micro-batch mb, stage s)'s seconds at grid index i
    are (work[mb, i] x per_pair[k, s] + fixed[k, mb, s]) x corr[mb, s] (the factor only where
    ``scaled``), forward (k = 0) and backward (1); ``work`` without rows: none."""

    fwd: np.ndarray
    bwd: np.ndarray
    tot: np.ndarray
    g: int
    work: np.ndarray
    per_pair: np.ndarray
    fixed: np.ndarray
    corr: np.ndarray
    scaled: bool

    @classmethod
    def of(cls, fwd, bwd, tot, formula=None) -> "Tables":
        """The record of tables [..., g] and their formula (work, per_pair, fixed, corr,
        scaled), or None."""
        work, per_pair, fixed, corr, scaled = formula if formula is not None else (
            np.zeros((0, 0)), np.zeros((2, 1)), np.zeros((2, 0, 1)), np.zeros((0, 1)), False)
        return cls(f64(fwd.reshape(-1)), f64(bwd.reshape(-1)), f64(tot.reshape(-1)),
                   int(tot.shape[-1]), f64(work), f64(per_pair), f64(fixed), f64(corr),
                   bool(scaled))


def unit_offsets(shape, g: int) -> np.ndarray:
    """Every unit's offset in flat tables [units x g] (``Tables``) laid out as ``shape``
    (flat unit id x g): add a grid index to read a unit's seconds there."""
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * int(g)


FILL_GRID = 4096
"""water-filling's bisection on log lambda in [-20, 20] visits -20 + 40 k / FILL_GRID only"""
FILL_EXPS = np.exp(-20.0 + 40.0 * np.arange(FILL_GRID + 1) / FILL_GRID)
"""exp of every log lambda on that grid"""


class Fill(NamedTuple):
    """Water-filling's search (``policy.dst_band.gain_fill``): the stages' gain tables laid
    end to end (``flat``), each unit's shift into them and its stage's first entry, the gains'
    clip ``low`` / ``high``, and the exps of the bisection's grid (``FILL_EXPS``)."""

    flat: np.ndarray
    shift: np.ndarray
    first: np.ndarray
    low: float
    high: float
    exps: np.ndarray

    @classmethod
    def of(cls, flat, shift, first, low: float, high: float) -> "Fill":
        return cls(f64(flat), f64(shift), i64(first), float(low), float(high), FILL_EXPS)


NO_START = np.empty((0, 0))
"""``graph.earliest_finish``'s ``start`` where the starts are not kept"""


# the inputs the warm-ups compile with (``kernels.warm_up``): a one-unit graph (its forward,
# then its backward, on one rank) and its cost tables on a two-point grid
SAMPLE_GRAPH = Graph.of([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], [1], [[0], [1]])
SAMPLE_TABLES = Tables.of(np.ones(2), np.ones(2), np.full(2, 2.0))
