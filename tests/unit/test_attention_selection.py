"""Block selection: layout, estimators, budget rules, invariants and statistics; bad input."""

import math

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention, build_layout
from sparsebalance_megatron.attention.kernels import to_blocks_kv, to_blocks_q
from sparsebalance_megatron.attention.selection import estimate_block_shares, select_from_shares


def _blocked(cu, nh, ng, hn, bs, seed):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k = torch.randn(t, nh, hn, generator=g), torch.randn(t, ng, hn, generator=g)
    lay = build_layout(cu, t, bs, "cpu")
    return q, k, lay, to_blocks_q(lay.pad(q), ng, bs), to_blocks_kv(lay.pad(k), bs)


def test_layout_blocks_and_padding():
    lay = build_layout([0, 5, 13, 29], 29, 4, "cpu")
    assert lay.doc_block_start == [0, 2, 4, 8]
    assert lay.block_doc.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert lay.block_local.tolist() == [0, 1, 0, 1, 0, 1, 2, 3]
    assert lay.block_len.tolist() == [4, 1, 4, 4, 4, 4, 4, 4]
    assert lay.token_slot.tolist()[:7] == [0, 1, 2, 3, 4, 8, 9]
    x = torch.arange(29.0)
    assert torch.equal(lay.unpad(lay.pad(x)), x)
    assert build_layout([0, 8, 16], 16, 4, "cpu").token_slot is None  # aligned: no copy


