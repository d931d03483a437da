"""DST's rounds of a draft settled in the planner process, their collectives relayed by the
training process (``--sb-planner process``; ``step/ahead.py``, ``step/planner_worker.py``).

The process runs ``Drafter.settle`` (all of DST's compute) with a ``RelayReducer``: each of its
calls (``__call__`` a round's parts, ``max`` a scalar, ``gather`` a row) goes up the pipe, and
the rank's reader thread makes it with the rank's ``DPReducer`` on the rounds group
(``Rounds.perform``, recorded) and sends the answer down. The messages of a settle, after the
draft is made and before its ``("drafted",)``::

    process -> rank   ("round", kind, arg)     kind: "call", "max" or "gather"
    rank -> process   ("agreed", result)       the DP group's answer
    rank -> process   ("cancel",)              instead: the training thread took the step over;
    process -> rank   ("cancelled",)           the process stops settling and answers this

``Rounds`` is the one owner of a step's rounds on the rank: the reader thread makes a round only
where the training thread has not claimed the step (``claim_when_due``), and the training thread
claims only between rounds, so the group is never used by two threads and a step's rounds run
once. A claim after ``k`` rounds (the process died, stalled or is late mid-rounds) leaves the
training thread to draft the step again from the same inputs and settle it with
``Rounds.replaying``: its first ``k`` calls answered from the record (each checked to be the
round recorded), the rest made live on the same group; the peers, which took part in those ``k``
collectives, see one set of rounds.

Numpy and threading only (the planner process imports it).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np

ROUND, AGREED, CANCEL, CANCELLED = "round", "agreed", "cancel", "cancelled"
KINDS = ("call", "max", "gather")


class SettleCancelled(Exception):
    """The rank answered a round with ``cancel``: the training thread settles this step."""


class RelayClosed(Exception):
    """The rank's end of the pipe closed while the process settled (the rank ended)."""


class RelayReducer:
    """The planner process's reducer: ``DPReducer``'s interface, each call sent up ``out`` and
    answered on ``inp`` by the rank's reader thread."""

    def __init__(self, inp, out):
        self._in, self._out = inp, out
        self.rounds = 0

    def _ask(self, kind: str, arg):
        try:
            self._out.send((ROUND, kind, arg))
            msg = self._in.recv()
        except (EOFError, OSError):
            raise RelayClosed() from None
        if msg[0] == CANCEL:
            raise SettleCancelled()
        if msg[0] != AGREED:
            raise RuntimeError(f"the planner process asked round {self.rounds + 1} ({kind}) "
                               f"and was answered {msg[0]!r}, not {AGREED!r}")
        self.rounds += 1
        return msg[1]

    def __call__(self, parts: dict) -> dict:
        return self._ask("call", parts)

    def max(self, x: float) -> float:
        return self._ask("max", float(x))

    def gather(self, row) -> np.ndarray:
        return self._ask("gather", np.asarray(row, dtype=np.float64).reshape(-1))


def signature(kind: str, arg) -> tuple:
    """What a replayed round must match: a call's keys and sizes per operation, a gather's row
    size (a max is one scalar)."""
    if kind == "call":
        return tuple((op, tuple((k, int(np.size(v))) for k, v in sorted(arg[op].items())))
                     for op in ("sum", "max", "cat") if arg.get(op))
    if kind == "gather":
        return (int(np.size(arg)),)
    return ()


class Rounds:
    """A step's rounds on this rank (module docstring): made by the reader thread through
    ``reducer`` (a ``DPReducer``; None where the process does not settle) until the training
    thread claims them. ``done``: (kind, signature, result) of each round made, in order;
    ``wait_s``: wall seconds in them (the peers' time, not the process's)."""

    def __init__(self, reducer=None):
        self.reducer = reducer
        self.done: list = []
        self.wait_s = 0.0
        self.claimed = self.finished = False
        self._busy = False
        self._last: Optional[float] = None     # monotonic end of the last round
        self._cond = threading.Condition()

    def take(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """(True, ``fn()``) run as the rank's rounds, or (False, None) where the training thread
        claimed them (the reader thread then makes none)."""
        with self._cond:
            if self.claimed:
                return False, None
            self._busy = True
        t0 = time.monotonic()
        try:
            return True, fn()
        finally:
            with self._cond:
                self._busy, self._last = False, time.monotonic()
                self.wait_s += self._last - t0
                self._cond.notify_all()

    def perform(self, kind: str, arg) -> tuple[bool, object]:
        """Round ``kind`` of the process's settle made with the rank's reducer and recorded
        (``take``'s answer)."""
        if kind not in KINDS:
            raise RuntimeError(f"the planner process asked a round of kind {kind!r} (not one "
                               f"of {', '.join(KINDS)})")

        def one():
            result = {"call": self.reducer, "max": self.reducer.max,
                      "gather": self.reducer.gather}[kind](arg)
            self.done.append((kind, signature(kind, arg), result))
            return result
        return self.take(one)

    def finish(self) -> None:
        """The reader thread makes no more rounds."""
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def claim_when_due(self, due: Callable[[Optional[float]], float]) -> bool:
        """The training thread's wait: True once the reader thread finished; False where it
        claimed the rounds first, at ``due(end of the last round or None)`` (monotonic) with no
        round in progress (a round in progress waits for the peers: it is let finish)."""
        with self._cond:
            while not self.finished:
                if not self._busy:
                    left = due(self._last) - time.monotonic()
                    if left <= 0:
                        self.claimed = True
                        return False
                    self._cond.wait(left)
                else:
                    self._cond.wait()
            return True

    def replaying(self) -> "ReplayingReducer":
        """The training thread's reducer once it claimed (or the reader finished): the rounds
        made so far replayed, then the rest on ``reducer``."""
        with self._cond:
            if not (self.claimed or self.finished) or self._busy:
                raise RuntimeError("the rounds are replayed only once the reader thread has "
                                   "stopped making them")
            return ReplayingReducer(list(self.done), self.reducer)


class ReplayingReducer:
    """``DPReducer``'s interface: the first ``len(done)`` calls answered from ``done`` (each
    checked against its record: a mismatch is a RuntimeError naming the round), then ``live``'s
    (whose ``sent`` counts every round's bytes once: the replayed ones went when recorded)."""

    def __init__(self, done: list, live):
        self._done, self.live, self.calls = done, live, 0

    @property
    def replayed(self) -> int:
        return min(self.calls, len(self._done))

    @property
    def sent(self) -> list:
        return self.live.sent

    def _round(self, kind: str, arg, live: Callable):
        i, self.calls = self.calls, self.calls + 1
        if i >= len(self._done):
            return live(arg)
        was_kind, was, result = self._done[i]
        now = signature(kind, arg)
        if (was_kind, was) != (kind, now):
            raise RuntimeError(
                f"DST's round {i + 1} of this step, replayed on the training thread after the "
                f"planner process stopped mid-rounds, is not the round the process made: it made "
                f"{was_kind} {was}, the training thread's draft asks {kind} {now} (the two drafts "
                f"differ, so the peers' rounds cannot be resumed)")
        return result

    def __call__(self, parts: dict) -> dict:
        return self._round("call", parts, self.live)

    def max(self, x: float) -> float:
        return self._round("max", float(x), self.live.max)

    def gather(self, row) -> np.ndarray:
        return self._round("gather", np.asarray(row, dtype=np.float64).reshape(-1),
                           self.live.gather)
