"""Block-sparse causal FlashAttention in Triton (forward and backward): the ``triton`` backend.

Runs over the lists of ``block_lists.build_block_lists`` (per query block its kept key blocks
besides the diagonal, all full; per key block the query blocks that keep it) of a
``BlockLayout`` (block size = the selection's, 64 or 128 on a GPU, >= 16), in either token space:

- ``sparse_attention(q, k, v, lists, layout, softmax_scale)``: the micro-batch's own tokens
  (``[t, heads, hn]``, documents as ``cu_seqlens`` has them). Nothing is padded: the kernels
  find block ``i``'s tokens at ``block_start[i] + [0, block_len[i])`` and mask past the real
  length (``triton_attention(q, k, v, selection, ...)`` builds the lists first);
- ``sparse_attention_padded(q_pad, k_pad, v_pad, lists, layout, softmax_scale)``: the padded
  token space of ``layout.pad`` (every document on a block boundary); padding slots (and slots
  past ``NB * B``) of the output are 0.

===============  ==================  ====================  ==================================
argument         shape               dtype                 layout / meaning
===============  ==================  ====================  ==================================
``q``            ``[T, np, hn]``     fp16 / bf16 / fp32    head ``h`` uses KV group
                                                           ``h // (np // ng)``
``k, v``         ``[T, ng, hn]``     as ``q``              the same token space as ``q``
``lists``        ``BlockLists``      int32                 ``build_block_lists(selection)``
``layout``       ``BlockLayout``                           the selection's
returns          ``[T, np, hn]``     as ``q``              attention output
===============  ==================  ====================  ==================================

Any strides and offsets (copied where not contiguous or not 16-byte aligned: ``aligned``);
``hn`` a power of two in 16..256; ``np`` a multiple of ``ng``; differentiable in q, k and v. The custom ops ``sparsebalance::
sparse_attn_fwd`` / ``sparse_attn_bwd`` underneath return (out, lse ``[np, NB * B]`` float32,
natural log, ``+inf`` on padding rows) / (dq, dk, dv).

Design (``sparse_triton_kernels`` has the kernels, ``work_model`` their cost):

- GQA: the ``rep = np // ng`` query heads of a KV group are stacked as the M dimension
  (``rep * B`` rows: head-major, then token), so every K/V tile a program loads serves all the
  heads in its rows.
- forward: one program per (row tile, group, query block), online softmax in float32 (base 2)
  over the full blocks of the list, unmasked, then the diagonal with the causal and real-length
  masks; saves the log-sum-exp. Query blocks are launched latest first (the longest lists).
- backward, 3 launches: ``bwd_pre`` (``delta = rowsum(dO * O)`` and the float32 dQ/dK/dV
  accumulators zeroed), ``dkv`` (the whole backward, 5 GEMMs per kept tile: one program per
  key tile over a chunk of its transposed list, one flattened loop over entry x row tile, dQ by
  float32 atomic adds), ``bwd_post`` (the accumulators cast to the input dtype); with a launch
  config's ``dq_block_m`` (the split), 4: ``dkv`` without dQ, then ``dq`` over the forward's
  lists (3 GEMMs per kept tile, dQ stored once). A column longer
  than ``kv_chunk`` entries (a document's sink) is split over several programs that add their
  dK/dV atomically; no program walks a whole sink column.
- launch settings (tiles, warps, stages, ``kv_chunk``) per (head dim, block, GQA ratio) from
  ``triton_launch.launch_config``: pinned from the device's kernel table, register-sized
  defaults until then.
- per call: forward 1 launch, backward 3 (4 split); no host sync, no per-length recompile
  (one kernel per head dim, block size, GQA ratio, dtype and launch config). The whole
  per-layer call on the unpadded tokens, selection included, is
  ``sparse_triton_select.triton_block_sparse``
  (7 launches forward with the maxkey estimator, 3 backward).

Registered with ``torch.library.custom_op`` (fake implementations for tracing) and its autograd;
the ops run under ``TRITON_INTERPRET=1`` on CPU tensors too, which is how the unit tests check
them. Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

import os
from dataclasses import astuple, replace
from typing import List, Optional, Tuple

import torch

from .block_lists import BlockLists, build_block_lists
from .block_tables import block_tables
from .triton_launch import LaunchConfig, launch_config

try:
    import triton
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    HAVE_TRITON = False

if HAVE_TRITON:
    from . import sparse_triton_kernels as _k

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KV_CHUNK = 16
"""Default entries of a key block's transposed list per backward program (``LaunchConfig``)."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_MAX = 2 ** 31 - 1
_POST_BLOCK = 1024


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


def _shape(q, k):
    t, nh, hn = q.shape
    ng = k.shape[1]
    return t, nh, ng, nh // ng, hn


