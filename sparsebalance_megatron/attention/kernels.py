"""Block-sparse attention kernels in plain PyTorch: the blockwise path and the dense reference.

``blockwise_attention`` is the CPU path and the portable fallback. It walks query blocks in
chunks; for every chunk it gathers only the kept K/V blocks (``index_select``, padded to the
chunk's largest kept count and masked), so work scales with the density and the L x L score
matrix is never built. It is a ``torch.autograd.Function`` that saves only q, k, v, the output
and the log-sum-exp and recomputes the probabilities chunk by chunk in backward
(flash-attention style), so activation memory is O(tokens), not O(tokens^2 * density).

``reference_attention`` is the oracle: dense SDPA with the block mask expanded to tokens.
Both compute exactly the same function. Pure torch; must not import megatron.
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch
import torch.nn.functional as F

from .selection import BlockSelection

# Largest score tile [heads, C * block_size, K * block_size] of one chunk, in elements; the chunk
# shrinks below ``query_chunk_blocks`` where the kept count is large. This bounds peak memory, and
# a tile that stays near the CPU caches is faster: at 8K tokens (4 heads, hn 64, one thread)
# 2^20 elements took 2.2 s fwd+bwd at density 1.0 and 0.57 s at 0.25, 2^25 took 4.4 s / 0.79 s.
_CHUNK_ELEMENTS = 1 << 20


def to_blocks_q(q_pad: torch.Tensor, num_groups: int, block_size: int) -> torch.Tensor:
    """[NB*B, np, hn] -> [ng, NB, rep, B, hn] (query heads of a group are contiguous)."""
    t, nh, hn = q_pad.shape
    return (q_pad.view(t // block_size, block_size, num_groups, nh // num_groups, hn)
            .permute(2, 0, 3, 1, 4).contiguous())


def to_blocks_kv(k_pad: torch.Tensor, block_size: int) -> torch.Tensor:
    """[NB*B, ng, hn] -> [ng, NB, B, hn]."""
    t, ng, hn = k_pad.shape
    return k_pad.view(t // block_size, block_size, ng, hn).permute(2, 0, 1, 3).contiguous()


def from_blocks_q(x_blk: torch.Tensor) -> torch.Tensor:
    """[ng, NB, rep, B, hn] -> [NB*B, np, hn]."""
    ng, nb, rep, bs, hn = x_blk.shape
    return x_blk.permute(1, 3, 0, 2, 4).reshape(nb * bs, ng * rep, hn)


def plan_chunks(kv_num, num_heads: int, block_size: int,
                query_chunk_blocks: int) -> List[Tuple[int, int, int, int]]:
    """Chunks ``(i0, i1, kmax, kmin)`` of query blocks: at most ``query_chunk_blocks`` blocks,
    and the score tile ``num_heads * C * B * kmax * B`` within ``_CHUNK_ELEMENTS`` (at least one
    block). ``kmax`` / ``kmin``: largest / smallest kept count in the chunk.

    ``kv_num``: ``[ng, NB]`` kept counts (read back to the host), or a ``KeptBounds`` (host-side
    bounds of the counts: the per-layer path plans from these, without a device round trip)."""
    if isinstance(kv_num, torch.Tensor):
        kmax_blk = kv_num.max(dim=0).values.tolist()
        kmin_blk = kv_num.min(dim=0).values.tolist()
    else:
        kmax_blk, kmin_blk = kv_num.hi.tolist(), kv_num.lo.tolist()
    chunks, i0, nb = [], 0, len(kmax_blk)
    per_pair = num_heads * block_size * block_size
    while i0 < nb:
        i1, k = i0 + 1, kmax_blk[i0]
        while i1 < nb and i1 - i0 < query_chunk_blocks:
            k2 = max(k, kmax_blk[i1])
            if (i1 + 1 - i0) * k2 * per_pair > _CHUNK_ELEMENTS:
                break
            i1, k = i1 + 1, k2
        chunks.append((i0, i1, k, min(kmin_blk[i0:i1])))
        i0 = i1
    return chunks


@contextlib.contextmanager
def _single_thread():
    # CPU index_add_ is 5-15x slower with 2 OpenMP threads than with 1 (measured, torch 2.13)
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def _chunk_scores(q, k_flat, idx, kv_num, chunk):
    """Masked, scaled scores of one chunk of query blocks.

    q ``[ng, NB, rep, B, hn]`` already multiplied by the softmax scale; k_flat ``[ng*NB, B, hn]``; idx ``[ng, NB, K]`` (slot 0 = diagonal).
    Returns (scores ``[ng*C, rep*B, K*B]`` in fp32 or fp64, flat key-block indices ``[ng*C*K]``,
    gathered keys ``[ng*C, K*B, hn]``, queries ``[ng*C, rep*B, hn]``).
    """
    i0, i1, kmax, kmin = chunk
    ng, nb, rep, bs, hn = q.shape
    c = i1 - i0
    dev = q.device
    sel = idx[:, i0:i1, :kmax]                                              # [ng, C, K]
    flat = (sel + (torch.arange(ng, device=dev) * nb).view(ng, 1, 1)).reshape(-1)
    kg = k_flat.index_select(0, flat).view(ng * c, kmax * bs, hn)
    qc = q[:, i0:i1].reshape(ng * c, rep * bs, hn)
    acc = torch.promote_types(q.dtype, torch.float32)   # softmax in fp32 (or fp64) at least
    s = torch.bmm(qc, kg.transpose(1, 2)).to(acc)   # [ng*C, rep*B, K*B]; q is pre-scaled
    s5 = s.view(ng * c, rep, bs, kmax, bs)
    # causal inside the diagonal block (slot 0); padded keys only ever sit in a diagonal block
    # (a document's short last block), above the diagonal of every real query row
    tok = torch.arange(bs, device=dev)
    s5[:, :, :, 0, :].masked_fill_(tok.view(bs, 1) < tok.view(1, bs), float("-inf"))
    if kmin < kmax:  # slots past kv_num are padding of this chunk's tile
        dead = torch.arange(kmin, kmax, device=dev).view(1, 1, -1) >= kv_num[:, i0:i1, None]
        s5[:, :, :, kmin:, :].masked_fill_(dead.view(ng * c, 1, 1, kmax - kmin, 1),
                                           float("-inf"))
    return s, flat, kg, qc


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv_indices, kv_num, chunks, scale):
        # q [ng, NB, rep, B, hn]; k, v [ng, NB, B, hn]
        ng, nb, rep, bs, hn = q.shape
        out = torch.empty_like(q)
        acc = torch.promote_types(q.dtype, torch.float32)
        lse_all = torch.empty(ng, nb, rep, bs, dtype=acc, device=q.device)
        k_flat, v_flat = k.reshape(ng * nb, bs, hn), v.reshape(ng * nb, bs, hn)
        qs = q * scale
        for chunk in chunks:
            i0, i1 = chunk[0], chunk[1]
            c = i1 - i0
            s, flat, _, _ = _chunk_scores(qs, k_flat, kv_indices, kv_num, chunk)
            m = s.amax(dim=-1, keepdim=True)                                # [ng*C, rep*B, 1]
            s.sub_(m).exp_()
            denom = s.sum(dim=-1, keepdim=True)
            vg = v_flat.index_select(0, flat).view(ng * c, -1, hn)
            o = torch.bmm(s.to(v.dtype), vg).to(acc).div_(denom)           # normalise [rows, hn]
            out[:, i0:i1] = o.view(ng, c, rep, bs, hn)
            lse_all[:, i0:i1] = (m + denom.log()).view(ng, c, rep, bs)
        ctx.save_for_backward(q, k, v, kv_indices, kv_num, out, lse_all)
        ctx.chunks, ctx.scale = chunks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kv_indices, kv_num, out, lse_all = ctx.saved_tensors
        ng, nb, rep, bs, hn = q.shape
        scale = ctx.scale
        acc = lse_all.dtype
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)                       # [ng, NB, rep, B]
        dq = torch.empty_like(q)
        dk = torch.zeros(ng * nb, bs * hn, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        k_flat, v_flat = k.reshape(ng * nb, bs, hn), v.reshape(ng * nb, bs, hn)
        qs = q * scale
        for chunk in ctx.chunks:
            i0, i1 = chunk[0], chunk[1]
            c = i1 - i0
            s, flat, kg, qc = _chunk_scores(qs, k_flat, kv_indices, kv_num, chunk)
            p = s.sub_(lse_all[:, i0:i1].reshape(ng * c, rep * bs, 1)).exp_()
            vg = v_flat.index_select(0, flat).view(ng * c, -1, hn)
            do_c = dout[:, i0:i1].reshape(ng * c, rep * bs, hn)
            dv_g = torch.bmm(p.to(v.dtype).transpose(1, 2), do_c).to(acc)  # [ng*C, K*B, hn]
            dp = torch.bmm(do_c, vg.transpose(1, 2)).to(acc)
            ds = p.mul_(dp.sub_(delta[:, i0:i1].reshape(ng * c, rep * bs, 1))).to(q.dtype)
            dq[:, i0:i1] = (torch.bmm(ds, kg).mul_(scale)).view(ng, c, rep, bs, hn)
            dk_g = torch.bmm(ds.transpose(1, 2), qc).to(acc)               # qc carries the scale
            with _single_thread():
                dv.index_add_(0, flat, dv_g.view(-1, bs * hn))
                dk.index_add_(0, flat, dk_g.view(-1, bs * hn))
        return (dq, dk.view(ng, nb, bs, hn).to(k.dtype), dv.view(ng, nb, bs, hn).to(v.dtype),
                None, None, None, None)


def blockwise_attention(q_blk: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                        selection: BlockSelection, softmax_scale: float,
                        query_chunk_blocks: int = 16) -> torch.Tensor:
    """Blocked q ``[ng, NB, rep, B, hn]``, k/v ``[ng, NB, B, hn]`` -> out ``[ng, NB, rep, B, hn]``.

    The chunk plan comes from the selection's host-side kept-count bounds (planned once per
    micro-batch and density), so this path reads nothing back from the device."""
    layout = selection.layout
    heads = q_blk.shape[0] * q_blk.shape[2]
    bounds = selection.bounds
    if bounds is None:
        chunks = plan_chunks(selection.kv_num, heads, layout.block_size, query_chunk_blocks)
    else:
        key = ("chunks", heads, query_chunk_blocks)
        if key not in bounds.memo:
            bounds.memo[key] = plan_chunks(bounds, heads, layout.block_size, query_chunk_blocks)
        chunks = bounds.memo[key]
    return _BlockSparseAttention.apply(q_blk, k_blk, v_blk, selection.kv_indices,
                                       selection.kv_num, chunks, float(softmax_scale))


def token_mask(selection: BlockSelection, num_heads: int) -> torch.Tensor:
    """[np, t, t] bool over the real tokens: kept block, causal, same document (O(t^2))."""
    layout = selection.layout
    tb = layout.token_block()
    bm = selection.block_mask()                                            # [ng, NB, NB]
    ng = bm.shape[0]
    t = layout.num_tokens
    ar = torch.arange(t, device=tb.device)
    m = bm[:, tb[:, None], tb[None, :]] & (ar[None, :] <= ar[:, None])
    return m.repeat_interleave(num_heads // ng, dim=0)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        selection: BlockSelection, softmax_scale: float) -> torch.Tensor:
    """Oracle: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np, hn]`` via dense masked SDPA."""
    nh, ng = q.shape[1], k.shape[1]
    mask = token_mask(selection, nh)
    kk = k.repeat_interleave(nh // ng, dim=1)
    vv = v.repeat_interleave(nh // ng, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
        attn_mask=mask[None], scale=softmax_scale)
    return out[0].transpose(0, 1)
