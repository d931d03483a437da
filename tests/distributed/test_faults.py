"""Fail fast: a rank that raises, dies or hangs ends the whole torchrun job soon, with that rank's
error in the output, instead of leaving its peers waiting for the distributed timeout.

Faults are injected with ``--sb-fault RANK:STEP:KIND`` (test-only flag) into rank 1's forward step
of iteration 2 or 3 of a DP=2 run (gloo, CPU). The bound on the job's duration is generous (a
loaded machine starts a run in about half a minute) but far below what a stall would cost: the
distributed timeout is 5 minutes here, and every process group gets it (Megatron's groups are made
with ``--distributed-timeout-minutes``; ``--distributed-timeout-seconds-after-init`` shortens it
after the first step, which the hang case uses; the watchdog then names the hung rank before
that timeout strikes: tests/distributed/test_watchdog.py has its cases)."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.conftest import PLANNER_THREAD, TINY_MODEL, read_metrics, read_scalars, run_entry

pytestmark = pytest.mark.distributed

FLAGS = [*TINY_MODEL, "--num-layers", "2", "--sb-sparse-attention", "--sb-block-size", "32",
         "--sb-tokenizer", "byte", "--global-batch-size", "4", "--train-iters", "4",
         "--eval-iters", "0", "--distributed-timeout-minutes", "5"]
BOUND_S = 240   # the stall this guards against: 300 s (the distributed timeout) and more


def _run(tmp_path, small_jsonl, fault, extra=(), launcher="torchrun"):
    """A faulted job, under torchrun itself unless ``launcher``: where the test reads how the job
    ended, that is torchrun's part (its summary names the root cause; a rank's error file)."""
    t0 = time.monotonic()
    proc = run_entry(2, [*FLAGS, "--data-path", small_jsonl, "--sb-fault", fault, *extra,
                         "--sb-metrics-file", tmp_path / "m.jsonl"], cwd=tmp_path,
                     timeout=600, check=False, launcher=launcher)
    return proc, time.monotonic() - t0


@pytest.mark.reliability(area="fault", case="an exception on rank 1 at iteration 2",
                         expect="the job ends within the bound, rank 1's traceback printed")
def test_an_exception_on_one_rank_ends_the_job(tmp_path, small_jsonl):
    proc, wall = _run(tmp_path, small_jsonl, "1:2:raise", PLANNER_THREAD, launcher=None)
    assert proc.returncode != 0
    assert "RuntimeError: --sb-fault: injected failure on rank 1 at iteration 2" in proc.stdout
    assert wall < BOUND_S, wall
    assert "iteration        2/" not in proc.stdout   # no rank got past the failed step


@pytest.mark.reliability(area="fault", case="rank 1 killed (SIGKILL) at iteration 2",
                         expect="the job ends within the bound, the dead rank named")
def test_a_killed_rank_ends_the_job(tmp_path, small_jsonl):
    proc, wall = _run(tmp_path, small_jsonl, "1:2:kill")
    assert proc.returncode != 0
    assert "Signal 9 (SIGKILL)" in proc.stdout or "exitcode  : -9" in proc.stdout, \
        proc.stdout[-3000:]
    assert wall < BOUND_S, wall


# (distributed timeout after init, --sb-watchdog-seconds, the threshold the watchdog says). The
# suite's form sets the threshold 30 s before the timeout, so a loaded machine's late heartbeat
# or sample cannot let the peers' collective time out first (it did, once in two runs at load
# 12 on 2 cores, with the automatic 2 s margin of a 10 s timeout); the automatic threshold is
# the slow form's (and WatchdogTiming.for_timeout's unit tests).
@pytest.mark.parametrize("timeout_s,watchdog,threshold", [
    pytest.param("40", "10", "10", id="fixed"),
    pytest.param("10", "auto", "8", id="auto", marks=pytest.mark.slow)])
@pytest.mark.reliability(area="fault", case="rank 1 hangs at iteration 3",
                         expect="the watchdog names rank 1 with its stack before the peers' "
                         "timeout would strike; the job ends")
def test_a_hung_rank_is_named_before_the_users_timeout(tmp_path, small_jsonl, timeout_s,
                                                       watchdog, threshold):
    proc, wall = _run(tmp_path, small_jsonl, "1:3:hang",
                      ["--distributed-timeout-seconds-after-init", timeout_s,
                       "--sb-watchdog-seconds", watchdog])
    assert proc.returncode != 0
    assert "injecting 'hang' on rank 1 at iteration 3" in proc.stdout
    # auto: the timeout after the first step less the margin, from the second step on
    assert f"(threshold {threshold} s)" in proc.stdout, proc.stdout[-3000:]
    assert "watchdog: rank 1 (dp 1, pp 0, tp 0, cp 0) is stalled" in proc.stdout
    assert "in _inject_fault" in proc.stdout and "rank 1 ends itself" in proc.stdout
    assert "exitcode  : 3" in proc.stdout   # torchrun's root cause: the hung rank
    assert wall < BOUND_S, wall
    assert _planner_orphans(tmp_path) == []   # every rank's planner process died with it


def _planner_orphans(cwd, wait_s: float = 30.0) -> list:
    """Planner processes left by the job that ran in ``cwd`` (the test's ``tmp_path``: a planner
    starts in its rank's working directory), after the kernel had ``wait_s`` to deliver their
    SIGKILL (``PR_SET_PDEATHSIG`` acts asynchronously). Called once the job has ended, so every
    such process outlived its rank. Matched by working directory, not by a parent of pid 1: the
    planners of tests running beside this one (another pytest worker, another checkout's suite)
    are not this job's, and a subreaper would adopt an orphan in pid 1's place."""
    root = os.path.realpath(cwd)
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
                where = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if b"sparsebalance_megatron.megatron.step.planner_worker" in cmd and state != "Z" \
                    and (where == root or where.startswith(root + os.sep)):
                found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


PLANNER_FAULTS = "1:3:planner-kill-idle,2:4:planner-kill-drafting,3:5:planner-stop"


@pytest.fixture(scope="module")
def planner_base(tmp_path_factory, small_jsonl, tiny_latency_table_pp2):
    """(flags, metrics) of the uninterrupted PP=2 x DP=2 SAB + DST run the planner-fault runs
    are compared with (one for the module)."""
    tmp = tmp_path_factory.mktemp("planner_base")
    common = [*TINY_MODEL, "--sparse-balance", "--sb-density", "0.5", "--sb-min-density",
              "0.25", "--sb-block-size", "32", "--sb-tokenizer", "byte", "--eval-iters", "0",
              "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
              "--train-iters", "6", "--data-path", small_jsonl,
              "--sb-latency-table", tiny_latency_table_pp2, "--sb-latency-table-force",
              "--sb-timing-source", "model", "--sb-straggler-rank", "1",
              "--sb-straggler-slowdown", "2"]
    # planned on a thread (the same plans as the planner process): the faulty runs, whose
    # planner processes die, stall or stop, are what the test is about
    run_entry(4, [*common, *PLANNER_THREAD, "--sb-metrics-file", tmp / "base.jsonl"], cwd=tmp)
    return common, read_metrics(tmp / "base.jsonl")


def _assert_plans_as_uninterrupted(base: list, faulty: list) -> None:
    """Every step's plan and loss of the faulty run equal the uninterrupted run's."""
    assert [r["step"] for r in faulty] == [r["step"] for r in base] == list(range(1, 7))
    assert any(r["units_cut"] or r["units_raised"] for r in base), "DST never moved a unit"
    for a, b in zip(base, faulty):
        for key in ("tokens", "densities", "predicted_step_s", "predicted_static_s",
                    "units_cut", "units_raised", "dst_stood_down"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["step"], a["loss"],
                                                                     b["loss"])


@pytest.mark.reliability(area="fault", case="PP=2 x DP=2, SAB + DST: rank 1's planner process "
                         "killed while idle (iteration 3's draft), rank 2's while drafting (4), "
                         "rank 3's stopped with SIGSTOP (5; the default --sb-planner-timeout, "
                         "30 s)",
                         expect="the run finishes; one warning line per event naming the rank, "
                         "pid, phase and signal; the stall costs at most its deadline (3x the "
                         "recent drafts' median, at least 0.5 s), not 30 s; every step's plan "
                         "and loss equal the uninterrupted run's; TensorBoard counts the "
                         "events; no process left")
def test_a_dead_or_stalled_planner_costs_a_step_not_the_job(tmp_path, planner_base):
    """Modelled timings (a 2x straggler), so the plans depend on nothing measured: the faulty
    run must plan every step as the uninterrupted one did, each failed draft redone on the
    training thread from the same inputs."""
    common, base = planner_base
    proc = run_entry(4, [*common, "--sb-fault", PLANNER_FAULTS,
                         "--sb-metrics-file", tmp_path / "faulty.jsonl",
                         "--tensorboard-dir", tmp_path / "tb"], cwd=tmp_path)
    out = proc.stdout
    warnings = re.findall(r"warning: rank (\d): the SparseBalance planner process \(pid \d+\) "
                          r"(.*?); the training thread drafts", out)
    said = {}                      # every warning of each rank (a loaded machine may add one)
    for r, what in warnings:
        said.setdefault(int(r), []).append(what)
    assert any("ended while idle after" in w and "with signal 9 (SIGKILL)" in w
               for w in said[1])
    assert "ended while drafting iteration 4 with signal 9 (SIGKILL)" in said[2]
    stall = [w for w in said[3] if re.match(r"stalled: iteration 5's draft was not (made|sent)", w)]
    assert stall and "it was stopped (state T); killed" in stall[0], stall
    # what the stall cost the step: its deadline, from the recent drafts, not the 30 s timeout
    deadline, median, waited = (float(x) for x in re.search(
        r"its deadline ([0-9.]+) s: 3x the recent drafts' median ([0-9.]+) s, at least 0.5 s, "
        r"at most 30 s; waited ([0-9.]+) s at the step's end", stall[0]).groups())
    assert deadline == pytest.approx(max(0.5, 3 * median), abs=0.011), stall[0]
    # the join waits out what is left of the deadline (a loaded machine may wake it late)
    assert waited < deadline + 5.0, stall[0]
    # (whether a restarted process is ready before the run's last draft depends on the
    # machine: the restart itself is tested on fake processes, tests/unit/test_plan_ahead.py)
    assert "restart 1 of 3" in out
    faulty = read_metrics(tmp_path / "faulty.jsonl")
    _assert_plans_as_uninterrupted(base, faulty)
    # every event counted once, over every rank (a loaded machine may add a true stall)
    assert faulty[-1]["planner_events_total"] == len(warnings) >= 3
    total = read_scalars(tmp_path / "tb")["sparsebalance/planner/events_total"]
    assert total[max(total)] == len(warnings)
    assert _planner_orphans(tmp_path) == []


@pytest.mark.reliability(area="fault", case="PP=2 x DP=2, SAB + DST: rank 1's planner process "
                         "killed after the first DST round it settles iteration 3's draft with, "
                         "rank 2's at iteration 4", expect="the run finishes; one warning line "
                         "each naming the rank, pid and 'while settling', the round replayed; "
                         "every step's plan and loss equal the uninterrupted run's; no process "
                         "left")
def test_a_planner_killed_mid_rounds_leaves_every_plan_as_the_uninterrupted_runs(
        tmp_path, planner_base):
    """The rounds the dead process made were made with its DP peers (relayed by the rank's
    reader thread): the training thread drafts the step again, replays them and makes the rest
    beside the peers' relayed ones, so the plan is the one the uninterrupted run made."""
    common, base = planner_base
    out = run_entry(4, [*common, "--sb-fault",
                        "1:3:planner-kill-agreeing,2:4:planner-kill-agreeing",
                        "--sb-metrics-file", tmp_path / "faulty.jsonl"], cwd=tmp_path).stdout
    for rank, it in ((1, 3), (2, 4)):
        line = re.search(rf"warning: rank {rank}: the SparseBalance planner process \(pid \d+\) "
                         rf"ended while settling iteration {it}'s DST .*", out)
        assert line and "signal 9 (SIGKILL)" in line[0], out[-4000:]
        assert "its 1 DST round(s) over the DP group replayed, the rest made" in line[0]
    faulty = read_metrics(tmp_path / "faulty.jsonl")
    _assert_plans_as_uninterrupted(base, faulty)
    assert faulty[-1]["planner_events_total"] >= 2
    assert _planner_orphans(tmp_path) == []
