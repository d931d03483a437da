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
``PlannerProcessError`` that says what it was doing (``idle``, ``drafting``, ``sending`` its
draft, ``stalled``), for which iteration, and its exit code or signal; the request stays with the
``PendingDraft``, so the training thread can draft the same step itself
(``step/planning.py`` decides what the run does then). A draft counts as stalled when it is not
read back ``PlannerProcess.deadline_s`` after it was asked for.

The worker side is ``step/planner_worker.py``.
"""

from __future__ import annotations

import collections
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
from .drafting import Draft, Drafter

POLL_S = 1.0            # how often a wait for the planner process checks that it is alive
STOP_WAIT_S = 5.0       # how long a closing training process waits for its planner to end
STALL_FACTOR = 10       # a draft is stalled after this many times the recent drafts' median
RECENT_DRAFTS = 8       # the drafts that median is taken over
WORKER = __name__.rsplit(".", 1)[0] + ".planner_worker"   # what the process runs


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


class PlannerProcessError(RuntimeError):
    """The planner process ended or stalled without answering (killed, crashed, out of memory,
    stopped): its ``pid``, its ``phase`` (``starting``, ``idle``: before it was sent the draft,
    ``drafting``, ``sending``: its answer begun, ``stalled``), the draft's ``iteration`` (0-based,
    None while starting) and its exit ``code`` (minus the signal that ended it; None alive)."""

    def __init__(self, message: str, *, pid: int, phase: str, iteration: Optional[int],
                 code: Optional[int]):
        super().__init__(message)
        self.pid, self.phase, self.iteration, self.code = pid, phase, iteration, code


def describe_exit(code: Optional[int]) -> str:
    """``exit code 1``, ``signal 9 (SIGKILL)``, or ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


PIPE_BYTES = 1 << 20     # the draft pipe's capacity where Linux allows (its default maximum)


def _widen(fd: int) -> None:
    """Let the draft pipe hold a whole draft (at 64 DP x 16, 0.5-1 MB), so that the planner
    process writes it in one call and the reader thread reads it in one: each read of a
    64 KB pipe takes the GIL back from the training thread once more. Left as it is where the
    system refuses (another OS, a lower limit)."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


class PlannerProcess:
    """The rank's planner process: ``submit`` a step's inputs, ``PendingDraft.result`` its
    draft. One draft in flight at a time. ``timeout_s``: the least time a draft may take before
    it counts as stalled (``deadline_s``)."""

    def __init__(self, drafter: Drafter, timeout_s: float = PLANNER_TIMEOUT_S):
        r_child, w_parent = os.pipe()
        r_parent, w_child = os.pipe()
        _widen(r_parent)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", WORKER, str(r_child), str(w_child), str(os.getpid())],
                pass_fds=(r_child, w_child), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(r_child)
            os.close(w_child)
        self.timeout_s = float(timeout_s)
        self.drafts = 0                                   # drafts it answered
        self._walls = collections.deque(maxlen=RECENT_DRAFTS)   # their seconds, asked to read
        self._out = Connection(w_parent, readable=False)
        self._in = Connection(r_parent, writable=False)
        self._pending: Optional[PendingDraft] = None
        self._ready = False
        self._finalize = weakref.finalize(self, _stop, self.proc, self._out, self._in)
        self._out.send(("init", drafter))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def deadline_s(self) -> float:
        """How long after it was asked for a draft may take before it counts as stalled:
        ``STALL_FACTOR`` x the median of the recent drafts, at least ``timeout_s``."""
        if not self._walls:
            return self.timeout_s
        return max(self.timeout_s, STALL_FACTOR * statistics.median(self._walls))

    def wait_ready(self) -> None:
        """Wait until the process has read its Drafter and imported what a draft uses, so that
        its start-up costs no CPU during a training step (``submit`` waits for it too)."""
        if not self._ready:
            self._wait("starting", None)
            self._take_ready()

    def ready_now(self) -> bool:
        """Whether the process is ready, without waiting (a restarted one starts while the
        training thread drafts); PlannerProcessError where it ended while starting."""
        if not self._ready and (self._in.poll(0) or self.proc.poll() is not None):
            self._take_ready()
        return self._ready

    def _take_ready(self) -> None:
        if self._message("starting", None) != ("ready",):
            raise self._error("starting", None, "answered its start-up with something else "
                              "than ready")
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
               with_dst: bool, latency_state: Optional[dict], tracker_sync, basis: dict
               ) -> "PendingDraft":
        """Start the draft of ``iteration`` from these inputs; ``tracker_sync``: None (no
        tracker), ("reset", state) or ("updates", [(ids, lengths, values), ...]). A process that
        ended gives a draft whose ``result`` raises that (the request kept for the caller)."""
        if self._pending is not None:
            raise RuntimeError("a draft of the planner process is still pending")
        request = dict(iteration=iteration, first_bin=first_bin, segments=segments,
                       num_microbatches=num_microbatches, with_dst=with_dst)
        c0, err = time.thread_time(), None
        try:
            self.wait_ready()
            if self.proc.poll() is not None:
                raise self._died("idle", iteration)
            self._out.send(("draft", dict(request, latency=latency_state,
                                          tracker=tracker_sync)))
        except (BrokenPipeError, OSError):
            err = self._died("idle", iteration)
        except PlannerProcessError as e:
            err = e
        self._pending = PendingDraft(self, basis, request, send_s=time.thread_time() - c0,
                                     error=err)
        return self._pending

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
                "sending": f"while sending its draft of iteration "
                           f"{None if iteration is None else iteration + 1}"}[phase]
        return self._error(phase, iteration, f"ended {what} with "
                           f"{describe_exit(self.proc.wait())}")

    def _error(self, phase: str, iteration: Optional[int], what: str) -> PlannerProcessError:
        return PlannerProcessError(f"the SparseBalance planner process (pid {self.pid}) {what}",
                                   pid=self.pid, phase=phase, iteration=iteration,
                                   code=self.proc.poll())

    def stop_for_test(self) -> None:
        """--sb-fault: stop the process (SIGSTOP): it answers nothing until killed."""
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """End the process now (SIGKILL: a stopped one too) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self._finalize()


