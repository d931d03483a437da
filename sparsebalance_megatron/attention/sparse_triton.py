"""Block-sparse causal FlashAttention in Triton (forward and backward): the ``triton`` backend.

Works in the padded token space of a ``BlockLayout`` (every document starts on a block
boundary; block size = the selection's, 64 or 128 on a GPU, >= 16) over the lists of
``block_lists.build_block_lists``: per query block its kept key blocks besides the diagonal
(all full), per key block the query blocks that keep it. Each call launches each kernel once,
over all query (or key) blocks of all documents of the micro-batch; nothing is compiled per
length (one kernel per head dim, block size, GQA ratio and dtype).

Contract of ``sparse_attention_padded(q_pad, k_pad, v_pad, lists, layout, softmax_scale)``:

===============  ==================  ====================  ==================================
argument         shape               dtype                 layout / meaning
===============  ==================  ====================  ==================================
``q_pad``        ``[P, np, hn]``     fp16 / bf16 / fp32    padded tokens (``layout.pad``);
                                                           head ``h`` uses KV group
                                                           ``h // (np // ng)``
``k_pad, v_pad`` ``[P, ng, hn]``     as ``q_pad``          padded tokens, zeros in padding
``lists``        ``BlockLists``      int32                 ``build_block_lists(selection)``
``layout``       ``BlockLayout``                           the selection's; ``P >= NB * B``
returns          ``[P, np, hn]``     as ``q_pad``          attention output; padding slots
                                                           (and slots past ``NB * B``) are 0
===============  ==================  ====================  ==================================

Any strides (made contiguous where they are not); ``hn`` a power of two in 16..256; ``np`` a
multiple of ``ng``; differentiable in q, k and v. ``triton_attention_padded(..., selection,
...)`` builds the lists and calls it. The custom ops ``sparsebalance::sparse_attn_fwd`` /
``sparse_attn_bwd`` underneath take the first ``NB * B`` rows only and return (out, lse
``[np, NB * B]`` float32, natural log, ``+inf`` on padding rows) / (dq, dk, dv).

Design (``sparse_triton_kernels`` has the kernels):

- GQA: the ``rep = np // ng`` query heads of a KV group are stacked as the M dimension
  (``rep * B`` rows: head-major, then token). A forward / dQ program takes ``BLOCK_M`` of those
  rows of one query block (``_tiles``: 128 or 64), so every K/V tile it loads serves all the
  heads in its rows (up to ``BLOCK_M / B``: two heads at block 64 and head dim <= 128; at block
  128 one head per program, and the group's programs are launched next to each other, so the
  tile comes from L2). A dK/dV program holds one K/V tile and loops over all ``rep`` heads'
  rows of every query block in its list: each K/V tile is loaded once per program for the
  whole group.
- forward: online softmax in float32 (base 2) over the full blocks, unmasked, then the diagonal
  with the causal and real-length masks; saves the log-sum-exp. Query blocks are launched
  latest first (the longest lists).
- backward: ``delta = rowsum(dO * O)``; dQ per query-block tile over the forward list; dK/dV
  per key block over its transposed list. A column is cut into chunks of ``KV_CHUNK`` = 16
  query blocks, one program each (the first also takes the diagonal): no program walks a whole
  document's sink column, and one program's work is at most 17 query blocks x ``rep`` heads.
  The chunks of a column longer than 16 add their partial sums into float32 dK/dV buffers with
  atomic adds; a shorter column is stored by its only program. The buffers are cast to the
  input dtype at the end. The grid is ``ceil(Wk / 16)`` chunks for every key block, most of
  them empty (they exit at once).
- tiles, ``KV_CHUNK`` and launch settings per head dim (``_tiles``, ``_LAUNCH``) are untuned
  first choices, to be tuned on the device.

Registered with ``torch.library.custom_op`` (fake implementations for tracing) and its autograd;
the ops run under ``TRITON_INTERPRET=1`` on CPU tensors too, which is how the unit tests check
them. Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .block_lists import BlockLists, build_block_lists

try:
    import triton
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    HAVE_TRITON = False

if HAVE_TRITON:
    from . import sparse_triton_kernels as _k

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KV_CHUNK = 16
"""Entries of a key block's transposed list one dK/dV program takes (untuned)."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (num_warps, num_stages) per head dim: untuned first choices, to be tuned on the device
_LAUNCH = {16: (4, 2), 32: (4, 2), 64: (4, 2), 128: (8, 2), 256: (8, 1)}
_INT32_MAX = 2 ** 31 - 1


