"""The profiler's crossover measurement on CPU (tiny shapes): packed micro-batches of equal
documents of increasing block counts through both kernels, a record the latency table accepts,
the crossover by the one rule."""

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
    # as many documents as one 96-token micro-batch holds: per-call costs shared, as in training
    assert rec["layout"] == "packed" and rec["docs_per_call"] == [6, 3, 2, 1, 1]
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


def test_each_timed_call_is_one_micro_batch_of_equal_documents(monkeypatch):
    """Both kernels get the same packed documents: the sparse call the boundaries of every
    document (padded as the whole micro-batch), the dense call the same boundaries."""
    import torch

    from sparsebalance_megatron.megatron.launch import crossover

    seen = {"sparse": [], "dense": []}
    real_sparse, real_dense = crossover.block_sparse_attention, crossover.dense_varlen_attention

    def sparse(q, k, v, bounds, *a, **kw):
        seen["sparse"].append((q.shape[0], list(bounds), kw["pad_to_tokens"]))
        return real_sparse(q, k, v, bounds, *a, **kw)

    def dense(q, k, v, docs, **kw):
        seen["dense"].append((q.shape[0], list(docs.bounds)))
        return real_dense(q, k, v, docs, **kw)

    monkeypatch.setattr(crossover, "block_sparse_attention", sparse)
    monkeypatch.setattr(crossover, "dense_varlen_attention", dense)
    sb = SparseBalanceConfig(block_size=16, attention_backend="torch", dense_kernel="varlen")
    crossover.measure_crossover(sb, num_heads=2, num_groups=1, head_dim=8, max_tokens=80,
                                device="cpu", dtype=torch.float32, repeats=1, warmup=0)
    want = {(n * c, tuple(range(0, n * c + 1, n)))          # (tokens, boundaries) per length
            for n, c in ((16, 5), (32, 2), (48, 1), (64, 1), (80, 1))}
    assert {(t, tuple(b)) for t, b, _ in seen["sparse"]} == want
    assert all(pad == 80 for _, _, pad in seen["sparse"])
    assert {(t, tuple(b)) for t, b in seen["dense"]} == want
