"""Honest prices in the simulator (issue 35): dense attention at cuDNN's measured H100 costs, a
per-call fixed cost of each attention kernel as a latency feature, format 2 tables unchanged, and
the dense + SAB run of the study."""

import json
import os

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, LatencyTableError, ModelShape, analytic_table
from sparsebalance_megatron.latency.analytic import (DeviceProfile, call_layer_coefficients,
                                                     dense_layer_coefficients, flop_price)
from sparsebalance_megatron.latency.features import FEATURES, UnitFeatures
from sparsebalance_megatron.latency.table import FORMAT_VERSION, validate_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "docs", "results", "attention_gpu_h100_run2.json")
FORMAT2 = os.path.join(ROOT, "docs", "results", "latency_table_h100_full.json")
# an idealised sparse kernel at twice the published throughputs and flex's former 0.637 ms per
# call: routes short documents only at d0 0.5
FAST_SPARSE = flop_price(DeviceProfile(attn_fwd_flops=700e12, attn_bwd_flops=560e12),
                         call_s=0.637e-3)


def test_the_measured_constants_are_those_of_the_cited_h100_file():
    rows = json.load(open(KERNELS))["results"]
    assert json.load(open(KERNELS))["heads"] == [8, 2, 128]
    dense = {r["seq_len"]: r["dense_cudnn_ms"] * 1e-3 for r in rows}
    tiles = {n: (n // 128) * (n // 128 + 1) / 2 for n in dense}
    per_tile = (dense[32768] - dense[8192]) / (tiles[32768] - tiles[8192])
    dev = DeviceProfile()
    assert dev.dense_tile_s == pytest.approx(per_tile, rel=1e-4)
    assert dev.dense_call_s == pytest.approx(dense[8192] - tiles[8192] * per_tile, rel=1e-3)
    # the sparse call's price from the same file: test_sparse_call_price.py


def test_dense_attention_at_the_measured_shape_reproduces_cudnn():
    """One layer, the measurement's shape (8 / 2 heads, hn 128, block 128): the dense call plus
    its tiles is cuDNN's measured fwd+bwd at 8K and 32K."""
    shape = ModelShape(num_attention_heads=8, num_query_groups=2, kv_channels=128,
                       hidden_size=1024)
    dev = DeviceProfile()
    per_pair = sum(dense_layer_coefficients(shape, dev, 128).values())
    call = sum(c["dense_calls"] for c in call_layer_coefficients(dev).values())
    for n, ms in ((8192, 1.2104), (32768, 14.3121)):
        nb = n // 128
        assert (call + per_pair * nb * (nb + 1) / 2) * 1e3 == pytest.approx(ms, rel=2e-3)
    # at block 64 the same document costs the same (4x the pairs, a quarter each) but for the
    # diagonal's half tiles
    per64 = sum(dense_layer_coefficients(shape, dev, 64).values())
    assert per64 == pytest.approx(per_pair / 4)


def test_a_dense_run_is_priced_by_the_dense_kernel_not_the_sparse_one_at_density_1():
    m = LatencyModel.analytic(ModelShape(seq_length=32768), pp=4)
    dense = m.all_dense()
    for s in range(4):
        one = dense.predict([32768], 0.5, s)
        assert one == pytest.approx(dense.predict([32768], 1.0, s))     # no density in it
        # cuDNN (measured) is cheaper per pair than the analytic sparse kernel at density 1
        assert one < m.predict([32768], 1.0, s)
        t = dense.unit_terms([[32768]], s)
        assert t.attn_s_per_pair * t.features.attention_work(1.0)[0] == 0.0


def test_a_unit_pays_each_kernels_call_once():
    m = LatencyModel.from_table(analytic_table(routing_density=0.5, sparse_price=FAST_SPARSE))
    n = m.dense_below_tokens
    assert 0 < n < 32768
    c = m._stage_coef[0]
    sparse_call = c["fwd"][6] + c["bwd"][6]
    dense_call = c["fwd"][7] + c["bwd"][7]
    assert sparse_call == pytest.approx(24 * FAST_SPARSE.call_s)
    assert dense_call == pytest.approx(24 * DeviceProfile().dense_call_s)
    plain = m.without_call_costs()
    for docs, calls in (([2 * n], sparse_call), ([n // 4] * 3, dense_call),
                        ([2 * n, n // 4], sparse_call + dense_call)):
        assert m.predict(docs, 0.5, 0) - plain.predict(docs, 0.5, 0) == pytest.approx(calls)
    # SAB's per-document cost leaves the calls out: a micro-batch pays each once
    from sparsebalance_megatron.batching import latency_sample_cost_fn
    cost = latency_sample_cost_fn(m, 0.5)(np.array([n // 4, 2 * n]))
    want = [plain.predict([x], 0.5, 0) - plain.predict_many(
        (np.zeros(2, np.int64), np.zeros(0, np.int64)), 0.5, 0)[0] for x in (n // 4, 2 * n)]
    np.testing.assert_allclose(cost, want, rtol=1e-9)


def test_fit_recovers_the_call_costs_where_the_grid_tells_them_from_const(tmp_path):
    table = analytic_table(routing_density=0.5, sparse_price=FAST_SPARSE, pp=2, seed=3)
    truth = table.pop("call_coefficients")
    del table["coefficients"], table["dense_coefficients"]
    m = LatencyModel.fit(table)
    assert m.table["format_version"] == FORMAT_VERSION == 3
    for kind in ("first", "middle", "last"):
        for p in ("fwd", "bwd"):
            for name, v in truth[kind][p].items():
                assert m.table["call_coefficients"][kind][p][name] == pytest.approx(v, rel=1e-5)
    m.save(str(tmp_path / "t.json"))
    back = LatencyModel.load(str(tmp_path / "t.json"))
    docs = [100] * 20 + [20000]
    assert back.predict(docs, 0.3, 1) == pytest.approx(m.predict(docs, 0.3, 1), rel=1e-12)


def test_a_format_2_table_on_disk_loads_and_predicts_as_before():
    """The H100 table profiled before the per-call features: no call cost (its const holds it),
    so its predictions are its five coefficients' exactly."""
    raw = json.load(open(FORMAT2))
    assert raw["format_version"] == 2 and "call_coefficients" not in raw
    m = LatencyModel.load(FORMAT2)
    mixes = [[16384], [2048] * 8, [300, 5000, 11084]]
    f = UnitFeatures.build(mixes, m.block_size, m.sink_blocks, m.local_blocks)
    c = raw["coefficients"]["only"]
    want = f.matrix(0.5) @ (np.asarray(c["fwd"]) + np.asarray(c["bwd"]))
    np.testing.assert_allclose(m.predict_many(mixes, 0.5, 0), want, rtol=1e-12)
    assert len(m._stage_coef[0]["fwd"]) == len(FEATURES) + 3
    assert not m._stage_coef[0]["fwd"][6:].any()


@pytest.mark.parametrize("mutate,needle", [
    pytest.param(lambda t: t.__setitem__("format_version", 2),
                 r"'call_coefficients': in a format_version 2 table: expected format_version 3",
                 marks=pytest.mark.reliability(
                     area="latency table", case="per-call costs in a format 2 table",
                     expect="refused: error names call_coefficients and format_version 3")),
    pytest.param(lambda t: t["call_coefficients"]["only"]["fwd"].__setitem__("sparse_calls", -1),
                 r"'call_coefficients.only.fwd.sparse_calls': -1: expected a finite number >= 0",
                 marks=pytest.mark.reliability(
                     area="latency table", case="a negative per-call cost",
                     expect="refused: error names the field and the value")),
    pytest.param(lambda t: t["call_coefficients"]["only"]["bwd"].__setitem__("launches", 1e-3),
                 r"'call_coefficients.only.bwd.launches': expected one of",
                 marks=pytest.mark.reliability(
                     area="latency table", case="an unknown per-call feature",
                     expect="refused: error names it and the known ones")),
])
def test_bad_call_coefficients_are_refused_naming_the_field(mutate, needle):
    table = analytic_table()
    mutate(table)
    with pytest.raises(LatencyTableError, match=needle):
        validate_table(table)


def test_context_parallel_does_not_divide_the_call_costs():
    m = LatencyModel.from_table(analytic_table(routing_density=0.5, sparse_price=FAST_SPARSE))
    cp = m.with_context_parallel(2, a2a_bytes_per_s=1e30, collective_latency_s=0.0)
    for p in ("fwd", "bwd"):
        np.testing.assert_allclose(cp._stage_coef[0][p][6:], m._stage_coef[0][p][6:])
        assert cp._stage_coef[0][p][5] == pytest.approx(m._stage_coef[0][p][5] / 2)


def test_the_studys_dense_sab_run_packs_by_sab_with_dense_attention():
    """dense_sab: SAB packing, every document dense; do no harm keeps it no slower than the
    dense run on the same layout (the simulator times what the model predicts)."""
    from sparsebalance_megatron.experiments import StudyConfig, run_study

    lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=2)
    lengths = np.random.default_rng(0).integers(200, 8000, size=400)
    cfg = StudyConfig(microbatches=4, seq_length=8192, steps=2)
    rows = run_study(2, cfg, lm, lengths, {"dense": ("dense", None),
                                           "dense_sab": ("dense_sab", None),
                                           "static": ("static", None)}, baseline="dense")
    assert rows["dense_sab"]["step_time_s"] <= rows["dense"]["step_time_s"]
    assert rows["dense_sab"]["step_time_s"] < rows["dense"]["step_time_s"]   # SAB helped here
    assert rows["dense_sab"]["mean_density"] == rows["dense"]["mean_density"] == 1.0
    assert rows["dense_sab"]["sab_stood_down_steps"][1] == 2
