"""The trained-quality study's quick form (issue 62, ``scripts/bench.py trained_quality --quick``):
every arm (dense, static sparse, --sparse-balance, DST with the density objective) trains a few
steps in Megatron's pretrain() under torchrun (DP 2, gloo), saves its checkpoint, is evaluated
from it, and the one JSON holds every field with finite numbers. What the numbers say is not
checked: three steps of a 2-layer model mean nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, script_launch_env

pytestmark = pytest.mark.distributed

ARMS = ("dense", "static", "sparse_balance", "dst_density")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_quick_study_writes_a_complete_result(tmp_path):
    out = tmp_path / "tq.json"
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "trained_quality", "--quick",
                           "--out", str(runs), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **script_launch_env()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for key in ("command", "commit", "versions", "device", "config", "runs", "paired",
                "density_match", "heldout", "wall_s"):
        assert key in doc, key
    assert doc["command"].startswith("python scripts/bench.py trained_quality --quick")
    assert doc["timing_source"] == "model" and doc["same_tokens_every_step"] is True
    seeds, depths = doc["config"]["seeds"], [f"{d:g}" for d in doc["config"]["depths"]]
    assert set(doc["runs"]) == set(ARMS)
    for arm in ARMS:
        for s in seeds:
            run = doc["runs"][arm][str(s)]
            tr = run["train"]
            assert tr["steps"] == doc["config"]["steps"]
            for k in ("final_train_loss", "mean_kept_density", "mean_planned_density"):
                assert finite(tr[k]), (arm, k, tr[k])
            assert 0 < tr["mean_kept_density"] <= 1
            for k in ("dst_steps_cut", "dst_steps_raised", "dst_units_cut", "dst_units_raised"):
                assert isinstance(tr[k], int) and tr[k] >= 0, (arm, k)
            if arm != "dense":      # the documents' densities, padding left out
                for k in ("doc_planned_density", "doc_kept_density", "doc_kept_d0_density"):
                    assert finite(tr[k]) and 0 < tr[k] <= 1, (arm, k, tr[k])
                moves = tr["dst_moves"]
                assert moves["raised"] == tr["dst_units_raised"]
                assert moves["cut"] == tr["dst_units_cut"]
                assert 0 <= moves["raised_keeping_no_block"] <= moves["raised"]
                assert 0 <= moves["cut_keeping_no_block"] <= moves["cut"]
            assert run["primary"] in run["eval"]
            assert set(run["eval"]) == {"1", f"{doc['config']['density']:g}"}
            for ev in run["eval"].values():
                for k in ("heldout_loss", "accuracy", "token_accuracy",
                          "eval_kept_density"):
                    assert finite(ev[k]), (arm, k, ev[k])
                assert set(ev["accuracy_by_depth"]) == set(depths)
                assert all(finite(v["accuracy"]) and v["n"] > 0
                           for v in ev["accuracy_by_depth"].values())
    assert doc["runs"]["dense"][str(seeds[0])]["train"]["mean_kept_density"] == 1.0
    assert set(doc["paired"]) == {"sparse_balance-static", "dst_density-static",
                                  "sparse_balance-dst_density", "static-dense",
                                  "sparse_balance-dense"}
    for pair in doc["paired"].values():
        for k in ("heldout_loss", "accuracy", "doc_kept_density",
                  *(f"accuracy@depth{d}" for d in depths)):
            assert finite(pair[k]["mean"]) and len(pair[k]["per_seed"]) == len(seeds), k
    assert set(doc["density_match"]) == {"sparse_balance", "dst_density"}
    assert [r["arm"] for r in doc["densities"]] == ["static", "sparse_balance", "dst_density"]
    static = doc["densities"][0]
    assert static["doc_kept_density"] == static["doc_kept_d0_density"]
    # the recorded steps re-planned by the same planner: the plans the runs committed
    again = tmp_path / "replan.json"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "trained_quality", "--quick",
                           "--out", str(runs), "--densities-only", "--replan",
                           "--json", str(again)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads(again.read_text())["densities"]}
    for arm in ("sparse_balance", "dst_density"):
        got = rows[f"{arm} re-planned"]
        assert got["plans_as_recorded"] == got["dst_plans"], (arm, got)
        assert got["doc_kept_density"] == rows[arm]["doc_kept_density"], arm
