"""The ``maxkey`` block scores in one Triton kernel (CUDA): no score tensor over all keys.

``maxkey_scores(qbar, keys, layout)`` computes, for every KV group ``g``, pooled query row
``r`` (query block ``i = r // rep``) and key block ``j <= i`` of the same document,
``max over the real keys of block j of qbar[g, r] . key`` (float32; ``-inf`` elsewhere). The
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
    @triton.jit
    def _maxkey_kernel(Q, K, LEN, DOC, OUT, R, REP, NB,
                       sq_g, sq_r, sk_g, sk_t, so_g, so_r,
                       HN: tl.constexpr, BS: tl.constexpr, BLOCK_R: tl.constexpr,
                       IEEE: tl.constexpr):
        g = tl.program_id(0)
        r0 = tl.program_id(1) * BLOCK_R
        j = tl.program_id(2)
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        i_first = r0 // REP
        i_last = tl.minimum(r0 + BLOCK_R - 1, R - 1) // REP
        out_ptrs = OUT + g * so_g + rows * so_r + j
        live = (j <= i_last) & (tl.load(DOC + j) >= tl.load(DOC + i_first))
        if live:
            d = tl.arange(0, HN)
            t = tl.arange(0, BS)
            klen = tl.load(LEN + j)
            key_ok = t < klen
            k = tl.load(K + g * sk_g + (j * BS + t)[:, None] * sk_t + d[None, :],
                        mask=key_ok[:, None], other=0.0)
            q = tl.load(Q + g * sq_g + rows[:, None] * sq_r + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m = tl.max(s, axis=1)
            m = tl.where((rows // REP) >= j, m, float("-inf"))
            tl.store(out_ptrs, m, mask=row_ok)
        else:
            tl.store(out_ptrs, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)


def maxkey_scores(qbar: torch.Tensor, keys: torch.Tensor, layout) -> torch.Tensor:
    """qbar ``[ng, NB, rep, hn]`` float32, keys ``[ng, NB*B, hn]`` (any strides, last dim
    contiguous) -> ``[ng, NB, rep, NB]`` float32 (``-inf`` for j > i and other documents)."""
    ng, nb, rep, hn = qbar.shape
    bs = layout.block_size
    ieee = keys.dtype == torch.float32
    q = qbar.reshape(ng, nb * rep, hn)
    if not ieee:
        q = q.to(keys.dtype)
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    out = torch.empty(ng, nb * rep, nb, dtype=torch.float32, device=qbar.device)
    lens = layout.block_len.to(torch.int32)
    docs = layout.block_doc.to(torch.int32)
    grid = (ng, triton.cdiv(nb * rep, _BLOCK_R), nb)
    _maxkey_kernel[grid](q, keys, lens, docs, out, nb * rep, rep, nb,
                         q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                         out.stride(0), out.stride(1),
                         HN=hn, BS=bs, BLOCK_R=_BLOCK_R, IEEE=ieee)
    return out.view(ng, nb, rep, nb)
