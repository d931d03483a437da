"""The inference study's quick form (``scripts/bench.py inference_quality --quick``): a 6-layer
cut of SmolLM2 scores short samples under every arm of both layouts and the pilot writes its
margins. What the numbers say is not checked: a 6-layer cut retrieves nothing."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.conftest import REPO, run_python

pytest.importorskip("transformers")
pytest.importorskip("gguf")


def bench(*argv) -> subprocess.CompletedProcess:
    proc = run_python(["scripts/bench.py", *argv], cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc


@pytest.fixture(scope="module")
def pilot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("iq")
    path = tmp / "pilot.json"
    bench("inference_quality", "--quick", "--cache", str(tmp / "cache.jsonl"), "--json",
          str(path))
    return path


def test_quick_pilot_writes_a_complete_result(pilot):
    p = json.loads(pilot.read_text())
    arms = {"uniform", "control"} | {f"{a}@{lay}" for a in ("dst", "eqtime", "matched")
                                     for lay in ("pp3", "pp2")}
    assert p["config"]["pilot"] and set(p["margin"]) == {"answer_nll", "loss"}
    assert len(p["samples"]) == p["config"]["samples"] == p["summary"]["n"]
    for s in p["samples"]:
        assert set(s["arms"]) == arms
        for arm, r in s["arms"].items():
            assert all(math.isfinite(r[k]) for k in ("answer_nll", "loss", "kept")), arm
            assert 0 < r["kept"] <= 1 and r["exact"] in (0.0, 1.0)
        # arms with the same densities are the same forward
        same = [a for a in arms if s["vectors"][a] == s["vectors"]["uniform"]]
        assert all(s["arms"][a] == s["arms"]["uniform"] for a in same)
    for lay in ("pp3", "pp2"):
        for step in p["layouts"][lay]["steps"]:
            assert step["equal_time_vs_static"] <= step["predicted_step_vs_static"] + 1e-9
    assert "pp3: dst - uniform (loss, token-weighted)" in p["summary"]["verdicts"]
    assert not any(k.endswith("eqtime (answer_nll)") for k in p["summary"]["verdicts"])


def test_jobs_2_gives_the_summary_of_one_process(pilot, tmp_path):
    """``--jobs 2`` on the pilot's cache less two of its 18 forwards, both of shard 1/2 (jobs
    15 and 17): the child process makes them, this one reads them once the child is done (its
    own shard cached: no model load here, the suite's cost), and the summary is the
    one-process run's."""
    lines = (pilot.parent / "cache.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 18
    cache = tmp_path / "cache.jsonl"
    cache.write_text("".join(lines[:15] + lines[16:17]))
    out = tmp_path / "jobs2.json"
    proc = bench("inference_quality", "--quick", "--jobs", "2", "--cache", str(cache), "--json",
                 str(out))
    # the child's progress line before its end: made there, not here after the wait
    assert proc.stdout.index("[18/18] 2 forwards") < proc.stdout.index("shard 1/2 done")
    assert proc.stdout.count(" forwards, ") == 1
    assert len(cache.read_text().splitlines()) == 18
    one, two = json.loads(pilot.read_text()), json.loads(out.read_text())
    for k in ("summary", "samples", "layouts", "margin", "arms", "kept_density_planned"):
        assert two[k] == one[k], k
