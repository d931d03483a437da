"""The simulator prices the sparse call from the kernel that runs (issue 40): flex measured on an
H100 for what ``auto`` runs today, a device kernel table's own rows where one is given (the
fastest at the micro-batch, as ``auto`` picks), the Triton kernel as a labelled estimate from the
work model, and every simulated row named with what priced it."""

import json
import os

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, ModelShape, analytic_table
from sparsebalance_megatron.latency.features import FEATURES
from sparsebalance_megatron.latency.sparse_call import (FLEX_H100, HBM_BYTES_PER_S,
                                                        LENGTH_FREE_BACKENDS, auto_price,
                                                        fit_price, kernel_labels, kernel_rows,
                                                        price_named, table_sparse_kernel,
                                                        triton_estimate)
from sparsebalance_megatron.latency.work import attention_work

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN2 = os.path.join(ROOT, "docs", "results", "attention_gpu_h100_run2.json")
DEVICE_TABLE = os.path.join(ROOT, "docs", "results", "latency_table_h100_full.json")


def test_the_flex_price_is_the_fit_of_the_cited_h100_file_and_reproduces_its_rows():
    rows = kernel_rows(RUN2)
    assert {r["backend"] for r in rows} == {"flex"} and len(rows) == 8     # sink 1 rows
    fit = fit_price(rows, "flex", "run2")
    for name in ("call_s", "call_s_per_token", "tile_s"):
        assert getattr(FLEX_H100, name) == pytest.approx(getattr(fit, name), rel=1e-4)
    for r in rows:          # the whole call (selection + kernel), every length and density
        kept = attention_work([r["tokens"]], r["density"], 128, 1)
        assert FLEX_H100.call_fwd_bwd_s(r["tokens"], kept) * 1e3 == pytest.approx(r["ms"],
                                                                                  rel=0.1)
    # flex's kernel costs ~3 ms at 8K whatever the density: the fixed part says so
    assert FLEX_H100.call_fwd_bwd_s(8192, 0) > 3e-3


def test_auto_without_a_device_measurement_is_flex_as_the_runtime_picks():
    from sparsebalance_megatron.attention.api import AUTO_UNMEASURED
    price = auto_price()
    assert price is FLEX_H100 and price.backend == AUTO_UNMEASURED and price.measured


def _device_rows(tmp_path, triton_ms):
    """A kernel table in ``scripts/bench.py attention_gpu``'s format: flex as run2 measured it and a
    triton kernel with the given ms per (tokens, density)."""
    rows = [dict(case="single", shape="8/2/128", tokens=r["tokens"], backend="flex",
                 density=r["density"], routing="none", ours_ms=r["ms"])
            for r in kernel_rows(RUN2)]
    rows += [dict(case="single", shape="8/2/128", tokens=t, backend="triton", density=d,
                  routing="none", ours_ms=ms) for (t, d), ms in triton_ms.items()]
    rows.append(dict(case="single", shape="14/2/64", tokens=8192, backend="triton",
                     density=0.5, routing="none", ours_ms=0.001))      # another shape: unused
    path = tmp_path / "kernel_table.json"
    path.write_text(json.dumps({"rows": rows}))
    return kernel_rows(str(path))


def test_a_device_kernel_table_prices_each_backend_and_auto_takes_the_fastest(tmp_path):
    # triton timed as 0.1 ms + 0.3 us per kept tile: faster than flex at 32K
    fast = {(t, d): 0.1 + 0.3e-3 * attention_work([t], d, 128, 1)
            for t in (8192, 32768) for d in (1.0, 0.5, 0.25)}
    rows = _device_rows(tmp_path, fast)
    price = auto_price(rows, microbatch_tokens=32768, density=0.5)
    assert price.backend == "triton" and price.measured
    assert price.tile_s == pytest.approx(0.3e-6, rel=1e-6)
    assert price.call_s == pytest.approx(1e-4, rel=1e-6)
    # the measurement replaces the estimate
    assert price_named("triton", rows).measured
    # a slow triton loses to flex: auto is flex again
    slow = {k: 10 * v + 20 for k, v in fast.items()}
    assert auto_price(_device_rows(tmp_path, slow)).backend == "flex"


def test_at_variable_lengths_auto_prices_only_a_length_free_kernel(tmp_path):
    """--sb-microbatch-multiple K > 0: the runtime's auto chooses among the length-free kernels
    only (``crossover.auto_candidates``), flex compiling per length. So does the simulator: a
    faster flex is passed over, and with no table flex's figure stands in, labelled."""
    from sparsebalance_megatron.megatron.launch.crossover import auto_candidates
    from sparsebalance_megatron.config import SparseBalanceConfig
    assert auto_candidates(SparseBalanceConfig(microbatch_multiple="128")) == \
        LENGTH_FREE_BACKENDS
    slow = {(t, d): 20 + 10 * (0.1 + 0.3e-3 * attention_work([t], d, 128, 1))
            for t in (8192, 32768) for d in (1.0, 0.5, 0.25)}
    rows = _device_rows(tmp_path, slow)
    assert auto_price(rows).backend == "flex"                       # fixed lengths: fastest
    assert auto_price(rows, length_free=True).backend == "triton"    # variable: length-free
    assert price_named("auto", rows, length_free=True).backend == "triton"
    flex_only = [r for r in rows if r["backend"] == "flex"]
    with pytest.raises(ValueError, match=r"no length-free backend \(fa4, triton"):
        auto_price(flex_only, length_free=True)
    stand = auto_price(length_free=True)
    assert stand.stands_in_for == "fa4 or triton" and not FLEX_H100.stands_in_for
    assert (stand.call_s, stand.tile_s) == (FLEX_H100.call_s, FLEX_H100.tile_s)
    assert stand.describe().startswith("flex (STANDING IN for fa4 or triton")
    table = analytic_table(ModelShape(seq_length=8192), pp=2, sparse_price=stand)
    assert kernel_labels(table)["sparse"][0] == "flex stand-in"


