"""Latency model: exact work counts, fit, closed-form unit terms, calibration, speed."""


import numpy as np
import pytest

from sparsebalance_megatron.latency import (LatencyModel, ModelShape, UnitFeatures,
                                            analytic_table, attention_work, selection_work)
from sparsebalance_megatron.latency.work import chunked_attention_work, kept_pairs_bruteforce


@pytest.mark.parametrize("lengths", [[1], [64], [65], [1000, 3000], [130, 7, 640]])
@pytest.mark.parametrize("density", [0.1, 0.25, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("sink,local", [(1, 0), (0, 0), (2, 3)])
def test_attention_work_matches_bruteforce(lengths, density, sink, local):
    assert attention_work(lengths, density, 64, sink, local) == \
        kept_pairs_bruteforce(lengths, density, 64, sink, local)


def test_work_hand_values_and_dense_limit():
    # one doc of 4 blocks, d=0.5, sink 1: available 1,2,3,4 -> kept 1,2,2,2
    assert attention_work([256], 0.5, 64, 1, 0) == 7
    # density 1 keeps every causal pair; a short last block counts as one pair
    assert attention_work([200], 1.0, 64) == 10
    # the estimator scores a dense [NB, NB] matrix over the micro-batch's blocks
    assert selection_work([200, 64], 64) == 25
    assert attention_work([1, 1], 0.2, 64) == 2
    with pytest.raises(ValueError, match="density"):
        attention_work([64], 0.0, 64)
    with pytest.raises(ValueError, match="block_size"):
        attention_work([64], 0.5, 48)
    with pytest.raises(ValueError, match="lengths >= 1"):
        attention_work([64, 0], 0.5, 64)


def test_unit_features_grid_csr_and_per_unit_densities_agree():
    units = [np.array([100, 900]), np.array([4096]), np.array([5, 6, 7, 2000])]
    f = UnitFeatures.build(units, 64, 1, 1)
    offsets = np.array([0, 2, 3, 7])
    g = UnitFeatures.build((offsets, np.concatenate(units)), 64, 1, 1)
    grid = np.array([0.125, 0.3, 1.0])
    wg = f.work_grid(grid)
    np.testing.assert_array_equal(wg, g.work_grid(grid))
    for j, d in enumerate(grid):
        np.testing.assert_array_equal(wg[:, j], [attention_work(u, d, 64, 1, 1) for u in units])
    per_unit = np.array([0.3, 1.0, 0.125])
    np.testing.assert_array_equal(f.attention_work(per_unit), [wg[0, 1], wg[1, 2], wg[2, 0]])
    np.testing.assert_array_equal(f.tokens, [1000, 4096, 2018])


def _synthetic_table(coef_fwd, coef_bwd, pp=1, noise=0.0, seed=0):
    t = analytic_table(ModelShape(num_layers=2, seq_length=4096), pp=pp, seed=seed)
    rng = np.random.default_rng(seed)
    f = UnitFeatures.build([m["doc_lengths"] for m in t["measurements"]], 64, 1, 0)
    x = f.matrix(np.array([m["density"] for m in t["measurements"]]))
    for m, row in zip(t["measurements"], x):
        m["fwd_s"] = float(row @ coef_fwd) * (1 + noise * rng.standard_normal())
        m["bwd_s"] = float(row @ coef_bwd) * (1 + noise * rng.standard_normal())
    del t["coefficients"]
    return t


def test_fit_recovers_known_coefficients_and_splits_fwd_bwd():
    cf = np.array([1e-3, 2e-6, 5e-6, 1e-7, 3e-5])
    cb = np.array([2e-3, 4e-6, 12e-6, 0.0, 6e-5])
    m = LatencyModel.fit(_synthetic_table(cf, cb))
    np.testing.assert_allclose(m.coef["only"]["fwd"], cf, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(m.coef["only"]["bwd"], cb, rtol=1e-6, atol=1e-12)
    docs = [3000, 700, 50]
    f, b = m.predict_fwd_bwd(docs, 0.4, 0)
    x = np.array([1, 3750, attention_work(docs, 0.4, 64), selection_work(docs, 64), 3])
    assert f == pytest.approx(x @ cf) and b == pytest.approx(x @ cb)
    assert m.predict(docs, 0.4, 0) == pytest.approx(f + b)
    assert m.predict(docs, 0.2, 0) < m.predict(docs, 0.4, 0)


def test_unit_terms_closed_form_equals_predict_many():
    m = LatencyModel.analytic(ModelShape(num_layers=4, seq_length=8192), pp=2)
    rng = np.random.default_rng(1)
    units = [np.diff(np.r_[0, np.sort(rng.choice(8191, 5, replace=False) + 1), 8192])
             for _ in range(20)]
    d = rng.choice([0.125, 0.25, 0.5, 1.0], 20)
    for stage in (0, 1):
        terms = m.unit_terms(units, stage)
        np.testing.assert_allclose(terms.time_s(d), m.predict_many(units, d, stage))
        np.testing.assert_allclose(terms.time_s(d)[3], m.predict(units[3], d[3], stage))
        grid = terms.time_grid_s([0.125, 0.25, 0.5, 1.0])
        idx = np.searchsorted([0.125, 0.25, 0.5, 1.0], d)
        np.testing.assert_allclose(grid[np.arange(20), idx], terms.time_s(d))
    with pytest.raises(ValueError, match="stage=2"):
        m.predict(units[0], 0.5, 2)


def test_unit_terms_are_computed_once_per_features_coefficients_and_correction():
    """A step's tables ask every stage for its terms of the same features: stages that share
    their coefficients share the arrays, each the numbers a fresh features object gives; a new
    correction or other coefficients are computed anew, and a pickled features object carries
    none of it."""
    import copy
    import pickle

    m = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=4)
    rng = np.random.default_rng(3)
    units = [np.diff(np.r_[0, np.sort(rng.choice(8191, 4, replace=False) + 1), 8192])
             for _ in range(12)]
    f = m.unit_features(units)
    same = [s for s in range(1, 4) if all(np.array_equal(m._stage_coef[s][p],
                                                         m._stage_coef[1][p])
                                          for p in ("fwd", "bwd"))]
    assert len(same) >= 2                       # the middle stages share their coefficients
    assert m.unit_terms(f, same[0]) is m.unit_terms(f, same[1])
    for stage in range(4):
        for rank in (None, 2):
            got, fresh = m.unit_terms(f, stage, rank), m.unit_terms(units, stage, rank)
            assert got is not fresh
            for a, b in ((got.fwd_fixed_s, fresh.fwd_fixed_s),
                         (got.bwd_fixed_s, fresh.bwd_fixed_s)):
                assert np.array_equal(a, b)
            assert (got.fwd_attn_s_per_pair, got.bwd_attn_s_per_pair) == \
                (fresh.fwd_attn_s_per_pair, fresh.bwd_attn_s_per_pair)
    before = m.unit_terms(f, 0, rank=2)
    m.calibrate(2, 1.0, 2.0)                    # a new factor: new terms, scaled by it
    after = m.unit_terms(f, 0, rank=2)
    assert after is not before
    np.testing.assert_allclose(after.fwd_fixed_s, before.fwd_fixed_s * m.correction(2))
    assert m.unit_terms(f, 0) is m.unit_terms(f, 0)
    assert m.unit_terms(f, 0) is not m.unit_terms(f, 3)   # the last stage's own coefficients
    other = copy.copy(m)                        # a stage whose backward alone differs
    other._stage_coef = list(m._stage_coef)
    other._stage_coef[same[1]] = dict(m._stage_coef[same[0]],
                                      bwd=m._stage_coef[same[0]]["bwd"] * 1.5)
    assert np.array_equal(other.unit_terms(f, same[1]).bwd_fixed_s,
                          other.unit_terms(units, same[1]).bwd_fixed_s)
    assert not np.array_equal(other.unit_terms(f, same[1]).bwd_fixed_s,
                              m.unit_terms(f, same[0]).bwd_fixed_s)
    back = pickle.loads(pickle.dumps(f))
    assert "_terms_memo" not in back.__dict__ and "_x_stack" not in back.__dict__
    assert np.array_equal(m.unit_terms(back, 1).fwd_fixed_s, m.unit_terms(f, 1).fwd_fixed_s)


def test_calibration_ema_and_bad_measurements():
    m = LatencyModel.analytic(ModelShape(num_layers=2, seq_length=4096), calibration_ema=0.5)
    base = m.predict([4096], 0.5, 0)
    m.calibrate(3, [1.0, 1.0], [2.0, 2.0])        # ratio 2 -> 1 + 0.5 * (2 - 1)
    assert m.correction(3) == pytest.approx(1.5)
    m.calibrate(3, 1.0, 2.0)
    assert m.correction(3) == pytest.approx(1.75)
    assert m.correction(0) == 1.0
    assert m.predict([4096], 0.5, 0, rank=3) == pytest.approx(1.75 * base)
    with pytest.warns(UserWarning, match="rank 3"):
        m.calibrate(3, 1.0, float("nan"))
    m.calibrate(3, 1.0, -1.0)                       # warned once already: silent, unchanged
    m.calibrate(3, 1.0, None)
    assert m.correction(3) == pytest.approx(1.75)


def test_recent_error_is_the_error_before_each_update():
    m = LatencyModel.analytic(ModelShape(num_layers=2, seq_length=4096), calibration_ema=0.5)
    assert m.recent_error() is None
    m.calibrate(0, 1.0, 2.0)     # corrected prediction 1.0 vs 2.0: error 0.5; factor -> 1.5
    m.calibrate(0, 1.0, 1.5)     # 1.5 vs 1.5: error 0
    m.calibrate(1, 2.0, 2.2)     # rank 1 factor 1.0: 2.0 vs 2.2: error 1/11
    assert m.recent_error() == pytest.approx(1 / 11)          # median of 0.5, 0, 1/11
    assert m.recent_error(last=2) == pytest.approx(0.5 / 11)  # median of 0, 1/11
    with pytest.warns(UserWarning):
        m.calibrate(2, 1.0, float("nan"))                      # unusable: no error sample
    assert m.recent_error(last=1) == pytest.approx(1 / 11)


def test_predict_many_global_batch_matches_one_by_one():
    """4,096 micro-batches at once equal their one-by-one predictions (the cost of the batched
    call is measured by scripts/bench.py planner_cost, not here: no wall clock in tests)."""
    m = LatencyModel.analytic(pp=4)
    rng = np.random.default_rng(0)
    units = [np.diff(np.r_[0, np.sort(rng.choice(32767, rng.integers(1, 30), replace=False) + 1),
                           32768]) for _ in range(4096)]
    d = rng.choice(np.linspace(0.125, 1.0, 8), 4096)
    out = m.predict_many(units, d, 1)
    assert out.shape == (4096,) and np.all(np.isfinite(out)) and np.all(out > 0)
    for i in (0, 17, 4095):
        assert out[i] == pytest.approx(m.predict(units[i], float(d[i]), 1))


@pytest.mark.parametrize("density", [0.3, 1.0])
def test_work_counts_equal_what_the_attention_kernels_compute(density):
    """'kept' = the selection's kept blocks; 'chunked' = the CPU kernel's padded query chunks
    (attention/selection.py, attention/kernels.py)."""
    torch = pytest.importorskip("torch")
    api = pytest.importorskip("sparsebalance_megatron.attention")
    kernels = pytest.importorskip("sparsebalance_megatron.attention.kernels")
    lengths = [400, 64, 700, 33, 200]
    cu = [0] + np.cumsum(lengths).tolist()
    q = torch.randn(sum(lengths), 2, 8, generator=torch.Generator().manual_seed(0))
    k = q[:, :1].clone()
    _, sel = api.block_sparse_attention(q, k, k, cu, density, block_size=64, sink_blocks=1,
                                        local_blocks=2, backend="reference")
    assert int(sel.kv_num[0].sum()) == attention_work(lengths, density, 64, 1, 2)
    chunks = kernels.plan_chunks(sel.kv_num, 2, 64, 4)
    kernel_pairs = sum((i1 - i0) * kmax for i0, i1, kmax, _ in chunks)
    assert kernel_pairs == chunked_attention_work(lengths, density, 64, 1, 2, 4)
    f = UnitFeatures.build([lengths, lengths[::-1]], 64, 1, 2, "chunked", 4)
    w = f.attention_work(density)
    assert w[0] == kernel_pairs
    assert w[1] == chunked_attention_work(lengths[::-1], density, 64, 1, 2, 4)
    np.testing.assert_array_equal(f.work_grid([density])[:, 0], w)


@pytest.mark.parametrize("layout", [None, "interleaved"])
def test_busy_s_sums_every_ranks_units_and_chunks(layout):
    """The calibration's prediction of a step: per (DP rank, pipeline rank), the model chunks of
    that rank summed, equal to the per-unit predictions one by one."""
    from sparsebalance_megatron.latency import PipelineLayout

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=4096), pp=2)
    if layout:
        lm = lm.with_layout(PipelineLayout.from_counts(8, 2, vp=2, first=2, last=6))
    rng = np.random.default_rng(4)
    dp, m, nv = 3, 4, lm.num_stages
    units = [rng.integers(50, 1500, rng.integers(1, 4)) for _ in range(dp * m)]
    dens = rng.choice([0.25, 0.5, 1.0], (dp, m, nv))
    got = lm.busy_s(units, dens)
    assert got.shape == (dp, 2)
    want = np.zeros((dp, 2))
    for r in range(dp):
        for i in range(m):
            for v in range(nv):
                want[r, lm.layout.rank_of(v)] += lm.predict(units[r * m + i], dens[r, i, v], v)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match=r"densities shape \(3, 4\): expected \[dp, m, "):
        lm.busy_s(units, dens[..., 0])


def test_memoised_terms_do_not_keep_their_features_alive():
    """The terms memo lives on the features object but refers to the terms only weakly: a
    step's features are freed when the step drops them, not at the next full collection."""
    import gc
    import weakref

    m = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=4)
    f = m.unit_features([np.array([100, 200, 3000])] * 6)
    terms = [m.unit_terms(f, s) for s in range(4)]
    assert m.unit_terms(f, 1) is terms[1]
    gone = weakref.ref(f)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del f, terms
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
