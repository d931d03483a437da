"""A first run that profiles its latency table starts (megatron/launch/startup_profile.py, issue 28).

Cheap form (2 gloo processes, seconds): the job's process group has a 2 s timeout and rank 0's
profile takes 5 s; rank 1 waits on the profile's own group, prints progress, and gets rank 0's
table, where the former barrier times out (``Timed out waiting``: the control, a 5 s profile
begun once rank 1 is at the barrier). A failing profile stops the waiting rank at once with rank
0's message. Slow form (SB_SLOW_TESTS=1): the README job at ``--seq-length 4096`` with an empty
latency cache and ``--distributed-timeout-minutes 1`` trains, and a run killed while profiling
resumes the profile on its retry.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import spawn

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 2.0
PROFILE_S = 5.0


MODES = ("shared", "fail", "barrier")


def _rank_main(rank: int, out_dir: str) -> None:
    """One rank: join a 2-rank job whose collectives time out after JOB_TIMEOUT_S, then for each
    of MODES wait for a profile (rank 0's) that takes PROFILE_S: ``shared_table`` with a profile
    that succeeds, one that fails, and the former barrier (the control, last: it breaks the
    job's group)."""
    import torch.distributed as dist

    from sparsebalance_megatron.megatron.launch import startup_profile

    out = Path(out_dir)
    sys.stdout = open(out / f"rank{rank}.log", "w", buffering=1)
    # The rendezvous may take a loaded machine longer than the job's timeout: the launcher's
    # store (its leader's, as torchrun's agent hosts it), reached with a timeout of its own; a
    # port picked free by the test could be taken before rank 0 bound it (by the leader's store).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=JOB_TIMEOUT_S))
    results = {}
    for mode in MODES:
        path = str(out / f"lat_{mode}.json")

        def profile(mode=mode, path=path):
            time.sleep(JOB_TIMEOUT_S + 0.5 if mode == "fail" else PROFILE_S)
            if mode == "fail":
                raise SystemExit("error: latency profiling failed: injected")
            Path(path).write_text('{"table": 1}\n')

        t0 = time.monotonic()
        result = {}
        try:
            if mode == "barrier":       # what load_latency_model did before: a barrier
                # Rank 0 profiles once rank 1 is at the barrier (the launcher's store says so):
                # rank 1 leaves the failed mode up to seconds after rank 0 on a loaded machine
                # (3.5 s once beside busy loops), and a profile begun that much earlier ended
                # within the job's timeout of rank 1's arrival: the barrier passed.
                if rank == 0:
                    store.wait(["control"])
                    profile()
                else:
                    store.set("control", "at the barrier")
                dist.barrier()
                got = Path(path).read_bytes()
            else:
                got = startup_profile.shared_table(path, profile, timeout_minutes=1.0,
                                                   interval_s=1.0, poll_s=0.2)
            result.update(ok=True, table=got.decode())
        except (SystemExit, RuntimeError) as e:
            result.update(ok=False, error=str(e))
        result["wait_s"] = time.monotonic() - t0
        results[mode] = result
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)         # no teardown collective: the control broke the job's group


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Both ranks' results of every mode (one ``conftest.spawn`` of two processes for the
    module: forked from the server, which has imported torch and the plugin; two fresh
    interpreters of ``torch.multiprocessing`` cost 3-4 s more CPU)."""
    out = tmp_path_factory.mktemp("startup")
    spawn(_rank_main, 2, str(out), cwd=out)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.reliability(area="start-up profile", case="rank 0 profiles 5 s; the job's distributed "
                         "timeout is 2 s (cheap form of --distributed-timeout-minutes 1 with a "
                         "minutes-long profile)",
                         expect="rank 1 waits on the profile's own group with progress lines and "
                         "gets rank 0's table; a barrier in its place times out")
def test_waiting_rank_outlives_the_job_timeout_and_gets_the_table(runs):
    out, (r0, r1) = runs
    a, b = r0["shared"], r1["shared"]
    assert a["ok"] and b["ok"], (a, b)
    assert a["table"] == b["table"] == '{"table": 1}\n'
    assert b["wait_s"] > JOB_TIMEOUT_S + 1
    log = (out / "rank1.log").read_text()
    assert "[sparsebalance] rank 1: profiling latency:" in log, log
    assert "waiting for rank 0 (at most 1 min: --sb-profile-timeout-minutes)" in log, log
    control = r1["barrier"]          # the former barrier under the job's timeout
    assert not control["ok"] and "Timed out" in control["error"], control


@pytest.mark.reliability(area="start-up profile", case="rank 0's profile fails while rank 1 waits",
                         expect="rank 1 stops at once with rank 0's message, naming rank 0 and "
                         "the table")
def test_a_failed_profile_stops_the_waiting_rank_with_rank_0s_message(runs):
    out, (r0, r1) = runs
    a, b = r0["fail"], r1["fail"]
    assert not a["ok"] and "injected" in a["error"]
    assert not b["ok"]
    assert "rank 0 failed to profile the latency table" in b["error"], b
    assert str(out / "lat_fail.json") in b["error"] and "injected" in b["error"]
    assert b["wait_s"] < 30                   # at once: not the profile timeout (1 min)


# --- the target: the README job ----------------------------------------------------------

def _readme_job(tmp_path: Path, cache: Path, iters: int, log: Path) -> subprocess.Popen:
    """``examples/run_cpu_demo.sh`` at --seq-length 4096, its latency cache in ``cache``, its
    output in ``log``."""
    env = dict(os.environ, PY=sys.executable, TRAIN_ITERS=str(iters), OUT=str(tmp_path / "run"),
               PYTHONUNBUFFERED="1")
    cmd = ["bash", str(REPO / "examples" / "run_cpu_demo.sh"), "--seq-length", "4096",
           "--max-position-embeddings", "4096", "--distributed-timeout-minutes", "1",
           "--sb-data-cache-dir", str(cache), "--eval-interval", "1000", "--log-interval", "1",
           "--lr-warmup-iters", "1"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.reliability(area="start-up profile", case="README job at --seq-length 4096, empty "
                         "latency cache, --distributed-timeout-minutes 1; stopped (SIGTERM to "
                         "torchrun) while profiling, then run again",
                         expect="the retry resumes the saved samples, profiles for more than the "
                         "job's 1-minute timeout while the other ranks wait, and trains")
def test_readme_job_at_4096_profiles_resumes_and_trains(tmp_path):
    cache = tmp_path / "cache"
    first = _readme_job(tmp_path, cache, 2, tmp_path / "first.log")
    partial = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:       # stop the job once samples are saved
        found = list((cache / "latency").glob("*.partial.jsonl")) if cache.exists() else []
        if found and sum(1 for _ in open(found[0])) > 6:
            partial = found[0]
            break
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        time.sleep(2)
    assert partial is not None, "no sample saved within 15 minutes"
    first.send_signal(signal.SIGTERM)        # torchrun stops its workers; the profiler dies
    first.wait(timeout=120)                  # with rank 0 (PR_SET_PDEATHSIG)
    kept = sum(1 for line in open(partial) if '"key"' in line)
    log = tmp_path / "retry.log"
    retry = _readme_job(tmp_path, cache, 2, log)
    retry.wait(timeout=2400)
    out = log.read_text()
    assert retry.returncode == 0, out[-6000:]
    assert f"resuming the latency profile from {partial}" in out, out[-6000:]
    assert "waiting for rank 0" in out and "Timed out" not in out
    assert " iteration        2/" in out, out[-4000:]
    # the retry's own profile outlasted the job's 1-minute timeout: the wait was no barrier
    took = float(re.search(r"latency table profiled in ([0-9.]+) s", out).group(1))
    assert took > 60, took
    assert kept > 0 and not partial.exists()
    print(f"retry: profile resumed from {kept} saved records, {took:.0f} s more")
