"""The inference quality study's quick form (issue 73, ``scripts/bench.py inference_quality
--quick``): a 2-layer cut of SmolLM2 scores short samples under every arm and the pilot writes
its margin; (slow) the main run reads it before its first forward and states a verdict. What the
numbers say is not checked: a 2-layer cut retrieves nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("transformers")
pytest.importorskip("gguf")

ARMS = ("uniform", "dst", "matched", "shuffled", "control", "dense")


def study(*argv) -> dict:
    proc = subprocess.run([sys.executable, "scripts/bench.py", "inference_quality", "--quick",
                           *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def pilot(tmp_path_factory):
    path = tmp_path_factory.mktemp("iq") / "pilot.json"
    study("--json", str(path))
    return path


def test_quick_pilot_writes_a_complete_result(pilot):
    p = json.loads(pilot.read_text())
    assert p["complete"] and p["config"]["pilot"] and set(p["margin"]) == {"answer_nll", "loss"}
    assert p["seconds_per_sample"] > 0 and p["samples_in_2h"] > 0
    for s in p["samples"]:
        assert set(s["arms"]) == set(ARMS)
        for arm, r in s["arms"].items():
            assert all(math.isfinite(r[k]) for k in ("answer_nll", "loss", "kept")), arm
            assert 0 < r["kept"] <= 1 and r["exact"] in (0.0, 1.0)
        assert s["arms"]["dense"]["kept"] == pytest.approx(1.0)
        assert len(s["dst_stage_densities"]) == p["config"]["pp"]
    assert p["summary"]["n"] == len(p["samples"]) == p["config"]["samples"]
    assert "verdicts" not in p["summary"] or not p["summary"]["verdicts"]   # pilots judge nothing
    assert set(p["gpu_form"]["lengths"]) == {"16384", "32768"}


@pytest.mark.slow   # a second run of the model (about 30 s); the suite checks the verdict's
def test_main_run_reads_the_pilots_margin(pilot, tmp_path):   # plumbing without a model
    p, main = json.loads(pilot.read_text()), tmp_path / "main.json"
    if not any(p["margin"].values()):
        pytest.skip("the quick pilot's control did no harm: no margin to run the main form with")
    out = study("--margin-from", str(pilot), "--json", str(main))
    m = json.loads(main.read_text())
    assert m["margin"] == p["margin"] and m["margin_source"]["path"] == str(pilot)
    assert m["config"]["seed_base"] == 0 != p["config"]["seed_base"]     # new samples
    assert m["command"].startswith("python scripts/bench.py inference_quality --quick")
    for k, v in m["summary"]["verdicts"].items():
        assert v["verdict"] in ("non-inferior", "inferior", "uninformative", "not matched"), k
        assert v["margin"] == p["margin"][k]
    assert "answer_nll:" in out.stdout or "loss:" in out.stdout


def test_gpu_form_bundle_scores_on_the_cpu_as_the_study_does(pilot, tmp_path):
    """The GPU form (item 5): ``--prepare`` writes the samples, plans, arms' densities and packed
    weights with the pilot's margin; ``--bundle`` (no tokenizer or GGUF reader used) scores them
    in the bundle's order, here on the CPU, and stops starting samples at ``--budget-s``."""
    p = json.loads(pilot.read_text())
    if not any(p["margin"].values()):
        pytest.skip("the quick pilot's control did no harm: no margin to prepare with")
    b = tmp_path / "bundle"
    study("--margin-from", str(pilot), "--prepare", str(b), "--json", str(tmp_path / "x.json"))
    made = json.loads((b / "bundle.json").read_text())
    assert (b / "ids.npz").exists() and (b / "weights" / "weights.json").exists()
    assert made["fixed"]["margin"] == p["margin"]
    assert made["fixed"]["margin_source"]["changed_since_pilot"] == {}     # the same lengths
    assert sorted(made["order"]) == list(range(made["config"]["samples"]))
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "inference_quality", "--bundle",
                           str(b), "--device", "cpu", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    g = json.loads(out.read_text())
    assert g["complete"] and g["bundle"]["device"] == "cpu"
    assert [s["index"] for s in g["samples"]] == made["order"]
    assert g["margin"] == p["margin"] and g["config"]["lengths"] == p["config"]["lengths"]
    assert all(set(s["arms"]) == set(ARMS) for s in g["samples"])
    assert g["arms"]["matched"] == made["dens"]["matched_density"]
    cut = tmp_path / "cut.json"
    subprocess.run([sys.executable, "scripts/bench.py", "inference_quality", "--bundle", str(b),
                    "--budget-s", "0", "--json", str(cut)], cwd=REPO, check=True,
                   capture_output=True, timeout=600)
    c = json.loads(cut.read_text())
    assert c["samples"] == [] and not c["complete"] and c["stopped_by_budget_s"] == 0
