"""FlexAttention backend (GPU): the block selection as a ``BlockMask``, compiled once, fwd + bwd.

Shapes that compile once per run. The kernel works in the padded token space of a
``BlockLayout`` built with ``fixed_length=True``: every document starts on a block boundary (so
the selection's global block indices are exactly the BlockMask's block indices, and no kept
block is inflated by a document edge), and the space is padded to ``fixed_padded_blocks``,
which depends on the micro-batch's token count only. q/k/v, the mask_mod's lookup tensors and
the BlockMask's row counts therefore have one shape for the whole run; the only sizes that
follow the data are the widths of the two index lists sized by the kept counts, and those are
marked dynamic (``torch._dynamo.maybe_mark_dynamic``) on purpose. The compiled function makes
one graph for forward+backward and one for forwards under no_grad (activation recomputation).

GQA without expanding anything per query head: the KV groups are the *batch* dimension
(q ``[ng, rep, P, hn]``, k/v ``[ng, 1, P, hn]``, ``enable_gqa``), so the BlockMask is
``[ng, 1, NBP, ...]``: one block list per KV group.

The lists: the diagonal is the only partial block of a query block (documents start on block
boundaries, and a document's short last block is a key block only for itself); the other kept
blocks are full (no mask_mod evaluation). The key-side lists are ``kmax - 1`` columns wide (the
kept count, not NB). The transposed (query-side) lists are built here by a sort of the kept
pairs instead of BlockMask's dense transposition; their width is the longest document's block
count, because a sink block is kept by every query block of its document. The partial lists,
which hold one entry, are as wide as the full lists of their side: the flex kernels of older
torch releases index the full lists with the partial lists' offsets ("always contiguous"), and
on an H100 with torch 2.11 narrower partial lists gave wrong outputs (docs/GPU.md; equal widths
have not run on a GPU yet).
``mask_mod`` still encodes causality, document ids, real tokens and the selected blocks (a bit
per block pair and KV group), because eager flex applies only mask_mod.
``torch.nn.attention.flex_attention`` is imported lazily; the CPU never runs it in training
(FlexAttention has no CPU backward in torch 2.13). Pure torch; must not import megatron.
"""

from __future__ import annotations

import torch

from .blocks import BlockLayout
from .selection import BlockSelection

_COMPILED = {}
# kernel tuning (``set_flex_tuning``): extra flex ``kernel_options`` and the torch.compile mode
_TUNING = {"kernel_options": {}, "mode": None}


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def set_flex_tuning(kernel_options=None, mode=None) -> None:
    """Extra FlexAttention ``kernel_options`` (tile sizes, warps, stages, flags such as
    ``ROWS_GUARANTEED_SAFE``) and the ``torch.compile`` mode (e.g. ``"max-autotune-no-cudagraphs"``,
    which benchmarks flex's tile configurations once per shape) for every later call."""
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise ValueError(f"kernel_options={kernel_options!r}: expected a dict or None")
    _TUNING["kernel_options"] = dict(kernel_options or {})
    if mode != _TUNING["mode"]:
        _COMPILED.clear()
    _TUNING["mode"] = mode


def _flex_fn(compile_backend):
    from torch.nn.attention.flex_attention import flex_attention
    if compile_backend is None:
        return flex_attention
    if compile_backend not in _COMPILED:
        kw = {"mode": _TUNING["mode"]} if _TUNING["mode"] else {}
        _COMPILED[compile_backend] = torch.compile(flex_attention, backend=compile_backend, **kw)
    return _COMPILED[compile_backend]


def _slot_tables(layout: BlockLayout):
    """Per padded slot ``[P]``: document id (-1 in the tail) and whether a real token sits there."""
    if "flex_slots" not in layout.memo:
        bs, nb, nbp = layout.block_size, layout.num_blocks, layout.padded_blocks
        dev = layout.block_doc.device
        doc = torch.full((nbp,), -1, dtype=torch.int32, device=dev)
        doc[:nb] = layout.block_doc.to(torch.int32)
        n = torch.zeros(nbp, dtype=torch.int32, device=dev)
        n[:nb] = layout.block_len.to(torch.int32)
        real = (torch.arange(bs, device=dev).view(1, bs) < n.view(nbp, 1)).reshape(-1)
        layout.memo["flex_slots"] = (doc.repeat_interleave(bs), real)
    return layout.memo["flex_slots"]


