"""--sb-quality-refresh-interval in a real Megatron run (pretrain(), PP=2 on gloo): the quality
model DST plans by is refreshed from forward-only passes of the network being trained.

Checks what only a run shows: the refresh happens at the iterations asked (not at the last),
the last stage's measured loss changes reach the first stage (rank 0 reports them; it has no
loss of its own) and every rank ends with the same scales (the probe checks them over the
pipeline and DP groups, a mismatch stops the run), the refresh's cost is in the metrics and in
the step's plugin overhead, and the passes leave training alone: a step whose plan the refresh
did not change has the loss of the run without refresh, bit for bit; a resumed run plans by
the scales its checkpoint holds."""

from __future__ import annotations

import re

import pytest

from tests.conftest import PLANNER_THREAD, TINY_MODEL, read_metrics, run_entry

pytestmark = pytest.mark.distributed

# 16-token blocks: a 256-token micro-batch's rows hold up to 16 blocks, where 0.45 and 0.5
# keep different counts (at 32-token blocks, 8 per row, they keep the same)
SB = ["--sparse-balance", "--sb-density", "0.5", "--sb-min-density", "0.25",
      "--sb-block-size", "16", "--sb-tokenizer", "byte", "--eval-iters", "0",
      "--sb-dense-below-tokens", "0", "--sb-timing-source", "model"]


def test_refresh_every_two_iterations(tmp_path, small_jsonl, analytic_latency_table_pp2):
    common = [*TINY_MODEL, *SB, "--pipeline-model-parallel-size", "2",
              "--global-batch-size", "4", "--train-iters", "5",
              "--sb-latency-table", analytic_latency_table_pp2, "--sb-latency-table-force"]
    # the refreshed run's held-out documents are a data set of their own (Megatron's per-split
    # paths), so it trains on the documents of the run without a valid split: the same long
    # documents, one per 256-token micro-batch, so the refresh measures two micro-batches and
    # the changes have a standard error (one document's is unknown and moves no scale)
    refresh = [*common, "--train-data-path", small_jsonl, "--valid-data-path", small_jsonl,
               "--sb-quality-refresh-interval", "2", "--sb-quality-refresh-microbatches", "2"]
    proc = run_entry(2, [*refresh, "--sb-metrics-file", tmp_path / "refresh.jsonl",
                         "--save", tmp_path / "ckpt", "--save-interval", "3"], cwd=tmp_path)
    # the run without refresh plans on a thread (the same plans as the planner process): it is
    # what the refreshed run, whose scales reach its planner process, is compared with
    run_entry(2, [*common, "--data-path", small_jsonl, "--split", "100,0,0", *PLANNER_THREAD,
                  "--sb-metrics-file", tmp_path / "plain.jsonl"], cwd=tmp_path)
    rows, plain = read_metrics(tmp_path / "refresh.jsonl"), read_metrics(tmp_path / "plain.jsonl")
    lines = [x for x in proc.stdout.splitlines() if "quality refresh at iteration" in x]
    assert [int(re.search(r"iteration (\d+):", x).group(1)) for x in lines] == [2, 4], lines
    for line in lines:             # two micro-batches, two documents: the errors are known
        se = [float(v) for v in re.search(r"\+- \[([^\]]*)\]", line).group(1).split(",")]
        assert len(se) == 3 and all(0 < v < float("inf") for v in se), line
        assert "document(s) in all" not in line, line
    refreshed = [r["step"] for r in rows if "quality_refresh_s" in r]
    assert refreshed == [2, 4]
    for r in rows:
        if r["step"] in refreshed:
            assert r["quality_refresh_s"] > 0
            assert r["sb_overhead_s"] >= r["quality_refresh_s"]
            assert len(r["quality_scales"]) == 3 and all(0.25 <= s <= 4 for s in
                                                         r["quality_scales"])
    # measured on the last stage, reported by rank 0 (the first stage): the loss changes
    # travelled, and moved the model
    assert any(c != 0 for r in rows if r["step"] in refreshed
               for c in r["quality_refresh_change"])
    assert rows[-2]["quality_scales"] != [1.0, 1.0, 1.0]
    # the passes change no parameter, no RNG: a step planned as in the plain run trains as it
    # did, on the same documents; steps 1-3 were drafted before the first refresh's scales
    # reached the planner
    same = [r["step"] for r, p in zip(rows, plain) if r["densities"] == p["densities"]]
    assert {1, 2, 3} <= set(same)
    for r, p in zip(rows, plain):
        if r["step"] in same:
            assert r["loss"] == p["loss"], (r["step"], r["loss"], p["loss"])
    # the planner process plans by the refreshed model: step 4, the first drafted after the
    # refresh at 2, prices its plan by the scaled curves (the same plan: by the scale itself
    # where every group got the same one)
    scales, priced = rows[1]["quality_scales"], 0
    for r, p in zip(rows, plain):
        q, q0 = r["predicted_loss_change"], p["predicted_loss_change"]
        if r["step"] <= 3:
            assert q == q0
        elif r["step"] in same and abs(q0) > 1e-9:
            priced += 1
            if len(set(scales)) == 1:
                assert q == pytest.approx(scales[0] * q0, rel=1e-9)
            assert q != q0
    assert priced
    # resumed at 3: the refreshed scales come back with the plugin's state (the prepared step's
    # and the next draft's), so steps 4-5 repeat the uninterrupted run, and the refresh at 4
    # scales the model the run had, not the launch-time one
    run_entry(2, [*refresh, "--load", tmp_path / "ckpt", "--ckpt-step", "3",
                  "--sb-metrics-file", tmp_path / "resumed.jsonl"], cwd=tmp_path)
    again = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in again] == [4, 5]
    for a, b in zip(rows[3:], again):
        for key in ("loss", "densities", "predicted_loss_change", "quality_scales",
                    "quality_refresh_change"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))


