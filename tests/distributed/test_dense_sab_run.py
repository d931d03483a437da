"""SAB packing with dense attention (``--sb-batching`` without sparse attention) in Megatron's
pretrain(), on gloo: the plugin's packing gain for a run that keeps dense attention.

The run must make no sparse-attention call (a tripwire replaces ``block_sparse_attention`` in the
training processes: any call stops the run), pack every step by SAB (``--sb-stand-down off``, so
SAB's packing is committed even when predicted no faster), and say so at launch, with the
dense kernel ``--sb-dense-kernel`` gives its core attention; with
``--sb-microbatch-multiple`` left at 'auto' its micro-batches are variable-length (multiples of
128 tokens: no fill for dense attention), and the launch line says so and why.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import TINY_MODEL, read_metrics, run_entry

pytestmark = pytest.mark.distributed

TRIPWIRE = '''
import os
if os.environ.get("SB_TEST_FORBID_SPARSE") == "1":
    import sparsebalance_megatron.attention as att
    import sparsebalance_megatron.attention.api as api

    def _forbidden(*a, **k):
        raise RuntimeError("SB_TEST_FORBID_SPARSE: block_sparse_attention was called")

    att.block_sparse_attention = api.block_sparse_attention = _forbidden
'''


def test_sab_packing_with_dense_attention_runs_no_sparse_call(tmp_path, small_jsonl,
                                                              monkeypatch):
    from sparsebalance_megatron.latency.analytic import analytic_table
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.latency.table import write_table

    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256)
    table = tmp_path / "analytic.json"
    write_table(analytic_table(shape, block_size=32, transformer_impl="local"), str(table))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TRIPWIRE)
    import os
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("SB_TEST_FORBID_SPARSE", "1")
    metrics = tmp_path / "m.jsonl"
    proc = run_entry(1, [*TINY_MODEL, "--sb-batching", "--sb-stand-down", "off",
                         "--sb-tokenizer", "byte", "--sb-block-size", "32",
                         "--sb-latency-table", table, "--sb-latency-table-force",
                         "--sb-timing-source", "model", "--data-path", small_jsonl,
                         "--sb-dense-kernel", "sdpa",
                         "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0",
                         "--sb-metrics-file", metrics, "--sb-data-cache-dir", tmp_path / "c"],
                     cwd=tmp_path)
    out = proc.stdout
    assert "dense attention (no sparse call; SAB packs by the dense kernel's predicted time)" \
        in out and "packing sab" in out
    assert "dense kernel sdpa (--sb-dense-kernel; CUDA bf16/fp16)" in out   # taken, and said
    assert "SB_TEST_FORBID_SPARSE" not in out
    assert "variable-length micro-batches, multiples of 128 tokens (--sb-microbatch-multiple " \
        "auto: SAB with dense attention pays no fill" in out
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["packing"] == "sab" and r["plan"]["length_multiple"] == 128
        assert "mean_density" not in r              # no density plan: nothing sparse
        assert "kernel_compiles" not in r           # nor a sparse kernel to compile
        assert math.isfinite(r["loss"])


def test_the_tripwire_trips(tmp_path, monkeypatch):
    """The check above cannot pass vacuously: with the tripwire, a sparse call fails."""
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TRIPWIRE)
    import os
    env = dict(os.environ, SB_TEST_FORBID_SPARSE="1", PYTHONPATH=os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = ("from sparsebalance_megatron.attention import block_sparse_attention as f\n"
            "f(None, None, None)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "SB_TEST_FORBID_SPARSE" in proc.stderr
