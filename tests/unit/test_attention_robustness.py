"""Selection and the public attention API under bad or awkward input (issue 15).

- Non-finite scores: NaN/inf in q or k (or in the shares themselves) cannot drop or reorder a
  forced block (diagonal, sinks, local window) nor bring in a future or other-document block;
  the torch backend's rows whose inputs are finite are unchanged.
- ``mass`` mode with threshold 1.0 keeps every allowed block (dense), even where shares
  are tiny enough that a float32 running sum reaches 1.0 before the last blocks.
- A density keeps the same blocks as a Python float or a float32/float64 tensor
  (``kept = ceil(density * available)`` on the decimal value).
- Every argument of ``block_sparse_attention`` is validated, with a ``ValueError`` naming it.
Every case is marked ``reliability`` (RELIABILITY.md).
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparsebalance_megatron.attention import block_sparse_attention, build_layout
from sparsebalance_megatron.attention.kernels import reference_attention
from sparsebalance_megatron.attention.selection import forced_blocks, select_from_shares

NAN, INF = float("nan"), float("inf")


def _rel(area_case: str, expect: str):
    return pytest.mark.reliability(area="attention", case=area_case, expect=expect)


def _qkv(t, nh, ng, hn, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, hn, generator=g) * scale for h in (nh, ng, ng))


def _check_selection_is_legal(sel, sink, local):
    """Every forced block of every (KV head, query block) kept, slot 0 the diagonal, nothing
    outside the causal in-document blocks."""
    lay = sel.layout
    mask = sel.block_mask()                                               # [ng, NB, NB]
    forced = forced_blocks(lay, sink, local)
    assert bool((mask | ~forced).all()), "a forced block was dropped"
    assert not bool((mask & ~lay.allowed()).any()), "a future or other-document block was kept"
    assert torch.equal(sel.kv_indices[..., 0], torch.arange(lay.num_blocks).expand_as(
        sel.kv_indices[..., 0]))
    # the kept counts are the mask's: nothing hides behind a duplicate index
    assert torch.equal(mask.sum(-1), sel.kv_num)


def _finite_rows(q, k, v, cu):
    """[t, np] bool: the row's query and every key/value it may attend to are finite."""
    rep = q.shape[1] // k.shape[1]
    q_ok = torch.isfinite(q).all(-1)                                      # [t, np]
    kv_ok = (torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)).repeat_interleave(rep, 1)
    ok = torch.zeros_like(q_ok)
    for a, b in zip(cu[:-1], cu[1:]):
        seen_ok = torch.cumprod(kv_ok[a:b].int(), dim=0).bool()          # all of [a, i] finite
        ok[a:b] = q_ok[a:b] & seen_ok
    return ok


