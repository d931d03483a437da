"""Name the hung rank: a heartbeat per rank over the job's store, judged by the ranks left waiting.

A rank that hangs (a stuck kernel, a sleep, SIGSTOP) or leaves early (``os._exit``) leaves its
peers waiting in a collective until the distributed timeout; torchrun then names a peer that timed
out, and a stopped process takes another 30 s of SIGTERM grace. Here every rank runs a daemon
thread that publishes, every ``interval_s``, a small record on the torch.distributed store (a
``PrefixStore`` of the default one, ``comm.watchdog_store``): a sequence number (the thread is
alive), the main thread's progress (how long since its last progress point: a micro-batch's
forward step), whether the main thread is waiting in communication, and the main thread's last
Python stack. A rank that has itself waited in communication for ``threshold_s`` reads its peers'
records and names the culprit:

- a peer whose process is gone, or that left before the job ended (an exit mark), is *exited*;
- a peer whose record stopped changing for ``stale_s`` (or, on this host, whose process is in the
  stopped state) is *stopped*: SIGSTOP, or a process frozen in the interpreter;
- a peer whose thread runs but whose main thread has made no progress for ``threshold_s / 2``
  while not waiting in communication is *stalled* (a sleep, an endless loop, a stuck device).
  Peers that wait in communication are victims and never blamed; a stalled peer is not blamed
  either when an exited or stopped one explains the wait.

One rank (the first to claim the verdict key) prints one block: the rank, its coordinates, its
iteration and phase, the age of its heartbeat and progress, its last Python stack. Then the job is
ended so that it stops before the user's timeout: a stalled rank ends itself (its own thread reads
the verdict, prints its current stack and exits with ``HUNG_EXIT_CODE``); a stopped rank on this
host is sent SIGKILL; otherwise (a rank gone, or stopped on another host) the reporting rank ends
itself. torchrun's summary then names the culprit as the first failure whenever it could be ended.

A rank that raises (the peers' collectives fail at once when a process exits) prints the same
block from ``sys.excepthook`` when an exited or stopped peer explains its error.

``threshold_s`` defaults to the distributed timeout in effect (``--distributed-timeout-minutes``,
then ``--distributed-timeout-seconds-after-init`` from the second step) less a margin, so the
watchdog acts before the timeout would. Watching starts at the first progress point (a training or
evaluation micro-batch): start-up, profiling and checkpoint loading before it are never judged.
Limits: a rank stopped on another host cannot be sent SIGKILL from here (its node's torchrun
still gives it 30 s of SIGTERM grace after the reporting rank ends); the records live on the
job's store, which torchrun's agent serves: under a launcher whose store lives in rank 0's process,
a stopped rank 0 also freezes the store and nothing is named.
Healthy runs print nothing and read no peer record (a rank only reads them once it has waited
``threshold_s / 2``). Imports neither megatron nor torch at module level: the store, the clock,
the stack source and the process probes are injected (unit tests drive them by hand).
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
from dataclasses import dataclass
from typing import Callable, Optional

HUNG_EXIT_CODE = 3          # a rank named as stalled ends itself with this code
STACK_FRAMES = 16           # frames of the main thread's stack kept in a record
# The innermost frame of a rank waiting for its peers is in one of these (gloo and NCCL calls,
# Megatron's pipeline sends and receives and gradient reductions, our own collectives) or is a
# ``.wait()`` on an asynchronous handle.
COMM_PATHS = ("/torch/distributed/", "/megatron/core/pipeline_parallel/p2p_communication.py",
              "/megatron/core/distributed/", "/sparsebalance_megatron/megatron/comm.py")
PREFIX = "[sparsebalance] watchdog:"


@dataclass(frozen=True)
class WatchdogTiming:
    """When a waiting rank judges its peers, and how often records are published."""

    threshold_s: float
    """A rank that has waited in communication this long reads its peers and names the culprit."""
    interval_s: float
    """Heartbeat period."""
    stale_s: float
    """A record unchanged this long means its thread no longer runs (stopped or gone)."""

    @classmethod
    def for_threshold(cls, threshold_s: float) -> "WatchdogTiming":
        interval = min(2.0, max(0.2, threshold_s / 15.0))
        return cls(threshold_s=float(threshold_s), interval_s=interval, stale_s=4.0 * interval)

    @classmethod
    def for_timeout(cls, timeout_s: float) -> "WatchdogTiming":
        """The automatic setting: act a margin before the distributed timeout (10%, at least 2 s
        and three heartbeats), so the job ends before a collective would time out."""
        interval = min(2.0, max(0.2, timeout_s / 30.0))
        margin = max(2.0, 3.0 * interval, 0.1 * timeout_s)
        return cls.for_threshold(max(1.0, timeout_s - margin))


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


def process_state(pid: int) -> Optional[str]:
    """The state letter of a local process (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``
    zombie), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"   # alive, no /proc (not Linux)


