"""Compiled forms of the planner's innermost loops, when numba is installed (``pip install
sparsebalance-megatron[fast]``; NGC's PyTorch containers ship it), and the loader the other
kernels (``policy.grid_kernels``) compile with.

The planner steps through a step's event graph hundreds of times per draft (the 1F1B simulator,
the float pass, the critical-path descent's candidates). In numpy those are a few calls per
event, and at the planner's sizes (a few hundred events, tens to hundreds of columns) the calls
are most of the time. Here each is one compiled loop:

- ``earliest_finish``: ``max(dep + p2p, prev) + duration`` per event and column, in event order;
- ``latest_finish``: ``min(deadline, next's start, successor's start - p2p)`` and its start;
- ``first_fit``: per DP rank, the first of the descent's candidates (cut or raise fractions)
  whose makespan fits, by a binary search that simulates a few columns instead of all of them
  (the makespans never rise from one candidate to the next, so the first is the same).

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
    process). ``calls``: the kernels ``fn`` calls, compiled first and bound in their module
    in place of the plain functions, so that ``fn`` resolves the compiled ones."""
    key = (fn.__module__, fn.__qualname__)
    k = _KERNELS.get(key)
    if k is None:
        for dep in calls:
            fn.__globals__[dep.__name__] = kernel(dep)
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


def _lift(tot, first, last, lim):
    # highest position in [first, last] with tot <= lim (first if none): ``tot`` is
    # UnitCosts.total_s, whose rows are non-decreasing (UnitCosts makes them so), so the first
    # from the top that fits is the one highest_at_most's lifting finds; a cut mostly moves a
    # few grid steps, so walking down beats the lifting's scattered probes
    pos = last
    while pos > first and not tot[pos] <= lim:
        pos -= 1
    return pos


def _column(prev, dep, cross, last, p, dur, col, lo, hi, rows_f, rows_b, fwd, bwd, tot, at,
            c, buf, end, fresh, lazy_u, lazy_on, lazy_delta, lazy_hi, lazy_lo, fracs, scale):
    # column ``col`` of dur with units lo:hi at their candidate c, simulated into buf / end
    # (``fresh``: buf holds another column; a candidate rewrites only its units' rows, so a
    # rank's tries copy its column once); a candidate not given (at < 0) is looked up: the
    # unit's seconds moved by fracs[c] x its delta (a cut: minus its cuttable time; a raise:
    # its float)
    n = dur.shape[0]
    if fresh:
        for e in range(n):
            buf[e] = dur[e, col]
    for u in range(lo, hi):
        a = at[c, u]
        if a < 0:
            lim = (lazy_on[u] + fracs[c] * lazy_delta[u]) * scale + 1e-15
            top = lazy_u[u] + lazy_hi[u]         # an earlier candidate's bounds this one's
            for c2 in range(c - 1, -1, -1):
                if at[c2, u] >= 0:
                    top = at[c2, u]
                    break
            a = _lift(tot, lazy_u[u] + lazy_lo[u], top, lim)
            at[c, u] = a
        buf[rows_f[u]] = fwd[a]
        buf[rows_b[u]] = bwd[a]
    for e in range(n):
        d, pr = dep[e], prev[e]
        end[e] = _start(end[d] if d >= 0 else 0.0, end[pr] if pr >= 0 else 0.0, d, pr,
                        cross[e] != 0 and p != 0.0, p) + buf[e]
    mk = end[last[0]]
    for i in range(1, last.size):                # np.max over the ranks' last events
        x = end[last[i]]
        if x > mk or x != x:
            mk = x
    return mk


def _keep(buf, end, dur_out, ef_out, j):
    # a simulated column's durations and finishes into column j of the outputs
    for e in range(buf.size):
        dur_out[e, j] = buf[e]
        ef_out[e, j] = end[e]


def _first_fit(prev, dep, cross, last, p, dur, ranks, seg, rows_f, rows_b, fwd, bwd, tot,
               at, limit, dur_out, ef_out, lazy_u, lazy_on, lazy_delta, lazy_hi, lazy_lo,
               fracs, scale, probe_first):
    k, r = at.shape[0], ranks.size
    n = dur.shape[0]
    fits = np.empty(r, dtype=np.bool_)
    pick = np.empty(r, dtype=np.int64)
    mk = np.empty(r)
    buf, end = np.empty(n), np.empty(n)
    for j in range(r):
        # makespans fall with c: every candidate below a is over, every one from z fits; the
        # first tried is the middle, or candidate 0 with probe_first (where it usually fits)
        a, z, mid, fresh = 0, k, 0 if probe_first else -1, True
        while a < z:
            if mid < 0:
                mid = (a + z) >> 1
            t = _column(prev, dep, cross, last, p, dur, ranks[j], seg[j], seg[j + 1], rows_f,
                        rows_b, fwd, bwd, tot, at, mid, buf, end, fresh, lazy_u, lazy_on,
                        lazy_delta, lazy_hi, lazy_lo, fracs, scale)
            fresh = False
            if t <= limit[j]:                    # the last that fits is the first that fits
                z = mid
                mk[j] = t
                _keep(buf, end, dur_out, ef_out, j)
            else:
                a = mid + 1
            mid = -1
        fits[j] = a < k
        if a >= k:                               # none fits: the first, as np.argmax gives
            a = 0
            mk[j] = _column(prev, dep, cross, last, p, dur, ranks[j], seg[j], seg[j + 1],
                            rows_f, rows_b, fwd, bwd, tot, at, 0, buf, end, fresh, lazy_u,
                            lazy_on, lazy_delta, lazy_hi, lazy_lo, fracs, scale)
            _keep(buf, end, dur_out, ef_out, j)
        pick[j] = a
    return fits, pick, mk


