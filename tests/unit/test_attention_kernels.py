"""Block-sparse attention kernels: torch (blockwise) and reference backends vs independent oracles.

Oracles are written here from scratch (per-document SDPA, explicit softmax under a block mask),
so a bug shared by the package's kernels and its mask expansion would still show up.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from sparsebalance_megatron.attention import block_sparse_attention
from sparsebalance_megatron.attention.flex import flex_attention_padded
from sparsebalance_megatron.attention.kernels import _CHUNK_ELEMENTS, plan_chunks


def _qkv(t, nh, ng, hn, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(t, h, hn, generator=g, dtype=dtype).requires_grad_(True)
    return mk(nh), mk(ng), mk(ng)


def _grads(out, inputs, seed=0):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


def _dense_causal_per_doc(q, k, v, cu):
    """Oracle 1: each document alone through causal SDPA (GQA by repeating k/v)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qq = q[a:b].transpose(0, 1)[None]
        kk = k[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None]
        vv = v[a:b].repeat_interleave(rep, 1).transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


def _masked_oracle(q, k, v, cu, block_size, block_mask, scale):
    """Oracle 2: explicit softmax; token i sees token j iff same doc, j <= i and the block
    (local index of j's block) is kept for (i's block) in ``block_mask [ng, NB, NB]``."""
    t, nh, _ = q.shape
    ng = k.shape[1]
    doc = torch.zeros(t, dtype=torch.long)
    gblk = torch.zeros(t, dtype=torch.long)
    nb0 = 0
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = d
        gblk[a:b] = nb0 + torch.arange(b - a) // block_size
        nb0 += math.ceil((b - a) / block_size)
    i = torch.arange(t)
    base = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    outs = []
    for h in range(nh):
        g = h // (nh // ng)
        allow = base & block_mask[g][gblk[:, None], gblk[None, :]]
        s = (q[:, h] @ k[:, g].T) * scale
        s = s.masked_fill(~allow, float("-inf"))
        outs.append(torch.softmax(s, -1) @ v[:, g])
    return torch.stack(outs, dim=1)


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("nh,ng", [(4, 2), (3, 3)])
def test_density_one_equals_dense_causal(backend, nh, ng):
    cu = [0, 70, 71, 200, 328]          # short last blocks, a 1-token doc, an aligned doc
    q, k, v = _qkv(cu[-1], nh, ng, 32, torch.float32, seed=1)
    out, sel = block_sparse_attention(q, k, v, cu, 1.0, block_size=32, backend=backend,
                                      query_chunk_blocks=2)
    ref = _dense_causal_per_doc(q, k, v, cu)
    assert _rel_err(out, ref) <= 1e-5
    for ga, gb in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert _rel_err(ga, gb) <= 1e-5
    assert torch.allclose(sel.density_kept, torch.ones(4))
    assert torch.allclose(sel.recall, torch.ones(4), atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_random_budgets_match_masked_oracle(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    nh, ng = [(4, 2), (4, 1), (2, 2), (6, 3)][seed]
    block_size = [8, 16, 16, 32][seed]
    ndoc = 1 + seed
    lens = torch.randint(1, 9 * block_size, (ndoc,), generator=gen).tolist()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    density = torch.rand(ndoc, generator=gen).clamp_min(0.05) if seed % 2 else 0.3
    kw = dict(block_size=block_size, sink_blocks=seed % 2, local_blocks=seed // 2,
              selection_mode="mass" if seed == 3 else "density", mass_threshold=0.6,
              min_density=0.2, max_density=0.7, estimator="pooled" if seed == 2 else "maxkey",
              query_chunk_blocks=1 + seed)
    q, k, v = _qkv(cu[-1], nh, ng, 16, torch.float64, seed)
    out_t, sel = block_sparse_attention(q, k, v, cu, density, backend="torch", **kw)
    out_r, sel_r = block_sparse_attention(q, k, v, cu, density, backend="reference", **kw)
    assert torch.equal(sel.block_mask(), sel_r.block_mask())
    oracle = _masked_oracle(q, k, v, cu, block_size, sel.block_mask(), 16 ** -0.5)
    g_oracle = _grads(oracle, (q, k, v))
    for out in (out_t, out_r):
        assert _rel_err(out, oracle) <= 1e-10
        for ga, gb in zip(_grads(out, (q, k, v)), g_oracle):
            assert _rel_err(ga, gb) <= 1e-10
    if bool((sel.density_kept < 1).any()):  # the budget really dropped something
        assert _rel_err(out_t, _dense_causal_per_doc(q, k, v, cu)) > 1e-6


def test_bf16_runs_and_stays_close():
    cu = [0, 100, 256]
    q, k, v = _qkv(256, 4, 2, 32, torch.float32, seed=5)
    ref, _ = block_sparse_attention(q, k, v, cu, 0.5, block_size=32, backend="reference")
    qb, kb, vb = (x.detach().bfloat16().requires_grad_(True) for x in (q, k, v))
    out, _ = block_sparse_attention(qb, kb, vb, cu, 0.5, block_size=32, backend="torch")
    assert out.dtype == torch.bfloat16
    assert _rel_err(out.float(), ref) < 2e-2
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad.float()).all() for x in (qb, kb, vb))


def test_softmax_scale_is_applied():
    cu = [0, 64]
    q, k, v = _qkv(64, 2, 2, 16, torch.float64, seed=6)
    out, sel = block_sparse_attention(q, k, v, cu, 1.0, block_size=16, backend="torch",
                                      softmax_scale=0.5)
    oracle = _masked_oracle(q, k, v, cu, 16, sel.block_mask(), 0.5)
    assert _rel_err(out, oracle) <= 1e-10


def test_chunks_bound_the_score_tile():
    kv_num = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 900, 900, 900]])
    chunks = plan_chunks(kv_num, num_heads=8, block_size=64, query_chunk_blocks=4)
    assert [c[:2] for c in chunks][0] == (0, 4)
    covered = []
    for i0, i1, kmax, kmin in chunks:
        covered += list(range(i0, i1))
        assert i1 - i0 <= 4
        assert kmax == int(kv_num[0, i0:i1].max()) and kmin == int(kv_num[0, i0:i1].min())
        assert i1 - i0 == 1 or (i1 - i0) * kmax * 8 * 64 * 64 <= _CHUNK_ELEMENTS
    assert covered == list(range(11))


def test_flex_eager_forward_matches_reference_on_cpu():
    # FlexAttention has no CPU backward; eager forward checks the BlockMask + mask_mod encoding.
    pytest.importorskip("torch.nn.attention.flex_attention")
    cu = [0, 100, 101, 300]
    q, k, v = (x.detach() for x in _qkv(300, 4, 2, 32, torch.float32, seed=7))
    out, sel = block_sparse_attention(q, k, v, cu, 0.3, block_size=16, backend="reference")
    lay = sel.layout
    got = lay.unpad(flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel,
                                          32 ** -0.5, compile_backend=None))
    assert _rel_err(got, out) <= 1e-5
