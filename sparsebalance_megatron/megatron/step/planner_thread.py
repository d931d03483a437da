"""The planners that draft in the training process: ``Planner`` (``--sb-planner thread``: one
background draft on a daemon thread) and ``Drafted`` (a draft the training thread already made,
where the planner process is down), both with ``PendingDraft``'s API (``done``, ``result``,
``basis``, ``wait_s``). Exported by ``step/ahead.py``, the planners' module.
"""

from __future__ import annotations

import threading
import time

from .drafting import Draft


class Planner:
    """One background draft on a daemon thread (``--sb-planner thread``): its result or
    exception."""

    def __init__(self, fn, basis: dict):
        self.basis, self._out, self._err = basis, None, None
        self.wait_s = 0.0                    # training thread's seconds blocked in ``result``
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="sparsebalance-planner")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out = fn()
        except BaseException as e:           # re-raised on the training thread by result()
            self._err = e

    def done(self) -> bool:
        """Whether the draft is made (``result`` would not wait)."""
        return not self._thread.is_alive()

    def result(self) -> Draft:
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s = time.perf_counter() - t0
        if self._err is not None:
            raise self._err
        self._out.basis = self.basis
        return self._out


class Drafted:
    """A draft already made on the training thread (the planner process down after a
    failure), with ``Planner``'s API: the same inputs give the same plan."""

    def __init__(self, draft: Draft, basis):
        self._draft, self.basis = draft, basis
        self.wait_s = 0.0

    def done(self) -> bool:
        return True

    def result(self) -> Draft:
        self._draft.basis = self.basis
        return self._draft
