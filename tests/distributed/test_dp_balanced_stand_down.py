"""``--sb-stand-down dp_balanced`` in Megatron's pretrain() (torchrun-like forked ranks, gloo, CPU).

At fixed length (``--sb-microbatch-multiple 0``) SAB's micro-batches are filled to --seq-length;
Megatron's dp_balanced packs the same documents into micro-batches of their documents only, as
many per DP rank as its rule makes (not --global-batch-size's count). Where the latency model
predicts that packing faster the stand-down commits it, and Megatron's schedule runs its count:
``step/microbatches.py`` wraps Megatron's micro-batch calculator for the step, while the loop's
consumed samples, its "never fewer micro-batches" check and the learning-rate schedule keep
Megatron's own count (the samples the step's documents were drawn from). Short documents
(40-300 bytes, 256-token micro-batches) make dp_balanced's packing the faster here.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import PLANNER_THREAD, TINY_MODEL, read_metrics, read_scalars, run_entry

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])   # pp 2: 60 s
def test_a_step_with_dp_balanceds_own_microbatch_count_trains(pp, tmp_path, short_docs_jsonl,
                                                               request):
    """DP 2 (pp 2: also the pipeline's stages exchanging each micro-batch's shape, which
    --sb-stand-down dp_balanced turns on at fixed length): step 2 runs 7 micro-batches per DP
    rank where --global-batch-size makes 8, through Megatron's loop, which refuses a count that
    falls (megatron-core 0.19.2's train()), and its learning-rate schedule; a run resumed after
    step 1 (the checkpoint's load calls the calculator too) repeats steps 2-4 exactly."""
    table = request.getfixturevalue(f"analytic_latency_table_pp{pp}")
    iters, gbs, dp = 4, 16, 2
    common = [*TINY_MODEL, "--pipeline-model-parallel-size", str(pp), "--sb-sparse-attention",
              "--sb-batching", "--sb-density", "0.5", "--sb-block-size", "32",
              "--sb-tokenizer", "byte", "--sb-latency-table", table, "--sb-latency-table-force",
              "--sb-timing-source", "model", "--sb-microbatch-multiple", "0",
              "--sb-stand-down", "dp_balanced", "--data-path", short_docs_jsonl,
              *PLANNER_THREAD,   # where the planning runs is not what this tests
              "--sb-data-cache-dir", tmp_path / "cache", "--global-batch-size", str(gbs),
              "--train-iters", str(iters), "--eval-iters", "0"]
    run_entry(dp * pp, [*common, "--sb-metrics-file", tmp_path / "m.jsonl",
                        "--tensorboard-dir", tmp_path / "tb", "--save", tmp_path / "ckpt",
                        "--save-interval", "1"], cwd=tmp_path)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, iters + 1))
    fixed = gbs // dp
    # the stand-down committed dp_balanced's packing, with fewer micro-batches than Megatron's
    assert [(r["packing"], r["microbatches"]) for r in rows[:2]] == \
        [("dp_balanced", fixed), ("dp_balanced", fixed - 1)], rows
    for r in rows:
        assert math.isfinite(r["loss"])
        # Megatron's data position: the samples the step's documents were drawn from
        assert r["samples"] == gbs and r["consumed_samples"] == r["step"] * gbs
        if r["packing"] == "dp_balanced":    # its micro-batches: their documents only
            assert r["positions"] == r["tokens"] < r["microbatches"] * dp * 256
        else:
            assert r["microbatches"] == fixed and r["positions"] == gbs * 256
    tb = read_scalars(tmp_path / "tb")
    assert sorted(tb["lm loss"]) == list(range(1, iters + 1))
    assert all(math.isfinite(v) for v in tb["lm loss"].values())
    if pp > 1:
        return
    run_entry(dp, [*common, "--load", tmp_path / "ckpt", "--ckpt-step", "1",
                   "--save", tmp_path / "again", "--save-interval", "100",
                   "--sb-metrics-file", tmp_path / "resumed.jsonl"], cwd=tmp_path)
    # no checkpoint on a "changed" count (Megatron's loop saves one where its count changes):
    # the count the loop sees is Megatron's at every step, the resumed first one included
    assert sorted(p.name for p in (tmp_path / "again").glob("iter_*")) == ["iter_0000004"]
    resumed = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == list(range(2, iters + 1))
    for a, b in zip(rows[1:], resumed):
        assert (a["microbatches"], a["consumed_samples"], a["tokens"]) == \
            (b["microbatches"], b["consumed_samples"], b["tokens"])
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
