"""A draft's rounds settled in the planner process (SAB's, DST's, the do-no-harm race's), their
collectives relayed by the training process (``--sb-planner process``; ``step/ahead.py``,
``step/planner_worker.py``).

The process runs ``Drafter.settle`` (all of DST's compute) with a ``RelayReducer``: each round
the step's driver asks of it (a round's parts, ``policy.dst_rounds``' protocol) goes up the
pipe, and the rank's reader thread reduces it with the rank's ``DPReducer`` on the rounds group
(``Rounds.perform``, recorded) and sends the answer down. The messages of a settle, after the
draft is made and before its ``("drafted",)``::

    process -> rank   ("round", parts)         one round of the settle
    rank -> process   ("agreed", result)       the DP group's answer
    rank -> process   ("cancel",)              instead: the training thread took the step over;
    process -> rank   ("cancelled",)           the process stops settling and answers this

``Rounds`` is the one owner of a step's rounds on the rank: the reader thread makes a round only
where the training thread has not claimed the step (``claim_when_due``), and the training thread
claims only between rounds, so the group is never used by two threads and a step's rounds run
once. A claim after ``k`` rounds (the process died, stalled or is late mid-rounds) leaves the
training thread to draft the step again from the same inputs and settle it with
``Rounds.replaying``: its first ``k`` rounds answered from the record (each checked to be the
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


class SettleCancelled(Exception):
    """The rank answered a round with ``cancel``: the training thread settles this step."""


class RelayClosed(Exception):
    """The rank's end of the pipe closed while the process settled (the rank ended)."""


class RelayReducer:
    """The planner process's reducer (``DPReducer``'s ``__call__``): each round sent up ``out``
    and answered on ``inp`` by the rank's reader thread."""

    def __init__(self, inp, out):
        self._in, self._out = inp, out
        self.rounds = 0

    def __call__(self, parts: dict) -> dict:
        try:
            self._out.send((ROUND, parts))
            msg = self._in.recv()
        except (EOFError, OSError):
            raise RelayClosed() from None
        if msg[0] == CANCEL:
            raise SettleCancelled()
        if msg[0] != AGREED:
            raise RuntimeError(f"the planner process asked round {self.rounds + 1} and was "
                               f"answered {msg[0]!r}, not {AGREED!r}")
        self.rounds += 1
        return msg[1]


def signature(parts: dict) -> tuple:
    """What a replayed round must match: its keys and sizes per operation."""
    return tuple((op, tuple((k, int(np.size(v))) for k, v in sorted(parts[op].items())))
                 for op in ("sum", "max", "cat") if parts.get(op))


class Rounds:
    """A step's rounds on this rank (module docstring): made by the reader thread through
    ``reducer`` (a ``DPReducer``; None where the process does not settle) until the training
    thread claims them. ``done``: (signature, result) of each round made, in order;
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

    def perform(self, parts: dict) -> tuple[bool, object]:
        """The process's round ``parts`` made with the rank's reducer and recorded (``take``'s
        answer)."""
        if not isinstance(parts, dict):
            raise RuntimeError(f"the planner process asked a round of {type(parts).__name__} "
                               f"{parts!r}, not a round's parts (a dict)")

        def one():
            result = self.reducer(parts)
            self.done.append((signature(parts), result))
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
    """``DPReducer``'s ``__call__``: the first ``len(done)`` rounds answered from ``done`` (each
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

    def __call__(self, parts: dict) -> dict:
        i, self.calls = self.calls, self.calls + 1
        if i >= len(self._done):
            return self.live(parts)
        was, result = self._done[i]
        now = signature(parts)
        if was != now:
            raise RuntimeError(
                f"DST's round {i + 1} of this step, replayed on the training thread after the "
                f"planner process stopped mid-rounds, is not the round the process made: it made "
                f"{was}, the training thread's draft asks {now} (the two drafts differ, so the "
                f"peers' rounds cannot be resumed)")
        return result
