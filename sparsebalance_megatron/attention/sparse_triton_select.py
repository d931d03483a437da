"""The ``triton`` and ``fa4`` backends' whole per-layer call on the micro-batch's own tokens:
selection, lists and kernels in few launches, no host sync.

``triton_block_sparse(q, k, v, layout, density, density_host=..., kernel=...)`` computes what
``api._sparse_attention`` computes for those backends (the same ``BlockSelection``, the same
output), with the fixed cost per call cut; ``kernel`` is the attention kernel run on the lists:
``triton`` (``sparse_triton`` on the unpadded tokens, no padded copy) or ``fa4``
(FlashAttention-4's block-sparse kernels, ``fa4_cute``, on the layout's block-aligned tokens:
one pad and one unpad copy). On an H200 the fused selection and lists cost 0.6-0.8 ms a call
where the generic selection fa4 took before cost 1.1 ms (``scripts/bench.py attention_gpu``,
32K, 2026-11-26):

==================  =========  ================================================================
step                launches   how
==================  =========  ================================================================
block query sums    1          ``_block_sums_kernel`` reads q in place (no padded copy)
block scores        1          ``maxkey_triton`` reads k in place (``pooled``: key sums + bmm)
shares + ranking    1          ``_shares_kernel``: softmax over key blocks, mean over the GQA
                               heads, sanitised, + the forced/allowed priority, per row
top-k               1          ``torch.topk`` on the priority
lists + selection   1          ``block_lists.lists_from_ranking``: lists, ``kv_indices``, recall
recall per doc      1          one matrix-vector product (weights memoised on the layout)
forward             1          ``sparse_triton`` on the unpadded tokens (``triton``)
backward            3          pre (delta, zeroed accumulators), dK/dV/dQ, post (casts)
==================  =========  ================================================================

``density`` selection mode only, without ``reduce_shares``; ``mass`` mode or a share reduction
(context parallelism) take the generic selection (``select_from_shares``) on the same scores.
What depends only on the micro-batch (the kept counts, the layout's int32 tables, the recall
weights) is memoised on the layout; nothing is read back to the host.
Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import maxkey_triton
from .block_lists import build_block_lists, lists_from_ranking
from .selection import (BlockSelection, _block_len_f, _budget_tensors, _disallowed,
                        kept_bounds, select_from_shares, selection_range)
from .block_tables import block_tables
from .blocks import doc_bounds
from .sparse_triton import aligned, sparse_attention

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    HAVE_TRITON = False


def _kernel(fn=None, **kw):
    """``triton.jit`` where triton is installed (the module imports without it)."""
    if not HAVE_TRITON:
        return (lambda f: f) if fn is None else fn
    return triton.jit(fn, **kw) if fn is not None else triton.jit(**kw)


@_kernel
def _block_sums_kernel(X, START, LEN, OUT, H: tl.constexpr, HN: tl.constexpr,
                       BS: tl.constexpr):
    """Grid (NB, H): OUT[i, h] = float32 sum of block i's real tokens of X ``[t, H, HN]``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, BS)
    d = tl.arange(0, HN)
    x = tl.load(X + ((tl.load(START + i) + t) * H + h)[:, None] * HN + d[None, :],
                mask=(t < tl.load(LEN + i))[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + (i * H + h) * HN + d, tl.sum(x, 0))


@_kernel(do_not_specialize=["NB", "s_g", "s_i", "s_r"])     # per micro-batch: one compile
def _shares_kernel(S, DOC_START, SH, PRI, NB, s_g, s_i, s_r, SINK, LOCAL,
                   REP: tl.constexpr, RP: tl.constexpr, BLOCK_J: tl.constexpr):
    """Grid (NB, ng): row (g, i) of the shares (softmax over i's causal in-document key
    blocks of each head's scores ``S[g, i, r, :]``, mean over the ``REP`` heads, NaN -> 0,
    clamped to [0, 1], 0 elsewhere) and of the priority the top-k ranks by (shares + 4 on the
    diagonal, + 2 on the sinks and the local window, - 1 where not allowed): what
    ``selection._maxkey_shares`` + ``select_from_shares`` compute with seven launches."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(DOC_START + i)
    r = tl.arange(0, RP)
    r_ok = r < REP
    row = S + g * s_g + i * s_i + r[:, None] * s_r
    m = tl.full([RP], float("-inf"), tl.float32)
    l = tl.zeros([RP], tl.float32)
    for j0 in range(start, i + 1, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        s = tl.load(row + j[None, :], mask=r_ok[:, None] & (j <= i)[None, :],
                    other=float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv = tl.where(r_ok, 1.0 / tl.where(r_ok, l * REP, 1.0), 0.0)
    for j0 in range(0, NB, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        allowed = (j >= start) & (j <= i)
        s = tl.load(row + j[None, :], mask=r_ok[:, None] & allowed[None, :],
                    other=float("-inf"))
        share = tl.sum(tl.exp(s - m_safe[:, None]) * inv[:, None], 0)
        share = tl.where(share != share, 0.0, tl.minimum(tl.maximum(share, 0.0), 1.0))
        share = tl.where(allowed, share, 0.0)
        forced = allowed & ((j - start < SINK) | (j - start >= i - start - LOCAL))
        base = tl.where(j == i, 4.0, tl.where(forced, 2.0, tl.where(allowed, 0.0, -1.0)))
        ok = j < NB
        tl.store(SH + (g * NB + i) * NB + j, share, mask=ok)
        tl.store(PRI + (g * NB + i) * NB + j, share + base, mask=ok)


def _tables(layout, ng: int):
    """(document's first block per block int32, recall weights [ndoc, ng * NB] float32)."""
    key = ("triton_select", ng)
    if key not in layout.memo:
        dev = layout.block_doc.device
        starts = doc_bounds(layout)[0]                       # uploaded with the layout
        doc_start = starts[:-1].to(torch.int32)[layout.block_doc]
        nblk = (starts[1:] - starts[:-1]).to(torch.float32)
        onehot = (layout.block_doc[None, :] == torch.arange(layout.num_docs, device=dev)[:, None])
        w = (onehot.float() / (nblk[:, None] * ng)).repeat(1, ng)
        layout.memo[key] = (doc_start, w)
    return layout.memo[key]


def block_sums(x: torch.Tensor, layout) -> torch.Tensor:
    """x ``[t, H, hn]`` (the micro-batch's own tokens) -> ``[NB, H, hn]`` float32 sums of each
    block's real tokens, in one launch."""
    if not HAVE_TRITON:
        raise RuntimeError("the triton backend needs triton (pip install triton)")
    t, h, hn = x.shape
    lens, start = block_tables(layout, padded=False)
    out = torch.empty(layout.num_blocks, h, hn, dtype=torch.float32, device=x.device)
    _block_sums_kernel[(layout.num_blocks, h)](x.contiguous(), start, lens, out, H=h, HN=hn,
                                               BS=layout.block_size)
    return out


def block_scores(q, k, layout, estimator: str, softmax_scale: float) -> torch.Tensor:
    """``[ng, NB, rep, NB]`` float32 scores of the estimator, from the unpadded q and k."""
    nb, bs = layout.num_blocks, layout.block_size
    nh, ng, hn = q.shape[1], k.shape[1], q.shape[2]
    qsum = block_sums(q, layout).view(nb, ng, nh // ng, hn).permute(1, 0, 2, 3)
    if estimator == "maxkey":
        return maxkey_triton.maxkey_scores(qsum, k.permute(1, 0, 2), layout, softmax_scale,
                                           padded=False)
    if estimator != "pooled":
        raise ValueError(f"estimator={estimator!r}: expected maxkey or pooled")
    blen = _block_len_f(layout).view(1, nb, 1, 1)
    kbar = block_sums(k, layout).permute(1, 0, 2) / blen.view(1, nb, 1)
    s = torch.matmul((qsum / blen).reshape(ng, -1, hn), kbar.transpose(1, 2))
    return (s * softmax_scale).view(ng, nb, nh // ng, nb)


def triton_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                        density: torch.Tensor, *, density_host, estimator: str,
                        softmax_scale: float, sink_blocks: int, local_blocks: int,
                        selection_mode: str, mass_threshold: float, min_density: float,
                        max_density: float,
                        reduce_shares: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                        kernel: str = "triton"):
    """Selection and ``kernel`` (``triton`` or ``fa4``) on the unpadded q ``[t, np, hn]``, k/v
    ``[t, ng, hn]`` of ``layout`` (module docstring) -> ``(out [t, np, hn], BlockSelection)``;
    ``density`` ``[ndoc]`` and its host list ``density_host``, the budget as
    ``select_from_shares`` takes it. Validated arguments assumed (``api.block_sparse_attention``
    checks them)."""
    q, k, v = aligned(q), aligned(k), aligned(v)       # every launch below reads them in place
    ng, nb = k.shape[1], layout.num_blocks
    rep = q.shape[1] // ng
    budget = dict(sink_blocks=sink_blocks, local_blocks=local_blocks,
                  selection_mode=selection_mode, min_density=min_density,
                  max_density=max_density)
    with torch.no_grad(), selection_range():
        scores = block_scores(q.detach(), k.detach(), layout, estimator, softmax_scale)
        if selection_mode == "density" and reduce_shares is None:
            bounds = kept_bounds(layout, density_host, **budget)
            t = _budget_tensors(layout, bounds, density, ng, sink_blocks, local_blocks,
                                selection_mode, min_density, max_density)
            doc_start, weights = _tables(layout, ng)
            shares = torch.empty(ng, nb, nb, dtype=torch.float32, device=q.device)
            priority = torch.empty_like(shares)
            _shares_kernel[(nb, ng)](scores, doc_start, shares, priority, nb,
                                     scores.stride(0), scores.stride(1), scores.stride(2),
                                     sink_blocks, local_blocks, REP=rep,
                                     RP=max(2, triton.next_power_of_2(rep)), BLOCK_J=64)
            order = priority.topk(bounds.kmax, dim=-1).indices
            lists, kv_indices, recall_row = lists_from_ranking(layout, order, t["kv_num"],
                                                               shares)
            selection = BlockSelection(layout, kv_indices, t["kv_num"], shares,
                                       t["density_kept"], torch.mv(weights, recall_row.view(-1)),
                                       bounds)
        else:
            scores = scores.masked_fill(_disallowed(layout), float("-inf"))
            shares = torch.softmax(scores, dim=-1).mean(dim=2)
            if reduce_shares is not None:
                shares = reduce_shares(shares)
            selection = select_from_shares(shares, layout, density, density_host=density_host,
                                           mass_threshold=mass_threshold, **budget)
            lists = build_block_lists(selection)
    if kernel == "fa4":
        from .fa4_cute import fa4_block_sparse_attention
        out = fa4_block_sparse_attention(layout.pad(q), layout.pad(k), layout.pad(v),
                                         lists.q_num, lists.q_idx, lists.kv_num, lists.kv_idx,
                                         block_size=layout.block_size,
                                         softmax_scale=softmax_scale)
        return layout.unpad(out), selection
    return sparse_attention(q, k, v, lists, layout, softmax_scale), selection


__all__ = ["block_scores", "block_sums", "triton_block_sparse"]
