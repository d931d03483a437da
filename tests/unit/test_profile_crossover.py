"""The profiler's crossover measurement on CPU (tiny shapes): single documents of increasing block
counts through both kernels, a record the latency table accepts, the crossover by the one rule."""

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.latency import LatencyModel, analytic_table
from sparsebalance_megatron.latency.crossover import crossover_entries, crossover_tokens
from sparsebalance_megatron.latency.table import validate_table


def test_measured_record_goes_into_a_table_and_routes_its_model():
    import torch

    from sparsebalance_megatron.megatron.launch.crossover import measure_crossover

    sb = SparseBalanceConfig(block_size=16, attention_backend="torch", dense_kernel="varlen")
    rec = measure_crossover(sb, num_heads=4, num_groups=2, head_dim=8, max_tokens=96,
                            device="cpu", dtype=torch.float32, repeats=1, warmup=1)
    assert rec["lengths"] == [16, 32, 48, 64, 96]
    assert rec["sparse_kernel"] == "torch" and rec["dense_kernel"] == "loop"   # CPU: the loop
    assert (rec["num_attention_heads"], rec["num_query_groups"], rec["head_dim"]) == (4, 2, 8)
    assert rec["density"] == sb.density and rec["dtype"] == "float32"
    assert all(t > 0 for t in rec["dense_s"] + rec["sparse_s"])
    assert rec["tokens"] == crossover_tokens(rec["lengths"], rec["dense_s"], rec["sparse_s"])
    table = {**analytic_table(), **crossover_entries(rec)}
    del table["coefficients"]
    validate_table(table)
    assert LatencyModel.fit(table).dense_below_tokens == rec["tokens"]


def test_profiler_flag_chooses_where_to_measure():
    from sparsebalance_megatron.megatron.profile_cli import build_parser

    p = build_parser()
    assert p.parse_args(["--out", "x"]).dense_crossover == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "x", "--dense-crossover", "always"])