class Watchdog:
    """One rank's heartbeat thread and judge. ``tick`` is called by the main thread at every
    progress point; ``stop`` at a normal end."""

    def __init__(self, store, rank: int, world_size: int, timing: Callable[[], WatchdogTiming], *,
                 coords: Optional[dict] = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, out=None,
                 main_frame: Optional[Callable] = None, proc_state=process_state,
                 kill=os.kill, exit=os._exit, pid: Optional[int] = None,
                 host: Optional[str] = None):
        self.store, self.rank, self.world_size, self.timing = store, rank, world_size, timing
        self.coords = dict(coords or {})
        self.clock, self.wall, self.out = clock, wall, out
        main_ident = threading.main_thread().ident
        self.main_frame = main_frame or (lambda: sys._current_frames().get(main_ident))
        self.proc_state, self.kill, self.exit = proc_state, kill, exit
        self.pid, self.host = pid or os.getpid(), host or socket.gethostname()
        self.progress, self.iteration, self.phase = 0, None, "starting"
        self.state = "running"           # running | finished | exited | failed
        self._last_tick = clock()
        self._seq = 0
        self._seen: dict[int, tuple] = {}   # peer -> (seq, local time the seq last changed)
        self._reported = False
        self._peers: dict = {}
        self._verdict_at: Optional[float] = None
        self._thread: Optional[threading.Thread] = None
        self._halt = threading.Event()
        self._prev_excepthook = None

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
        """A normal end (every rank reached it): peers no longer judge this one."""
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.state = "finished"
        self.publish()
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook

    def _atexit(self) -> None:
        if self.state == "running":     # left before the job's end (sys.exit, a return)
            self.state = "exited"
            try:
                self.publish()
            except Exception:           # the store is gone with the job: nothing to tell
                pass

    def _excepthook(self, etype, value, tb) -> None:
        (self._prev_excepthook or sys.__excepthook__)(etype, value, tb)
        if self.state != "running":
            return
        self.state = "failed"
        self.phase = f"{self.phase} ({etype.__name__})"
        self.publish()
        try:
            culprits = [c for c in self._judge(self.timing(), failing=True) if c[0] != "stalled"]
        except Exception:   # the store went away with the job: nothing more to say
            return
        if culprits and self._claim():
            self._say(f"rank {self.rank} failed ({etype.__name__}) while its peers were lost:")
            self._report(culprits, me="failed")

    # --- the thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._halt.wait(self.timing().interval_s):
            try:
                self.poll()
            except Exception as e:   # never take the rank down; say it once
                if not getattr(self, "_poll_failed", False):
                    self._poll_failed = True
                    self._say(f"rank {self.rank}: heartbeat failed ({type(e).__name__}: {e}); "
                              "not watching any more")
                return

    def poll(self) -> None:
        """One heartbeat: publish this rank's record; if the main thread has waited in
        communication for ``threshold_s / 2``, read the verdict and the peers, and act."""
        t = self.timing()
        frame = self.main_frame()
        waiting = waiting_in_communication(frame)
        self.publish(frame, waiting)
        stall = self.clock() - self._last_tick
        if self.state != "running" or stall < t.threshold_s / 2:
            return
        verdict = self._read("verdict")
        if verdict is not None:
            self._obey(verdict, t, stall)
        if not waiting or stall < t.threshold_s:
            self._judge(t)   # keep the peers' heartbeat ages current
            return
        culprits = self._judge(t)
        if culprits and not self._reported and self._claim():
            self._say(f"rank {self.rank} has made no progress for {stall:.1f} s and waits in "
                      f"communication (threshold {t.threshold_s:g} s); the "
                      f"rank{'s' if len(culprits) > 1 else ''} it waits for:")
            self._report(culprits)
            self._end(culprits)

    def publish(self, frame=None, waiting: Optional[bool] = None) -> None:
        self._seq += 1
        if frame is None and self.state == "running" and self._thread is not None:
            frame = self.main_frame()
        stack = _format_stack(frame, STACK_FRAMES)
        rec = dict(rank=self.rank, pid=self.pid, host=self.host, coords=self.coords,
                   seq=self._seq, wall=self.wall(), state=self.state, progress=self.progress,
                   iteration=self.iteration, phase=self.phase,
                   stall_s=round(self.clock() - self._last_tick, 2),
                   waiting=bool(waiting) if waiting is not None else
                   waiting_in_communication(frame), where=_where(frame),
                   stack="".join(stack))
        self.store.set(f"hb/{self.rank}", json.dumps(rec))

    # --- judging --------------------------------------------------------------------------------

    def _read(self, key: str) -> Optional[dict]:
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _judge(self, t: WatchdogTiming, failing: bool = False) -> list:
        """[(kind, why, record)] for the peers that explain the wait, exited and stopped ones
        first (a stalled one is named only when nothing else explains it)."""
        now = self.clock()
        hard, stalled = [], []
        self._peers = {}
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            rec = self._peers[peer] = self._read(f"hb/{peer}")
            if rec is None or rec["state"] in ("finished", "failed"):
                continue   # not started watching, done, or raised (torchrun names that one)
            seq, since = self._seen.get(peer, (None, now))
            if rec["seq"] != seq:
                since = now
            self._seen[peer] = (rec["seq"], since)
            age = now - since
            if failing:   # no history yet: the record's own wall time tells its age
                age = max(age, self.wall() - rec["wall"])
            local = rec["host"] == self.host
            pstate = self.proc_state(rec["pid"]) if local else "?"
            if rec["state"] == "exited":
                hard.append(("exited", f"left the job before its end (process {rec['pid']} on "
                                       f"{rec['host']} exited)", rec))
            elif local and pstate in (None, "Z"):
                hard.append(("exited", f"its process {rec['pid']} on {rec['host']} is gone "
                                       "(killed, or os._exit) before the job's end", rec))
            elif local and pstate in ("T", "t"):
                hard.append(("stopped", f"its process {rec['pid']} on {rec['host']} is stopped "
                                        f"(SIGSTOP or a debugger); heartbeat {age:.1f} s old", rec))
            elif age >= t.stale_s:
                hard.append(("stopped", f"its heartbeat stopped {age:.1f} s ago (process "
                                        f"{rec['pid']} on {rec['host']} frozen or gone)", rec))
            elif not rec["waiting"] and rec["stall_s"] >= t.threshold_s / 2:
                stalled.append(("stalled", f"its heartbeat runs but its main thread has made no "
                                           f"progress for {rec['stall_s']:.1f} s, outside any "
                                           "communication", rec))
        return hard or stalled

    def _claim(self) -> bool:
        """The first rank to call this reports (one block per job)."""
        self._reported = True
        return self.store.add("claim", 1) == 1

    def _report(self, culprits: list, me: str = "waits") -> None:
        for kind, why, rec in culprits:
            where = ", ".join(f"{k} {v}" for k, v in rec["coords"].items())
            it = "" if rec["iteration"] is None else f"iteration {rec['iteration'] + 1}, "
            verb = "has exited" if kind == "exited" else f"is {kind}"
            self._say(f"rank {rec['rank']}{f' ({where})' if where else ''} {verb}: {why}; "
                      f"its last record ({self.wall() - rec['wall']:.1f} s old): {it}phase "
                      f"'{rec['phase']}'")
            self._say(f"rank {rec['rank']}'s last Python stack (main thread):")
            self._say(rec["stack"].rstrip() or "  (none recorded)", raw=True)
        named = {r["rank"] for _, _, r in culprits}
        others = [f"rank {p} " + ("(no record)" if r is None else r["state"]
                                  if r["state"] != "running" else
                                  f"{'waits' if r['waiting'] else 'runs'} in {r['where']}")
                  for p, r in sorted(self._peers.items()) if p not in named]
        self._say(f"the other ranks: rank {self.rank} (this one) {me}; " + "; ".join(others))
        self.store.set("verdict", json.dumps(dict(by=self.rank, ranks=[
            dict(rank=r["rank"], kind=k) for k, _, r in culprits])))

    def _end(self, culprits: list) -> None:
        """End the job before the timeout: a stalled rank ends itself (``_obey``), a stopped one
        on this host gets SIGKILL; when none of them can be ended (gone, or stopped on another
        host) this rank ends itself."""
        self._verdict_at = self.clock()
        ending = False
        for kind, _, rec in culprits:
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
            self._end_self(", ".join(str(r["rank"]) for _, _, r in culprits))

    def _obey(self, verdict: dict, t: WatchdogTiming, stall: float) -> None:
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
        if self.clock() - self._verdict_at >= max(5.0, 3 * t.interval_s):
            # The named rank was not ended (it should have been by now): end this one, so that
            # torchrun tears the job down before the timeout.
            self._end_self(", ".join(map(str, named)))

    def _end_self(self, ranks: str) -> None:
        self._say(f"rank {self.rank} ends itself so the job stops: rank(s) {ranks} cannot "
                  "continue (exit code 1)")
        self._flush()
        self.exit(1)

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


