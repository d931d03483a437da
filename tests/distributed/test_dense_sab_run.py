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
from pathlib import Path

import pytest

from tests.conftest import ENTRY, TINY_MODEL, read_metrics, run_entry

pytestmark = pytest.mark.distributed

# The tripwire is the entry a rank runs: it replaces block_sparse_attention wherever a loaded
# module holds it (a forked rank's modules were imported by its server, before any test: a
# sitecustomize would never run there), then runs the real entry as __main__.
TRIPWIRE = '''
import runpy, sys
import sparsebalance_megatron.megatron.model.core_attention  # noqa: F401 (what calls it)
from sparsebalance_megatron.attention import api

def _forbidden(*a, **k):
    raise RuntimeError("SB_TEST_FORBID_SPARSE: block_sparse_attention was called")

original = api.block_sparse_attention
for module in list(sys.modules.values()):
    if getattr(module, "block_sparse_attention", None) is original:
        module.block_sparse_attention = _forbidden
sys.argv[0] = {entry!r}
runpy.run_path({entry!r}, run_name="__main__")
'''


def tripwire(tmp_path, entry) -> Path:
    """An entry that runs ``entry`` with every sparse-attention call forbidden."""
    path = tmp_path / "tripwire_entry.py"
    path.write_text(TRIPWIRE.format(entry=str(entry)))
    return path


def test_sab_packing_with_dense_attention_runs_no_sparse_call(tmp_path, small_jsonl):
    from sparsebalance_megatron.latency.analytic import analytic_table
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.latency.table import write_table

    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256)
    table = tmp_path / "analytic.json"
    write_table(analytic_table(shape, block_size=32, transformer_impl="local"), str(table))
    metrics = tmp_path / "m.jsonl"
    proc = run_entry(1, [*TINY_MODEL, "--sb-batching", "--sb-stand-down", "off",
                         "--sb-tokenizer", "byte", "--sb-block-size", "32",
                         "--sb-latency-table", table, "--sb-latency-table-force",
                         "--sb-timing-source", "model", "--data-path", small_jsonl,
                         "--sb-dense-kernel", "sdpa",
                         "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0",
                         "--sb-metrics-file", metrics, "--sb-data-cache-dir", tmp_path / "c"],
                     cwd=tmp_path, entry=tripwire(tmp_path, ENTRY))
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


def test_the_tripwire_trips(tmp_path):
    """The check above cannot pass vacuously: run the same way (a rank forked from the server
    that preloaded the plugin, or torchrun's), an entry that calls the sparse attention the way
    Megatron's core attention does stops at the tripwire."""
    probe = tmp_path / "probe.py"
    probe.write_text("from sparsebalance_megatron.megatron.model import core_attention\n"
                     "core_attention.block_sparse_attention(None, None, None)\n")
    proc = run_entry(1, [], cwd=tmp_path, entry=tripwire(tmp_path, probe), check=False,
                     timeout=120)
    assert proc.returncode != 0 and "SB_TEST_FORBID_SPARSE" in proc.stdout, proc.stdout[-3000:]
