"""The planner's compiled kernels (numba; docs/DESIGN.md section 5, "The planner's loops run
compiled"): one room for every pass and rule of the simulator, DST and SAB, each written once.
Rooms: ``graph`` (an event graph's finishes and floats, a plan's simulation), ``grid`` (the
grid search, the cost tables), ``band`` (a DST band pass), ``descent`` (a critical-path round),
``packing`` and ``slots`` (SAB's loops), ``features`` (the latency features' run sums);
``records`` holds the typed records they take. A kernel is a module-level function compiled
where it is defined (``jit``); a kernel that calls another imports it by name, so numba
resolves the compiled callee. A room is imported on first use (``kernels.graph``).

Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import importlib

import numpy as np

ROOMS = ("graph", "grid", "band", "descent", "packing", "slots", "features")


def jit(fn=None, *, inline: bool = False):
    """``fn`` (a module-level function in numba's subset) compiled on first call, the GIL
    released, and cached on disk where numba finds a writable place (else compiled once per
    process); ``@jit(inline=True)``: a small helper inlined into its callers' code (no call,
    its tuple arguments taken apart where they are made)."""
    import numba

    if fn is None:
        return lambda f: jit(f, inline=inline)
    opts = dict(nogil=True, inline="always") if inline else dict(nogil=True)
    try:
        return numba.njit(cache=True, **opts)(fn)
    except RuntimeError:         # no writable cache directory: compile in this process only
        return numba.njit(**opts)(fn)


def contiguous(a, dtype):
    """``a`` as a C-contiguous, writable array of ``dtype`` (numba compiles a read-only array,
    e.g. a ``broadcast_to`` view, as another type: one signature per kernel, the warm-up's).
    An array that already is one is returned as it is (most are: np.require's checks cost
    more than many kernels' work)."""
    if type(a) is np.ndarray and a.dtype == dtype:
        flags = a.flags
        if flags.c_contiguous and flags.writeable:
            return a
    return np.require(a, dtype=dtype, requirements="CW")


def f64(a) -> np.ndarray:
    """``contiguous(a, np.float64)``."""
    return contiguous(a, np.float64)


def i64(a) -> np.ndarray:
    """``contiguous(a, np.int64)``."""
    return contiguous(a, np.int64)


def warm_up(rooms=ROOMS) -> None:
    """Compile every room's kernels (or load them from numba's disk cache) with the argument
    types a draft passes: the planner process does it before it says it is ready, so a run
    pays it at start-up, not in its first step's draft (``rooms``: these rooms only)."""
    for room in rooms:
        importlib.import_module(f"{__name__}.{room}").warm_up()


def __getattr__(name):
    if name in ROOMS:            # a room on first use: numba is imported with it
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
