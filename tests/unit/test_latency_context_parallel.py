"""The latency model of one rank of a context-parallel group (latency/context_parallel.py)."""

import numpy as np
import pytest

from sparsebalance_megatron.latency import ContextParallelCost, LatencyModel, ModelShape
from sparsebalance_megatron.latency.analytic import ideal_price
from sparsebalance_megatron.latency.layout import PipelineLayout

SHAPE = ModelShape(num_layers=8, seq_length=16384)   # 14 query heads, 2 KV groups
UNITS = [[16384], [4096] * 4, [256] * 64, [1000, 3000, 12384]]


def _model(pp=1, **kw):
    # the ideal FLOP-priced kernel: its selection is a work term of its own (a measured call
    # holds it in the per-call cost), which these tests divide
    return LatencyModel.analytic(ModelShape(**{**SHAPE.__dict__, "num_attention_heads": 16,
                                               **kw}), pp=pp, sparse_price=ideal_price())


def test_cp1_is_the_model_unchanged():
    m = _model(pp=2)
    c = m.with_context_parallel(1)
    for s in range(m.num_stages):
        np.testing.assert_array_equal(c.predict_many(UNITS, 0.3, s), m.predict_many(UNITS, 0.3, s))
    assert c.cp == 1 and c.p2p_s == m.p2p_s and c.context_parallel is None


def test_work_divides_per_sequence_cost_does_not():
    m = _model()
    m.coef["only"]["fwd"][4] = m.coef["only"]["bwd"][4] = 1e-5   # a per-sequence cost
    m = m.with_layout(m.layout)
    free = m.with_context_parallel(4, a2a_bytes_per_s=1e30, collective_latency_s=0.0)
    base, cp = m.coef["only"], free._stage_coef[0]
    for p in ("fwd", "bwd"):
        assert cp[p][0] == base[p][0] and cp[p][4] == base[p][4]        # const, sequences
        np.testing.assert_allclose(cp[p][1:4], base[p][1:4] / [4, 4, 2])  # 2 KV groups < 4
    # so a unit's time falls by less than 4x, the more so the more documents it has
    one, many = free.predict_many([[16384], [256] * 64], 0.5, 0) / \
        m.predict_many([[16384], [256] * 64], 0.5, 0)
    assert 0.25 < one < many < 1.0


def test_all_to_all_grows_with_tokens_and_follows_the_formula():
    m = _model()
    cp = m.with_context_parallel(2, a2a_bytes_per_s=100e9, collective_latency_s=0.0)
    free = m.with_context_parallel(2, a2a_bytes_per_s=1e30, collective_latency_s=0.0)
    comm = cp.predict_many([[8192], [16384]], 1.0, 0) - free.predict_many([[8192], [16384]],
                                                                          1.0, 0)
    np.testing.assert_allclose(comm[1], 2 * comm[0])                  # linear in tokens
    # 16384 tokens / 2 ranks x (16 + 2 x 2 KV + 16) heads x 64 x 2 B x 1/2 sent, 8 layers,
    # forward and backward
    want = 2 * 8 * 16384 / 2 * (16 + 4 + 16) * 56 * 2 * 0.5 / 100e9
    np.testing.assert_allclose(comm[1], want, rtol=1e-12)


def test_fewer_kv_groups_than_ranks_replicates_and_all_reduces_shares():
    m = _model()
    cost = m.with_context_parallel(4).context_parallel
    assert cost.kv_heads_sent == 4 and cost.selection_split == 2
    assert cost.share_bytes_per_pair() == 2 * 4 * 2 * 3 / 4
    assert cost.collectives_per_layer("fwd") == 3 and cost.collectives_per_layer("bwd") == 2
    even = m.with_context_parallel(2).context_parallel
    assert even.share_bytes_per_pair() == 0.0 and even.collectives_per_layer("fwd") == 2


def test_pipelined_layouts_and_order_of_adaptation():
    m = _model(pp=2)
    lay = PipelineLayout.from_counts(8, 2, first=6)                  # uneven: 6 | 2
    a = m.with_layout(lay).with_context_parallel(2)
    b = m.with_context_parallel(2).with_layout(lay)
    for s in range(a.num_stages):
        np.testing.assert_allclose(a.predict_many(UNITS, 0.4, s), b.predict_many(UNITS, 0.4, s))
    assert a.p2p_s == m.p2p_s / 2
    # a CP rank of 2 is faster than the whole micro-batch on one rank, slower than half of it
    t1, t2 = m.predict_many(UNITS, 0.4, 0), a.with_layout(m.layout).predict_many(UNITS, 0.4, 0)
    assert np.all(t2 < t1) and np.all(t2 > t1 / 2)


