"""A draft the planner process is making (``step/ahead.py``'s ``PendingDraft``): the reader thread
that waits for it, relays its settle's collectives and reads it back, and the training thread's
join, which past the draft's deadline claims the step's rounds and names the process late or
stalled (``PlannerProcessError``)."""

from __future__ import annotations

import threading
import time
from typing import Optional

from ..runtime.children import process_state
from .drafting import Draft
from .relay import AGREED, CANCEL, CANCELLED, ROUND, Rounds


class PendingDraft:
    """A draft the planner process is making: a reader thread waits for it (the GIL released),
    relays the collectives of the process's settle (``step/relay.py``) and reads the draft back
    as soon as it is made, while the step trains; ``result`` joins it (``Planner``'s API) and
    raises what the draft or the process raised. ``request``: the draft's inputs (what the
    training thread drafts from where the process fails); ``rounds``: the step's rounds on this
    rank (``relay.Rounds``: what the reader thread made, and the claim that stops it); ``recv_s``:
    the reader thread's CPU seconds reading the draft back; ``wait_s``: wall seconds the training
    thread waited at the join (both ``planner_cost``'s)."""

    def __init__(self, planner, basis: dict, request: dict,
                 error: Optional[BaseException] = None,
                 rounds: Optional[Rounds] = None, on_round=None):
        self._planner, self.basis, self.request = planner, basis, request
        self._on_round = on_round
        self.rounds = Rounds() if rounds is None else rounds
        self.recv_s, self.wait_s = 0.0, 0.0
        self.asked = time.monotonic()
        self.phase = "drafting"       # "agreeing" (its rounds relayed), "sending" its draft
        self.dropped = False          # late: the training thread drafted it instead
        self._draft: Optional[Draft] = None
        self._err: Optional[BaseException] = error
        self._thread = None
        if error is not None:
            self.rounds.finish()
            return
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name="sparsebalance-planner-reader")
        self._thread.start()

    @property
    def pid(self) -> int:
        return self._planner.pid

    def _read(self) -> None:
        try:
            self._take()
        except BaseException as e:          # raised on the training thread by result()
            self._err = e
        finally:
            self.rounds.finish()

    def _take(self) -> None:
        planner, it, rounds = self._planner, self.request["iteration"], self.rounds
        planner._wait("drafting", it)
        msg = planner._message("drafting", it)
        while msg[0] == ROUND:              # the process settles: each collective relayed
            self.phase = "agreeing"
            try:
                made, result = rounds.perform(msg[1])
            except BaseException:           # it waits for an answer that will not come
                planner.kill()
                raise
            if made and self._on_round is not None:
                self._on_round(len(rounds.done))
            try:
                planner._send((AGREED, result) if made else (CANCEL,))
            except (BrokenPipeError, OSError):
                raise planner._died("agreeing", it) from None
            planner._wait("agreeing", it)
            msg = planner._message("agreeing", it)
            if msg == (CANCELLED,):         # the training thread settles this step
                return
        c0 = time.thread_time()
        if msg == ("drafted",):
            self.phase = "sending"
            msg = planner._message("sending", it)
        self._draft = planner._answer(msg)
        self.recv_s = time.thread_time() - c0
        planner.drafts += 1
        planner.note_draft_s(time.monotonic() - self.asked - rounds.wait_s)
        if self.dropped:                    # the training thread drafted it: not needed
            self._draft = None

    def done(self) -> bool:
        """Whether the draft is read back (``result`` would not wait)."""
        return self._thread is None or not self._thread.is_alive()

    def still_stalled(self) -> BaseException:
        """A late draft still not back when the next is due: the process is killed (its
        reader ends) and named as stalled."""
        planner, it = self._planner, self.request["iteration"]
        state = process_state(planner.pid)
        planner.kill()
        self._thread.join()
        planner._late = None
        return planner._error("stalled", it, f"stalled: iteration {it + 1}'s draft, late at "
                                             f"its step's end, was still not back "
                                             f"{time.monotonic() - self.asked:.2f} s after it "
                                             f"was asked for (it ran, state {state}); killed")

    def result(self) -> Draft:
        """The draft, waiting at most until ``deadline_s`` after it was asked for, or while the
        process settles, after its last round's answer (a round in progress waits for the
        peers). Past that the training thread claims the step's rounds (``rounds``: those made
        are replayed, ``StepPlanning.join_ahead``), PlannerProcessError: ``stalled`` where the
        process is stopped (state T) or otherwise cannot answer (it is killed), ``late`` where
        it still runs (it is left to finish: its draft is read and dropped,
        ``PlannerProcess.still_late``); either way the training thread drafts the request
        itself."""
        t0 = time.perf_counter()
        if self._thread is not None:
            if self.rounds.claim_when_due(lambda last: (self.asked if last is None else last)
                                          + self._planner.deadline_s()):
                self._thread.join()
            else:
                self._overdue(time.perf_counter() - t0)
        self.wait_s = time.perf_counter() - t0
        self._planner._pending = None
        if self._err is not None:
            raise self._err
        self._draft.basis = self.basis
        return self._draft

    def _overdue(self, waited: float) -> None:
        planner, it = self._planner, self.request["iteration"]
        if planner.proc.poll() is not None:    # it ended, not stalled: the reader names how
            self._thread.join()
            return
        state = process_state(planner.pid)
        if self.phase == "agreeing":
            what = (f"iteration {it + 1}'s DST rounds: no next round "
                    f"{planner.deadline_s():.2f} s after round {len(self.rounds.done)}'s "
                    f"answer")
        else:
            what = (f"iteration {it + 1}'s draft was not "
                    f"{'sent' if self.phase == 'sending' else 'made'} "
                    f"{time.monotonic() - self.asked:.2f} s after it was asked for")
        what += f" ({planner.describe_deadline()}; waited {waited:.2f} s at the step's end)"
        if state in ("R", "S", "D"):           # it runs: leave it, drop its draft when it comes
            self.dropped = True
            planner._late = self
            self._err = planner._error("late", it, f"is late: {what}; it runs (state "
                                                   f"{state}), its draft is dropped when it "
                                                   f"comes")
            return
        how = {"T": "stopped (state T)", "t": "stopped by a tracer (state t)",
               "Z": "a zombie (state Z)", None: "gone"}.get(state, f"in state {state}")
        planner.kill()
        self._thread.join()
        self._err = planner._error("stalled", it, f"stalled: {what}; it was {how}; killed")