def _diagonal_lists(layout: BlockLayout, ng: int, width: int, side: str):
    """The partial lists: every real query block's own block, ``[ng, 1, NBP]`` counts and
    ``[ng, 1, NBP, width]`` indices (as wide as the full lists: torch 2.11's kernels index
    both with one stride). One pair per ``side``: the kv and q lists are never the same tensor
    (an input aliased in one call and not in another would make Dynamo compile again)."""
    key = ("flex_diag", side, ng, width)
    if key not in layout.memo:
        nb, nbp, dev = layout.num_blocks, layout.padded_blocks, layout.block_doc.device
        ar = torch.arange(nbp, dtype=torch.int32, device=dev)
        num = (ar < nb).to(torch.int32).view(1, 1, nbp).expand(ng, 1, nbp).contiguous()
        idx = torch.zeros(ng, 1, nbp, width, dtype=torch.int32, device=dev)
        idx[..., 0] = ar
        layout.memo[key] = (num, idx)
    return layout.memo[key]


def _transpose_lists(num: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, width: int):
    """Row lists ``num [G, R]``, ``idx [G, R, K]`` (``valid``: the slots below ``num``) ->
    column lists ``[G, R]``, ``[G, R, width]`` (rows ascending), contiguous, by one sort of the
    kept pairs; no host sync. ``width`` must bound the entries of every column."""
    g, r, k = idx.shape
    dev = idx.device
    rows = torch.arange(r, device=dev).view(1, r, 1)
    key = torch.where(valid, idx.long() * r + rows, r * r).view(g, r * k)   # sentinel last
    key = key.sort(dim=-1).values
    col, row = key // r, key % r                                   # sentinel -> col r
    counts = torch.zeros(g, r + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(1, col, torch.ones_like(col))
    start = counts.cumsum(-1) - counts
    rank = torch.arange(r * k, device=dev).view(1, -1) - start.gather(1, col)
    rank = rank.clamp(max=width - 1)     # only sentinels can exceed it; they land in the dump row
    out = torch.zeros(g, (r + 1) * width, dtype=torch.int32, device=dev)
    out.scatter_(1, col * width + rank, row.to(torch.int32))
    out = out.view(g, r + 1, width)[:, :r].contiguous()
    return counts[:, :r].to(torch.int32).contiguous(), out


def mask_tensors(selection: BlockSelection) -> dict:
    """The BlockMask's tensors for a selection (see the module docstring), as a dict."""
    layout = selection.layout
    nb, nbp = layout.num_blocks, layout.padded_blocks
    ng, _, kmax = selection.kv_indices.shape
    dev = selection.kv_num.device
    kf = max(2, kmax - 1)                    # >= 2: sizes 0 and 1 would be specialised
    wq = max(2, layout.max_doc_blocks - 1)
    # in density mode the counts depend on the micro-batch and the budget only: build once
    budget = selection.bounds.memo.get(("tensors", ng), {}) if selection.bounds else {}
    memo = budget if selection.kv_num is budget.get("kv_num") else {}
    if "flex_full_num" not in memo:
        full_num = torch.zeros(ng, nbp, dtype=torch.int32, device=dev)
        full_num[:, :nb] = selection.kv_num - 1
        memo["flex_full_num"] = full_num
        memo["flex_full_valid"] = torch.arange(kf, device=dev) < full_num[..., None]
        memo["flex_slot_bit_valid"] = (torch.arange(kmax, device=dev)
                                       < selection.kv_num[..., None])
    full_num, full_valid = memo["flex_full_num"], memo["flex_full_valid"]
    full_idx = torch.zeros(ng, nbp, kf, dtype=torch.int32, device=dev)
    full_idx[:, :nb, :kmax - 1] = selection.kv_indices[..., 1:]
    fq_num, fq_idx = _transpose_lists(full_num, full_idx, full_valid, wq)
    # one bit per (query block, key block): the selection, for mask_mod
    words = (nbp + 7) // 8
    sel = selection.kv_indices
    bits = torch.zeros(ng, nbp, words, dtype=torch.int32, device=dev)
    bits[:, :nb].scatter_add_(2, sel // 8, (memo["flex_slot_bit_valid"] << (sel % 8)).int())
    kv_num, kv_idx = _diagonal_lists(layout, ng, kf, "kv")
    q_num, q_idx = _diagonal_lists(layout, ng, wq, "q")
    return dict(kv_num_blocks=kv_num, kv_indices=kv_idx,
                full_kv_num_blocks=full_num.unsqueeze(1), full_kv_indices=full_idx.unsqueeze(1),
                q_num_blocks=q_num, q_indices=q_idx,
                full_q_num_blocks=fq_num.unsqueeze(1), full_q_indices=fq_idx.unsqueeze(1),
                selected_bits=bits.to(torch.uint8))


def build_block_mask(selection: BlockSelection):
    """BlockMask ``[ng, 1, P, P]`` over the padded layout encoding the selection."""
    from torch.nn.attention.flex_attention import BlockMask
    layout = selection.layout
    bs, p = layout.block_size, layout.padded_tokens
    t = mask_tensors(selection)
    bits = t.pop("selected_bits")
    slot_doc, slot_real = _slot_tables(layout)

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // bs, kv_idx // bs
        kept = ((bits[b, qb, kb // 8].to(torch.int32) >> (kb % 8)) & 1) == 1
        return ((q_idx >= kv_idx) & (slot_doc[q_idx] == slot_doc[kv_idx]) & slot_real[kv_idx]
                & kept)

    return BlockMask(seq_lengths=(p, p), BLOCK_SIZE=(bs, bs), mask_mod=mask_mod, **t)


def flex_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                          selection: BlockSelection, softmax_scale: float,
                          compile_backend="inductor") -> torch.Tensor:
    """q_pad ``[P, np, hn]``, k/v_pad ``[P, ng, hn]`` -> ``[P, np, hn]``.

    ``compile_backend``: torch.compile backend (``None``: eager flex, mask_mod only)."""
    p, nh, hn = q_pad.shape
    ng = k_pad.shape[1]
    rep = nh // ng
    block_mask = build_block_mask(selection)
    bs = selection.layout.block_size
    kernel_options = None
    if bs < 128:
        # default tiles are up to 128 wide; they must divide the sparse block size
        kernel_options = {"BLOCK_M": bs, "BLOCK_N": bs, "BLOCK_M1": min(bs, 32),
                          "BLOCK_N1": bs, "BLOCK_M2": bs, "BLOCK_N2": min(bs, 32)}
    if _TUNING["kernel_options"]:
        kernel_options = {**(kernel_options or {}), **_TUNING["kernel_options"]}
    if compile_backend is not None:
        # the list widths follow the budget and the longest document: one graph for all
        for t in (block_mask.kv_indices, block_mask.full_kv_indices, block_mask.q_indices,
                  block_mask.full_q_indices):
            torch._dynamo.maybe_mark_dynamic(t, 3)
    q4 = q_pad.view(p, ng, rep, hn).permute(1, 2, 0, 3)                  # [ng, rep, P, hn]
    k4, v4 = (x.permute(1, 0, 2).unsqueeze(1) for x in (k_pad, v_pad))   # [ng, 1, P, hn]
    try:
        out = _flex_fn(compile_backend)(q4, k4, v4, block_mask=block_mask, scale=softmax_scale,
                                        enable_gqa=rep > 1, kernel_options=kernel_options)
    except Exception as e:   # noqa: BLE001 - only a known compile failure is translated
        if bs < 128 and "NoValidChoices" in str(e):
            raise ValueError(
                f"block_size={bs}: torch's compiled FlexAttention found no kernel configuration "
                f"whose tiles divide the block size (seen with torch 2.11, head dim {hn}); use "
                f"block_size=128 (--sb-block-size 128) on this GPU, or the 'torch' backend") from e
        raise
    return out.permute(2, 0, 1, 3).reshape(p, nh, hn)                    # [P, np, hn]