def why_not(q: torch.Tensor, block_size: int) -> Optional[str]:
    """Why the kernels cannot run on ``q`` with this block size, or None when they can."""
    return missing(q.device, q.dtype, q.shape[-1], block_size)


def missing(device, dtype=None, head_dim: Optional[int] = None,
            block_size: Optional[int] = None) -> Optional[str]:
    """Why the kernels cannot run on ``device`` (and, where given, this dtype, head dim and
    block size), or None when they can."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if torch.device(device).type != "cuda" and not _INTERPRET:
        return (f"it needs a CUDA device (q is on {device}; TRITON_INTERPRET=1 runs it "
                f"on CPU tensors in Triton's interpreter, slowly)")
    if dtype is not None and dtype not in _DTYPES:
        return f"q dtype {dtype}: expected float16, bfloat16 or float32"
    if head_dim is not None and not (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0):
        return f"head dim {head_dim}: expected a power of two in 16..256"
    if block_size is not None and block_size < 16:
        return f"block_size={block_size}: expected >= 16"
    return None


def usable(q: torch.Tensor, block_size: int) -> bool:
    """Whether the kernels run on ``q`` (CUDA, or the interpreter; dtypes and tiles they take)."""
    return why_not(q, block_size) is None


def _tiles(hn: int, bs: int, rep: int) -> dict:
    """Stacked query rows per program (forward, dQ, dK/dV) and key rows per dK/dV program:
    register-sized for the head dim (untuned)."""
    rows = triton.next_power_of_2(rep * bs)
    return dict(fwd=min(rows, 128 if hn <= 128 else 64), dq=min(rows, 128 if hn <= 64 else 64),
                dkv_m=min(rows, 64 if hn <= 64 else 32),
                dkv_n=min(bs, 128 if hn <= 64 else 64))


def _block_len(layout) -> torch.Tensor:
    if "triton_block_len" not in layout.memo:
        layout.memo["triton_block_len"] = layout.block_len.to(torch.int32)
    return layout.memo["triton_block_len"]


def _shape(q, k):
    t, nh, hn = q.shape
    ng = k.shape[1]
    return t, nh, ng, nh // ng, hn


def _prec(q):
    """tl.dot's input precision: exact float32 for float32 inputs (no TF32)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _launch(hn):
    warps, stages = _LAUNCH[hn]
    return dict(num_warps=warps, num_stages=stages)