def test_an_empty_stage_of_a_layout_string_pays_no_per_layer_collective():
    """A layout string's LM-head-only last stage (0 decoder layers) adapts to CP: its token work
    divides, no all-to-all or collective is added (the runtime's start-up layout search meets
    such layouts under CP)."""
    m = _model(pp=2)
    lay = PipelineLayout.from_string("Etttttttt|L", 2, 8)                 # 8 | 0
    cp = m.with_layout(lay).with_context_parallel(2)
    empty = cp._stage_coef[1]
    for p in ("fwd", "bwd"):
        base = np.array(m.with_layout(lay)._stage_coef[1][p], dtype=np.float64)
        assert empty[p][0] == base[0]                                     # no collective latency
        assert empty[p][1] == pytest.approx(base[1] / 2)                  # tokens divide, no a2a
    with pytest.raises(ValueError, match="layers=-1: expected an integer >= 0"):
        cp.context_parallel.stage_coefficients(m.with_layout(lay)._stage_coef[1], -1)


def test_analytic_constructor_uses_the_device_bandwidth():
    a = LatencyModel.analytic(SHAPE, context_parallel=2)
    assert a.cp == 2 and a.context_parallel.a2a_bytes_per_s == 200e9
    assert a.context_parallel.num_attention_heads == 14


@pytest.mark.parametrize("kw, needle", [
    (dict(size=0), "context_parallel_size=0"),
    (dict(size=3), "context_parallel_size=3"),
    (dict(size=2.0), "context_parallel_size=2.0"),
    (dict(size=True), "context_parallel_size=True"),
    (dict(size=2, tensor_model_parallel_size=3), "tensor_model_parallel_size=3"),
    (dict(size=2, a2a_bytes_per_s=0.0), "a2a_bytes_per_s=0.0"),
    (dict(size=2, collective_latency_s=-1.0), "collective_latency_s=-1.0"),
])
def test_bad_values_are_named(kw, needle):
    m = _model()
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        m.with_context_parallel(**kw)


def test_kv_groups_neither_multiple_nor_divisor():
    with pytest.raises(ValueError, match="context_parallel_size=4.*6 KV groups"):
        ContextParallelCost(4, 12, 6, 64, 1e9, 0.0)


def _run_args(**kw):
    from types import SimpleNamespace
    base = dict(num_layers=8, pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                tensor_model_parallel_size=1)
    return SimpleNamespace(**{**base, **kw})


def test_a_cp_run_plans_with_the_cp_adapted_model():
    """latency_setup.model_for_run: what the callback's latency model is for a run."""
    from sparsebalance_megatron.megatron.launch.latency_setup import model_for_run

    m = _model(pp=2)
    plain = model_for_run(m, _run_args())
    assert plain.cp == 1
    run = model_for_run(m, _run_args(context_parallel_size=4, tensor_model_parallel_size=2))
    want = m.with_context_parallel(4, tensor_model_parallel_size=2)
    assert run.cp == 4 and run.context_parallel.num_attention_heads == 8   # 16 heads / TP 2
    assert run.context_parallel.num_query_groups == 1                      # replicated over 4
    for s in range(2):
        np.testing.assert_array_equal(run.predict_many(UNITS, 0.3, s),
                                      want.predict_many(UNITS, 0.3, s))
        assert np.all(run.predict_many(UNITS, 0.3, s) < plain.predict_many(UNITS, 0.3, s))
    assert run.table is m.table                       # the table stays the CP=1 one


def test_a_table_profiled_at_one_token_total_splits_its_intercept_as_token_work():
    # the profiler's grid holds --seq-length tokens in every mix, so the fit folds the token
    # work into the intercept (tokens coefficient 0): CP must still divide that work
    m = _model()
    t0 = 16384
    for p in ("fwd", "bwd"):
        c = m.coef["only"][p]
        c[0], c[1] = c[0] + c[1] * t0, 0.0          # the same CP=1 times at t0 tokens
    m.table = {**m.table, "profile": {"token_totals": [t0]}}
    m = m.with_layout(m.layout)
    free = m.with_context_parallel(2, a2a_bytes_per_s=1e30, collective_latency_s=0.0)
    for p in ("fwd", "bwd"):
        base, cp = m.coef["only"][p], free._stage_coef[0][p]
        assert cp[0] == 0.0 and cp[1] == pytest.approx(base[0] / t0 / 2, rel=1e-12)
    # with several token totals the intercept stays as it is
    m.table = {**m.table, "profile": {"token_totals": [8192, t0]}}
    kept = m.with_layout(m.layout).with_context_parallel(2, a2a_bytes_per_s=1e30,
                                                         collective_latency_s=0.0)
    assert kept._stage_coef[0]["fwd"][0] == m.coef["only"]["fwd"][0]
