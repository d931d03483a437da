"""The profiling grid holds micro-batches training can have (one token count, training's padding,
one padded length of the flex kernel), and the fit copes with the features such a grid leaves
constant (the stored H100 profile's state change: docs/benchmarks/attention-gpu.md)."""

import numpy as np
import pytest

from sparsebalance_megatron.data.packing import PAD_SEQ_TOKENS
from sparsebalance_megatron.latency import LatencyModel, ModelShape, UnitFeatures, analytic_table
from sparsebalance_megatron.megatron.launch.profile_grid import (QUICK_MIXES, default_mixes,
                                                                 padded_length_warning)


@pytest.mark.parametrize("seq_length,block_size", [(16384, 128), (32768, 128), (4096, 128),
                                                   (2048, 64), (256, 32), (128, 32)])
@pytest.mark.parametrize("count", [2, 5, 10, 24])
def test_default_mixes_hold_seq_length_tokens_packed_like_training(seq_length, block_size, count):
    mixes = default_mixes(seq_length, count, seed=1234, block_size=block_size)
    assert len(mixes) == count
    for m in mixes:
        assert sum(m) == seq_length and all(isinstance(x, int) and x > 0 for x in m)
    # one padded length: on CUDA a second one would recompile the flex kernel with a dynamic
    # length (by the token count, or by short last blocks overflowing fixed_padded_blocks' slack)
    assert padded_length_warning(mixes, block_size, "cuda") is None
    assert default_mixes(seq_length, count, seed=1234, block_size=block_size) == mixes
    if count >= 5:
        assert len({len(m) for m in mixes}) >= 3      # the sequence count varies