if HAVE_TRITON:
    @torch.library.custom_op("sparsebalance::sparse_attn_fwd", mutates_args=())
    def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_num: torch.Tensor,
                q_idx: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
                block_len: torch.Tensor, block_size: int, scale: float,
                kv_chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
        t, nh, ng, rep, hn = _shape(q, k)
        nb = t // block_size
        out = torch.empty_like(q)
        lse = torch.empty(nh, t, dtype=torch.float32, device=q.device)
        bm = _tiles(hn, block_size, rep)["fwd"]
        _k.fwd_kernel[(triton.cdiv(rep * block_size, bm), ng, nb)](
            q, k, v, out, lse, q_num, q_idx, block_len, nb, t, q_idx.shape[-1],
            scale * _k.LOG2E.value, NP=nh, NG=ng, REP=rep, HN=hn, BS=block_size, BLOCK_M=bm,
            PREC=_prec(q), **_launch(hn))
        return out, lse

    @_fwd_op.register_fake
    def _fwd_fake(q, k, v, q_num, q_idx, kv_num, kv_idx, block_len, block_size, scale,
                  kv_chunk):
        return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)

    @torch.library.custom_op("sparsebalance::sparse_attn_bwd", mutates_args=())
    def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, q_num: torch.Tensor, q_idx: torch.Tensor,
                kv_num: torch.Tensor, kv_idx: torch.Tensor, block_len: torch.Tensor,
                block_size: int, scale: float,
                kv_chunk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, nh, ng, rep, hn = _shape(q, k)
        nb = t // block_size
        dout = dout.contiguous()
        tiles, launch, prec = _tiles(hn, block_size, rep), _launch(hn), _prec(q)
        delta = torch.empty(nh, t, dtype=torch.float32, device=q.device)
        _k.delta_kernel[(triton.cdiv(t, 64), nh)](out, dout, delta, t, t, NP=nh, HN=hn,
                                                  BLOCK_T=64)
        dq = torch.empty_like(q)
        qk_scale = scale * _k.LOG2E.value
        bm = tiles["dq"]
        _k.dq_kernel[(triton.cdiv(rep * block_size, bm), ng, nb)](
            q, k, v, dout, dq, lse, delta, q_num, q_idx, block_len, nb, t, q_idx.shape[-1],
            qk_scale, scale, NP=nh, NG=ng, REP=rep, HN=hn, BS=block_size, BLOCK_M=bm,
            PREC=prec, **launch)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        chunks = -(-kv_idx.shape[-1] // kv_chunk)
        bn = tiles["dkv_n"]
        _k.dkv_kernel[(chunks * (block_size // bn), ng, nb)](
            q, k, v, dout, dk, dv, lse, delta, kv_num, kv_idx, block_len, nb, t,
            kv_idx.shape[-1], kv_chunk, qk_scale, scale, NP=nh, NG=ng, REP=rep, HN=hn,
            BS=block_size, BLOCK_N=bn, BLOCK_M=tiles["dkv_m"], PREC=prec, **launch)
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    @_bwd_op.register_fake
    def _bwd_fake(dout, q, k, v, out, lse, q_num, q_idx, kv_num, kv_idx, block_len,
                  block_size, scale, kv_chunk):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, q_num, q_idx, kv_num, kv_idx, block_len, block_size, scale, kv_chunk = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], q_num, q_idx, kv_num, kv_idx,
                              block_len)
        ctx.args = (block_size, scale, kv_chunk)

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, *lists = ctx.saved_tensors
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, *lists, *ctx.args)
        return (dq, dk, dv) + (None,) * 8

    _fwd_op.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                            lists: BlockLists, layout, softmax_scale: float,
                            kv_chunk: int = KV_CHUNK) -> torch.Tensor:
    """Block-sparse causal attention over the padded layout (module docstring: the contract).
    ``kv_chunk``: entries of a transposed list per dK/dV program (``KV_CHUNK``)."""
    bs, nb = layout.block_size, layout.num_blocks
    why = why_not(q_pad, bs)
    if why is not None:
        raise ValueError(f"sparse_attention_padded: {why}")
    p, nh, hn = q_pad.shape
    ng = k_pad.shape[1]
    t = nb * bs
    if k_pad.shape != v_pad.shape or k_pad.shape[0] != p or k_pad.shape[2] != hn \
            or nh % ng or p < t:
        raise ValueError(f"q_pad {tuple(q_pad.shape)}, k_pad {tuple(k_pad.shape)}, v_pad "
                         f"{tuple(v_pad.shape)}: expected [P, np, hn], [P, ng, hn] x 2 with np "
                         f"a multiple of ng and P >= {t} (the layout's {nb} blocks of {bs})")
    if tuple(lists.q_num.shape) != (ng, nb):
        raise ValueError(f"lists for {tuple(lists.q_num.shape)} (groups, blocks): expected "
                         f"({ng}, {nb}) for these k/v and this layout")
    if t * nh * hn > _INT32_MAX:
        raise ValueError(f"{t} padded tokens x {nh} heads x head dim {hn} = {t * nh * hn} "
                         f"elements: the kernels index in int32 (at most {_INT32_MAX})")
    if isinstance(kv_chunk, bool) or not isinstance(kv_chunk, int) or kv_chunk < 1:
        raise ValueError(f"kv_chunk={kv_chunk!r}: expected an integer >= 1")
    q, k, v = (x[:t].contiguous() for x in (q_pad, k_pad, v_pad))
    idx = (x.contiguous() for x in (lists.q_num, lists.q_idx, lists.kv_num, lists.kv_idx))
    out, _ = _fwd_op(q, k, v, *idx, _block_len(layout), bs, float(softmax_scale), kv_chunk)
    if p > t:
        out = torch.cat([out, out.new_zeros(p - t, nh, hn)])
    return out


def triton_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                            selection, softmax_scale: float) -> torch.Tensor:
    """``sparse_attention_padded`` over the lists of ``selection`` (built here, on the device)."""
    return sparse_attention_padded(q_pad, k_pad, v_pad, build_block_lists(selection),
                                   selection.layout, softmax_scale)


__all__ = ["KV_CHUNK", "sparse_attention_padded", "triton_attention_padded", "usable",
           "why_not", "missing"]
