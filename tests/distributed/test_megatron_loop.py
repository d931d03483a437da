"""What Megatron's own training loop gives a --sparse-balance run (torchrun, gloo, CPU).

- TensorBoard: Megatron's scalars and ours (``sparsebalance/...``) in the same event file, read back;
  the console carries Megatron's log line and one ``[sparsebalance]`` line per log interval;
- ``--eval-interval`` runs Megatron's evaluation on the held-out split;
- ``--exit-interval`` stops cleanly, with a checkpoint that holds the plugin state;
- fp16 trains with Megatron's dynamic loss scale (``config.grad_scale_func`` is Megatron's);
- with ``--step-batch-size-schedule`` (Megatron's batch-size rules) a resumed run reads exactly
  the samples the uninterrupted run read: the data position is Megatron's consumed samples.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.conftest import SLOW_ENV, TINY_MODEL, read_metrics, read_scalars, run_entry

pytestmark = pytest.mark.distributed

SB = ["--sb-density", "0.5", "--sb-min-density", "0.25", "--sb-block-size", "32",
      "--sb-tokenizer", "byte"]


def test_tensorboard_eval_and_exit_interval(tmp_path, small_jsonl, tiny_latency_table):
    proc = run_entry(2, [*TINY_MODEL, *SB, "--sparse-balance", "--data-path", small_jsonl,
                         "--global-batch-size", "4", "--train-iters", "6",
                         "--sb-latency-table", tiny_latency_table, "--sb-latency-table-force",
                         "--eval-interval", "2", "--eval-iters", "1", "--exit-interval", "3",
                         "--save", tmp_path / "ckpt", "--save-interval", "100",
                         "--tensorboard-dir", tmp_path / "tb"], cwd=tmp_path)
    out = proc.stdout
    tb = read_scalars(tmp_path / "tb")
    # Megatron's own scalars and ours, at Megatron's iteration numbers; the run exited at 3.
    assert sorted(tb["lm loss"]) == [1, 2, 3]
    for tag in ("sparsebalance/density/mean", "sparsebalance/density/stage0",
                "sparsebalance/density/rank_min", "sparsebalance/density/rank_max",
                "sparsebalance/step_time/predicted_s",
                "sparsebalance/step_time/static_s", "sparsebalance/imbalance/predicted_after",
                "sparsebalance/units/cut", "sparsebalance/units/raised",
                "sparsebalance/overhead_s", "sparsebalance/loss",
                "sparsebalance/dst_stood_down", "sparsebalance/sab_stood_down"):
        assert sorted(tb[tag]) == [1, 2, 3], tag
    assert sorted(tb["sparsebalance/latency_model/error"]) == [2, 3]  # step 1 is warm-up
    for it in (1, 2, 3):
        assert 0.25 - 1e-6 <= tb["sparsebalance/density/mean"][it] <= 1.0
        assert abs(tb["sparsebalance/loss"][it] - tb["lm loss"][it]) <= 1e-5 * tb["lm loss"][it]
    # Evaluation on the held-out split at iteration 2 (Megatron's own).
    assert "validation loss at iteration 2" in out and 2 in tb["lm loss validation"]
    # One [sparsebalance] line per iteration (log interval 1), from one rank only.
    ours = [ln for ln in out.splitlines() if ln.startswith("[sparsebalance] iteration")]
    assert len(ours) == 3 and "density" in ours[0]
    # do no harm (issue 27): the cumulative stand-downs, and a summary at the clean stop
    assert all("stood down DST " in ln for ln in ours)
    assert sum(ln.startswith("[sparsebalance] run summary: stood down DST ")
               for ln in out.splitlines()) == 1
    assert sum("| lm loss:" in ln for ln in out.splitlines()) == 3   # Megatron's log line
    # --exit-interval: a clean stop with a checkpoint carrying the plugin state.
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" /
            "train_dataloader_dprank000.pt").exists()
    assert "CPU RNG state changed" not in out
    assert "watchdog:" not in out   # evaluation, a checkpoint and an early exit: nothing named


@pytest.mark.slow   # 16 s; the other distributed tests train in fp32; the fp16 loss-scale path runs with make test-slow
def test_fp16_trains_with_megatrons_loss_scale(tmp_path, small_jsonl):
    run_entry(1, [*TINY_MODEL, *SB, "--sb-sparse-attention", "--data-path", small_jsonl,
                  "--global-batch-size", "2", "--train-iters", "6", "--eval-iters", "0",
                  "--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2",
                  "--tensorboard-dir", tmp_path / "tb"], cwd=tmp_path)
    tb = read_scalars(tmp_path / "tb")
    scale = [tb["loss-scale"][it] for it in sorted(tb["loss-scale"])]
    # Megatron's dynamic scaler is at work: an overflowing step halves the scale (and is
    # skipped), two clean steps double it (--loss-scale-window 2); either way it moves.
    assert len(set(scale)) > 1 and max(scale) <= 4096, scale
    updated = sorted(tb["grad-norm"])
    assert updated and all(math.isfinite(tb["lm loss"][it]) for it in updated)


@pytest.mark.slow   # 35 s; resume stays in the suite in the PP=2 x DP=2 GPT and Hybrid resumes
@pytest.mark.reliability(area="resume", case="resume at iteration 3 (also 5 with "
                         "SB_SLOW_TESTS=1) under a batch-size schedule (2 then 4)",
                         expect="the same samples as the uninterrupted run")
def test_resume_reads_the_same_samples_under_a_batch_size_schedule(tmp_path, small_jsonl):
    """Batch size 2 for the first 8 samples (2048 tokens), then 4 (--step-batch-size-schedule);
    resumed at 3 (inside the first phase, so the resumed run crosses the change) and, with
    SB_SLOW_TESTS=1, also at 5 (after it)."""
    slow = os.environ.get(SLOW_ENV) == "1"
    common = [*TINY_MODEL, *SB, "--sb-sparse-attention", "--data-path", small_jsonl,
              "--step-batch-size-schedule", "0:2 2048:4", "--train-iters", "7",
              "--eval-iters", "0"]
    run_entry(1, [*common, "--save", tmp_path / "ckpt", "--save-interval", "1" if slow else "3",
                  "--sb-metrics-file", tmp_path / "full.jsonl"], cwd=tmp_path)
    full = read_metrics(tmp_path / "full.jsonl")
    assert [r["samples"] for r in full] == [2, 2, 2, 2, 4, 4, 4]
    for k in (3, 5) if slow else (3,):
        metrics = tmp_path / f"from{k}.jsonl"
        run_entry(1, [*common, "--load", tmp_path / "ckpt", "--ckpt-step", str(k),
                      "--sb-metrics-file", metrics], cwd=tmp_path)
        resumed = read_metrics(metrics)
        assert [r["step"] for r in resumed] == list(range(k + 1, 8))
        for a, b in zip(full[k:], resumed):
            assert (a["samples"], a["consumed_samples"], a["tokens"]) == \
                (b["samples"], b["consumed_samples"], b["tokens"])
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
