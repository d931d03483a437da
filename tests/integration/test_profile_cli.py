"""sparsebalance-profile measures the MLP the run has: a --no-swiglu table loads for a GeLU run
and is refused for a SwiGLU one."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from sparsebalance_megatron.latency import LatencyModel
from sparsebalance_megatron.latency.table import LatencyTableMismatch
from sparsebalance_megatron.megatron.profile import StageShape


def test_no_swiglu_profile_matches_a_gelu_run_only(tmp_path):
    args = SimpleNamespace(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                           num_attention_heads=4, num_query_groups=2, kv_channels=None,
                           padded_vocab_size=256, seq_length=128, micro_batch_size=1,
                           pipeline_model_parallel_size=1, swiglu=False)
    shape = StageShape.from_megatron_args(args)
    out = tmp_path / "gelu.json"
    cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--no-progress", "--out", str(out), *shape.cli_flags(), "--sb-block-size", "32",
           "--mixes", "2", "--densities", "0.5", "1.0", "--repeats", "1"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    m = LatencyModel.load(str(out), expect={"model": shape.as_table_model()})
    assert m.table["model"]["swiglu"] is False and m.predict([128], 0.5, 0) > 0
    swiglu = StageShape.from_megatron_args(SimpleNamespace(**{**vars(args), "swiglu": True}))
    with pytest.raises(LatencyTableMismatch, match="model.swiglu"):
        LatencyModel.load(str(out), expect={"model": swiglu.as_table_model()})
