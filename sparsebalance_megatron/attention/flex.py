"""FlexAttention backend (GPU): the block selection as a ``BlockMask``, compiled, fwd + bwd.

Works in the padded token space of ``BlockLayout`` (every document starts on a block boundary),
so the selection's global block indices are exactly the BlockMask's block indices. The
``BlockMask`` is built from ``kv_num_blocks / kv_indices``: kept off-diagonal blocks with a full
key block go in the *full* lists (no mask_mod evaluation), the diagonal and short (padded) key
blocks in the partial lists. ``mask_mod`` still encodes everything (causality, document ids,
real tokens and the selected blocks), because eager flex applies only mask_mod.
``torch.nn.attention.flex_attention`` is imported lazily: importing this module never needs it,
and the CPU never runs it (FlexAttention has no CPU backward in torch 2.13).
Untested on a GPU so far (none was available): forward on CPU (eager and compiled) equals the
reference. Risk to check first: inductor's default backward tiles for hn=128 on sm90 are
128 wide, and tiles must divide the sparse block size, so ``block_size=64`` may fail to compile
the backward there; ``block_size=128`` avoids that. ``tests/gpu/test_flex_attention.py`` covers
both.
Pure torch; must not import megatron.
"""

from __future__ import annotations

import torch

from .selection import BlockSelection

_COMPILED = {}


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    if "fn" not in _COMPILED:
        # automatic dynamic shapes: packed micro-batches change length every step, and a
        # static compile would hit the recompile limit and fall back to dense eager flex
        _COMPILED["fn"] = torch.compile(flex_attention)
    return _COMPILED["fn"]


def _compact(idx: torch.Tensor, keep: torch.Tensor, num_kv_blocks: int):
    """Kept slots of every row moved to the front, as BlockMask wants them:
    (num ``[..]`` int32, indices ``[.., num_kv_blocks]`` int32, zero-padded)."""
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    ordered = idx.gather(-1, order).to(torch.int32)
    out = ordered.new_zeros(tuple(idx.shape[:-1]) + (num_kv_blocks,))
    out[..., :idx.shape[-1]] = ordered
    return keep.sum(-1).to(torch.int32), out


def build_block_mask(selection: BlockSelection, num_heads: int):
    """BlockMask over the padded layout ``[1, np, NB*B, NB*B]`` encoding the selection."""
    from torch.nn.attention.flex_attention import BlockMask
    layout = selection.layout
    bs, nb = layout.block_size, layout.num_blocks
    ng = selection.kv_num.shape[0]
    rep = num_heads // ng
    dev = selection.kv_num.device
    idx = selection.kv_indices                                             # [ng, NB, K]
    kmax = idx.shape[-1]
    valid = torch.arange(kmax, device=dev) < selection.kv_num[..., None]
    diag = idx == torch.arange(nb, device=dev).view(1, nb, 1)
    short = layout.block_len[idx] < bs
    partial = valid & (diag | short)
    full = valid & ~partial
    kv_num, kv_idx = _compact(idx, partial, nb)
    full_num, full_idx = _compact(idx, full, nb)

    def per_head(x):  # [ng, ...] -> [1, np, ...]
        return x.repeat_interleave(rep, dim=0).unsqueeze(0).contiguous()

    block_sel = selection.block_mask()                                     # [ng, NB, NB]
    slot_doc = layout.block_doc.repeat_interleave(bs)                      # [NB*B]
    slot_real = (torch.arange(bs, device=dev).view(1, bs)
                 < layout.block_len.view(nb, 1)).reshape(-1)               # [NB*B]

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (slot_doc[q_idx] == slot_doc[kv_idx]) & slot_real[kv_idx]
                & block_sel[h // rep, q_idx // bs, kv_idx // bs])

    return BlockMask.from_kv_blocks(per_head(kv_num), per_head(kv_idx), per_head(full_num),
                                    per_head(full_idx), BLOCK_SIZE=bs, mask_mod=mask_mod,
                                    seq_lengths=(nb * bs, nb * bs))


def flex_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                          selection: BlockSelection, softmax_scale: float,
                          compiled: bool = True) -> torch.Tensor:
    """q_pad ``[NB*B, np, hn]``, k/v_pad ``[NB*B, ng, hn]`` -> ``[NB*B, np, hn]``."""
    nh, ng = q_pad.shape[1], k_pad.shape[1]
    block_mask = build_block_mask(selection, nh)
    bs = selection.layout.block_size
    kernel_options = None
    if bs < 128:
        # default tiles are up to 128 wide; they must divide the sparse block size
        kernel_options = {"BLOCK_M": bs, "BLOCK_N": bs, "BLOCK_M1": min(bs, 32),
                          "BLOCK_N1": bs, "BLOCK_M2": bs, "BLOCK_N2": min(bs, 32)}
    fn = _flex_fn(compiled)
    out = fn(q_pad.transpose(0, 1)[None], k_pad.transpose(0, 1)[None],
             v_pad.transpose(0, 1)[None], block_mask=block_mask, scale=softmax_scale,
             enable_gqa=(nh != ng), kernel_options=kernel_options)
    return out[0].transpose(0, 1)
