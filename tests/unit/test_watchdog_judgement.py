"""The watchdog's judgement (``megatron/watchdog.py``), driven by hand: ranks share an in-memory
store, time is an injected clock, each rank's main-thread stack a real frame made to look as if
it waited in a collective or not, and the process probes, ``kill`` and ``exit`` are recorded
instead of acting. The same code runs on real processes in tests/distributed/test_watchdog.py."""

from __future__ import annotations

import argparse
import io
import signal
import sys
import threading

import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.megatron.watchdog import (
    HUNG_EXIT_CODE,
    Watchdog,
    WatchdogTiming,
    start_for_megatron,
    waiting_in_communication,
    watchdog_problems,
)

TIMING = WatchdogTiming.for_threshold(10.0)


class DictStore:
    """The four calls the watchdog makes on a torch.distributed store; counts the reads."""

    def __init__(self):
        self.data, self.reads = {}, 0

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.reads += 1
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _frame_in(path: str):
    """A real frame whose code lives at ``path`` (how a collective's frame looks)."""
    ns: dict = {}
    exec(compile("import sys\ndef wait_for_peers():\n    return sys._getframe()\n", path, "exec"),
         ns)
    return ns["wait_for_peers"]()


def _hung_in_user_code():
    return sys._getframe()


IN_COLLECTIVE = _frame_in("/venv/lib/python3.12/site-packages/torch/distributed/"
                          "distributed_c10d.py")
HUNG = _hung_in_user_code()


class Job:
    """``n`` ranks on one host (or one host each), sharing a store and a clock."""

    def __init__(self, n=3, one_host=True):
        self.store, self.clock, self.out = DictStore(), Clock(), io.StringIO()
        self.proc = {}               # pid -> state letter (None: gone)
        self.killed, self.exits, self.frames = [], {}, {}
        self.ranks = [self._rank(r, n, one_host) for r in range(n)]

    def _rank(self, r, n, one_host):
        pid = 100 + r
        self.proc[pid] = "S"
        self.frames[r] = IN_COLLECTIVE
        return Watchdog(self.store, r, n, lambda: TIMING, coords=dict(dp=r, pp=0),
                        clock=self.clock, wall=self.clock, out=self.out,
                        main_frame=lambda: self.frames[r], proc_state=self.proc.get,
                        kill=lambda p, s: self.killed.append((p, s)),
                        exit=lambda code: self.exits.setdefault(r, code), pid=pid,
                        host="h" if one_host else f"h{r}")

    def step(self, iteration=0):
        for w in self.ranks:
            w.tick(iteration, f"forward step, iteration {iteration + 1}, micro-batch 0")

    def advance(self, seconds, *, polling=None):
        """Let ``seconds`` pass in heartbeat intervals; ``polling``: the ranks whose thread runs."""
        polling = range(len(self.ranks)) if polling is None else polling
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t += TIMING.interval_s
            for r in polling:
                if r not in self.exits:
                    self.ranks[r].poll()

    def started(self):
        for w in self.ranks:   # what ``start`` does, without its thread and the hooks
            w._thread = threading.Thread(target=lambda: None)
            w._thread.start()
            w.publish()
        return self


def test_timing_acts_before_the_distributed_timeout():
    for timeout in (10, 60, 600):
        t = WatchdogTiming.for_timeout(timeout)
        # judged at threshold + one heartbeat; the named rank ends within another
        assert t.threshold_s + 2 * t.interval_s < timeout, (timeout, t)
        assert t.threshold_s >= 0.8 * timeout   # not much earlier: legitimate waits survive
        assert t.stale_s < t.threshold_s / 2    # a stopped peer is seen as such before judging


def test_a_healthy_run_is_silent_and_reads_no_peer():
    job = Job().started()
    for it in range(20):
        job.step(it)
        job.advance(4.0)   # each step waits in collectives, well under the threshold
    assert job.out.getvalue() == ""
    assert job.store.reads == 0 and not job.killed and not job.exits


def test_a_rank_sleeping_outside_communication_is_named_and_ends_itself():
    job = Job().started()
    job.step(2)
    job.frames[1] = HUNG                    # rank 1 sleeps; ranks 0 and 2 wait for it
    job.advance(TIMING.threshold_s + 2 * TIMING.interval_s)
    out = job.out.getvalue()
    assert "rank 1 (dp 1, pp 0) is stalled" in out, out
    assert "iteration 3, phase 'forward step, iteration 3, micro-batch 0'" in out
    assert "in _hung_in_user_code" in out   # its last Python stack
    assert out.count("is stalled") == 1     # one block, from one rank
    assert "rank 0 " not in out.split("the rank it waits for")[1].split("stack")[0]
    assert ("the other ranks: rank 0 (this one) waits; rank 2 waits in "
            "distributed_c10d.py:wait_for_peers") in out
    assert job.exits == {1: HUNG_EXIT_CODE}, job.exits   # the victims stay
    assert "rank 1 was named by rank" in out and "rank 1 ends itself" in out


def test_ranks_all_waiting_blame_nobody():
    job = Job().started()
    job.step(0)
    job.advance(3 * TIMING.threshold_s)     # a deadlock between collectives: no culprit to name
    assert job.out.getvalue() == "" and not job.exits and not job.killed


