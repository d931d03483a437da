"""Planning step n+1 while step n trains (``--sb-planner process`` or ``thread``).

``Planner`` drafts on a thread of the training process. The draft is Python and numpy: it holds
the GIL most of the time, so a training thread that launches many small kernels (a GPU step's
forward and backward) runs slower while it drafts. ``PlannerProcess`` drafts in a process of its
own (one per rank, started at the first draft): the training thread only sends the draft's
inputs (the step's segments, the latency calibration, the sensitivity updates since the last
draft). A reader thread waits for the draft (without the GIL) and reads it back as soon as it is
made, while the step still trains, so that the step's end only joins it. What comes back is
what the rank may use: of the two packings a step may draft (SAB's and the do-no-harm
baseline's), the one the step commits where the rank knows it (``reply``), both where rank 0's
broadcast will say; packings and features are pickled without their caches.

The process holds a copy of the rank's ``Drafter`` (config, latency model, tracker) made when it
starts, and before each draft sets its latency calibration to the one sent and replays the
tracker's updates in order (or replaces its state when the training process loaded a state), so
it drafts from exactly the state the training process holds when it asks: the same function on
the same inputs as the in-line planner (a unit test compares the three). It ends when the
training process closes the pipe (its exit included, a crash too), and with its rank however the
rank ends (``runtime.children.die_with_parent``: SIGKILL when the rank that started it ends). A
draft's error is raised on the training thread. The process's death or stall is a
``PlannerProcessError`` that says what it was doing (``idle``, ``drafting``, ``agreeing``: its
settle's rounds, ``sending`` its draft, ``stalled``, ``late``), for which iteration, and its exit code or signal; the request stays
with the ``PendingDraft``, so the training thread can draft the same step itself
(``step/planning.py`` decides what the run does then). A draft is overdue when it is not read
back ``PlannerProcess.deadline_s`` after it was asked for, or while it settles, its next round
not asked that long after the last one's answer (3x the recent drafts' median, at least
``STALL_FLOOR_S``, at most ``--sb-planner-timeout`` capped at half the distributed timeout): a
process that cannot answer (stopped, state T) is then killed (``stalled``), one that runs is left
to finish and its draft dropped (``late``).

Where the run plans DST per DP rank, the process also settles the draft (``Drafter.settle``, all
of DST's compute) and the reader thread only relays its collectives over the DP group
(``step/relay.py``); a process that dies, stalls or is late mid-rounds leaves the training
thread to settle the step, the rounds already made replayed (``step/pending.py``).

The process starts from the rank's ``sys.path`` and says which package it imported before
anything else; another copy than the rank's is refused (``step/planner_boot.py``). The worker
side is ``step/planner_worker.py``; a draft in flight, ``step/pending.py``.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Optional

from ...config import PLANNER_TIMEOUT_S
from ..runtime.children import process_state
from .drafting import Drafter
from .planner_boot import (BOOT, PlannerPackageMismatch, describe_exit, package_identity,
                           package_mismatch, stop_process, widen_pipe)
from .planner_thread import Drafted, Planner  # noqa: F401  (this module's API, one body there)
from .pending import PendingDraft
from .relay import Rounds

POLL_S = 1.0            # how often a wait for the planner process checks that it is alive
STALL_FACTOR = 3        # a draft is late after this many times the recent drafts' median ...
STALL_FLOOR_S = 0.5
"""... and at least this long. A draft is asked for as its step starts and is normally back long
before the step ends; its wall time is what CPU the planner gets. Three times the recent median
follows a steady load (the median is of the drafts' wall times, load included); the floor covers
what a median of short drafts does not see: the process drafts at nice 5, so beside a busy
training thread on one core it gets about a quarter of it (CFS weights 335 : 1024), and on a
loaded host a runnable process waits tens of milliseconds per scheduling round. 0.5 s is 10x the
50 ms a draft may take at 64 DP (BENCHMARKS.md, "The planner's own cost": a rank's 50 ms), so a
healthy draft is not late, and a stall costs a step at most this plus one draft on the training
thread: not the 30 s of ``--sb-planner-timeout``, which now only caps the deadline."""
RECENT_DRAFTS = 8       # the drafts that median is taken over


class PlannerProcessError(RuntimeError):
    """The planner process ended or stalled without answering (killed, crashed, out of memory,
    stopped): its ``pid``, its ``phase`` (``starting``, ``idle``: before it was sent the draft,
    ``drafting``, ``agreeing``: settling it, its rounds relayed, ``sending``: its answer begun,
    ``stalled``, ``late``), the draft's ``iteration`` (0-based,
    None while starting) and its exit ``code`` (minus the signal that ended it; None alive)."""

    def __init__(self, message: str, *, pid: int, phase: str, iteration: Optional[int],
                 code: Optional[int]):
        super().__init__(message)
        self.pid, self.phase, self.iteration, self.code = pid, phase, iteration, code


class PlannerProcess:
    """The rank's planner process: ``submit`` a step's inputs, ``PendingDraft.result`` its
    draft. One draft in flight at a time. ``timeout_s``: the most time a draft may take before
    it counts as late (``deadline_s``). ``sys_path``: where it imports from (the rank's
    ``sys.path``; a test passes another)."""

    def __init__(self, drafter: Drafter, timeout_s: float = PLANNER_TIMEOUT_S, *,
                 sys_path: Optional[list] = None):
        r_child, w_parent = os.pipe()
        r_parent, w_child = os.pipe()
        widen_pipe(r_parent)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        path = [p or os.getcwd() for p in (sys.path if sys_path is None else sys_path)]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, json.dumps(path), str(r_child), str(w_child),
                 str(os.getpid())],
                pass_fds=(r_child, w_child), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(r_child)
            os.close(w_child)
        self.timeout_s = float(timeout_s)
        self.drafts = 0                                   # drafts it answered
        self._walls = collections.deque(maxlen=RECENT_DRAFTS)   # recent drafts' wall seconds
        self._out = Connection(w_parent, readable=False)
        self._in = Connection(r_parent, writable=False)
        self._pending: Optional[PendingDraft] = None
        self._late: Optional[PendingDraft] = None         # a late draft, dropped when it comes
        self._ready = False
        self._identity: Optional[tuple] = None            # what it said it imported
        self._finalize = weakref.finalize(self, stop_process, self.proc, self._out, self._in)
        self._send_lock = threading.Lock()
        self._send(("init", drafter))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def note_draft_s(self, wall_s: float) -> None:
        """A draft's wall seconds (the process's, from asked to read back, or one the training
        thread made): the recent drafts ``deadline_s`` is taken from."""
        self._walls.append(float(wall_s))

    def deadline_s(self) -> float:
        """How long after it was asked for a draft may take before it counts as late:
        ``STALL_FACTOR`` x the median of the recent drafts, at least ``STALL_FLOOR_S``, at most
        ``timeout_s`` (--sb-planner-timeout, at most half the distributed timeout); before any
        draft was timed, ``timeout_s``."""
        if not self._walls:
            return self.timeout_s
        return min(self.timeout_s, max(STALL_FLOOR_S,
                                       STALL_FACTOR * statistics.median(self._walls)))

    def describe_deadline(self) -> str:
        """``deadline_s`` and where it comes from, in words (the late and stalled lines)."""
        d = self.deadline_s()
        if not self._walls:
            return f"its deadline {d:.2f} s: no draft timed yet"
        med = statistics.median(self._walls)
        return (f"its deadline {d:.2f} s: {STALL_FACTOR}x the recent drafts' median "
                f"{med:.3f} s, at least {STALL_FLOOR_S:g} s, at most {self.timeout_s:g} s")

    def still_late(self) -> Optional["PendingDraft"]:
        """The late draft (``PendingDraft.result`` gave up on it) while it is still not back;
        None once it came (its answer dropped) or where none was late."""
        if self._late is not None and self._late.done():
            self._late = None
        return self._late

    def wait_ready(self) -> None:
        """Wait until the process has read its Drafter and imported what a draft uses, so that
        its start-up costs no CPU during a training step (``submit`` waits for it too).
        ``PlannerPackageMismatch`` where it imported another copy of the package."""
        self._take_ready(wait=True)

    def ready_now(self) -> bool:
        """Whether the process is ready, without waiting (a restarted one starts while the
        training thread drafts); PlannerProcessError where it ended while starting."""
        self._take_ready(wait=False)
        return self._ready

    def _take_ready(self, wait: bool) -> None:
        """Its start-up messages: first the package it imported (checked against the rank's),
        then ``ready``."""
        while not self._ready:
            if wait:
                self._wait("starting", None)
            elif not self._in.poll(0) and self.proc.poll() is None:
                return
            msg = self._message("starting", None)
            if self._identity is None:         # its first word: which package it imported
                said = tuple(msg[1:]) if msg[0] == "package" else None
                problem = package_mismatch(package_identity(), said)
                if problem is not None:
                    self.kill()
                    raise PlannerPackageMismatch(problem)
                self._identity = said
                continue
            if msg != ("ready",):
                raise self._error("starting", None, "answered its start-up with something "
                                  "else than ready")
            self._ready = True

    def _wait(self, phase: str, iteration: Optional[int]) -> None:
        """Until the process has something to read (waiting without the GIL)."""
        while not self._in.poll(POLL_S):
            if self.proc.poll() is not None:
                raise self._died(phase, iteration)

    def _message(self, phase: str, iteration: Optional[int]):
        try:
            return self._in.recv()
        except (EOFError, OSError):
            raise self._died(phase, iteration) from None

    def submit(self, iteration: int, first_bin: int, segments, num_microbatches: int, *,
               with_dst: bool, latency_state: Optional[dict], tracker_sync, basis: dict,
               settle: Optional[tuple] = None, on_round=None,
               rank: Optional[int] = None, quality_scales: Optional[tuple] = None
               ) -> "PendingDraft":
        """Start the draft of ``iteration`` from these inputs; ``tracker_sync``: None (no
        tracker), ("reset", state) or ("updates", [(ids, lengths, values), ...]); ``rank``: a DP
        rank's own draft (``Drafter.own_draft``); ``settle``: (DP rank, its ``DPReducer`` on the
        rounds group): the process settles the draft as that rank (``Drafter.settle``, its
        ``agreed``), the reader thread relaying its collectives (``step/relay.py``);
        ``on_round(k)``: called on the reader thread after the k-th relayed round
        (``--sb-fault planner-kill-agreeing``); ``quality_scales``: the quality model's
        refreshed group scales the rank's drafts use (``Drafter.quality_scales``). A process
        that ended gives a draft whose
        ``result`` raises that (the request kept for the caller)."""
        if self._pending is not None:
            raise RuntimeError("a draft of the planner process is still pending")
        request = dict(iteration=iteration, first_bin=first_bin, segments=segments,
                       num_microbatches=num_microbatches, with_dst=with_dst, rank=rank)
        err = None
        try:
            self.wait_ready()
            if self.proc.poll() is not None:
                raise self._died("idle", iteration)
            self._send(("draft", dict(request, latency=latency_state, tracker=tracker_sync,
                                      quality=quality_scales,
                                      settle=None if settle is None else int(settle[0]))))
        except (BrokenPipeError, OSError):
            err = self._died("idle", iteration)
        except PlannerProcessError as e:
            err = e
        self._pending = PendingDraft(self, basis, request, error=err,
                                     rounds=Rounds(None if settle is None else settle[1]),
                                     on_round=on_round)
        return self._pending

    def _send(self, msg) -> None:
        """``msg`` down the pipe (the training thread's requests, the reader thread's answers
        to a settle's rounds: one writer at a time)."""
        with self._send_lock:
            self._out.send(msg)

    def _answer(self, msg):
        """An answer's value, or its error raised here."""
        kind, *rest = msg
        if kind == "error":
            err, text = rest
            if not isinstance(err, BaseException):
                raise RuntimeError(text)
            err.add_note(f"in the planner process (pid {self.pid}):\n{text}")
            raise err
        return rest[0]

    def _died(self, phase: str, iteration: Optional[int]) -> PlannerProcessError:
        """What ended the process (it is reaped here), as the error a caller handles."""
        what = {"starting": "while starting",
                "idle": f"while idle after {self.drafts} draft(s), before it was sent "
                        f"iteration {None if iteration is None else iteration + 1}'s",
                "drafting": f"while drafting iteration "
                            f"{None if iteration is None else iteration + 1}",
                "agreeing": f"while settling iteration "
                            f"{None if iteration is None else iteration + 1}'s DST (its "
                            f"rounds relayed over the DP group)",
                "sending": f"while sending its draft of iteration "
                           f"{None if iteration is None else iteration + 1}"}[phase]
        return self._error(phase, iteration, f"ended {what} with "
                           f"{describe_exit(self.proc.wait())}")

    def _error(self, phase: str, iteration: Optional[int], what: str) -> PlannerProcessError:
        return PlannerProcessError(f"the SparseBalance planner process (pid {self.pid}) {what}",
                                   pid=self.pid, phase=phase, iteration=iteration,
                                   code=self.proc.poll())

    def stop_for_test(self, wait_s: float = 30.0) -> None:
        """--sb-fault: stop the process (SIGSTOP): it answers nothing until killed. Returns
        once the process reads as stopped (state T), at most ``wait_s`` later: the signal takes
        effect when the process next runs, so on a loaded machine a check made right after the
        kill could still find it running and call it late instead of stalled."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + wait_s
        while process_state(self.pid) not in ("T", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def kill(self) -> None:
        """End the process now (SIGKILL: a stopped one too) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self._finalize()