@pytest.mark.parametrize("mode", [
    pytest.param("density", marks=_rel(
        "NaN and inf in q/k, density mode",
        "forced blocks kept, no future/other-document block, finite rows unchanged")),
    pytest.param("mass", marks=_rel(
        "NaN and inf in q/k, mass mode",
        "forced blocks kept, no future/other-document block, finite rows unchanged")),
])
def test_non_finite_q_k_keep_forced_blocks_and_finite_rows(mode):
    cu, bs, sink, local = [0, 100, 230, 300], 16, 1, 1
    q, k, v = _qkv(300, 4, 2, 8, seed=0)
    q[40, 0] = NAN                        # a whole query row: its block's pooled query is NaN
    q[150, 1, 3] = INF
    q[250, 2, 0] = -INF
    k[60, 0, 2] = NAN                     # poisons the scores of every later block of doc 0
    k[200, 1, 0] = -INF
    k[120, 1, 5] = INF
    kw = dict(block_size=bs, sink_blocks=sink, local_blocks=local, selection_mode=mode,
              mass_threshold=0.6, min_density=0.2, max_density=0.7)
    out, sel = block_sparse_attention(q, k, v, cu, 0.3, backend="torch", **kw)
    _check_selection_is_legal(sel, sink, local)
    assert torch.isfinite(sel.shares).all() and torch.isfinite(sel.recall).all()
    assert float(sel.shares.min()) >= 0.0 and float(sel.shares.max()) <= 1.0
    # the oracle with the same selection, on inputs whose non-finite entries are zeroed: rows
    # that never see a non-finite value must not change
    clean = [torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (q, k, v)]
    want = reference_attention(*clean, sel, 8 ** -0.5)
    ok = _finite_rows(q, k, v, cu)
    assert ok.float().mean() > 0.5                 # the test compares most rows
    assert torch.allclose(out[ok], want[ok], atol=1e-5, rtol=1e-5)
    # the reference backend selects the same blocks from the same inputs; so does flex (its
    # own padded layout, run eagerly: mask_mod only)
    _, sel_ref = block_sparse_attention(q, k, v, cu, 0.3, backend="reference", **kw)
    assert torch.equal(sel_ref.kv_indices, sel.kv_indices)
    pytest.importorskip("torch.nn.attention.flex_attention")
    out_f, sel_f = block_sparse_attention(q, k, v, cu, 0.3, backend="flex", compile_backend=None,
                                          **kw)
    _check_selection_is_legal(sel_f, sink, local)
    assert torch.equal(sel_f.block_mask(), sel.block_mask())
    assert torch.allclose(out_f[ok], want[ok], atol=1e-5, rtol=1e-5)


@_rel("NaN, +inf and -inf in the block shares (every entry, future blocks included)",
      "forced blocks kept in slot order, no future/other-document block, finite statistics")
@pytest.mark.parametrize("mode", ["density", "mass"])
def test_non_finite_shares_cannot_reorder_forced_or_pick_disallowed(mode):
    lay = build_layout([0, 90, 91, 200], 200, 8, "cpu")
    ng, nb = 2, lay.num_blocks
    g = torch.Generator().manual_seed(1)
    shares = torch.rand(ng, nb, nb, generator=g) * 50           # far outside [0, 1]
    pick = torch.rand(ng, nb, nb, generator=g)
    shares[pick < 0.2] = NAN
    shares[(pick >= 0.2) & (pick < 0.4)] = INF
    shares[(pick >= 0.4) & (pick < 0.5)] = -INF
    shares[:, ~lay.allowed()] = INF                            # the future looks best of all
    density = torch.full((lay.num_docs,), 0.25, dtype=torch.float64)
    sel = select_from_shares(shares, lay, density, sink_blocks=2, local_blocks=1,
                             selection_mode=mode, mass_threshold=0.5, min_density=0.125)
    _check_selection_is_legal(sel, 2, 1)
    assert torch.isfinite(sel.recall).all() and torch.isfinite(sel.density_kept).all()


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=_rel(f"mass mode, threshold 1.0, peaked scores ({b} backend)",
                               "every allowed block kept: equals dense causal attention"))
    for b in ("torch", "reference")])
