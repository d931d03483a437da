"""The planner's compiled kernels (numba, when installed: ``pip install
sparsebalance-megatron[fast]``; NGC's PyTorch containers ship it) and their loader: one room
for every compiled pass and rule of the simulator, DST and SAB, each beside no other compiled
copy of itself; the numpy reference of each lives with its caller (``sim``, ``policy``,
``batching``, ``latency``), and the tests compare the two bit for bit.

Rooms: ``graph`` (an event graph's earliest and latest finishes, units' floats, one row's
makespan), ``fit`` (the descent's first fitting candidate, the cost formula's look-ups),
``grid`` (grid look-ups, water-filling, sensitivity moves, unit tables), ``band`` (a DST band
pass's cut and raise rows), ``descent`` (a critical-path round's cut and raise preparation),
``floors`` (the descent's floor verdicts), ``packing`` and ``slots`` (SAB's loops),
``features`` (the latency features' run sums). ``records`` holds the typed records
(``Graph``, ``Tables``, ``Formula``, ``Lookup``, ``Tries``) the kernels take instead of long
positional lists.

Every kernel is a module-level function compiled where it is defined (``jit``): a kernel that
calls another imports it by name, so numba resolves the compiled callee; nothing rebinds
another module's globals. A room is imported on first use (``kernels.graph``), so numba's
import (a few tenths of a second) is paid only where a planner runs with the kernels on.
Callers check ``enabled()`` first and run their numpy path otherwise (the same numbers).

Pure numpy and numba; must not import torch, megatron or anything else from this package.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np

ROOMS = ("graph", "fit", "grid", "band", "descent", "floors", "packing", "slots", "features")
_STATE: dict = {}


def enabled() -> bool:
    """Whether the compiled kernels run: numba importable and not turned off by
    ``SB_PLANNER_JIT=0`` (or ``disable``). numba is imported on the first call, not with this
    module."""
    on = _STATE.get("on")
    if on is None:
        on = _STATE["on"] = os.environ.get("SB_PLANNER_JIT", "1").strip() != "0" and \
            _numba() is not None
    return on


def packing_enabled() -> bool:
    """Whether SAB's compiled loops (``packing``) run: the kernels on, and a Python whose
    ``sum()`` of floats is Neumaier's (3.12+), which ``packing.py_sum`` reproduces."""
    return sys.version_info >= (3, 12) and enabled()


def disable(why: str) -> None:
    """Turn the kernels off in this process (the numpy paths run: the same plans, more CPU),
    with one warning saying ``why``."""
    import warnings

    if _STATE.get("on"):
        warnings.warn(f"sparsebalance: the planner's compiled kernels are off ({why}); its "
                      f"numpy paths run instead (the same plans, more CPU)", stacklevel=2)
    _STATE["on"] = False


def _numba():
    if "numba" not in _STATE:
        try:
            import numba
        except ImportError:      # the numpy paths run instead: the same numbers, slower
            numba = None
        _STATE["numba"] = numba
    return _STATE["numba"]


def jit(fn):
    """``fn`` (a module-level function in numba's subset) compiled on first call and cached on
    disk where numba finds a writable place (else compiled once per process), the GIL released;
    ``fn`` itself where numba is not installed (its callers then never call it)."""
    numba = _numba()
    if numba is None:
        return fn
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:         # no writable cache directory: compile in this process only
        return numba.njit(nogil=True)(fn)


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


def warm_up() -> None:
    """Compile every room's kernels (or load them from numba's disk cache) with the argument
    types a draft passes: the planner process does it before it says it is ready, so a run
    pays it at start-up, not in its first step's draft. Nothing without numba."""
    if not enabled():
        return
    for room in ROOMS:
        importlib.import_module(f"{__name__}.{room}").warm_up()


def __getattr__(name):
    if name in ROOMS:            # a room on first use: numba is imported with it
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
