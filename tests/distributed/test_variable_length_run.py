"""Variable-length micro-batches (--sb-microbatch-multiple) in Megatron's pretrain(), on gloo.

A micro-batch that ends where its documents end (rounded up to the multiple) trains exactly like
the fixed-length one: padding sequences are outside the loss and outside every document's
attention, so only the fill's linear-layer work goes. Checked at PP=2 x CP=2, where Megatron's
stages exchange each tensor's shape first (``variable_seq_lengths``, which the plugin sets) and
each CP rank holds its zigzag share of a micro-batch of any length. The documents are short
(40-300 bytes, byte tokenizer, 256-token micro-batches), so the fill is a real share of the step.
With --sparse-balance and evaluation: test_context_parallel_run.py's CP x PP test, variable case.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY_MODEL, close, read_metrics, read_scalars, run_entry

pytestmark = pytest.mark.distributed

PP2_CP2 = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
           "--cp-comm-type", "a2a"]
COMMON = ["--sb-density", "0.5", "--sb-block-size", "32", "--sb-tokenizer", "byte",
          "--sb-latency-table-force",
          "--sb-timing-source", "model", "--global-batch-size", "4", "--train-iters", "3",
          "--eval-iters", "0"]


@pytest.mark.slow   # 52 s; variable-length micro-batches stay in the suite through the CP=2 x PP=2 variable-length run
def test_variable_length_microbatches_train_like_fixed_ones(tmp_path, short_docs_jsonl,
                                                            analytic_latency_table_pp2):
    # static sparse attention and SAB packing: the same micro-batches in both runs
    common = [*TINY_MODEL, *COMMON, *PP2_CP2, "--sb-sparse-attention", "--sb-batching",
              "--sb-latency-table", analytic_latency_table_pp2, "--data-path", short_docs_jsonl,
              "--sb-data-cache-dir", tmp_path / "cache"]
    for name, extra in (("fixed", []), ("var", ["--sb-microbatch-multiple", "32"])):
        run_entry(4, [*common, *extra, "--sb-metrics-file", tmp_path / f"{name}.jsonl",
                      "--tensorboard-dir", tmp_path / f"tb_{name}"], cwd=tmp_path)
    fixed, var = read_metrics(tmp_path / "fixed.jsonl"), read_metrics(tmp_path / "var.jsonl")
    assert [r["step"] for r in fixed] == [r["step"] for r in var] == [1, 2, 3]
    for a, b in zip(fixed, var):
        assert a["tokens"] == b["tokens"]                          # the same documents
        assert a["positions"] == 4 * 256                           # fixed: 4 x --seq-length
        assert b["tokens"] <= b["positions"] <= a["tokens"] + 4 * 31   # rounded up to 32 each
        assert b["positions"] % 32 == 0
        assert close(a["loss"], b["loss"], 1e-5), (a["step"], a["loss"], b["loss"])
    assert sum(b["positions"] for b in var) < 0.95 * sum(a["positions"] for a in fixed)
    tf, tv = read_scalars(tmp_path / "tb_fixed"), read_scalars(tmp_path / "tb_var")
    for it in (1, 2, 3):
        assert close(tf["lm loss"][it], tv["lm loss"][it], 1e-5), it
        assert close(tf["grad-norm"][it], tv["grad-norm"][it], 1e-4), it
