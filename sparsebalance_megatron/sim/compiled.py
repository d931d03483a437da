"""Compiled forms of the planner's innermost loops, when numba is installed (``pip install
sparsebalance-megatron[fast]``; NGC's PyTorch containers ship it), and the loader the other
kernels (``policy.grid_kernels``) compile with.

The planner steps through a step's event graph hundreds of times per draft (the 1F1B simulator,
the float pass, the critical-path descent's candidates). In numpy those are a few calls per
event, and at the planner's sizes (a few hundred events, tens to hundreds of columns) the calls
are most of the time. Here each is one compiled loop:

- ``earliest_finish``: ``max(dep + p2p, prev) + duration`` per event and column, in event order;
- ``latest_finish``: ``min(deadline, next's start, successor's start - p2p)`` and its start;
- ``unit_floats``: the latest finishes and every unit's smaller float in one pass;
- the descent's search for the first cut or raise fraction that fits: ``sim.fit_kernels``.

Every kernel does the numpy path's floating point operations, on the same operands, in the same
order (maxima, minima, one add or subtract, comparisons: each exact given its operands), and
propagates NaN as ``np.maximum`` / ``np.minimum`` do, so the results are the numpy path's bit for
bit (``tests/unit/test_compiled_kernels.py`` compares them) and a plan does not depend on
whether numba is installed. Without numba (or with ``SB_PLANNER_JIT=0``) ``enabled()`` is
False and the callers run their numpy paths. Kernels compile on first use and are cached on disk
(numba's ``cache=True``); they release the GIL.

Pure numpy and numba; must not import torch, megatron or anything else from this package.
"""

from __future__ import annotations

import os

import numpy as np

_STATE: dict = {}
_KERNELS: dict = {}


def enabled() -> bool:
    """Whether the compiled kernels run: numba importable and not turned off by
    ``SB_PLANNER_JIT=0``. numba is imported on the first call, not with this module (it takes
    a few tenths of a second that a run without a planner need not pay)."""
    on = _STATE.get("on")
    if on is None:
        on = _STATE["on"] = _load()
    return on


def disable(why: str) -> None:
    """Turn the kernels off in this process (the numpy paths run: the same plans, more CPU),
    with one warning saying ``why``."""
    import warnings

    if _STATE.get("on"):
        warnings.warn(f"sparsebalance: the planner's compiled kernels are off ({why}); its "
                      f"numpy paths run instead (the same plans, more CPU)", stacklevel=2)
    _STATE["on"] = False


def _load() -> bool:
    if os.environ.get("SB_PLANNER_JIT", "1").strip() == "0":
        return False
    try:
        import numba
    except ImportError:          # the numpy paths run instead: the same numbers, slower
        return False
    _STATE["numba"] = numba
    return True


def kernel(fn, calls=()):
    """The compiled form of ``fn``, a module-level function written in numba's subset (compiled
    on first use, cached on disk where numba finds a writable place, else compiled once per
    process). ``calls``: the kernels ``fn`` calls, directly or through one another, compiled
    first and bound in place of the plain functions in ``fn``'s module and in each one's own
    module, so that every kernel resolves the compiled ones (whichever compiles first)."""
    key = (fn.__module__, fn.__qualname__)
    k = _KERNELS.get(key)
    if k is None:
        for dep in calls:
            fn.__globals__[dep.__name__] = kernel(dep)
        for dep in calls:       # a kernel of another module calls its own module's names:
            names = getattr(dep, "py_func", dep).__globals__    # bound there too, whichever
            for other in calls:                                  # kernel compiles first
                plain = getattr(other, "py_func", other)
                if names.get(plain.__name__) is plain:
                    names[plain.__name__] = kernel(plain)
        numba = _STATE["numba"]
        plain = getattr(fn, "py_func", fn)
        try:
            k = numba.njit(cache=True, nogil=True)(plain)
        except RuntimeError:     # no writable cache directory: compile in this process only
            k = numba.njit(nogil=True)(plain)
        _KERNELS[key] = k
    return k


def _start(vd, vpr, d, pr, add, p):
    # an event's start: max(its dependency's finish (+ p2p when it crosses ranks), its rank's
    # previous event's finish), as np.maximum (NaN wins); 0 with neither (-1: none)
    if d >= 0:
        v = vd + p if add else vd
        if pr >= 0 and (vpr > v or vpr != vpr):
            v = vpr
        return v
    return vpr if pr >= 0 else 0.0


def _earliest_finish(prev, dep, cross, dur, p, start, record):
    n, cols = dur.shape
    end = np.empty((n, cols))
    for e in range(n):
        d, pr = dep[e], prev[e]
        add = cross[e] != 0 and p != 0.0
        for j in range(cols):
            v = _start(end[d, j] if d >= 0 else 0.0, end[pr, j] if pr >= 0 else 0.0, d, pr,
                       add, p)
            if record:
                start[e, j] = v
            end[e, j] = v + dur[e, j]
    return end