class PendingDraft:
    """A draft the planner process is making: a reader thread waits for it (the GIL released)
    and reads it back as soon as it is made, while the step trains; ``result`` joins it
    (``Planner``'s API) and raises what the draft or the process raised. ``request``: the
    draft's inputs (what the training thread drafts from where the process fails); ``send_s``:
    the training thread's CPU seconds pickling the inputs; ``recv_s``: the reader thread's
    reading the draft back (off the critical path; it holds the GIL while it unpickles, which a
    launch-bound training thread beside it pays: ``planner_cost``'s slowdown study);
    ``wait_s``: wall seconds the training thread waited at the join."""

    def __init__(self, planner: PlannerProcess, basis: dict, request: dict, send_s: float,
                 error: Optional[PlannerProcessError] = None):
        self._planner, self.basis, self.request = planner, basis, request
        self.send_s, self.recv_s, self.wait_s = send_s, 0.0, 0.0
        self.asked = time.monotonic()
        self.phase = "drafting"       # then "sending" once the process says its draft is made
        self._draft: Optional[Draft] = None
        self._err: Optional[BaseException] = error
        self._thread = None
        if error is None:
            self._thread = threading.Thread(target=self._read, daemon=True,
                                            name="sparsebalance-planner-reader")
            self._thread.start()

    @property
    def pid(self) -> int:
        return self._planner.pid

    def _read(self) -> None:
        planner, it = self._planner, self.request["iteration"]
        try:
            planner._wait("drafting", it)
            msg = planner._message("drafting", it)
            if msg == ("drafted",):
                self.phase = "sending"
                msg = planner._message("sending", it)
            c0 = time.thread_time()
            self._draft = planner._answer(msg)
            self.recv_s = time.thread_time() - c0
            planner.drafts += 1
            planner._walls.append(time.monotonic() - self.asked)
        except BaseException as e:          # raised on the training thread by result()
            self._err = e

    def done(self) -> bool:
        """Whether the draft is read back (``result`` would not wait)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Draft:
        """The draft, waiting at most until ``deadline_s`` after it was asked for; past that
        the process is killed and PlannerProcessError raised (``stalled``)."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join(max(0.0, self.asked + self._planner.deadline_s() - time.monotonic()))
            if self._thread.is_alive():
                self._stalled(time.perf_counter() - t0)
        self.wait_s = time.perf_counter() - t0
        self._planner._pending = None
        if self._err is not None:
            raise self._err
        self._draft.basis = self.basis
        return self._draft

    def _stalled(self, waited: float) -> None:
        planner, it = self._planner, self.request["iteration"]
        if planner.proc.poll() is not None:    # it ended, not stalled: the reader names how
            self._thread.join()
            return
        made = "sent" if self.phase == "sending" else "made"
        planner.kill()
        self._thread.join()
        self._err = planner._error(
            "stalled", it, f"stalled: iteration {it + 1}'s draft was not {made} "
                           f"{time.monotonic() - self.asked:.1f} s after it was asked for "
                           f"(its deadline {planner.deadline_s():.1f} s; waited {waited:.1f} s "
                           f"at the step's end); killed")


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


def _stop(proc, out: Connection, inp: Connection) -> None:
    """Ask the planner process to end, close the pipes (its EOF), and reap it."""
    try:
        out.send(("stop",))
    except (OSError, ValueError):
        pass
    for c in (out, inp):
        try:
            c.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
