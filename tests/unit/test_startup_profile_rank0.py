"""Rank 0's side of the start-up profile (megatron/launch/startup_profile.py) without a process group:
the profiler subprocess prints progress lines read from its partial profile, a failure names the
saved samples a retry resumes, and one rank profiles only when the table is missing. The
profiler is a stand-in command (no model is built); two ranks: tests/distributed."""

from __future__ import annotations

import sys

import pytest

from sparsebalance_megatron.latency.partial import PartialProfile, partial_path
from sparsebalance_megatron.megatron.launch import startup_profile


def test_progress_lines_read_the_partial_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = str(tmp_path / "lat.json")
    p = PartialProfile(partial_path(path), {"x": 1}, say=print)
    p.put("total", 40)
    for j in range(12):
        p.put(f"first/0/{j}", [0.1, 0.2])
    p.close()
    assert startup_profile.progress_line(path, 35.2) == "profiling latency: 12/40 samples, 35 s"
    assert startup_profile.progress_line(str(tmp_path / "none.json"), 3) == \
        "profiling latency: 3 s"
    cmd = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    startup_profile.run_profiler(cmd, path, interval_s=0.3)
    out = capsys.readouterr().out
    assert "[sparsebalance] rank 0: profiling latency: 12/40 samples," in out, out


def test_a_failed_profiler_names_the_samples_a_retry_resumes(tmp_path):
    path = str(tmp_path / "lat.json")
    cmd = [sys.executable, "-c", "print('out of memory'); raise SystemExit(3)"]
    with pytest.raises(SystemExit) as e:
        startup_profile.run_profiler(cmd, path, interval_s=60)
    msg = str(e.value)
    assert "latency profiling failed" in msg and partial_path(path) in msg
    assert "out of memory" in msg


def test_one_rank_profiles_only_a_missing_table(tmp_path):
    path = tmp_path / "lat.json"
    calls = []

    def profile():
        calls.append(1)
        path.write_text("{}")

    assert startup_profile.shared_table(str(path), profile, timeout_minutes=1) is None
    assert startup_profile.shared_table(str(path), profile, timeout_minutes=1) is None
    assert calls == [1]
