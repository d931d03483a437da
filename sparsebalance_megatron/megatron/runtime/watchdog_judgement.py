"""The watchdog's judgement, as pure functions: when a waiting rank may act, and which peer it
names. ``runtime/watchdog.py`` feeds them its heartbeat records; unit tests feed them by hand.

The rule (issue 34: a watchdog that never blames a healthy rank):

- a rank judges only when its main thread has been in **one** collective, continuously, for
  ``threshold_s`` (``ContinuousWait``: the same innermost frame at the same instruction, no
  progress point in between). Many short waits, however long together, are never a hang. In
  automatic mode ``threshold_s`` is the distributed timeout less a margin: a wait that long would
  end the job at the timeout anyway, so the watchdog only names the culprit a little earlier;
- it names only a peer that is itself not progressing: gone or marked exited, its heartbeat
  thread frozen for ``stale_s`` (a process seen stopped whose heartbeat is still fresh was only
  paused: SIGSTOP then SIGCONT), or, *stalled*: not waiting in a collective, outside every
  progress phase, and without a progress point for ``threshold_s / 2``;
- progress phases (``PHASES``: evaluation, checkpoint save and load, the optimizer step, data
  loading; entered and left through Megatron's timers) count as progress for as long as they last;
- no rank acts while any rank is inside a checkpoint save: a job ended mid-save loses its
  checkpoint and orphans the save's helper processes, which costs more than waiting for the
  distributed timeout.

Imports nothing of torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Megatron's timer names (``megatron/training/training.py``, megatron-core 0.19-0.20, and our
# forward step's 'batch-generator') -> the progress phase they time.
PHASES = {
    "save-checkpoint": "checkpoint save",
    "save-checkpoint-non-persistent": "checkpoint save",
    "load-checkpoint": "checkpoint load",
    "evaluate": "evaluation",
    "optimizer": "optimizer step",
    "batch-generator": "data loading",
}
SAVE = "checkpoint save"


@dataclass(frozen=True)
class WatchdogTiming:
    """When a waiting rank judges its peers, and how often records are published."""

    threshold_s: float
    """A rank that has waited this long in one collective reads its peers and names the culprit."""
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


class ContinuousWait:
    """Seconds the main thread has spent in its current collective, from samples of its
    innermost frame. The same wait is the same frame object (held here while it waits, so a new
    call cannot reuse its identity), at the same instruction, with no progress point between the
    samples; anything else starts a new wait. Sampled every heartbeat, so it errs short by up to
    one interval, never long."""

    def __init__(self):
        self._frame = None
        self._lasti = self._progress = self._since = None

    def observe(self, frame, waiting: bool, progress: int, now: float) -> float:
        if not waiting or frame is None:
            self._frame = None   # drop the reference: the frame's locals are freed with it
            return 0.0
        if frame is self._frame and frame.f_lasti == self._lasti and progress == self._progress:
            return now - self._since
        self._frame, self._lasti, self._progress, self._since = (frame, frame.f_lasti, progress,
                                                                 now)
        return 0.0

    def clear(self) -> None:
        self._frame = None


def classify(rec: Optional[dict], *, age_s: float, local: bool, pstate: Optional[str],
             t: WatchdogTiming) -> Optional[tuple[str, str]]:
    """(kind, why) when peer record ``rec`` shows a rank that does not progress, else None.
    ``age_s``: how long its record has not changed; ``local``: it runs on this host, where
    ``pstate`` is its process state letter (None: no such process)."""
    if rec is None or rec["state"] in ("finished", "failed"):
        return None   # not watching yet, done, or raised (torchrun names that one)
    where = f"process {rec['pid']} on {rec['host']}"
    if rec["state"] == "exited":
        return "exited", f"left the job before its end ({where} exited)"
    if local and pstate in (None, "Z"):
        return "exited", f"its {where} is gone (killed, or os._exit) before the job's end"
    if age_s >= t.stale_s:
        if local and pstate in ("T", "t"):
            return "stopped", (f"its {where} is stopped (SIGSTOP or a debugger); heartbeat "
                               f"{age_s:.1f} s old")
        return "stopped", f"its heartbeat stopped {age_s:.1f} s ago ({where} frozen or gone)"
    if not rec["waiting"] and not rec.get("busy") and rec["stall_s"] >= t.threshold_s / 2:
        return "stalled", (f"its heartbeat runs but its main thread has made no progress for "
                           f"{rec['stall_s']:.1f} s, outside any communication and any progress "
                           "phase")
    return None


def culprits(judged: list) -> list:
    """[(kind, why, record)] from ``judged`` = [(record, classify's answer)]: exited and stopped
    peers first; a stalled one only when nothing else explains the wait."""
    hard = [(c[0], c[1], r) for r, c in judged if c is not None and c[0] != "stalled"]
    return hard or [(c[0], c[1], r) for r, c in judged if c is not None]


def saving(records: list) -> Optional[int]:
    """The rank of a record inside a checkpoint save (None: no rank saves)."""
    for rec in records:
        if rec is not None and rec["state"] == "running" and SAVE in (rec.get("busy") or ()):
            return rec["rank"]
    return None


def should_act(wait_s: float, found: list, records: list, t: WatchdogTiming) -> bool:
    """Whether a rank that has waited ``wait_s`` in one collective names ``found`` and ends the
    job, given every rank's record (its own included)."""
    return wait_s >= t.threshold_s and bool(found) and saving(records) is None


def torchrun_error(found: list, me: int, how: str, now_wall: float) -> dict:
    """The error file this rank leaves for torchrun (``TORCHELASTIC_ERROR_FILE``) when the peers
    in ``found`` explain its end. torchrun's summary shows one failure as the root cause, and a
    rank that left with ``os._exit(0)`` is no failure to it: the ranks that failed after it carry
    its name instead (the message's first words say the root cause is another rank)."""
    names = "; ".join(f"rank {r['rank']} {'has exited' if k == 'exited' else 'is ' + k}: {why}"
                      for k, why, r in found)
    return {"message": f"[sparsebalance] watchdog: the root cause is not rank {me}: {names}. "
                       f"Rank {me} {how}.", "timestamp": int(now_wall)}


# --- the launch check (``preflight``) ---------------------------------------------------------

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