# --- Megatron ------------------------------------------------------------------------------------

def distributed_timeouts_s(args) -> tuple[float, Optional[float]]:
    """(the timeout of Megatron's process groups at start-up, the one after the first step or
    None): ``--distributed-timeout-minutes``, ``--distributed-timeout-seconds-after-init``."""
    after = getattr(args, "distributed_timeout_seconds_after_init", None)
    return 60.0 * float(args.distributed_timeout_minutes), None if after is None else float(after)


def watchdog_problems(args, sb) -> list[str]:
    """A fixed ``--sb-watchdog-seconds`` must act before a collective times out: a line naming the
    first timeout it does not fit in (``preflight.check_parsed`` refuses the launch with it)."""
    w = sb.watchdog_seconds_value
    if not w or getattr(args, "distributed_timeout_minutes", None) is None:
        return []
    init, after = distributed_timeouts_s(args)
    return [f"--sb-watchdog-seconds={sb.watchdog_seconds}: expected fewer seconds than the "
            f"distributed timeout ({timeout:g} s, {flag}): the collectives would time out before "
            "the watchdog names the hung rank; lower it, or use 'auto'"
            for timeout, flag in ((init, "--distributed-timeout-minutes"),
                                  (after, "--distributed-timeout-seconds-after-init"))
            if timeout is not None and w >= timeout][:1]


def start_for_megatron(args, sb) -> Optional[Watchdog]:
    """This rank's watchdog (None with ``--sb-watchdog-seconds 0``), once Megatron's process
    groups exist; its thread starts at the first ``tick``."""
    from megatron.core import parallel_state as ps

    from . import comm

    w = sb.watchdog_seconds_value
    if w == 0 or not comm.is_initialized():
        return None
    init, after = distributed_timeouts_s(args)
    coords = dict(dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                  tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank())
    fixed = WatchdogTiming.for_threshold(w) if w else None
    at_init = fixed or WatchdogTiming.for_timeout(init)
    later = fixed or (WatchdogTiming.for_timeout(after) if after is not None else at_init)
    first: list = []

    def timing() -> WatchdogTiming:
        # Megatron shortens the groups' timeout after the first step of this run.
        it = wd.iteration
        if it is not None and not first:
            first.append(it)
        return later if it is not None and it > first[0] else at_init

    wd = Watchdog(comm.watchdog_store(), comm.rank(), comm.world_size(), timing, coords=coords)
    return wd