def _brute_maxkey(q, k, cu, bs, scale):
    """Per-document explicit loops: pooled query block . each key, max per key block."""
    nh, ng = q.shape[1], k.shape[1]
    rows = {}
    for a, b in zip(cu[:-1], cu[1:]):
        nb = math.ceil((b - a) / bs)
        for i in range(nb):
            qbar = q[a + i * bs: min(b, a + (i + 1) * bs)].mean(0)            # [nh, hn]
            per_head = []
            for h in range(nh):
                sc = torch.stack([(k[a + j * bs: min(b, a + (j + 1) * bs), h // (nh // ng)]
                                   @ qbar[h]).max() for j in range(i + 1)]) * scale
                per_head.append(torch.softmax(sc, 0))
            rows[(a, i)] = torch.stack(per_head).view(ng, nh // ng, -1).mean(1)  # [ng, i+1]
    return rows


@pytest.mark.parametrize("estimator", ["maxkey", "pooled"])
def test_estimator_shares_match_brute_force(estimator):
    cu, bs = [0, 37, 40, 90], 8
    q, k, lay, qb, kb = _blocked(cu, 4, 2, 8, bs, seed=0)
    shares = estimate_block_shares(qb, kb, lay, estimator, 0.3)
    assert torch.allclose(shares.sum(-1), torch.ones_like(shares[..., 0]), atol=1e-5)
    if estimator == "pooled":
        return
    brute = _brute_maxkey(q, k, cu, bs, 0.3)
    for d, a in enumerate(cu[:-1]):
        s0 = lay.doc_block_start[d]
        for i in range(lay.doc_block_start[d + 1] - s0):
            got = shares[:, s0 + i, s0:s0 + i + 1]
            assert torch.allclose(got, brute[(a, i)], atol=1e-5), (d, i)
            assert float(shares[:, s0 + i].sum() - got.sum()) < 1e-6  # nothing outside


def test_maxkey_finds_a_planted_key_that_pooling_dilutes():
    # one key of block 5 matches the queries strongly; the block's mean key does not
    bs, t = 16, 160
    g = torch.Generator().manual_seed(3)
    q = torch.randn(t, 2, 32, generator=g) * 0.1
    k = torch.randn(t, 1, 32, generator=g)
    direction = torch.randn(32, generator=g)
    q[-bs:, :] += direction
    k[5 * bs + 3, 0] = 4 * direction
    _, sel = block_sparse_attention(q, k, k.clone(), [0, t], 0.2, block_size=bs, sink_blocks=0,
                                    estimator="maxkey")
    last = sel.layout.num_blocks - 1
    assert 5 in sel.kv_indices[0, last, :int(sel.kv_num[0, last])].tolist()


@pytest.mark.parametrize("mode", ["density", "mass"])
def test_selection_invariants(mode):
    cu, bs = [0, 150, 151, 400, 530], 16
    _, _, lay, qb, kb = _blocked(cu, 6, 3, 8, bs, seed=1)
    density = torch.tensor([0.3, 1.0, 0.15, 0.6], dtype=torch.float64)
    sink, local, tau, dmin, dmax = 2, 1, 0.7, 0.2, 0.6
    shares = estimate_block_shares(qb, kb, lay, "maxkey", 8 ** -0.5)
    sel = select_from_shares(shares, lay, density, sink_blocks=sink, local_blocks=local,
                             selection_mode=mode, mass_threshold=tau, min_density=dmin,
                             max_density=dmax)
    mask = sel.block_mask()
    ng, nb = sel.kv_num.shape
    doc, loc = lay.block_doc.tolist(), lay.block_local.tolist()
    for g in range(ng):
        for i in range(nb):
            n = int(sel.kv_num[g, i])
            kept = sel.kv_indices[g, i, :n].tolist()
            assert kept[0] == i                                   # diagonal, slot 0
            assert len(set(kept)) == n                            # no duplicates
            assert all(doc[j] == doc[i] and j <= i for j in kept)  # causal, in document
            assert mask[g, i].sum() == n
            avail = loc[i] + 1
            forced = {j for j in range(i - loc[i], i + 1)
                      if loc[j] < sink or loc[j] >= loc[i] - local}
            assert forced <= set(kept)
            if mode == "density":
                want = min(avail, max(len(forced), math.ceil(density[doc[i]] * avail - 1e-9)))
                assert n == want
            else:
                lo = max(len(forced), math.ceil(dmin * avail - 1e-9))
                hi = min(avail, max(len(forced), math.ceil(dmax * avail - 1e-9)))
                assert lo <= n <= hi, (g, i, lo, n, hi, avail, len(forced))
                mass = float(shares[g, i, kept].sum())
                assert mass >= tau - 1e-6 or n == hi
                if n > lo:  # minimal: one block fewer would not reach tau
                    assert float(shares[g, i, kept[:-1]].sum()) < tau + 1e-6
    # statistics: kept / available per document, and estimated recall = kept share
    avail = lay.block_available().double()
    for d in range(lay.num_docs):
        rows = lay.block_doc == d
        want = sel.kv_num[:, rows].double().sum() / (ng * avail[rows].sum())
        assert abs(float(sel.density_kept[d]) - float(want)) < 1e-6
        rec = (shares * mask).sum(-1)[:, rows].mean()
        assert abs(float(sel.recall[d]) - float(rec)) < 1e-5
    assert float(sel.density_kept[1]) == 1.0 and float(sel.recall[1]) == pytest.approx(1.0)


def test_lower_density_keeps_fewer_blocks_and_less_mass():
    cu = [0, 512]
    _, _, lay, qb, kb = _blocked(cu, 4, 2, 16, 16, seed=2)
    shares = estimate_block_shares(qb, kb, lay, "maxkey", 0.25)
    stats = [select_from_shares(shares, lay, torch.tensor([d], dtype=torch.float64))
             for d in (1.0, 0.5, 0.25, 0.125)]
    dens = [float(s.density_kept[0]) for s in stats]
    recs = [float(s.recall[0]) for s in stats]
    assert dens == sorted(dens, reverse=True) and dens[0] == 1.0 and dens[-1] < 0.3
    assert recs == sorted(recs, reverse=True) and recs[-1] > dens[-1]  # better than random


def test_gqa_shares_average_the_group_heads():
    cu = [0, 96]
    q, k, lay, qb, kb = _blocked(cu, 4, 2, 8, 16, seed=4)
    gqa = estimate_block_shares(qb, kb, lay, "maxkey", 0.5)
    k_mha = k.repeat_interleave(2, dim=1)  # each query head gets its own copy of its KV head
    q_mha = qb.permute(0, 2, 1, 3, 4).reshape(4, lay.num_blocks, 16, 8).unsqueeze(2)
    mha = estimate_block_shares(q_mha, to_blocks_kv(lay.pad(k_mha), 16), lay, "maxkey", 0.5)
    assert torch.allclose(gqa, mha.view(2, 2, *mha.shape[1:]).mean(1), atol=1e-6)


def _call(**over):
    t, kw = 64, dict(q=torch.randn(64, 4, 8), k=torch.randn(64, 2, 8), v=torch.randn(64, 2, 8),
                     cu_seqlens=[0, 30, 64], density=0.5, block_size=16)
    kw.update(over)
    return block_sparse_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("cu_seqlens"),
                                  kw.pop("density"), **kw)


@pytest.mark.parametrize("over,needle", [
    (dict(density=0.0), "density=0.0"),
    (dict(density=1.5), "density=1.5"),
    (dict(density=float("nan")), "density=nan"),
    (dict(density=torch.tensor([0.5, 0.5, 0.5])), "3 entries"),
    (dict(block_size=48), "block_size=48"),
    (dict(block_size=0), "block_size=0"),
    (dict(block_size=-16), "block_size=-16"),
    (dict(k=torch.randn(64, 2, 4), v=torch.randn(64, 2, 4)), "head dim"),
    (dict(k=torch.randn(64, 3, 8), v=torch.randn(64, 3, 8)), "multiple"),
    (dict(v=torch.randn(64, 1, 8)), "v shape"),
    (dict(q=torch.randn(64, 32)), "3 dims"),
    (dict(cu_seqlens=[0, 40, 30, 64]), "increasing"),
    (dict(cu_seqlens=[0, 30, 30, 64]), "increasing"),
    (dict(cu_seqlens=[0, 30, 60]), "token count"),
    (dict(cu_seqlens=[5, 30, 64]), "cu_seqlens"),
    (dict(backend="cuda"), "backend='cuda'"),
    (dict(estimator="lastq"), "estimator='lastq'"),
    (dict(selection_mode="topk"), "selection_mode='topk'"),
    (dict(mass_threshold=0.0), "mass_threshold=0.0"),
    (dict(min_density=0.8, max_density=0.5), "min_density=0.8"),
    (dict(sink_blocks=-1), "sink_blocks=-1"),
    (dict(query_chunk_blocks=0), "query_chunk_blocks=0"),
])
def test_bad_input_raises_value_error_naming_the_value(over, needle):
    with pytest.raises(ValueError, match=None) as err:
        _call(**over)
    assert needle in str(err.value)


def test_per_document_density_tensor_is_used():
    _, sel = _call(cu_seqlens=[0, 32, 64], block_size=4,
                   density=torch.tensor([1.0, 0.25]), sink_blocks=0)
    assert float(sel.density_kept[0]) == 1.0 and float(sel.density_kept[1]) < 0.5