def test_mass_threshold_one_keeps_every_allowed_block(backend):
    cu = [0, 700, 1024]
    q, k, v = _qkv(1024, 2, 1, 8, seed=2, scale=6.0)
    v = v / 6.0                                       # peaked scores (tiny shares), plain values
    out, sel = block_sparse_attention(q, k, v, cu, 0.5, block_size=16, backend=backend,
                                      selection_mode="mass", mass_threshold=1.0,
                                      min_density=0.125, max_density=1.0)
    # the hard case is present: a float32 running sum of these shares reaches 1.0 early
    ranked = sel.shares.sort(dim=-1, descending=True).values
    need_f32 = ((ranked.cumsum(-1) - ranked) < 1.0).sum(-1)
    assert bool((need_f32 < sel.layout.block_available()).any())
    assert torch.equal(sel.kv_num, sel.layout.block_available().expand_as(sel.kv_num))
    assert sel.density_kept.tolist() == [1.0, 1.0]
    rep = 2
    want = torch.cat([F.scaled_dot_product_attention(
        q[a:b].transpose(0, 1)[None], k[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None],
        v[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
        for a, b in zip(cu[:-1], cu[1:])])
    assert float((out - want).abs().max()) < 1e-4


def _density_variants(d):
    return [d, torch.tensor(d, dtype=torch.float32), torch.tensor(d, dtype=torch.float64),
            torch.tensor([d, d], dtype=torch.float32), np.float32(d)]


@_rel("the same density as a Python float, float32/float64 tensor or numpy float32",
      "identical selections; kept = ceil(decimal density * available), 0.3 of 10 keeps 3")
@pytest.mark.parametrize("d", [0.3, 0.7, 0.1, 0.6, 0.35, 0.55, 0.9, 1 / 3, 1.0])
def test_density_rounds_the_same_for_floats_and_tensors(d):
    cu, bs = [0, 320, 640], 16             # 20 blocks per document: available 1..20
    q, k, _ = _qkv(640, 2, 2, 8, seed=3)
    sels = [block_sparse_attention(q, k, k, cu, dd, block_size=bs, sink_blocks=0)[1]
            for dd in _density_variants(d)]
    for s in sels[1:]:
        assert torch.equal(s.kv_num, sels[0].kv_num)
        assert torch.equal(s.kv_indices, sels[0].kv_indices)
    exact = Fraction(repr(d)) if d != 1 / 3 else Fraction(1, 3)
    avail = sels[0].layout.block_available()
    want = torch.tensor([max(1, math.ceil(exact * int(a))) for a in avail])
    assert torch.equal(sels[0].kv_num[0], want)
    if d == 0.3:
        assert int(sels[0].kv_num[0, 9]) == 3              # 10 available blocks keep 3


def _call(**over):
    kw = dict(q=torch.randn(64, 4, 8), k=torch.randn(64, 2, 8), v=torch.randn(64, 2, 8),
              cu_seqlens=[0, 30, 64], density=0.5, block_size=16)
    kw.update(over)
    return block_sparse_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("cu_seqlens"),
                                  kw.pop("density"), **kw)


def _bad(case, over, needle):
    return pytest.param(over, needle, id=case, marks=_rel(
        f"block_sparse_attention({case})", f"ValueError naming it: '{needle}'"))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("over,needle", [
    _bad("v float64, q/k float32", dict(v=torch.randn(64, 2, 8, dtype=torch.float64)),
         "v dtype torch.float64 != q dtype torch.float32"),
    _bad("k bfloat16, q/v float32", dict(k=torch.randn(64, 2, 8).bfloat16()), "k dtype"),
    _bad("integer q/k/v", dict(q=torch.ones(64, 4, 8, dtype=torch.long),
                               k=torch.ones(64, 2, 8, dtype=torch.long),
                               v=torch.ones(64, 2, 8, dtype=torch.long)), "q dtype torch.int64"),
    _bad("k on another device", dict(k=torch.randn(64, 2, 8, device="meta")), "k is on meta"),
    _bad("q a numpy array", dict(q=np.zeros((64, 4, 8), np.float32)), "q is a ndarray"),
    _bad("head dim 0", dict(q=torch.randn(64, 4, 0), k=torch.randn(64, 2, 0),
                            v=torch.randn(64, 2, 0)), "head dim >= 1"),
    _bad("0 query heads", dict(q=torch.randn(64, 0, 8)), "0 query heads"),
    _bad("softmax_scale=0", dict(softmax_scale=0.0), "softmax_scale=0.0"),
    _bad("softmax_scale<0", dict(softmax_scale=-0.5), "softmax_scale=-0.5"),
    _bad("softmax_scale=nan", dict(softmax_scale=NAN), "softmax_scale=nan"),
    _bad("softmax_scale=inf", dict(softmax_scale=INF), "softmax_scale=inf"),
    _bad("softmax_scale a string", dict(softmax_scale="0.1"), "softmax_scale='0.1'"),
    _bad("softmax_scale a tensor", dict(softmax_scale=torch.tensor(0.3)), "softmax_scale="),
    _bad("softmax_scale=True", dict(softmax_scale=True), "softmax_scale=True"),
    _bad("cu_seqlens with a float", dict(cu_seqlens=[0, 30.5, 64]), "cu_seqlens="),
    _bad("cu_seqlens float tensor", dict(cu_seqlens=torch.tensor([0.0, 30.0, 64.0])),
         "cu_seqlens"),
    _bad("cu_seqlens 2-D", dict(cu_seqlens=[[0, 30], [30, 64]]), "cu_seqlens="),
    _bad("cu_seqlens None", dict(cu_seqlens=None), "cu_seqlens=None"),
    _bad("cu_seqlens decreasing", dict(cu_seqlens=[0, 40, 30, 64]), "increasing"),
    _bad("cu_seqlens not starting at 0", dict(cu_seqlens=[2, 30, 64]), "cu_seqlens=[2, 30, 64]"),
    _bad("cu_seqlens not ending at t", dict(cu_seqlens=[0, 30, 70]), "ends at 70"),
    _bad("density=-0.1", dict(density=-0.1), "density=-0.1"),
    _bad("density=inf", dict(density=INF), "density=inf"),
    _bad("density tensor with nan", dict(density=torch.tensor([0.5, NAN])), "density=nan"),
    _bad("density bool tensor", dict(density=torch.tensor(True)), "density"),
    _bad("density a string", dict(density="0.5"), "density='0.5'"),
    _bad("density=True", dict(density=True), "density=True"),
    _bad("block_size=16.0", dict(block_size=16.0), "block_size=16.0"),
    _bad("block_size='16'", dict(block_size="16"), "block_size='16'"),
    _bad("block_size=True", dict(block_size=True), "block_size=True"),
    _bad("sink_blocks=1.5", dict(sink_blocks=1.5), "sink_blocks=1.5"),
    _bad("local_blocks=-1", dict(local_blocks=-1), "local_blocks=-1"),
    _bad("query_chunk_blocks=2.0", dict(query_chunk_blocks=2.0), "query_chunk_blocks=2.0"),
    _bad("mass_threshold=nan", dict(mass_threshold=NAN), "mass_threshold=nan"),
    _bad("max_density=1.5", dict(max_density=1.5), "max_density=1.5"),
    _bad("min_density a tensor", dict(min_density=torch.tensor(0.2)), "min_density="),
    _bad("estimator a list", dict(estimator=["maxkey"]), "estimator=['maxkey']"),
    _bad("selection_mode=None", dict(selection_mode=None), "selection_mode=None"),
    _bad("cache a list", dict(cache=[]), "cache is a list"),
    _bad("compile_backend=3", dict(compile_backend=3), "compile_backend=3"),
])
def test_bad_argument_raises_value_error_naming_it(over, needle, backend):
    with pytest.raises(ValueError) as err:
        _call(backend=backend, **over)
    assert needle in str(err.value)


def test_integer_and_real_types_other_than_int_and_float_are_accepted():
    q, k, v = _qkv(64, 4, 2, 8, seed=4)
    want, sel = block_sparse_attention(q, k, v, [0, 30, 64], 0.5, block_size=16, sink_blocks=1,
                                       softmax_scale=0.25)
    got, sel2 = block_sparse_attention(q, k, v, np.array([0, 30, 64]), np.float32(0.5),
                                       block_size=np.int64(16), sink_blocks=np.int32(1),
                                       softmax_scale=np.float64(0.25))
    assert torch.equal(got, want) and torch.equal(sel2.kv_indices, sel.kv_indices)
    got, _ = block_sparse_attention(q, k, v, torch.tensor([0, 30, 64]), 0.5, block_size=16,
                                    softmax_scale=0.25)
    assert torch.equal(got, want)