def _latest_finish(nxt, succ, cross, dur, deadline, p):
    n, cols = dur.shape
    lf = np.empty((n, cols))
    ls = np.empty((n, cols))
    for e in range(n - 1, -1, -1):
        j, k = nxt[e], succ[e]
        sub = k >= 0 and cross[k] != 0 and p != 0.0
        for c in range(cols):
            v = deadline[c]
            if j >= 0:
                x = ls[j, c]
                if x < v or x != x:              # np.minimum: NaN wins
                    v = x
            if k >= 0:
                x = ls[k, c] - p if sub else ls[k, c]
                if x < v or x != x:
                    v = x
            lf[e, c] = v
            ls[e, c] = v - dur[e, c]
    return lf


def _unit_floats(nxt, succ, cross, dur, ef, deadline, p, ev_f, ev_b):
    # every unit's smaller float, min(lf - ef) of its forward and backward events, as
    # np.minimum gives it (NaN wins), [cols, units]
    lf = _latest_finish(nxt, succ, cross, dur, deadline, p)
    cols, n = dur.shape[1], ev_f.size
    out = np.empty((cols, n))
    for u in range(n):
        a, b = ev_f[u], ev_b[u]
        for c in range(cols):
            x = lf[a, c] - ef[a, c]
            y = lf[b, c] - ef[b, c]
            out[c, u] = x if (x < y or x != x) else y
    return out


def _c(a, dtype):
    """``a`` as a C-contiguous, writable array of ``dtype`` (numba compiles a read-only array,
    e.g. a ``broadcast_to`` view, as another type: one signature per kernel, the warm-up's).
    An array that already is one is returned as it is (most are: np.require's checks cost
    more than many kernels' work)."""
    if type(a) is np.ndarray and a.dtype == dtype:
        flags = a.flags
        if flags.c_contiguous and flags.writeable:
            return a
    return np.require(a, dtype=dtype, requirements="CW")


_NO_START = np.empty((0, 0))
def earliest_finish(links: np.ndarray, dur: np.ndarray, p2p_s: float, start=None) -> np.ndarray:
    """[E, cols] earliest finishes of an event graph (``links``: [5, E] int64 rows prev, dep,
    cross, next, successor, ``EventGraph.links``) with durations ``dur`` [E, cols]; ``start``
    ([E, cols], optional) receives every event's start."""
    d = _c(dur, np.float64)
    rec = start is not None
    buf = np.empty(d.shape) if rec else _NO_START
    run = kernel(_earliest_finish, calls=(_start,))
    end = run(links[0], links[1], links[2], d, float(p2p_s), buf, rec)
    if rec:
        start[...] = buf
    return end


def latest_finish(links: np.ndarray, dur: np.ndarray, deadline, p2p_s: float) -> np.ndarray:
    """[E, cols] latest finishes with every rank's last event due at ``deadline`` ([cols] or a
    scalar), as ``policy.slack.latest_finish``."""
    d = _c(dur, np.float64)
    dl = _c(np.broadcast_to(np.asarray(deadline, dtype=np.float64), (d.shape[1],)), np.float64)
    return kernel(_latest_finish)(links[3], links[4], links[2], d, dl, float(p2p_s))


def unit_floats(links: np.ndarray, dur: np.ndarray, ef: np.ndarray, deadline, p2p_s: float,
                unit_events: np.ndarray) -> np.ndarray:
    """[cols, units] the smaller of every unit's forward and backward float, lf - ef, with
    every rank's last event due at ``deadline`` ([cols] or a scalar): ``latest_finish`` and
    ``policy.slack.unit_floats_from``'s gather in one call (``unit_events``: [2, units] the
    event rows of each unit's forward and backward, ``EventGraph.unit_events``)."""
    d = _c(dur, np.float64)
    dl = _c(np.broadcast_to(np.asarray(deadline, dtype=np.float64), (d.shape[1],)), np.float64)
    run = kernel(_unit_floats, calls=(_latest_finish,))
    return run(links[3], links[4], links[2], d, _c(ef, np.float64), dl, float(p2p_s),
               _c(unit_events[0], np.int64), _c(unit_events[1], np.int64))


def warm_up() -> None:
    """Compile this module's kernels (or load them from numba's disk cache) with the argument
    types a draft passes, on a two-event graph: the planner process does it before it says it
    is ready, so a run pays it at start-up, not in its first step's draft. Nothing without
    numba."""
    if not enabled():
        return
    i64 = np.int64
    links = np.array([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], dtype=i64)  # e0 -> e1
    dur = np.ones((2, 2))
    earliest_finish(links, dur, 0.0)
    earliest_finish(links, dur, 0.0, np.empty((2, 2)))
    latest_finish(links, dur, np.ones(2), 0.0)
    unit_floats(links, dur, dur, np.ones(2), 0.0, np.array([[0], [1]], dtype=i64))