def _c(a, dtype):
    """``a`` as a C-contiguous, writable array of ``dtype`` (numba compiles a read-only array,
    e.g. a ``broadcast_to`` view, as another type: one signature per kernel, the warm-up's)."""
    return np.require(a, dtype=dtype, requirements="CW")


_NO_START = np.empty((0, 0))
_NO_CUTS = (np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0),
            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0),
            1.0)                                 # first_fit, every candidate given


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


def first_fit(links: np.ndarray, last: np.ndarray, dur: np.ndarray, p2p_s: float,
              ranks: np.ndarray, seg: np.ndarray, rows_f: np.ndarray, rows_b: np.ndarray,
              fwd: np.ndarray, bwd: np.ndarray, at: np.ndarray, limit: np.ndarray,
              lazy: tuple = None, probe_first: bool = False) -> tuple:
    """Per DP rank ``ranks[j]`` (a column of ``dur`` [E, dp]), the first candidate c of ``at``
    [k, n] whose makespan is <= ``limit[j]``, the makespans falling with c (a binary search:
    a few simulated columns, not k): the rank's units ``seg[j]:seg[j + 1]`` take their
    durations ``fwd[at[c]]`` / ``bwd[at[c]]`` at event rows ``rows_f`` / ``rows_b``. Returns
    (fits [r], pick [r] (0 where none fits), makespan [r], durations and earliest finishes
    [E, r] of each rank's pick), what simulating every candidate and taking np.argmax gives.

    ``lazy`` (optional): (the cost table's totals, fwd + bwd (``UnitCosts.total_s``), flat
    like ``fwd``; unit offsets [n], unit seconds t [n], deltas [n], highest grid indices [n],
    lowest grid indices [n], fractions [k], scale): an entry of ``at`` < 0 (int64, written in
    place) is then looked up when its candidate is tried, as the critical-path descent's cut
    (delta: t at the lowest index less t) or raise (delta: the unit's float): the highest grid
    index in [lowest, highest] whose total is <= (t + fraction x delta) x scale + 1e-15
    (``highest_at_most``; the tables are non-decreasing along the grid), searched down from an
    earlier candidate's where one is known (the fractions make the limits fall with c).
    ``probe_first``: try the first candidate alone before the search (where it usually fits:
    one simulated column instead of a search's three); the same answer."""
    d = _c(dur, np.float64)
    r = ranks.size
    dur_out, ef_out = np.empty((d.shape[0], r)), np.empty((d.shape[0], r))
    tot, u, on, delta, hi, lo, fracs, scale = _NO_CUTS if lazy is None else lazy
    if at.dtype != np.int64 or not at.flags.c_contiguous:
        raise ValueError(f"first_fit: at is {at.dtype}, C-contiguous {at.flags.c_contiguous}: "
                         f"expected a C-contiguous int64 array (it is written in place)")
    kernel(_column, calls=(_lift, _start))
    fit = kernel(_first_fit, calls=(_column, _keep))
    fits, pick, mk = fit(links[0], links[1], links[2], _c(last, np.int64), float(p2p_s), d,
                         _c(ranks, np.int64), _c(seg, np.int64), _c(rows_f, np.int64),
                         _c(rows_b, np.int64), _c(fwd, np.float64), _c(bwd, np.float64),
                         _c(tot, np.float64), at, _c(limit, np.float64), dur_out, ef_out,
                         _c(u, np.int64), _c(on, np.float64), _c(delta, np.float64),
                         _c(hi, np.int64), _c(lo, np.int64), _c(fracs, np.float64),
                         float(scale),
                         bool(probe_first))
    return fits, pick, mk, dur_out, ef_out


def warm_up() -> None:
    """Compile this module's kernels (or load them from numba's disk cache) with the argument
    types a draft passes, on a two-event graph: the planner process does it before it says it
    is ready, so a run pays it at start-up, not in its first step's draft. Nothing without
    numba."""
    if not enabled():
        return
    i64 = np.int64
    links = np.array([[-1, 0], [-1, -1], [0, 0], [1, -1], [-1, -1]], dtype=i64)  # e0 -> e1
    dur, one, none = np.ones((2, 2)), np.ones(1), np.zeros(1, dtype=i64)
    earliest_finish(links, dur, 0.0)
    earliest_finish(links, dur, 0.0, np.empty((2, 2)))
    latest_finish(links, dur, np.ones(2), 0.0)
    unit_floats(links, dur, dur, np.ones(2), 0.0, np.array([[0], [1]], dtype=i64))
    args = (links, np.array([1], dtype=i64), dur, 0.0, none, np.array([0, 1], dtype=i64), none,
            np.array([1], dtype=i64), np.ones(2), np.ones(2))
    first_fit(*args, np.zeros((1, 1), dtype=i64), one, probe_first=True)
    first_fit(*args, np.full((1, 1), -1, dtype=i64), one,
              lazy=(np.ones(2), none, one, one, none, none, one, 1.0))
