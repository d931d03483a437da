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

import time

import pytest

from tests.conftest import TINY_MODEL, run_entry

pytestmark = pytest.mark.distributed

FLAGS = [*TINY_MODEL, "--num-layers", "2", "--sb-sparse-attention", "--sb-block-size", "32",
         "--sb-tokenizer", "byte", "--global-batch-size", "4", "--train-iters", "4",
         "--eval-iters", "0", "--distributed-timeout-minutes", "5"]
BOUND_S = 240   # the stall this guards against: 300 s (the distributed timeout) and more


def _run(tmp_path, small_jsonl, fault, extra=()):
    t0 = time.monotonic()
    proc = run_entry(2, [*FLAGS, "--data-path", small_jsonl, "--sb-fault", fault, *extra,
                         "--sb-metrics-file", tmp_path / "m.jsonl"], cwd=tmp_path,
                     timeout=600, check=False)
    return proc, time.monotonic() - t0


@pytest.mark.reliability(area="fault", case="an exception on rank 1 at iteration 2",
                         expect="the job ends within the bound, rank 1's traceback printed")
def test_an_exception_on_one_rank_ends_the_job(tmp_path, small_jsonl):
    proc, wall = _run(tmp_path, small_jsonl, "1:2:raise")
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


@pytest.mark.reliability(area="fault", case="rank 1 hangs at iteration 3",
                         expect="the watchdog names rank 1 with its stack before the peers' "
                         "timeout (10 s after the first step) would strike; the job ends")
def test_a_hung_rank_is_named_before_the_users_timeout(tmp_path, small_jsonl):
    proc, wall = _run(tmp_path, small_jsonl, "1:3:hang",
                      ["--distributed-timeout-seconds-after-init", "10"])
    assert proc.returncode != 0
    assert "injecting 'hang' on rank 1 at iteration 3" in proc.stdout
    # --sb-watchdog-seconds auto: 10 s less the margin, from the second step on
    assert "(threshold 8 s)" in proc.stdout, proc.stdout[-3000:]
    assert "watchdog: rank 1 (dp 1, pp 0, tp 0, cp 0) is stalled" in proc.stdout
    assert "in _inject_fault" in proc.stdout and "rank 1 ends itself" in proc.stdout
    assert "exitcode  : 3" in proc.stdout   # torchrun's root cause: the hung rank
    assert wall < BOUND_S, wall