def _prec(q):
    """tl.dot's input precision: exact float32 for float32 inputs (no TF32)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with its first element 16-byte aligned, copied where it is not. A
    contiguous view at an odd offset passes ``.contiguous()`` uncopied, and triton specialises
    a launch on pointer alignment: an unaligned pointer gets a kernel compiled without the
    divisibility hints, one the compile gate never judged (slower, and the review found it
    spilling). Differentiable (``contiguous``/``clone``)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _config(cfg: List[int]) -> LaunchConfig:
    return LaunchConfig(*cfg)


if HAVE_TRITON:
    @torch.library.custom_op("sparsebalance::sparse_attn_fwd", mutates_args=())
    def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_num: torch.Tensor,
                q_idx: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
                block_len: torch.Tensor, block_start: torch.Tensor, block_size: int,
                scale: float, padded: bool,
                cfg: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        t, nh, ng, rep, hn = _shape(q, k)
        nb = q_num.shape[1]
        c = _config(cfg)
        out = torch.empty_like(q)
        lse = torch.empty(nh, nb * block_size, dtype=torch.float32, device=q.device)
        _k.fwd_kernel[(triton.cdiv(rep * block_size, c.fwd_block_m), ng, nb)](
            q, k, v, out, lse, q_num, q_idx, block_len, block_start, nb, q_idx.shape[-1],
            scale * _k.LOG2E.value, NP=nh, NG=ng, REP=rep, HN=hn, BS=block_size,
            BLOCK_M=c.fwd_block_m, PREC=_prec(q), PADDED=padded, num_warps=c.fwd_warps,
            num_stages=c.fwd_stages)
        return out, lse

    @_fwd_op.register_fake
    def _fwd_fake(q, k, v, q_num, q_idx, kv_num, kv_idx, block_len, block_start, block_size,
                  scale, padded, cfg):
        return torch.empty_like(q), q.new_empty(q.shape[1], q_num.shape[1] * block_size,
                                                dtype=torch.float32)

    @torch.library.custom_op("sparsebalance::sparse_attn_bwd", mutates_args=())
    def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, q_num: torch.Tensor, q_idx: torch.Tensor,
                kv_num: torch.Tensor, kv_idx: torch.Tensor, block_len: torch.Tensor,
                block_start: torch.Tensor, block_size: int, scale: float, padded: bool,
                cfg: List[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, nh, ng, rep, hn = _shape(q, k)
        nb = q_num.shape[1]
        c = _config(cfg)
        dout = aligned(dout)
        delta = torch.empty(nh, nb * block_size, dtype=torch.float32, device=q.device)
        dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk_acc = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        dv_acc = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        _k.bwd_pre_kernel[(nb, nh)](out, dout, delta, dq_acc, dk_acc, dv_acc, block_len,
                                    block_start, nb, NP=nh, NG=ng, HN=hn, BS=block_size,
                                    PADDED=padded)
        chunks = -(-kv_idx.shape[-1] // c.kv_chunk)
        _k.dkv_kernel[(chunks * (block_size // c.bwd_block_n), ng, nb)](
            q, k, v, dout, dq_acc, dk_acc, dv_acc, lse, delta, kv_num, kv_idx, block_len,
            block_start, nb, kv_idx.shape[-1], c.kv_chunk, scale * _k.LOG2E.value, scale,
            NP=nh, NG=ng, REP=rep, HN=hn, BS=block_size, BLOCK_N=c.bwd_block_n,
            BLOCK_M=c.bwd_block_m, PREC=_prec(q), ONE_PASS=not c.dq_block_m,
            num_warps=c.bwd_warps, num_stages=c.bwd_stages)
        if c.dq_block_m:                   # the split: dQ over the forward's lists
            _k.dq_kernel[(triton.cdiv(rep * block_size, c.dq_block_m), ng, nb)](
                q, k, v, dout, dq_acc, lse, delta, q_num, q_idx, block_len, block_start, nb,
                q_idx.shape[-1], scale * _k.LOG2E.value, scale, NP=nh, NG=ng, REP=rep, HN=hn,
                BS=block_size, BLOCK_M=c.dq_block_m, PREC=_prec(q), PADDED=padded,
                num_warps=c.bwd_warps, num_stages=c.bwd_stages)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _k.bwd_post_kernel[(triton.cdiv(q.numel(), _POST_BLOCK),)](
            dq_acc, dk_acc, dv_acc, dq, dk, dv, q.numel(), k.numel(), BLOCK=_POST_BLOCK)
        return dq, dk, dv

    @_bwd_op.register_fake
    def _bwd_fake(dout, q, k, v, out, lse, q_num, q_idx, kv_num, kv_idx, block_len,
                  block_start, block_size, scale, padded, cfg):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, q_num, q_idx, kv_num, kv_idx, block_len, block_start, *args = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], q_num, q_idx, kv_num, kv_idx,
                              block_len, block_start)
        ctx.args = tuple(args)
        ctx.set_materialize_grads(False)    # lse gets no gradient: no zeros made for it

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, *lists = ctx.saved_tensors
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, *lists, *ctx.args)
        return (dq, dk, dv) + (None,) * 10

    _fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check(q, k, v, lists, layout, rows_needed, what, kv_chunk, config):
    """Validate before any launch; -> (launch config, contiguous q, k, v)."""
    bs, nb = layout.block_size, layout.num_blocks
    why = why_not(q, bs)
    if why is not None:
        raise ValueError(f"{what}: {why}")
    p, nh, hn = q.shape
    ng = k.shape[1]
    if k.shape != v.shape or k.shape[0] != p or k.shape[2] != hn or nh % ng \
            or p < rows_needed:
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}: expected [T, np, hn], [T, ng, hn] x 2 with np a "
                         f"multiple of ng and T >= {rows_needed} (the layout's {nb} blocks "
                         f"of {bs})")
    if tuple(lists.q_num.shape) != (ng, nb):
        raise ValueError(f"lists for {tuple(lists.q_num.shape)} (groups, blocks): expected "
                         f"({ng}, {nb}) for these k/v and this layout")
    if max(p, nb * bs) * nh * hn > _INT32_MAX:
        raise ValueError(f"{max(p, nb * bs)} tokens x {nh} heads x head dim {hn} elements: "
                         f"the kernels index in int32 (at most {_INT32_MAX})")
    cfg = config if config is not None else launch_config(hn, bs, nh // ng)
    if not isinstance(cfg, LaunchConfig):
        raise ValueError(f"config={cfg!r}: expected a triton_launch.LaunchConfig or None")
    if kv_chunk is not None:
        if isinstance(kv_chunk, bool) or not isinstance(kv_chunk, int) or kv_chunk < 1:
            raise ValueError(f"kv_chunk={kv_chunk!r}: expected an integer >= 1")
        cfg = replace(cfg, kv_chunk=kv_chunk)
    return cfg.check(bs)


def _lists(lists):
    return tuple(x.contiguous() for x in (lists.q_num, lists.q_idx, lists.kv_num,
                                          lists.kv_idx))


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: BlockLists,
                     layout, softmax_scale: float, kv_chunk: Optional[int] = None,
                     config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """Block-sparse causal attention on the micro-batch's own tokens, q ``[t, np, hn]``, k/v
    ``[t, ng, hn]`` (``t = layout.num_tokens``): no padded copy in or out (module docstring).
    ``kv_chunk`` / ``config``: override the pinned launch settings (tests, the autotune)."""
    if q.shape[0] != layout.num_tokens:
        raise ValueError(f"sparse_attention: q has {q.shape[0]} tokens: expected the "
                         f"layout's {layout.num_tokens} (sparse_attention_padded takes the "
                         f"padded token space)")
    cfg = _check(q, k, v, lists, layout, layout.num_tokens, "sparse_attention", kv_chunk,
                 config)
    out, _ = _fwd_op(aligned(q), aligned(k), aligned(v), *_lists(lists),
                     *block_tables(layout, padded=False), layout.block_size,
                     float(softmax_scale), False, list(astuple(cfg)))
    return out


def sparse_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                            lists: BlockLists, layout, softmax_scale: float,
                            kv_chunk: Optional[int] = None,
                            config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """Block-sparse causal attention over the padded layout ``[P, heads, hn]`` (``P >= NB *
    B``); padding slots of the output are 0 (module docstring: the contract)."""
    t = layout.num_blocks * layout.block_size
    cfg = _check(q_pad, k_pad, v_pad, lists, layout, t, "sparse_attention_padded", kv_chunk,
                 config)
    p, nh, hn = q_pad.shape
    q, k, v = (aligned(x[:t]) for x in (q_pad, k_pad, v_pad))
    out, _ = _fwd_op(q, k, v, *_lists(lists), *block_tables(layout, padded=True),
                     layout.block_size, float(softmax_scale), True, list(astuple(cfg)))
    if p > t:
        out = torch.cat([out, out.new_zeros(p - t, nh, hn)])
    return out


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection,
                     softmax_scale: float) -> torch.Tensor:
    """``sparse_attention`` (unpadded tokens) over the lists of ``selection`` (built here,
    on the device)."""
    return sparse_attention(q, k, v, build_block_lists(selection), selection.layout,
                            softmax_scale)


def triton_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                            selection, softmax_scale: float) -> torch.Tensor:
    """``sparse_attention_padded`` over the lists of ``selection`` (built here, on the device)."""
    return sparse_attention_padded(q_pad, k_pad, v_pad, build_block_lists(selection),
                                   selection.layout, softmax_scale)


__all__ = ["KV_CHUNK", "aligned", "block_tables", "sparse_attention", "sparse_attention_padded",
           "triton_attention", "triton_attention_padded", "usable", "why_not", "missing"]
