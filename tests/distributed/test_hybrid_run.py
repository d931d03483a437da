"""--sparse-balance (DST + SAB) in a HybridModel (``examples/pretrain_hybrid_sparsebalance.py``):
PP=2 x DP=2, four processes on gloo, in Megatron's own ``pretrain()``.

What only a run shows: the plan has one stage per pipeline rank and weights each by its attention
layers (the pattern's ``*``), DST moves units with one rank modelled twice as slow, Megatron
evaluates, and (slow) a run resumed from its checkpoint repeats the uninterrupted one.
"""

from __future__ import annotations

import pytest

from tests.conftest import HYBRID_ENTRY, TINY_MODEL, read_metrics, run_entry
from tests.distributed.test_sparse_balance_run import assert_resumed_like_uninterrupted

pytestmark = pytest.mark.distributed

SB = ["--sparse-balance", "--sb-density", "0.5", "--sb-min-density", "0.25",
      "--sb-block-size", "32", "--sb-tokenizer", "byte",
      "--sb-timing-source", "model", "--sb-straggler-rank", "1", "--sb-straggler-slowdown", "2"]


def _common(pattern, data, table):
    return [*TINY_MODEL, "--hybrid-layer-pattern", pattern, *SB,
            "--pipeline-model-parallel-size", "2", "--data-path", data,
            "--global-batch-size", "4", "--sb-latency-table", table, "--sb-latency-table-force"]


def test_hybrid_entry_trains_pp2_dp2_with_dst_sab_and_eval(tmp_path, small_jsonl,
                                                           analytic_latency_table_pp2):
    metrics = tmp_path / "m.jsonl"
    proc = run_entry(4, [*_common("*-*-", small_jsonl, analytic_latency_table_pp2),
                         "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
                         "--sb-metrics-file", metrics], cwd=tmp_path, entry=HYBRID_ENTRY)
    out = proc.stdout
    assert "in the 2 attention layers of HybridModel '*-*-'" in out and "DST on" in out
    assert "packing sab" in out and "validation loss at iteration 3" in out
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["budgets_consistent"] is True
        assert r["layers_per_stage"] == [2, 2] and r["attention_layers_per_stage"] == [1, 1]
        assert len(r["densities"]) == 2 and all(len(u) == 2 for mb in r["densities"] for u in mb)
        assert 0.25 - 1e-9 <= r["mean_density"] <= 1.0
        assert r["predicted_step_s"] <= r["predicted_static_s"] + 1e-12
    assert any(r["units_cut"] for r in rows), "DST never moved a unit"


@pytest.mark.slow
def test_hybrid_entry_resumes_like_the_uninterrupted_run(tmp_path, small_jsonl,
                                                         analytic_latency_table_pp2):
    common = [*_common("*-|-*", small_jsonl, analytic_latency_table_pp2), "--train-iters", "4",
              "--eval-interval", "2", "--eval-iters", "1"]
    run_entry(4, [*common, "--save", tmp_path / "ckpt", "--save-interval", "2",
                  "--sb-metrics-file", tmp_path / "full.jsonl"], cwd=tmp_path,
              entry=HYBRID_ENTRY, timeout=600)
    state = tmp_path / "ckpt" / "iter_0000002"
    assert any(state.rglob("train_dataloader_dprank*.pt")), "no plugin state in the checkpoint"
    run_entry(4, [*common, "--load", tmp_path / "ckpt", "--ckpt-step", "2",
                  "--sb-metrics-file", tmp_path / "resumed.jsonl"], cwd=tmp_path,
              entry=HYBRID_ENTRY, timeout=600)
    full, resumed = read_metrics(tmp_path / "full.jsonl"), read_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    assert all(r["attention_layers_per_stage"] == [1, 1] for r in full + resumed)
    assert_resumed_like_uninterrupted(full[2:], resumed)