def test_default_mixes_pad_like_training_and_vary_the_documents():
    t = 16384
    mixes = default_mixes(t, 10, seed=1234, block_size=128)
    assert default_mixes(t, 10, seed=1234) == mixes      # nothing overflows at 16K / 128
    # the quick grid (first seven): 1, 4, 16 documents, half a micro-batch plus its padding in
    # pieces of PAD_SEQ_TOKENS (as data.packing pads), 64 short sequences, half a micro-batch
    # beside 64 documents of t / 128 tokens, 128 of those
    assert QUICK_MIXES == 7
    assert [len(m) for m in mixes[:7]] == [1, 4, 16, 1 + (t // 2) // PAD_SEQ_TOKENS, 64, 65,
                                           128]
    assert mixes[3] == [t // 2] + [PAD_SEQ_TOKENS] * ((t // 2) // PAD_SEQ_TOKENS)
    assert mixes[5] == [t // 2] + [t // 128] * 64 and mixes[6] == [t // 128] * 128
    assert mixes[8] == [3 * t // 8] * 2 + [PAD_SEQ_TOKENS] * ((t // 4) // PAD_SEQ_TOKENS)
    # random cuts keep their documents (the earlier grid's), now padded to t
    assert mixes[9][:5] == [859, 108, 169, 266, 578] and set(mixes[9][-3:]) == {PAD_SEQ_TOKENS}
    longest = {max(m) for m in mixes}
    assert {t, t // 2, t // 4, t // 16, PAD_SEQ_TOKENS} <= longest


def test_unequal_padded_lengths_warn_on_cuda_only():
    # the earlier H100 grid: 16K, 12K and 8K tokens (160, 120 and 80 blocks)
    grid = [[16384], [6144, 6144], [8192]]
    msg = padded_length_warning(grid, 128, "cuda")
    assert msg is not None and "3 padded lengths" in msg and "dynamic length" in msg
    assert "token counts [8192, 12288, 16384]" in msg
    assert padded_length_warning(grid, 128, "cpu") is None
    # one token count, but 24 one-token documents overflow the slack of 1024 tokens (8 + 8
    # blocks): another padded length too
    msg = padded_length_warning([[1024], [1] * 24 + [1000]], 128, "cuda")
    assert msg is not None and "token counts [1024]" in msg


def _constant_token_table(c_fwd, c_bwd, seq_length=2048, block_size=64):
    """An analytic-format table whose grid is ``default_mixes`` (one token count), timed by
    known coefficients."""
    t = analytic_table(ModelShape(num_layers=2, seq_length=seq_length), block_size=block_size)
    mixes = default_mixes(seq_length, 10, seed=3)
    dens = [0.125, 0.25, 0.5, 1.0]
    rows = [(m, d) for m in mixes for d in dens]
    f = UnitFeatures.build([m for m, _ in rows], block_size, 1, 0)
    x = f.matrix(np.array([d for _, d in rows]))
    t["measurements"] = [{"kind": "only", "doc_lengths": m, "density": d,
                          "fwd_s": float(r @ c_fwd), "bwd_s": float(r @ c_bwd)}
                         for (m, d), r in zip(rows, x)]
    del t["coefficients"]
    return t, x


def test_fit_folds_a_feature_constant_on_the_grid_into_the_intercept():
    # every micro-batch holds 2048 tokens: the per-token cost cannot be told from the constant
    cf = np.array([2e-3, 3e-6, 5e-6, 1e-8, 4e-5])
    cb = np.array([3e-3, 6e-6, 1.1e-5, 0.0, 7e-5])
    table, x = _constant_token_table(cf, cb)
    assert np.ptp(x[:, 1]) == 0 and np.ptp(x[:, 3]) > 0     # random cuts leave partial blocks
    m = LatencyModel.fit(table)
    for part, c in (("fwd", cf), ("bwd", cb)):
        got = m.coef["only"][part]
        assert got[1] == 0.0                                  # no share of the constant
        assert got[0] == pytest.approx(c[0] + c[1] * 2048, rel=1e-9)
        np.testing.assert_allclose(got[2:], c[2:], rtol=1e-6, atol=1e-14)
        np.testing.assert_allclose(x @ got, x @ c, rtol=1e-9)
    # a sample's cost (what SAB ranks samples by) is the work it adds, with no arbitrary share
    # of the micro-batch's fixed cost per token
    from sparsebalance_megatron.batching.packing import latency_sample_cost_fn
    lengths = np.array([100, 700, 2048])
    f = UnitFeatures.build([[n] for n in lengths], 64, 1, 0)
    c = cf + cb
    want = c[2] * f.attention_work(0.5) + c[3] * f.selection_work + c[4]
    np.testing.assert_allclose(latency_sample_cost_fn(m, 0.5)(lengths), want, rtol=1e-6)


def test_variable_length_grid_lets_the_fit_see_token_work():
    """``--sb-microbatch-multiple``: the grid's mixes are padded as variable-length training pads
    them (to a multiple of K), so it holds several token totals (the quick grid: t, t/2, t/4) and
    the fit recovers the per-token cost that a one-token-count grid folds into the intercept; a
    half-length micro-batch is then predicted right."""
    t, k = 2048, 64
    quick = default_mixes(t, 5, seed=3, block_size=64, length_multiple=k)
    assert sorted({sum(m) for m in quick}) == [t // 4, t // 2, t]
    full = default_mixes(t, 10, seed=3, block_size=64, length_multiple=k)
    assert full[:5] == quick and all(sum(m) % k == 0 and sum(m) <= t for m in full)
    cf = np.array([2e-3, 3e-6, 5e-6, 1e-8, 4e-5])
    cb = np.array([3e-3, 6e-6, 1.1e-5, 0.0, 7e-5])
    table = analytic_table(ModelShape(num_layers=2, seq_length=t), block_size=64)
    rows = [(m, d) for m in full for d in (0.125, 0.25, 0.5, 1.0)]
    x = UnitFeatures.build([m for m, _ in rows], 64, 1, 0).matrix(np.array([d for _, d in rows]))
    table["measurements"] = [{"kind": "only", "doc_lengths": m, "density": d,
                              "fwd_s": float(r @ cf), "bwd_s": float(r @ cb)}
                             for (m, d), r in zip(rows, x)]
    del table["coefficients"]
    m = LatencyModel.fit(table)
    for part, c in (("fwd", cf), ("bwd", cb)):
        np.testing.assert_allclose(m.coef["only"][part], c, rtol=1e-6, atol=1e-12)
    half = UnitFeatures.build([[600, 400, 24]], 64, 1, 0).matrix(np.array([0.5]))[0]
    assert m.predict([600, 400, 24], 0.5, 0) == pytest.approx(
        float(half @ cf + half @ cb), rel=1e-6)


def test_a_variable_length_run_profiles_its_own_grid_and_cache_entry(tmp_path):
    """The run-time profile of a variable-length run passes the multiple to the profiler (its
    grid: several token totals) and caches apart from a fixed-length run's table."""
    import types

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.latency_setup import cached_table_path, profile_command

    args = types.SimpleNamespace(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                 num_attention_heads=4, num_query_groups=2, kv_channels=None,
                                 padded_vocab_size=512, seq_length=256, micro_batch_size=1,
                                 pipeline_model_parallel_size=1, swiglu=True)
    fixed = SparseBalanceConfig(sparse_balance=True, data_cache_dir=str(tmp_path))
    var = SparseBalanceConfig(sparse_balance=True, data_cache_dir=str(tmp_path),
                              microbatch_multiple=32)
    cmd = profile_command(args, var, "out.json")
    assert cmd[cmd.index("--sb-microbatch-multiple") + 1] == "32"
    assert "--sb-microbatch-multiple" not in profile_command(args, fixed, "out.json")
    expect = {"model": {"num_layers": 2}, "sparsebalance_megatron": "x", "megatron_core": "y",
              "torch": "z", "execution": {}}
    assert cached_table_path(args, var, expect) != cached_table_path(args, fixed, expect)


@pytest.mark.parametrize("work_mode", ["kept", "chunked"])
def test_attention_work_on_the_last_work_grid_is_the_computed_work(work_mode):
    """``attention_work`` at per-unit densities that lie on the last ``work_grid`` (DST's plans
    do) reads that grid instead of counting again: the same numbers (integer pair counts), with
    a grid that ends in a repeated 1.0 (``UnitCosts.from_latency``'s); a density off the grid
    counts as before, and the grid is not pickled."""
    import pickle

    rng = np.random.default_rng(2)
    units = [rng.integers(30, 6000, rng.integers(0, 5)) for _ in range(24)]
    grid = np.append(np.linspace(0.125, 1.0, 15), 1.0)

    def fresh():
        return UnitFeatures.build(units, 64, 1, 1, work_mode, 16)

    f = fresh()
    f.work_grid(grid)
    for dens in (grid[rng.integers(0, grid.size, 24)], np.full(24, 1.0),
                 np.r_[grid[rng.integers(0, grid.size, 23)], 0.3]):
        want = fresh().attention_work(dens)
        np.testing.assert_array_equal(f.attention_work(dens), want)
    on_grid = grid[rng.integers(0, grid.size, 24)]
    f._grid = (grid, np.zeros((24, grid.size)))      # proof the table is what is read
    assert not f.attention_work(on_grid).any()
    assert fresh().attention_work(on_grid).any()
    assert pickle.loads(pickle.dumps(f))._grid is None


def test_quick_grid_tells_a_per_document_cost_from_routed_dense_work():
    """The H200's quick profile routed documents under 4,096 tokens dense and had one grid point
    of many short documents, so the backward's per-document cost (Megatron's unfused packed
    RoPE) went into the dense work and micro-batches of 100+ short documents were predicted
    16-26% short. The quick grid's last two mixes (short documents of another length, alone and
    beside a long one) make every cost term identifiable: the fit recovers them all and such a
    micro-batch is predicted right."""
    from sparsebalance_megatron.latency.features import MODEL_FEATURES

    t, bs, k, cross = 8192, 64, 64, 1024
    quick = default_mixes(t, QUICK_MIXES, seed=3, block_size=bs, length_multiple=k)
    table = analytic_table(ModelShape(num_layers=2, seq_length=t), block_size=bs)
    table["dense_crossover_tokens"] = cross
    # const, tokens, attention_work, selection_work, sequences, dense_work, sparse / dense call
    cf = np.array([2e-3, 3e-7, 5e-6, 1e-8, 2.9e-3, 4e-6, 1e-3, 5e-4])
    cb = np.array([3e-3, 6e-7, 1.1e-5, 0.0, 2.1e-3, 9e-6, 2e-3, 8e-4])
    assert len(cf) == len(MODEL_FEATURES)

    def x_of(mixes, dens):
        return UnitFeatures.build(mixes, bs, 1, 0, "kept", 16, cross).matrix(
            np.asarray(dens), MODEL_FEATURES)

    rows = [(m, d) for m in quick for d in (0.25, 1.0)]
    x = x_of([m for m, _ in rows], [d for _, d in rows])
    table["measurements"] = [{"kind": "only", "doc_lengths": m, "density": d,
                              "fwd_s": float(r @ cf), "bwd_s": float(r @ cb)}
                             for (m, d), r in zip(rows, x)]
    del table["coefficients"]
    m = LatencyModel.fit(table)
    held = [1000, 500] + [64] * 100
    want = x_of([held], [0.4])[0]
    assert m.predict(held, 0.4, 0) == pytest.approx(float(want @ cf + want @ cb), rel=1e-6)
    for part, c in (("fwd", cf), ("bwd", cb)):
        np.testing.assert_allclose(m.coef["only"][part], c[:5], rtol=1e-6, atol=1e-12)
    # without the last mix, or the last two, some term cannot be told apart
    assert np.linalg.matrix_rank(x) == len(MODEL_FEATURES)
    for drop in (slice(0, 10), slice(0, 12)):
        assert np.linalg.matrix_rank(x[drop]) < len(MODEL_FEATURES)
