"""Name the hung rank: a heartbeat per rank over the job's store, judged by the ranks left waiting.

A rank that hangs (a stuck kernel, a sleep, SIGSTOP) or leaves early (``os._exit``) leaves its
peers waiting in a collective until the distributed timeout, and torchrun then names a peer. Here
every rank runs a daemon thread that publishes, every ``interval_s``, a record on the job's store
(``comm.watchdog_store``): a sequence number (the thread is alive), how long since the main
thread's last progress point (a micro-batch's forward step, entering or leaving a progress
phase), the progress phases it is in (evaluation, checkpoint save or load, optimizer step, data
loading: ``watchdog_megatron`` marks them through Megatron's timers), whether it waits in
communication and how long in the current collective, and its last Python stack.
``watchdog_judgement`` decides (pure functions): a rank acts only after ``threshold_s`` in ONE
collective, names only a peer that is itself not progressing (exited, frozen, or stalled outside
every collective and progress phase), and never while any rank is inside a checkpoint save.

One rank (the first to claim the verdict key) prints one block: the rank, its coordinates,
iteration and phase, the age of its record, its last Python stack. Then the job is ended before
the user's timeout: a stalled rank ends itself (its thread reads the verdict, prints its stack,
exits with ``HUNG_EXIT_CODE``); a stopped rank on this host gets SIGKILL; otherwise (gone, or
stopped on another host) the reporting rank ends itself. A rank that raises because a peer left
(its collective fails at once) prints the same block from ``sys.excepthook``. A rank that ends
because of a peer leaves torchrun an error file naming the culprit, so torchrun's "Root Cause"
names it even when the culprit left with ``os._exit(0)``, which torchrun does not count a failure.

``threshold_s`` defaults to the distributed timeout in effect less a margin: a wait that long in
one collective would end the job at the timeout anyway. Watching starts at the first forward step.
Limits: a hang inside a progress phase is left to the distributed timeout; a rank stopped on
another host cannot be sent SIGKILL from here; under a launcher whose store lives in rank 0's
process a stopped rank 0 freezes the store. With NCCL a rank blocks at a device synchronisation,
not in the collective's Python frame, so it rarely counts as waiting and the watchdog rarely acts
(the safe side). Healthy runs print nothing and read no peer record. Imports neither megatron nor
torch: the store, clocks, stack source and process probes are injected (unit tests drive them).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from .children import launcher_store_gone, process_state  # noqa: F401  (process_state: API)
from .watchdog_judgement import (ContinuousWait, WatchdogTiming, classify, culprits, saving,
                                 should_act, torchrun_error, watchdog_problems)

__all__ = ["HUNG_EXIT_CODE", "Watchdog", "WatchdogTiming", "waiting_in_communication",
           "watchdog_problems"]

HUNG_EXIT_CODE = 3          # a rank named as stalled ends itself with this code
STACK_FRAMES = 16           # frames of the main thread's stack kept in a record
# The innermost frame of a rank waiting for its peers is in one of these (gloo and NCCL calls,
# Megatron's pipeline sends and receives and gradient reductions, our own collectives) or is a
# ``.wait()`` on an asynchronous handle.
COMM_PATHS = ("/torch/distributed/", "/megatron/core/pipeline_parallel/p2p_communication.py",
              "/megatron/core/distributed/", "/sparsebalance_megatron/megatron/runtime/comm.py")
PREFIX = "[sparsebalance] watchdog:"


def waiting_in_communication(frame) -> bool:
    """Whether a thread whose innermost Python frame is ``frame`` waits for its peers."""
    if frame is None:
        return False
    path = frame.f_code.co_filename.replace("\\", "/")
    if any(p in path for p in COMM_PATHS):
        return True
    import linecache

    return ".wait(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _format_stack(frame, limit: Optional[int]) -> list:
    """The innermost ``limit`` frames of ``frame``'s stack, outermost first, as traceback
    prints them."""
    if frame is None:
        return []
    return traceback.format_list(traceback.extract_stack(frame, limit=limit))


def _where(frame) -> str:
    """``file:function`` of the innermost frame (one word in the report's list of ranks)."""
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


class Watchdog:
    """One rank's heartbeat thread and judge. ``tick`` is called by the main thread at every
    progress point, ``enter``/``leave`` around every progress phase; ``stop`` at a normal end."""

    def __init__(self, store, rank: int, world_size: int, timing: Callable[[], WatchdogTiming], *,
                 coords: Optional[dict] = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, out=None,
                 main_frame: Optional[Callable] = None, proc_state=process_state,
                 kill=os.kill, exit=os._exit, pid: Optional[int] = None,
                 host: Optional[str] = None, launcher_gone: Optional[Callable[[], bool]] = None):
        self.store, self.rank, self.world_size, self.timing = store, rank, world_size, timing
        self.coords = dict(coords or {})
        self.clock, self.wall, self.out = clock, wall, out
        main_ident = threading.main_thread().ident
        self.main_frame = main_frame or (lambda: sys._current_frames().get(main_ident))
        self.proc_state, self.kill, self.exit = proc_state, kill, exit
        self.pid, self.host = pid or os.getpid(), host or socket.gethostname()
        self.progress, self.iteration, self.phase = 0, None, "starting"
        self.busy: list = []              # the progress phases the main thread is in
        self.state = "running"           # running | finished | exited | failed
        self._last_tick = clock()
        self._wait = ContinuousWait()
        self._seq = 0
        self._seen: dict[int, tuple] = {}   # peer -> (seq, local time the seq last changed)
        self._reported = False
        self._peers: dict = {}
        self._verdict_at: Optional[float] = None
        self._thread: Optional[threading.Thread] = None
        self._halt = threading.Event()
        self._prev_excepthook = None
        # torchrun hosts the job's store in its own process (TORCHELASTIC_USE_AGENT_STORE):
        # once it is gone (this process reparented), so is every record; nothing to publish
        self.launcher_gone = launcher_gone or launcher_store_gone()
        self._store_gone = False

    # --- main thread ----------------------------------------------------------------------------

    def tick(self, iteration: Optional[int], phase: str) -> None:
        """A progress point of the main thread (cheap: a few assignments; the first starts the
        thread). ``iteration`` None (evaluation) keeps the last training iteration."""
        self.progress += 1
        self.phase = phase
        if iteration is not None:
            self.iteration = iteration
        self._last_tick = self.clock()
        if self._thread is None and self.state == "running":
            self.start()

    def enter(self, phase: str) -> None:
        """The main thread starts a progress phase (``PHASES``): a progress point, and while it
        lasts this rank is never named as stalled; while it is a checkpoint save no rank acts."""
        self.busy = self.busy + [phase]     # a new list: the thread reads it without a lock
        self.progress += 1
        self.phase, self._last_tick = phase, self.clock()

    def leave(self, phase: str) -> None:
        busy = list(self.busy)
        if phase in busy:
            del busy[len(busy) - 1 - busy[::-1].index(phase)]
        self.busy = busy
        self.progress += 1
        self.phase, self._last_tick = f"after {phase}", self.clock()

    def start(self) -> None:
        import atexit

        self.publish(sys._getframe(1))   # the caller's stack: the main thread's first record
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._atexit)
        self._thread = threading.Thread(target=self._loop, name="sparsebalance-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """A normal end (every rank reached it): peers no longer judge this one. Guarded as
        ``_atexit`` is: where the job's store is gone (its launcher was killed: torchrun hosts
        it), the finished rank has nobody left to tell, and its run still ends normally."""
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._wait.clear()
        self.state = "finished"
        if not self._store_gone:
            try:
                self.publish()
            except Exception:           # the store is gone with the launcher: nothing to tell
                self._store_gone = True
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook

    def _atexit(self) -> None:
        if self.state == "running" and not self._store_gone:   # left before the job's end
            self.state = "exited"
            try:
                self.publish()
            except Exception:           # the store is gone with the job: nothing to tell
                pass

    def _excepthook(self, etype, value, tb) -> None:
        (self._prev_excepthook or sys.__excepthook__)(etype, value, tb)
        if self.state != "running" or self._store_gone:
            return
        self.state = "failed"
        self.phase = f"{self.phase} ({etype.__name__})"
        self.publish()
        try:
            found = [c for c in self._judge(self.timing(), failing=True) if c[0] != "stalled"]
            named = self._read("verdict") is not None
        except Exception:   # the store went away with the job: nothing more to say
            return
        if not found:
            return
        if not named:   # else the rank the verdict named is torchrun's root cause
            self._tell_torchrun(found, f"failed ({etype.__name__}: {value}) when it lost that "
                                "rank")
        if self._claim():
            self._say(f"rank {self.rank} failed ({etype.__name__}) while its peers were lost:")
            self._report(found, me="failed")

    # --- the thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._halt.wait(self.timing().interval_s):
            if self.launcher_gone():
                self._store_gone = True
                self._say(f"rank {self.rank}: the launcher has exited and the job's store with "
                          "it: not watching any more (the run goes on)")
                return
            try:
                self.poll()
            except Exception as e:   # never take the rank down; say it once
                if not getattr(self, "_poll_failed", False):
                    self._poll_failed = True
                    self._say(f"rank {self.rank}: heartbeat failed ({type(e).__name__}: {e}); "
                              "not watching any more")
                return

    def poll(self) -> None:
        """One heartbeat: publish this rank's record; once the main thread has waited
        ``threshold_s / 2`` in one collective, read the verdict and the peers, and act at
        ``threshold_s``. A rank that could be named (no progress for ``threshold_s / 2``, not
        waiting, in no progress phase) reads the verdict, to end itself if it is named."""
        t = self.timing()
        frame = self.main_frame()
        waiting = waiting_in_communication(frame)
        wait_s = self._wait.observe(frame, waiting, self.progress, self.clock())
        self.publish(frame, waiting, wait_s)
        if self.state != "running":
            return
        suspect = not waiting and not self.busy and \
            self.clock() - self._last_tick >= t.threshold_s / 2
        if wait_s < t.threshold_s / 2 and not suspect:
            return
        verdict = self._read("verdict")
        if verdict is not None:
            self._obey(verdict, t)
        if wait_s < t.threshold_s / 2:
            return
        found = self._judge(t)   # also keeps the peers' heartbeat ages current
        records = [self._record] + list(self._peers.values())
        if self._reported or not should_act(wait_s, found, records, t):
            return
        if self._claim():
            self._say(f"rank {self.rank} has waited {wait_s:.1f} s in one collective (threshold "
                      f"{t.threshold_s:g} s); the rank{'s' if len(found) > 1 else ''} it waits "
                      "for:")
            self._report(found)
            self._end(found)

    def publish(self, frame=None, waiting: Optional[bool] = None, wait_s: float = 0.0) -> None:
        self._seq += 1
        if frame is None and self.state == "running" and self._thread is not None:
            frame = self.main_frame()
        stack = _format_stack(frame, STACK_FRAMES)
        rec = self._record = dict(
            rank=self.rank, pid=self.pid, host=self.host, coords=self.coords, seq=self._seq,
            wall=self.wall(), state=self.state, progress=self.progress, iteration=self.iteration,
            phase=self.phase, busy=list(self.busy), stall_s=round(self.clock() - self._last_tick, 2),
            waiting=bool(waiting) if waiting is not None else waiting_in_communication(frame),
            wait_s=round(wait_s, 2), where=_where(frame), stack="".join(stack))
        self.store.set(f"hb/{self.rank}", json.dumps(rec))

    # --- judging --------------------------------------------------------------------------------

    def _read(self, key: str) -> Optional[dict]:
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _judge(self, t: WatchdogTiming, failing: bool = False) -> list:
        """[(kind, why, record)] for the peers that explain the wait (``culprits``)."""
        now = self.clock()
        judged = []
        self._peers = {}
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            rec = self._peers[peer] = self._read(f"hb/{peer}")
            if rec is None:
                continue
            seq, since = self._seen.get(peer, (None, now))
            if rec["seq"] != seq:
                since = now
            self._seen[peer] = (rec["seq"], since)
            age = now - since
            if failing:   # no history yet: the record's own wall time tells its age
                age = max(age, self.wall() - rec["wall"])
            local = rec["host"] == self.host
            judged.append((rec, classify(rec, age_s=age, local=local, t=t,
                                         pstate=self.proc_state(rec["pid"]) if local else "?")))
        return culprits(judged)

    def _claim(self) -> bool:
        """The first rank to call this reports (one block per job)."""
        self._reported = True
        return self.store.add("claim", 1) == 1

    def _report(self, found: list, me: str = "waits") -> None:
        for kind, why, rec in found:
            where = ", ".join(f"{k} {v}" for k, v in rec["coords"].items())
            it = "" if rec["iteration"] is None else f"iteration {rec['iteration'] + 1}, "
            verb = "has exited" if kind == "exited" else f"is {kind}"
            self._say(f"rank {rec['rank']}{f' ({where})' if where else ''} {verb}: {why}; "
                      f"its last record ({self.wall() - rec['wall']:.1f} s old): {it}phase "
                      f"'{rec['phase']}'")
            self._say(f"rank {rec['rank']}'s last Python stack (main thread):")
            self._say(rec["stack"].rstrip() or "  (none recorded)", raw=True)
        named = {r["rank"] for _, _, r in found}
        others = [f"rank {p} " + ("(no record)" if r is None else r["state"]
                                  if r["state"] != "running" else
                                  f"{'waits' if r['waiting'] else 'runs'} in {r['where']}")
                  for p, r in sorted(self._peers.items()) if p not in named]
        self._say(f"the other ranks: rank {self.rank} (this one) {me}; " + "; ".join(others))
        self.store.set("verdict", json.dumps(dict(by=self.rank, ranks=[
            dict(rank=r["rank"], kind=k) for k, _, r in found])))

    def _end(self, found: list) -> None:
        """End the job before the timeout: a stalled rank ends itself (``_obey``), a stopped one
        on this host gets SIGKILL; when none of them can be ended (gone, or stopped on another
        host) this rank ends itself."""
        self._verdict_at = self.clock()
        ending = False
        for kind, _, rec in found:
            if kind == "stalled":
                ending = True
            elif kind == "stopped" and rec["host"] == self.host:
                self._say(f"sending SIGKILL to rank {rec['rank']} (pid {rec['pid']}) so the job "
                          "ends now")
                try:
                    self.kill(rec["pid"], signal.SIGKILL)
                    ending = True
                except ProcessLookupError:
                    pass
        if not ending:
            self._tell_torchrun(found, "ended itself so that the job stops (exit code 1)")
            self._end_self(", ".join(str(r["rank"]) for _, _, r in found))

    def _obey(self, verdict: dict, t: WatchdogTiming) -> None:
        named = {v["rank"]: v["kind"] for v in verdict["ranks"]}
        if named.get(self.rank) == "stalled":
            frame = self.main_frame()
            stack = "".join(_format_stack(frame, None))
            self._say(f"rank {self.rank} was named by rank {verdict['by']} as the rank the job "
                      "waits for; its stack now:")
            self._say(stack.rstrip(), raw=True)
            self._say(f"rank {self.rank} ends itself (exit code {HUNG_EXIT_CODE})")
            self._flush()
            self.exit(HUNG_EXIT_CODE)
            return
        if self._verdict_at is None:
            self._verdict_at = self.clock()
        if self.clock() - self._verdict_at >= max(5.0, 3 * t.interval_s) and \
                saving([self._record] + list(self._peers.values())) is None:
            # The named rank was not ended (it should have been by now): end this one, so that
            # torchrun tears the job down before the timeout.
            self._end_self(", ".join(map(str, named)))

    def _end_self(self, ranks: str) -> None:
        self._say(f"rank {self.rank} ends itself so the job stops: rank(s) {ranks} cannot "
                  "continue (exit code 1)")
        self._flush()
        self.exit(1)

    def _tell_torchrun(self, found: list, how: str) -> None:
        """Leave torchrun's error file (``TORCHELASTIC_ERROR_FILE``, set for each worker) naming
        the culprit, so that its summary's root cause names it (``torchrun_error``)."""
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:
            return
        try:
            with open(path, "w") as f:
                json.dump(torchrun_error(found, self.rank, how, self.wall()), f)
        except OSError:
            pass

    # --- output ---------------------------------------------------------------------------------

    def _say(self, msg: str, raw: bool = False) -> None:
        out = self.out or sys.stderr
        print(msg if raw else f"{PREFIX} {msg}", file=out, flush=True)

    def _flush(self) -> None:
        for f in (sys.stdout, sys.stderr, self.out):
            try:
                f and f.flush()
            except Exception:
                pass