def test_a_stopped_rank_on_this_host_is_named_and_killed():
    job = Job().started()
    job.step(4)
    job.advance(TIMING.interval_s)          # one heartbeat of every rank
    job.proc[101] = "T"                     # SIGSTOP: its thread no longer publishes
    job.advance(TIMING.threshold_s + TIMING.interval_s, polling=[0, 2])
    out = job.out.getvalue()
    assert "rank 1 (dp 1, pp 0) is stopped: its process 101 on h is stopped (SIGSTOP" in out, out
    assert "iteration 5" in out and "wait_for_peers" in out   # its last stack, as published
    assert job.killed == [(101, signal.SIGKILL)]
    assert not job.exits


def test_a_frozen_rank_on_another_host_is_named_by_its_heartbeat_and_the_job_ended():
    job = Job(one_host=False).started()
    job.step(0)
    job.advance(TIMING.threshold_s + TIMING.interval_s, polling=[0, 2])   # rank 1's thread stops
    out = job.out.getvalue()
    assert "rank 1 (dp 1, pp 0) is stopped: its heartbeat stopped" in out, out
    assert not job.killed                  # not ours to signal
    assert list(job.exits.values()) == [1]  # the reporter ends itself: torchrun ends the job


def test_a_rank_that_left_early_is_named_exited():
    job = Job().started()
    job.step(1)
    job.proc[102] = None                    # os._exit(0): no mark, the process is gone
    job.advance(TIMING.threshold_s + TIMING.interval_s, polling=[0, 1])
    out = job.out.getvalue()
    assert "rank 2 (dp 2, pp 0) has exited: its process 102 on h is gone" in out, out
    assert list(job.exits.values()) == [1]


def test_a_normal_exit_before_the_end_leaves_a_mark_and_a_finished_rank_is_not_blamed():
    job = Job(one_host=False).started()
    job.step(1)
    job.ranks[2]._atexit()                  # returned from main before the others
    job.ranks[1].stop()                     # reached the end (hooks.finish)
    job.ranks[1]._atexit()                  # ... and then exits: no mark
    job.advance(TIMING.threshold_s + TIMING.interval_s, polling=[0])
    out = job.out.getvalue()
    assert "rank 2 (dp 2, pp 0) has exited: left the job before its end" in out, out
    assert "rank 1 (dp" not in out and "rank 1 finished" in out


def test_a_failing_rank_names_the_peer_it_lost():
    job = Job().started()
    job.step(2)
    job.proc[101] = "Z"                     # rank 1 left; rank 0's collective failed at once
    job.ranks[0]._prev_excepthook = lambda *a: None
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as e:
        job.ranks[0]._excepthook(type(e), e, e.__traceback__)
    out = job.out.getvalue()
    assert "rank 0 failed (RuntimeError) while its peers were lost" in out, out
    assert "rank 1 (dp 1, pp 0) has exited" in out and "rank 2 (dp" not in out
    assert "the other ranks: rank 0 (this one) failed; rank 2 waits in" in out


def test_a_rank_that_raised_is_left_to_torchrun():
    job = Job().started()
    job.step(2)
    job.ranks[1]._prev_excepthook = job.ranks[0]._prev_excepthook = lambda *a: None
    err = RuntimeError("injected")
    job.ranks[1]._excepthook(RuntimeError, err, None)   # rank 1 raised: its own traceback says it
    job.proc[101] = None
    job.ranks[0]._excepthook(RuntimeError, err, None)   # its peer's collective failed after
    assert job.out.getvalue() == ""


def test_waiting_in_communication():
    assert waiting_in_communication(IN_COLLECTIVE)
    assert waiting_in_communication(_frame_in("/x/megatron/core/pipeline_parallel/"
                                              "p2p_communication.py"))
    assert not waiting_in_communication(HUNG) and not waiting_in_communication(None)


@pytest.mark.reliability(area="plugin flags", case="--sb-watchdog-seconds -1 / 'soon'",
                         expect="refused: the error names the flag and what it takes")
@pytest.mark.parametrize("bad", ["-1", "soon", "nan", True])
def test_bad_watchdog_seconds_are_refused(bad):
    with pytest.raises(ConfigError, match=r"--sb-watchdog-seconds=.*: expected 'auto' \(the "
                       r"distributed timeout less a margin\), 0 \(off\) or a number of seconds"):
        SparseBalanceConfig(watchdog_seconds=bad)


def test_a_watchdog_slower_than_the_timeout_is_a_launch_problem():
    args = argparse.Namespace(distributed_timeout_minutes=5,
                              distributed_timeout_seconds_after_init=30)
    assert watchdog_problems(args, SparseBalanceConfig(watchdog_seconds="20")) == []
    assert watchdog_problems(args, SparseBalanceConfig(watchdog_seconds="0")) == []
    assert watchdog_problems(args, SparseBalanceConfig()) == []          # auto fits any
    assert watchdog_problems(args, SparseBalanceConfig(watchdog_seconds="30")) == [
        "--sb-watchdog-seconds=30: expected fewer seconds than the distributed timeout (30 s, "
        "--distributed-timeout-seconds-after-init): the collectives would time out before the "
        "watchdog names the hung rank; lower it, or use 'auto'"]


def test_off_or_without_a_process_group_there_is_no_watchdog(monkeypatch):
    from sparsebalance_megatron.megatron import comm

    args = argparse.Namespace(distributed_timeout_minutes=1,
                              distributed_timeout_seconds_after_init=None)
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    assert start_for_megatron(args, SparseBalanceConfig(watchdog_seconds="0")) is None
    monkeypatch.setattr(comm, "is_initialized", lambda: False)   # whatever other tests left
    assert start_for_megatron(args, SparseBalanceConfig()) is None