def test_no_held_out_documents_is_refused_before_training(tmp_path, small_jsonl,
                                                          analytic_latency_table_pp1):
    """A valid split without documents leaves the refresh nothing to measure: one line, before
    the first step."""
    proc = run_entry(1, [*TINY_MODEL, *SB, "--data-path", small_jsonl, "--split", "100,0,0",
                         "--global-batch-size", "2", "--train-iters", "3",
                         "--sb-latency-table", analytic_latency_table_pp1, "--sb-latency-table-force",
                         "--sb-quality-refresh-interval", "1"], cwd=tmp_path, check=False)
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-3000:]
    assert "--sb-quality-refresh-interval 1: the valid split holds no documents" in errors[0]
    assert "iteration        1/" not in proc.stdout


def test_refresh_over_two_data_parallel_ranks(tmp_path, small_jsonl, analytic_latency_table_pp1):
    """DP=2: each DP rank measures its own held-out micro-batch and the sums meet in the DP
    group's all-reduce (the probe stops the run where the ranks' scales differ): the held-out
    documents of both ranks count, so the change has a standard error and is shrunk by it."""
    proc = run_entry(2, [*TINY_MODEL, *SB, "--data-path", small_jsonl, "--global-batch-size", "4",
                         "--train-iters", "3", "--sb-latency-table", analytic_latency_table_pp1,
                         "--sb-latency-table-force", "--sb-quality-refresh-interval", "2",
                         *PLANNER_THREAD, "--sb-metrics-file", tmp_path / "m.jsonl"],
                     cwd=tmp_path)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows if "quality_refresh_s" in r] == [2]
    line = next(x for x in proc.stdout.splitlines() if "quality refresh at iteration 2" in x)
    se = [float(v) for v in re.search(r"\+- \[([^\]]*)\]", line).group(1).split(",")]
    assert len(se) == 3 and any(v > 0 for v in se), line     # documents of both DP ranks
    assert all(0.25 <= s <= 4 for s in rows[1]["quality_scales"])
