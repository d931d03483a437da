"""Context parallelism (--context-parallel-size 2 --cp-comm-type a2a) in Megatron's pretrain()
with --sparse-balance, on gloo.

CP x DP: a CP=2 x DP=2 run trains like the DP=2 run on the same packed micro-batches
(``--sb-seq-pad-multiple 4`` gives the CP=1 run CP=2's padding): the same DST plans (a modelled
straggler makes them cut and raise), losses and gradient norms, step after step. CP x PP: a
CP=2 x PP=2 run trains and evaluates, with DST moving densities per micro-batch and stage, and
every rank (both CP ranks of a stage included) served the broadcast plan. The analytic latency
table and modelled timings make the plans a function of the data alone.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import TINY_MODEL, read_metrics, read_scalars, run_entry

pytestmark = pytest.mark.distributed

CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
SB = ["--sparse-balance", "--sb-density", "0.5", "--sb-min-density", "0.25",
      "--sb-block-size", "32", "--sb-tokenizer", "byte", "--sb-latency-table-force",
      "--sb-timing-source", "model", "--global-batch-size", "4", "--train-iters", "3"]


@pytest.fixture(scope="module")
def analytic_table_pp1(tmp_path_factory):
    from sparsebalance_megatron.latency.analytic import analytic_table
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.latency.table import write_table

    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256, pp=1)
    out = tmp_path_factory.mktemp("lat") / "analytic_pp1.json"
    write_table(analytic_table(shape, pp=1, block_size=32, transformer_impl="local"), str(out))
    return out


def _close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def test_cp2_x_dp2_trains_like_dp2(tmp_path, small_jsonl, analytic_table_pp1):
    common = [*TINY_MODEL, *SB, "--sb-latency-table", analytic_table_pp1, "--data-path",
              small_jsonl, "--eval-iters", "0", "--sb-straggler-rank", "1",
              "--sb-straggler-slowdown", "2", "--sb-data-cache-dir", tmp_path / "cache"]
    run_entry(4, [*common, *CP2, "--sb-metrics-file", tmp_path / "cp2.jsonl",
                  "--tensorboard-dir", tmp_path / "tb_cp2"], cwd=tmp_path)
    run_entry(2, [*common, "--sb-seq-pad-multiple", "4", "--sb-metrics-file",
                  tmp_path / "cp1.jsonl", "--tensorboard-dir", tmp_path / "tb_cp1"], cwd=tmp_path)
    cp2, cp1 = read_metrics(tmp_path / "cp2.jsonl"), read_metrics(tmp_path / "cp1.jsonl")
    assert [r["step"] for r in cp2] == [r["step"] for r in cp1] == [1, 2, 3]
    for a, b in zip(cp2, cp1):
        assert a["budgets_consistent"] is True and b["budgets_consistent"] is True
        assert a["densities"] == b["densities"]                      # the same DST plans
        assert _close(a["loss"], b["loss"], 1e-5), (a["step"], a["loss"], b["loss"])
    # the straggler made DST cut one DP rank and raise the other: densities differ per unit
    assert any(len({d for rank in r["densities"] for mb in rank for d in mb}) > 1 for r in cp2)
    tb2, tb1 = read_scalars(tmp_path / "tb_cp2"), read_scalars(tmp_path / "tb_cp1")
    for it in (1, 2, 3):
        assert _close(tb2["lm loss"][it], tb1["lm loss"][it], 1e-5), it
        assert _close(tb2["grad-norm"][it], tb1["grad-norm"][it], 1e-4), it


@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable-length"])
def test_cp2_x_pp2_trains_and_evaluates(tmp_path, request, variable, analytic_latency_table_pp2):
    """Fixed-length micro-batches of the stdlib texts; or variable-length ones
    (--sb-microbatch-multiple 32) of short documents, DST planning on the units that end where
    the micro-batches do (test_variable_length_run.py: they train like fixed-length ones)."""
    metrics = tmp_path / "m.jsonl"
    data = request.getfixturevalue("short_docs_jsonl" if variable else "small_jsonl")
    extra = ["--sb-microbatch-multiple", "32"] if variable else []
    out = run_entry(4, [*TINY_MODEL, *SB, *CP2, *extra, "--pipeline-model-parallel-size", "2",
                        "--sb-latency-table", analytic_latency_table_pp2, "--data-path",
                        data, "--eval-interval", "2", "--eval-iters", "1",
                        "--sb-metrics-file", metrics], cwd=tmp_path).stdout
    assert "validation loss at iteration 2" in out
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["budgets_consistent"] is True and math.isfinite(r["loss"])
        assert len(r["density_per_stage"]) == 2
        if variable:
            assert r["positions"] < 4 * 256 and r["positions"] % 32 == 0
    # bubble filling raised some micro-batch's stage: densities vary per unit
    assert any(len({d for mb in r["densities"][0] for d in mb}) > 1 for r in rows)
