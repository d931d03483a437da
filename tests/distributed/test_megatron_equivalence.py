"""Real Megatron runs on gloo (torchrun): pipeline, data parallel and resume equivalences.

One tiny GPT (4 layers, GQA, RoPE, RMSNorm, SwiGLU) with sparse attention, on real text, packed
THD micro-batches. Every run starts from the same initial checkpoint so weights are identical.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY_MODEL, read_metrics, run_entry

pytestmark = pytest.mark.distributed

SPARSE = ["--sb-sparse-attention", "--sb-density", "0.5", "--sb-block-size", "32",
          "--sb-tokenizer", "byte"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_jsonl):
    """Initial checkpoint + reference run (PP=1, DP=1) with a checkpoint at step 2."""
    d = tmp_path_factory.mktemp("runs")
    common = [*TINY_MODEL, *SPARSE, "--data-path", small_jsonl, "--global-batch-size", "4"]
    # One step at lr 0 writes the initial weights; the runs below load them with --finetune.
    run_entry(1, [*common, "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                  "--save", d / "init", "--save-interval", "1000"], cwd=d)
    run_entry(1, [*common, "--train-iters", "3", "--load", d / "init", "--finetune", "--save", d / "ref",
                  "--save-interval", "2", "--sb-metrics-file", d / "ref.jsonl"], cwd=d)
    return d, common, read_metrics(d / "ref.jsonl")


def _close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def test_pipeline_parallel_matches_single_stage(runs):
    d, common, ref = runs
    run_entry(2, [*common, "--train-iters", "3", "--load", d / "init", "--finetune",
                  "--pipeline-model-parallel-size", "2", "--sb-metrics-file", d / "pp2.jsonl"], cwd=d)
    pp2 = read_metrics(d / "pp2.jsonl")
    assert [r["step"] for r in pp2] == [1, 2, 3]
    for a, b in zip(ref, pp2):
        assert _close(a["loss"], b["loss"], 1e-5), (a["loss"], b["loss"])
        assert _close(a["grad_norm"], b["grad_norm"], 1e-4), (a["grad_norm"], b["grad_norm"])


def test_data_parallel_matches_one_rank_on_the_union(runs):
    d, common, ref = runs
    run_entry(2, [*common, "--train-iters", "3", "--load", d / "init", "--finetune",
                  "--sb-metrics-file", d / "dp2.jsonl"], cwd=d)
    dp2 = read_metrics(d / "dp2.jsonl")
    for a, b in zip(ref, dp2):
        assert a["tokens"] == b["tokens"]  # the same global batch
        # Same gradients: same norm before clipping, and the same loss after each update.
        assert _close(a["grad_norm"], b["grad_norm"], 1e-4), (a["grad_norm"], b["grad_norm"])
        assert _close(a["loss"], b["loss"], 1e-5), (a["loss"], b["loss"])


def test_resume_gives_the_uninterrupted_next_loss(runs):
    d, common, ref = runs
    run_entry(1, [*common, "--train-iters", "3", "--load", d / "ref", "--ckpt-step", "2",
                  "--sb-metrics-file", d / "resumed.jsonl"], cwd=d)
    resumed = read_metrics(d / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3]
    assert _close(resumed[0]["loss"], ref[2]["loss"], 1e-6), (resumed[0]["loss"], ref[2]["loss"])
    assert resumed[0]["tokens"] == ref[2]["tokens"]
