"""The suite's launcher (tests/forked_ranks.py) does what torchrun does for the tests that use it:
torchrun's variables on every rank, a process group that forms, one failed rank ending the job
with exit status 1 and the others stopped, a timeout that kills the job, the torchrun-style
command line for scripts; a test's own group of processes (``conftest.spawn``) fails with its
rank's error; and a plain process (``conftest.run_python``) ends as an interpreter would."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, _forked_ranks, run_python, spawn

pytestmark = pytest.mark.distributed

SCRIPT = '''
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
t = __import__("torch").tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"sum {t.item():g} argv {sys.argv[1:]} name {__name__}", flush=True)
if sys.argv[1:] == ["fail"]:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(300)
if sys.argv[1:] == ["hang"]:
    time.sleep(300)
dist.destroy_process_group()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def _run(script, arg, timeout=120):
    return _forked_ranks().run(script, [arg], 2, script.parent,
                               dict(os.environ, OMP_NUM_THREADS="1"), timeout)


def test_ranks_get_torchruns_variables_and_form_a_group(script):
    proc = _run(script, "ok")
    assert proc.returncode == 0, proc.stdout
    for r in (0, 1):
        assert f"rank {r} of 2 local {r} sum 3 argv ['ok'] name __main__" in proc.stdout


def test_a_failed_rank_ends_the_job_and_stops_the_others(script):
    t0 = time.monotonic()
    proc = _run(script, "fail")
    assert proc.returncode == 1
    assert "RuntimeError: rank 1 fails" in proc.stdout
    assert "forked_ranks: rank 1 exited with 1; stopping the other ranks" in proc.stdout
    assert time.monotonic() - t0 < 60      # rank 0 sleeps 300 s unless stopped


def test_a_job_past_its_timeout_is_killed(script):
    """The job sleeps 300 s: past any timeout, whatever the machine's load; the timeout is
    short (the kill works at any point of the job's start, forked_ranks._kill_job)."""
    with pytest.raises(subprocess.TimeoutExpired):
        _run(script, "hang", timeout=2)
    proc = _run(script, "ok")              # the server takes the next job
    assert proc.returncode == 0, proc.stdout


def _spawned(rank: int, out: str, fail_on: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = __import__("torch").tensor([float(rank) + 1])
    dist.all_reduce(t)
    if rank == fail_on:
        raise RuntimeError(f"rank {rank} fails on purpose")
    with open(f"{out}/{rank}", "w") as f:
        f.write(f"{t.item():g} {os.environ['WORLD_SIZE']}")


def test_a_spawned_function_runs_on_every_rank_and_a_failure_fails_the_call(tmp_path):
    spawn(_spawned, 3, str(tmp_path), -1, cwd=tmp_path)
    assert [(tmp_path / str(r)).read_text() for r in range(3)] == ["6 3"] * 3
    with pytest.raises(AssertionError, match="RuntimeError: rank 1 fails on purpose"):
        spawn(_spawned, 2, str(tmp_path), 1, cwd=tmp_path)


def test_a_plain_process_ends_as_an_interpreter_would(tmp_path):
    code = "import os, sys; print(sys.argv, 'RANK' in os.environ, os.getcwd()); sys.exit(3)"
    proc = run_python(["-c", code, "a"], cwd=tmp_path)
    assert proc.returncode == 3 and f"['-c', 'a'] False {tmp_path}" in proc.stdout, proc.stdout
    proc = run_python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                      cwd=tmp_path)
    assert proc.returncode == -15, proc.stdout
    proc = run_python(["-c", "raise ValueError('bad')"], cwd=tmp_path)
    assert proc.returncode == 1 and "ValueError: bad" in proc.stdout
    assert "forked_ranks:" not in proc.stdout       # a plain process's failure: its own output


MEMO = """
from megatron.core.transformer import TransformerConfig
from megatron.training.argument_utils import ArgumentGroupFactory as F
memo, f = F._get_field_docstrings, F.__new__(F)
got = memo(f, TransformerConfig)
got["added by the caller"] = "?"
assert memo(f, TransformerConfig) == memo.__wrapped__(f, TransformerConfig) != got
print("docstrings", len(memo(f, TransformerConfig)))
"""


def test_a_forked_process_has_megatrons_field_docstrings_as_its_own_parse_gives_them(tmp_path):
    """The server's memo of megatron's field docstrings (``_warm_pure_caches``): a forked process
    gets what megatron's own parse of the class's source gives, and a caller's change to its copy
    stays its own."""
    proc = _forked_ranks().run(f"-c {MEMO}", [], 0, tmp_path, dict(os.environ), 120)
    assert proc.returncode == 0 and "docstrings " in proc.stdout, proc.stdout[-3000:]
    assert int(proc.stdout.split("docstrings ")[1].split()[0]) > 50, proc.stdout


def test_a_script_launches_with_torchruns_command_line(script):
    server = _forked_ranks()
    server.start()
    env = dict(os.environ, OMP_NUM_THREADS="1", SB_FORKED_RANKS=server.path)
    proc = subprocess.run([sys.executable, "tests/forked_ranks.py", "--standalone",
                           "--nproc_per_node=2", str(script), "ok"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1 of 2 local 1 sum 3" in proc.stdout


def test_a_server_whose_parent_is_gone_ends_itself(tmp_path):
    """An interrupted pytest worker leaves no server behind holding megatron-core's memory."""
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from tests.forked_ranks import Server\n"
            "s = Server(); s.start(); print(s.proc.pid, flush=True)\n"
            "import os; os._exit(0)\n") % str(REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1",
                                               SB_FORKED_RANKS_LIGHT="1"))
    pid = int(out.stdout.split()[0])
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, 9)
    raise AssertionError(f"the server {pid} outlived its parent by 30 s")


@pytest.mark.parametrize("given", [True, False])
def test_a_server_keeps_the_environment_it_was_given(tmp_path, monkeypatch, given):
    """The suite's server starts with pytest's own environment, whichever test starts it: a
    ``PYTHONPATH`` a test set for itself (here one whose sitecustomize marks the interpreter)
    does not reach the server every later launch forks from. Without ``env`` (the control) the
    server takes the variables of the moment, and the mark shows."""
    from tests.forked_ranks import Server

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import builtins\nbuiltins.SB_MARKED = True\n")
    start_env = dict(os.environ, SB_FORKED_RANKS_LIGHT="1")
    monkeypatch.setenv("SB_FORKED_RANKS_LIGHT", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    server = Server(env=start_env if given else None)
    try:
        proc = server.run("-c import builtins; print(hasattr(builtins, 'SB_MARKED'))", [], 0,
                          tmp_path, dict(start_env), 60)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip() == ("False" if given else "True"), proc.stdout
