"""A refusal is said once per job (``megatron/runtime/refusal.py``): the first rank to claim the
line on the job's store says it, the others exit with the same code in silence, and every rank
leaves torchrun an error file whose earliest entry (torchrun's root cause) is the line. Ranks are
threads here sharing an in-memory store; torchrun itself: tests/distributed/test_edges.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from sparsebalance_megatron.megatron.runtime import comm, refusal


class Store:
    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.data[key] = self.data.get(key, 0) + n
            return self.data[key]


LINE = "error: --sb-density=0.0: expected a number in (0, 1]"


def test_the_first_rank_says_it_and_every_rank_exits_1(monkeypatch, capsys):
    store, ranks, left = Store(), 4, []
    monkeypatch.setattr(comm, "job_store", lambda timeout_s: store)
    monkeypatch.setattr(refusal, "_world_size", lambda: ranks)
    monkeypatch.setattr(refusal, "_exit_together", lambda: left.append(dict(store.data)))
    monkeypatch.setattr(refusal, "_exit_on_terminate", lambda: None)   # (pytest's process)
    results = {}

    def rank(r):
        results[r] = refusal.refusal(LINE).code

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(map(str, results.values())) == ["1", "1", "1", LINE]
    assert capsys.readouterr().err == LINE + "\n"             # said once, at once
    # every rank left only once every rank had met the refusal and left its error file (none
    # stopped on its way): both counts full
    assert [sorted(d.values()) for d in left] == [[ranks, ranks]] * ranks
    # another line is another claim: said too (its rank waits for ranks that never come)
    monkeypatch.setattr(refusal, "ALL_MET_S", 0.2)
    assert refusal.refusal(LINE + " (another)").code == LINE + " (another)"


def test_the_error_file_makes_the_line_torchruns_root_cause(monkeypatch, tmp_path, capsys):
    said, quiet = (refusal.error_file_record(LINE, s, r, now=1000.0)
                   for s, r in ((True, 2), (False, 0)))
    assert said == {"message": LINE, "timestamp": 1000}
    assert quiet["timestamp"] == 1001 and "rank 0 refused the launch as well" in \
        quiet["message"]
    # torchrun's rule: the root cause is the failure with the smallest timestamp
    assert min((quiet, said), key=lambda rec: rec["timestamp"])["message"] == LINE
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(comm, "is_initialized", lambda: False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "1")                     # one process: rank 0 would say it
    e = refusal.say_refusal(LINE)
    assert e.code == 1 and capsys.readouterr().err == ""
    assert "rank 1 refused the launch as well" in \
        json.loads((tmp_path / "error.json").read_text())["message"]
    monkeypatch.setenv("RANK", "0")
    assert refusal.refusal(LINE).code == LINE           # Python prints it as the rank ends
    assert refusal.say_refusal(LINE).code == 1 and capsys.readouterr().err == LINE + "\n"
    assert json.loads((tmp_path / "error.json").read_text())["message"] == LINE


@pytest.mark.parametrize("rank,says", [("0", True), ("3", True)])
def test_without_a_store_every_rank_says_it(monkeypatch, rank, says):
    """Another launcher, before the process group: no store to claim on, and rank 0 alone could
    be stopped by the launcher before it says it (a silent rank left first): every rank."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(comm, "is_initialized", lambda: False)
    assert refusal._refuse(LINE) is says


def test_a_store_that_fails_says_it_here(monkeypatch):
    def broken(timeout_s):
        raise RuntimeError("DistNetworkError: connection refused")

    monkeypatch.setattr(comm, "job_store", broken)
    monkeypatch.setattr(refusal, "_world_size", lambda: 4)
    assert refusal._refuse(LINE) is True                # said twice rather than never


def test_a_rank_stopped_by_torchrun_while_it_waits_exits_with_the_refusals_code():
    """torchrun SIGTERMs the ranks still running once one has left: a rank that met the refusal
    leaves with 1 all the same (-15 was a second failure, whichever rank happened to be
    slower). Driven by a signal sent once the rank is waiting, not by timing."""
    child = textwrap.dedent("""
        import time
        from sparsebalance_megatron.megatron.runtime import comm, refusal

        class Store:
            def __init__(self):
                self.data = {}

            def add(self, key, n):
                self.data[key] = self.data.get(key, 0) + n
                return self.data[key]

        store = Store()
        comm.job_store = lambda timeout_s: store
        refusal._world_size = lambda: 2        # the other rank never comes

        def wait(store, key, world):
            print("waiting", flush=True)
            time.sleep(600)

        refusal._wait_for_all = wait
        refusal._refuse("error: --sb-density=0.0: expected a number in (0, 1]")
        print("returned", flush=True)
    """)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, (out, err)
    assert err.strip() == LINE and "returned" not in out
