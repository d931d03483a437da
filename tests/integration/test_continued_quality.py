"""The continued-training quality study's quick form (issue 73, ``scripts/bench.py
continued_quality --quick``): the pilot (base, static, control) writes its margin, and scored
again at ``--eval-jobs 2`` gives the same scores; the main form reads the margin, keeps the
pilot's checkpoints, trains the other arms (the refresh arm on a valid set of its own) and the
matched arm under a name that carries its density (other seeds give another density: no stale
run is reused), and states a verdict. What
the numbers say is not checked: two steps learn nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def study(*argv) -> str:
    proc = subprocess.run([sys.executable, "scripts/bench.py", "continued_quality", "--quick",
                           *argv], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow   # about 2 min: eight short pretrain() runs, the pilot evaluated twice
def test_quick_pilot_then_main_run(tmp_path):
    out, pilot, main = tmp_path / "runs", tmp_path / "pilot.json", tmp_path / "main.json"
    study("--out", str(out), "--json", str(pilot))
    p = json.loads(pilot.read_text())
    assert p["config"]["pilot"] and set(p["runs"]) == {"base", "static", "control"}
    assert set(p["margin"]) == {"answer_nll", "heldout_loss"}
    for scores in out.glob("*/eval.json"):      # the checkpoints kept, scored again in 2
        scores.unlink()
    study("--out", str(out), "--json", str(tmp_path / "pilot2.json"), "--eval-jobs", "2")
    p2 = json.loads((tmp_path / "pilot2.json").read_text())
    assert json.dumps(p2["runs"]) == json.dumps(p["runs"]) and p2["means"] == p["means"]
    if not any(p["margin"].values()):
        pytest.skip("the quick pilot's control did no harm: no margin to run the main form with")
    log = study("--out", str(out), "--margin-from", str(pilot), "--json", str(main))
    assert "kept static_s1" in log and "kept control_s1" in log        # the pilot's runs reused
    m = json.loads(main.read_text())
    # the refresh arm: its own valid set, the model refreshed at step 1 (not the last), read
    # against the plain DST run
    refreshed = m["runs"]["refresh"]["1"]["train"]
    assert refreshed["quality_refreshes"] == [1] and refreshed["quality_refresh_s"] > 0
    # one global batch's held-out micro-batches: 8 at micro-batch 1, 4 per DP rank of 2
    assert m["arms"]["refresh"]["flags"][-4:] == ["--sb-quality-refresh-interval", "1",
                                                   "--sb-quality-refresh-microbatches", "4"]
    assert m["config"]["refresh_microbatches"] == 4 and (out / "refresh4mb_s1" / "ckpt").exists()
    assert set(m["verdicts_refresh"]["at_d0"]) == {"answer_nll", "heldout_loss"}
    d_m = m["arms"]["matched"]["eval_density"]
    assert (out / f"matched{d_m:.4f}_s1" / "ckpt").exists()
    assert m["margin"] == p["margin"] and set(m["verdicts"]) <= {"answer_nll", "heldout_loss"}
    for v in m["verdicts"].values():
        assert v["verdict"] in ("non-inferior", "inferior", "uninformative", "not matched")
