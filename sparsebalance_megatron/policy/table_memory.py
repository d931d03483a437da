"""The cost tables' memory kept from one draft to the next (``TableMemory``) and lent to one draft
at a time (``TableLease``): ``UnitCosts.from_latency`` writes its tables into it
(``tables=``), so a drafter that prices its packings every step reuses its pages.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Tuple

import numpy as np


class TableMemory:
    """Memory for one ``UnitCosts.from_latency``'s tables, kept from one step to the next: a
    drafter prices its packings every step, and fresh arrays of that size (240 MB each at DP
    4,096 x 16 micro-batches x 8 virtual stages) are fresh pages every step, whose faults cost
    the draft as much system time as all its work (BENCHMARKS.md, "Control plane"). The tables
    are written whole (``kernels.grid.unit_tables``), so what the memory held before does not
    matter; a ``UnitCosts`` made in it is valid until the memory is used again. Pickled
    empty."""

    def __init__(self):
        self._flat = None

    def arrays(self, n: int, stages: int, g: int) -> Tuple[np.ndarray, np.ndarray]:
        """(forward and backward [2, n, stages, g], total [n, stages, g]), views of the kept
        memory (grown where it is too small)."""
        size = 3 * n * stages * g
        if self._flat is None or self._flat.size < size:
            self._flat = np.empty(size)
        fb = self._flat[:2 * n * stages * g].reshape(2, n, stages, g)
        return fb, self._flat[2 * n * stages * g:size].reshape(n, stages, g)

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self._flat = None


class TableLease:
    """A drafter's ``TableMemory`` per packing option, lent to one draft at a time
    (``lease``): a draft made while another holds it (the training thread beside a planner
    thread) gets fresh arrays instead. Pickled empty."""

    def __init__(self, options: int = 2):
        self._options, self._lock = options, threading.Lock()
        self._memory = [TableMemory() for _ in range(options)]

    @contextmanager
    def lease(self):
        """The options' memories for the length of the block (None where held elsewhere: the
        caller makes fresh arrays); every ``UnitCosts`` made in them is dropped by its end."""
        if not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            yield self._memory
        finally:
            self._lock.release()

    def __getstate__(self):
        return {"options": self._options}

    def __setstate__(self, state):
        self.__init__(state["options"])
