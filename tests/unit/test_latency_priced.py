"""A profiled latency table priced by the device's kernel table (issue 74): the sparse call's
measured price (its fixed cost per call and per kept tile, each pass apart) carries the stage's
sparse calls, and only the rest is fitted; the held-out checks that judge it."""

import json
import os
import sys

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, read_table
from sparsebalance_megatron.latency.features import MODEL_FEATURES
from sparsebalance_megatron.latency.sparse_call import (SparseCallPrice, attach_price, fit_price,
                                                        price_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "docs", "results", "latency_gpu_h200_fa4.json")
KERNELS = os.path.join(ROOT, "docs", "results", "kernel_table_h200_run5_fa4_flash.json")


def _price():
    rows = json.load(open(KERNELS))["rows"]
    return fit_price(price_rows(rows, "14/2/64"), "fa4", "run 5", shape="14/2/64")


def test_the_price_carries_the_sparse_calls_and_the_rest_is_fitted():
    table, price = read_table(TABLE), _price()
    assert price.lengths == (32768,) and (price.ref_q_heads, price.ref_head_dim) == (14, 64)
    assert 0.4 < price.call_bwd_share < 0.7          # measured, not the launches' 2 : 1
    model = LatencyModel.fit(attach_price(table, price))
    layers = table["pipeline"]["layers_per_stage"][0]
    terms = price.layer_terms(14, 64, 128, 32768)
    for p in ("fwd", "bwd"):
        c = model._coef_full["only"][p]
        assert c[MODEL_FEATURES.index("attention_work")] == pytest.approx(layers * terms[p]["pair"])
        assert c[MODEL_FEATURES.index("sparse_calls")] == pytest.approx(layers * terms[p]["call"])
        assert c[MODEL_FEATURES.index("selection_work")] == 0.0     # inside the measured call
    assert model.table["sparse_call"]["backend"] == "fa4"
    # what the measurements leave is fitted exactly where they hold nothing else: a table of
    # the priced model's own predictions gives its coefficients back
    again = dict(model.table, measurements=[
        dict(m, fwd_s=f, bwd_s=b) for m in table["measurements"]
        for f, b in [model.predict_fwd_bwd(m["doc_lengths"], m["density"], 0)]])
    refit = LatencyModel.fit(attach_price(again, price))
    for p in ("fwd", "bwd"):
        np.testing.assert_allclose(refit._coef_full["only"][p], model._coef_full["only"][p],
                                   rtol=1e-6, atol=1e-9)
    # the record round-trips
    assert SparseCallPrice.from_dict(price.as_dict()) == price


def test_only_a_profiled_table_takes_a_measured_price():
    from sparsebalance_megatron.latency import ModelShape, analytic_table
    from sparsebalance_megatron.latency.sparse_call import triton_estimate
    with pytest.raises(ValueError, match="expected a profiled table and a price measured"):
        attach_price(analytic_table(ModelShape(seq_length=8192)), _price())
    with pytest.raises(ValueError, match="a 'profiled' table and an estimated price"):
        attach_price(read_table(TABLE), triton_estimate())


def test_the_held_out_check_scores_the_priced_model_and_the_price(tmp_path):
    """``latency_cv --kernel-table``: on the H200's fa4 table (14 points, 2 repeats) the priced
    model's leave-one-mix-out error is the plain fit's third or less, the price's own error
    with each density left out is stated per pass, and the repeats' spread beside them."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from studies import latency_cv
    out = tmp_path / "cv.json"
    assert latency_cv.main(["--table", TABLE, "--kernel-table", KERNELS,
                            "--json", str(out)]) == 0
    got = json.load(open(out))
    plain, priced = got["fits"][0], got["fits"][-1]
    assert priced["features"] == "priced (fa4 14/2/64)"
    assert priced["cv_mape"] < plain["cv_mape"] / 2
    assert priced["cv_mape_few"] < plain["cv_mape_few"]
    assert 0.03 < got["repeat_spread"] < 0.07
    assert got["price"]["cases"] == ["file#0", "single"] and got["price"]["rows"] == 8
    assert 0 < got["price"]["lodo_mape_bwd"] < 0.2