def test_a_backend_with_too_few_rows_is_not_priced(tmp_path):
    with pytest.raises(ValueError, match=r"backend 'triton': 1 rows at 1 lengths"):
        fit_price([dict(backend="triton", tokens=8192, density=0.5, ms=1.0, block_size=128)],
                  "triton", "x")


def test_the_triton_estimate_is_the_work_model_scaled_from_flexs_measured_rate():
    from sparsebalance_megatron.attention import work_model
    est = triton_estimate()
    assert not est.measured and "ESTIMATE" in est.describe()
    ours = work_model.attention_flops(1, 8, 128, 128)
    rate = FLEX_H100.tile_s / work_model.attention_flops(1, 8, 128, 128,
                                                         one_pass_backward=False)["total"]
    # the backward's key tile as launched (triton_launch: the H200's pin takes the whole
    # 128-key block at hn 128; the default's 64-key tiles double the dQ adds, and at HBM
    # bandwidth those take longer than the backward's GEMMs at flex's rate)
    from sparsebalance_megatron.attention.triton_launch import default_config, launch_config
    key_tile = launch_config(128, 128, 4).bwd_block_n
    dq_s = work_model.dq_traffic(1, 8, 128, 128, key_tile=key_tile)["atomic"] / HBM_BYTES_PER_S
    assert est.tile_s == pytest.approx(ours["fwd"] * rate + max(ours["bwd"] * rate, dq_s),
                                       rel=1e-9)
    assert work_model.dq_traffic(1, 8, 128, 128, key_tile=default_config(128, 128, 4)
                                 .bwd_block_n)["atomic"] / HBM_BYTES_PER_S > ours["bwd"] * rate
    assert not est.selection_in_call
    assert price_named("triton") == est              # nothing measured it: the estimate


def test_the_analytic_table_charges_the_price_per_layer_call_and_names_it():
    shape = ModelShape(seq_length=32768)
    lm = LatencyModel.analytic(shape, pp=4)
    terms = FLEX_H100.layer_terms(shape.num_attention_heads, shape.head_dim, 64, 32768)
    per_stage = shape.num_layers // 4
    for p in ("fwd", "bwd"):
        c = lm.table["call_coefficients"]["middle"][p]["sparse_calls"]
        assert c == pytest.approx(per_stage * terms[p]["call"], rel=1e-12)
        coef = lm.table["coefficients"]["middle"][p]
        assert coef[FEATURES.index("attention_work")] == pytest.approx(
            per_stage * terms[p]["pair"], rel=1e-12)
        assert coef[FEATURES.index("selection_work")] == 0.0       # measured with the call
    assert lm.table["sparse_call"]["backend"] == "flex" and lm.table["sparse_call"]["measured"]
    assert kernel_labels(lm.table)["sparse"][0] == "flex"
    est = LatencyModel.analytic(shape, pp=4, sparse_price=triton_estimate())
    assert kernel_labels(est.table)["sparse"][0] == "triton est."
    assert "ESTIMATE" in table_sparse_kernel(est.table)
    # flex's measured call costs far more per call than the estimate's launches, and a
    # micro-batch of short documents pays it: the estimate is the cheaper kernel there
    calls = [t.table["call_coefficients"]["middle"]["fwd"]["sparse_calls"] for t in (lm, est)]
    assert calls[0] > 20 * calls[1]
    short = [2048] * 16
    assert lm.predict(short, 0.5, 1) > est.predict(short, 0.5, 1)


def test_a_device_latency_table_names_its_own_kernel():
    table = json.load(open(DEVICE_TABLE))
    assert table["attention"]["backend"] == "auto" and "sparse_call" not in table
    assert table_sparse_kernel(table).startswith("flex (auto before any measurement; measured")
    table["attention"]["backend"] = "triton"
    assert kernel_labels(table)["sparse"][0] == "triton"
    assert "measured: NVIDIA H100" in table_sparse_kernel(table)


def test_every_simulated_row_names_the_kernel_that_priced_it():
    from sparsebalance_megatron.experiments import StudyConfig, format_table, run_study
    lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=2)
    lengths = np.random.default_rng(0).integers(200, 8000, size=300)
    rows = run_study(2, StudyConfig(microbatches=4, seq_length=8192, steps=1), lm, lengths,
                     {"static": ("static", None), "dense": ("dense", None)})
    assert rows["static"]["attention_kernel"] == "flex"
    assert rows["static"]["attention_priced_by"].startswith("flex (measured")
    assert rows["dense"]["attention_kernel"] == "cudnn"
    text = format_table("t", {2: rows})
    assert "kernel" in text.splitlines()[2] and " flex " in text and " cudnn " in text
