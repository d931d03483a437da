"""The edges of a job (issue 76), each probed from outside as a user would meet it: a refusal said
once per job under torchrun, torchrun's root cause naming it, and under the suite's forked ranks;
a finished run whose torchrun was SIGKILLed mid-run ends rc 0 on every rank, without a traceback
(slow: SB_SLOW_TESTS=1; its cheap form is tests/unit/test_watchdog_stop.py). The planner process's edges (a
stall, another package) are tests/distributed/test_faults.py's and tests/unit/
test_planner_faults.py's; a resume on another layout tests/distributed/test_relayout.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENTRY, TINY_MODEL

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.reliability(area="launch", case="a bad flag (--sb-density 0) on 4 ranks under "
                         "torchrun", expect="the refusal said once, every rank exits 1, "
                         "torchrun's root cause is the refusal's line")
def test_a_refusal_is_said_once_and_is_torchruns_root_cause(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(HERE / "parse_entry.py"), "--sparse-balance", "--sb-density", "0"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300).stdout
    line = "error: --sb-density=0.0: expected a number in (0, 1]"
    assert "[test] the flags passed" not in out
    said = [x for x in out.splitlines() if x.startswith("error:")]
    assert said == [said[0]] and said[0].startswith(line), out[-4000:]
    codes = re.findall(r"^  exitcode  : (-?\d+)", out, re.M)   # torchrun's summary
    assert codes == ["1"] * 4, out[-4000:]                     # no rank stopped by torchrun
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {said[0]}" in root, root
    assert "To enable traceback" not in out


@pytest.mark.slow   # torchrun's two fresh interpreters, 40 steps: about a minute on 2 loaded
# cores; its cheap form is tests/unit/test_watchdog_stop.py (the store gone, the launcher gone)
@pytest.mark.reliability(area="fault", case="torchrun SIGKILLed at iteration 2 of a DP=2 run "
                         "that trains on to its end and saves", expect="every rank exits 0, no "
                         "traceback, the checkpoint written, nothing left running")
def test_a_run_whose_launcher_died_finishes_rc_0(tmp_path, small_jsonl):
    args = [*TINY_MODEL, "--num-layers", "2", "--sparse-balance", "--sb-block-size", "32",
            "--sb-tokenizer", "byte", "--global-batch-size", "4", "--train-iters", "40",
            "--eval-iters", "0", "--data-path", small_jsonl, "--save", tmp_path / "ckpt",
            "--save-interval", "40"]
    out = subprocess.run([sys.executable, str(HERE / "launcher_killer.py"), "iteration        2/",
                          "2", str(ENTRY), *map(str, args)], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["killed"] and len(result["workers"]) == 2, out[-4000:]
    assert set(result["workers"].values()) == {0}, out[-4000:]
    assert all(c == -9 for c in result["others"].values()), result   # children died with them
    assert "Traceback" not in out and "sendBytes failed" not in out, out[-4000:]
    assert "iteration       40/" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"


@pytest.mark.reliability(area="launch", case="a bad input (--sb-density 0) on PP=2 x DP=2 forked "
                         "ranks (their leader hosts the job's store, as torchrun does)",
                         expect="refused in one line said once (the first rank to meet it), the "
                         "job exits 1 before any training")
def test_a_bad_input_is_said_once_per_job(tmp_path, small_jsonl):
    """Every refusal goes through ``runtime.refusal`` (the parse-time checks, the latency table,
    the resume state, the planner's package): one of them at the suite's cheap form of the
    issue's PP=2 x DP=2 probe (four lines there before)."""
    from tests.conftest import run_entry

    proc = run_entry(4, [*TINY_MODEL, "--sparse-balance", "--sb-block-size", "32",
                         "--sb-tokenizer", "byte", "--pipeline-model-parallel-size", "2",
                         "--global-batch-size", "4", "--train-iters", "2",
                         "--data-path", small_jsonl, "--sb-density", "0"], cwd=tmp_path,
                     check=False)
    said = [x for x in proc.stdout.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and len(said) == 1, proc.stdout[-3000:]
    assert said[0].startswith("error: --sb-density=0.0: expected a number in (0, 1]")
    assert "Traceback" not in proc.stdout and "iteration        1/" not in proc.stdout


@pytest.mark.reliability(area="attention", case="PP=2 x DP=2: the fa4 kernel (auto's pick, the "
                         "kernels standing in on the CPU) fails to compile on rank 1 from "
                         "iteration 2 (injected)", expect="rank 1 falls back to triton with one "
                         "warning naming the kernel, shape and error; every rank runs triton from "
                         "the next step, the latency model re-priced by the table's timings; the "
                         "run completes and its metrics name the fallback")
def test_a_failing_attention_kernel_falls_back_and_the_run_completes(tmp_path, small_jsonl,
                                                                      analytic_latency_table_pp2):
    from tests.conftest import PLANNER_THREAD, read_metrics, run_entry

    table = json.loads(Path(analytic_latency_table_pp2).read_text())
    table["attention"]["backend_choice"] = {"chosen": "fa4", "seconds": {
        "fa4": 1.0e-3, "triton": 1.5e-3, "flex": 2.0e-3}}
    path = tmp_path / "lat.json"
    path.write_text(json.dumps(table))
    proc = run_entry(4, [*TINY_MODEL, "--sparse-balance", "--sb-density", "0.5",
                         "--sb-min-density", "0.25", "--sb-block-size", "32", "--sb-tokenizer",
                         "byte", "--eval-iters", "0", "--pipeline-model-parallel-size", "2",
                         "--global-batch-size", "4", "--train-iters", "4", "--data-path",
                         small_jsonl, "--sb-latency-table", path, "--sb-latency-table-force",
                         "--sb-timing-source", "model", "--sb-fault", "1:2:fa4-fails",
                         "--sb-metrics-file", tmp_path / "m.jsonl", *PLANNER_THREAD],
                     cwd=tmp_path)
    out = proc.stdout
    failed = [ln for ln in out.splitlines() if "attention kernel failed on" in ln]
    assert len(failed) == 1 and failed[0].startswith(
        "[sparsebalance] warning: the fa4 attention kernel failed on q ["), failed
    assert "(RuntimeError: --sb-fault: injected compile failure of the fa4 kernel on a new " \
           "shape (rank 1, iteration 2)); falling back to triton" in failed[0]
    follow = [ln for ln in out.splitlines() if "attention kernel fallback:" in ln]
    assert follow == ["[sparsebalance] warning: attention kernel fallback: every rank runs "
                      "triton from iteration 3 on (it replaces fa4, which failed on a rank: its "
                      "warning above); the latency model re-priced x1.50 (the table's profile: "
                      "fa4 1.00 ms, triton 1.50 ms)"], follow
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "attention_fallback" not in rows[0]
    assert all(r["attention_fallback"] == "fa4 -> triton" and r["attention_backend"] == "triton"
               for r in rows[1:]), [r.get("attention_fallback") for r in rows]
