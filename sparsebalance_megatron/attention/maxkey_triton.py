"""The ``maxkey`` block scores in one Triton kernel (CUDA): no score tensor over all keys.

``maxkey_scores(qsum, keys, layout, scale)`` computes, for every KV group ``g``, query head
``r`` of the group, query block ``i`` and key block ``j <= i`` of the same document,
``scale * max over the real keys of block j of mean_query[g, i, r] . key`` (float32; ``-inf``
elsewhere) from the per-block query *sums* (the division by the block length and the scale are
applied in the kernel). The
PyTorch fallback (``selection._maxkey_scores_torch``) builds the same numbers chunk by chunk;
this kernel needs no Python loop and no memory beyond its ``[ng, NB, rep, NB]`` output.
One program per (group, tile of ``_BLOCK_R`` pooled rows, key block); programs whose key block
lies after, or in an earlier document than, every row of the tile only write ``-inf``.
Triton is optional (``HAVE_TRITON``); ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors,
which is how the unit test checks it without a GPU. Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

import os

import torch

from .block_tables import block_tables

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    HAVE_TRITON = False

_BLOCK_R = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(keys: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel can score these keys (CUDA, or the interpreter; tile sizes it takes)."""
    hn = keys.shape[-1]
    return (HAVE_TRITON and (keys.is_cuda or _INTERPRET) and block_size >= 16
            and 16 <= hn <= 256 and hn & (hn - 1) == 0)


if HAVE_TRITON:
    @triton.jit(do_not_specialize=["R", "NB", "so_g", "so_r"])   # per micro-batch: one compile
    def _maxkey_kernel(Q, K, LEN, START, DOC, OUT, R, REP, NB, scale,
                       sq_g, sq_i, sq_j, sk_g, sk_t, so_g, so_r,
                       HN: tl.constexpr, BS: tl.constexpr, BLOCK_R: tl.constexpr,
                       IEEE: tl.constexpr):
        g = tl.program_id(0)
        r0 = tl.program_id(1) * BLOCK_R
        j = tl.program_id(2)
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        qi = rows // REP                              # query block of each pooled row
        i_first = r0 // REP
        i_last = tl.minimum(r0 + BLOCK_R - 1, R - 1) // REP
        out_ptrs = OUT + g * so_g + rows * so_r + j
        live = (j <= i_last) & (tl.load(DOC + j) >= tl.load(DOC + i_first))
        if live:
            d = tl.arange(0, HN)
            t = tl.arange(0, BS)
            klen = tl.load(LEN + j)
            key_ok = t < klen
            k = tl.load(K + g * sk_g + (tl.load(START + j) + t)[:, None] * sk_t + d[None, :],
                        mask=key_ok[:, None], other=0.0)
            q = tl.load(Q + g * sq_g + qi[:, None] * sq_i + (rows % REP)[:, None] * sq_j
                        + d[None, :], mask=row_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where(key_ok[None, :], s, float("-inf"))
            # q holds block sums: the mean is the sum / the block's real length
            qlen = tl.load(LEN + qi, mask=row_ok, other=1).to(tl.float32)
            m = tl.max(s, axis=1) * (scale / qlen)
            m = tl.where(qi >= j, m, float("-inf"))
            tl.store(out_ptrs, m, mask=row_ok)
        else:
            tl.store(out_ptrs, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)


def _int32_tables(layout, padded=True):
    """(block_len, block_start, block_doc) [NB] int32 (memoised on the layout); block_start in
    the padded token space (``j * B``) or the micro-batch's own (``padded=False``)."""
    key = ("maxkey_i32", padded)
    if key not in layout.memo:
        lens, start = block_tables(layout, padded)
        layout.memo[key] = (lens, start, layout.block_doc.to(torch.int32))
    return layout.memo[key]


def maxkey_scores(qsum: torch.Tensor, keys: torch.Tensor, layout,
                  softmax_scale: float = 1.0, padded: bool = True) -> torch.Tensor:
    """qsum ``[ng, NB, rep, hn]`` float32 *sums* of each block's queries (any strides, last dim
    contiguous), keys ``[ng, NB*B, hn]`` (any strides, last dim contiguous; ``padded=False``:
    ``[ng, t, hn]``, the micro-batch's own tokens, e.g. ``k.permute(1, 0, 2)``) ->
    ``softmax_scale * max_key(mean query . key)`` as ``[ng, NB, rep, NB]`` float32 (``-inf``
    for j > i and for key blocks of earlier documents than the row tile)."""
    ng, nb, rep, hn = qsum.shape
    bs = layout.block_size
    ieee = keys.dtype == torch.float32
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if qsum.stride(-1) != 1:
        qsum = qsum.contiguous()
    out = torch.empty(ng, nb * rep, nb, dtype=torch.float32, device=qsum.device)
    lens, start, docs = _int32_tables(layout, padded)
    grid = (ng, triton.cdiv(nb * rep, _BLOCK_R), nb)
    _maxkey_kernel[grid](qsum, keys, lens, start, docs, out, nb * rep, rep, nb,
                         float(softmax_scale),
                         qsum.stride(0), qsum.stride(1), qsum.stride(2),
                         keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
                         HN=hn, BS=bs, BLOCK_R=_BLOCK_R, IEEE=ieee)
    return out.view(ng, nb, rep, nb)
