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
per block pair and KV group), because eager flex applies only mask_mod. Compiled kernels apply
it to the partial (diagonal) blocks only, where causality is all that is left for real queries;
the ``flash`` kernel gets that causal mask_mod alone (``build_block_mask(causal_only=True)``).

The sink split (``_sink_split``, on by default): a document's first block is kept by all its
query blocks, and flex's backward walks that whole column in one program; long documents'
query blocks therefore read the sink from copies of its K/V rows (one per run of
``SPLIT_BLOCKS`` query blocks) in a square space of ``P + copies * B`` slots.
``torch.nn.attention.flex_attention`` is imported lazily; the CPU never runs it in training
(FlexAttention has no CPU backward in torch 2.13). Pure torch; must not import megatron.

Why this is long: the block lists, the sink split and the compiled call share one shape
contract (above); apart, each half would need the other's docstring to be read.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import numpy as np
import torch

from .blocks import BlockLayout
from .selection import BlockSelection

_COMPILED = {}
FLASH_MODULE = "flash_attn.cute.interface"   # what flex's compiled FLASH kernels call into
FLEX_KERNELS = {"flex": "triton", "flash": "flash"}   # attention backend -> compiled flex kernel
SPLIT_BLOCKS = 16
"""Default run length of the sink split (``_sink_split``), query blocks per sink copy; 0: off.
On an H100 (32K, bf16, docs/GPU.md) the flex kernel took -34% / -18% / -1% / +5% at densities
0.125 / 0.25 / 0.5 / 1.0."""
# set_flex_tuning: extra flex kernel_options, the torch.compile mode, the sink split's run length
_TUNING = {"kernel_options": {}, "mode": None, "split_blocks": SPLIT_BLOCKS,
           "dynamic_lists": True}


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flash_kernel_missing(device) -> Optional[str]:
    """Why flex's FlashAttention-4 kernel (``kernel_options BACKEND=FLASH``) cannot run on
    ``device``, or None when it can: it needs CUDA, a Hopper or newer GPU and the
    ``flash-attn-4`` package (``flash_attn.cute``, CuTe DSL)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device"
    major = torch.cuda.get_device_capability(torch.device(device))[0]
    if major < 9:
        return f"it needs a Hopper or newer GPU (compute capability 9.0+, this one is {major}.x)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:     # no flash_attn package at all
        found = False
    if not found:
        return "flash-attn-4 is not installed (pip install --pre 'flash-attn-4[cu13]')"
    return None


def set_flex_tuning(kernel_options=None, mode=None, split_blocks=SPLIT_BLOCKS,
                    dynamic_lists=True) -> None:
    """Extra FlexAttention ``kernel_options`` (tile sizes, warps, stages, flags such as
    ``ROWS_GUARANTEED_SAFE``), the ``torch.compile`` mode (e.g. ``"max-autotune-no-cudagraphs"``,
    which benchmarks flex's tile configurations once per shape), the sink split's run length
    (0: off) and the block lists' widths for every later call: ``dynamic_lists`` True (the
    kept counts, marked dynamic) or False (every list as wide as the block space: one static
    shape per run, for kernels that recompile on dynamic sizes; the kernels read only the
    counted entries, so only memory grows)."""
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise ValueError(f"kernel_options={kernel_options!r}: expected a dict or None")
    if isinstance(split_blocks, bool) or not isinstance(split_blocks, int) or split_blocks < 0:
        raise ValueError(f"split_blocks={split_blocks!r}: expected an int >= 0 (0: no split)")
    if not isinstance(dynamic_lists, bool):
        raise ValueError(f"dynamic_lists={dynamic_lists!r}: expected True or False")
    _TUNING["split_blocks"] = split_blocks
    _TUNING["dynamic_lists"] = dynamic_lists
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


def _diagonal_lists(layout: BlockLayout, ng: int, width: int, side: str, rows: int = None):
    """The partial lists: every real query block's own block, ``[ng, 1, rows]`` counts and
    ``[ng, 1, rows, width]`` indices (``rows``: NBP, or NBP + the sink split's copy blocks,
    which have no partial entry; as wide as the full lists: torch 2.11's kernels index both
    with one stride). One pair per ``side``: the kv and q lists are
    never the same tensor (an input aliased in one call and not in another would make Dynamo
    compile again)."""
    nb, nbp, dev = layout.num_blocks, layout.padded_blocks, layout.block_doc.device
    rows = nbp if rows is None else rows
    key = ("flex_diag", side, ng, width, rows)
    if key not in layout.memo:
        ar = torch.arange(rows, dtype=torch.int32, device=dev)
        num = (ar < nb).to(torch.int32).view(1, 1, rows).expand(ng, 1, rows).contiguous()
        idx = torch.zeros(ng, 1, rows, width, dtype=torch.int32, device=dev)
        idx[..., 0] = torch.where(ar < nb, ar, 0)
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


def split_capacity(padded_blocks: int, split_blocks: int) -> int:
    """Copy blocks reserved for the sink split: a fixed number per token count (one compiled
    shape). A document of n > s blocks (s = ``split_blocks``) needs ceil((n - 1) / s) < 2 (n - 1)
    / s copies, so ``2 * ceil(NBP / s)`` always suffices."""
    return 0 if split_blocks <= 0 else 2 * -(-padded_blocks // split_blocks)


def _sink_split(layout: BlockLayout, split_blocks: int):
    """The sink split of a micro-batch (layout-only, memoised): per padded query block the first
    block of its document ``[NBP]`` and the copy block that stands in for it (``-1``: none), and
    the padded key row of every slot of the extended key space ``[P + cap * B]`` (the identity,
    then the rows each copy block repeats).

    Why: flex's backward gives every key block one program that walks the block's whole column
    of query blocks; a document's first block (the attention sink, kept by every query block of
    the document) is a column as long as the document, and that one program is the kernel's
    tail (at 32K, density 0.25 on an H100: 9.2 ms with the sink against 7.1 ms without). Here
    the query blocks of a document longer than ``split_blocks`` + 1 blocks are cut into runs of
    ``split_blocks``, and each run reads the sink from its own copy of the sink's K/V rows,
    appended after the padded key space: each copy's column is at most ``split_blocks`` long.
    The query space gets as many empty blocks (``flex_attention_padded``): a key space longer
    than the query space alone made torch 2.11's kernels 18% slower on an H100.
    Outputs are the same (the copies hold the same keys and values); the copies' K/V gradients
    are summed back onto the sink's rows by autograd (the copies are an ``index_select``)."""
    key = ("flex_split", split_blocks)
    if key not in layout.memo:
        bs, nbp = layout.block_size, layout.padded_blocks
        cap = split_capacity(nbp, split_blocks)
        starts = layout.doc_block_start
        row_sink = np.full(nbp, -1, dtype=np.int64)
        row_copy = np.full(nbp, -1, dtype=np.int64)
        src = np.zeros(cap, dtype=np.int64)
        n = 0
        for d in range(len(starts) - 1):
            s0, e0 = starts[d], starts[d + 1]
            row_sink[s0:e0] = s0
            if e0 - s0 - 1 <= split_blocks:
                continue
            for c0 in range(s0 + 1, e0, split_blocks):
                row_copy[c0:min(c0 + split_blocks, e0)] = nbp + n
                src[n] = s0
                n += 1
        if n > cap:    # cannot happen (see split_capacity); a wrong list would be silent
            raise AssertionError(f"sink split needs {n} copy blocks, reserved {cap}")
        dev = layout.block_doc.device
        rows = torch.cat([torch.arange(nbp * bs),
                          (torch.from_numpy(src).view(cap, 1) * bs
                           + torch.arange(bs).view(1, bs)).reshape(-1)])
        layout.memo[key] = (cap, torch.from_numpy(row_sink).to(dev),
                            torch.from_numpy(row_copy).to(dev), rows.to(dev))
    return layout.memo[key]


def mask_tensors(selection: BlockSelection, split_blocks: int = None,
                 with_bits: bool = True) -> dict:
    """The BlockMask's tensors for a selection (see the module docstring), as a dict; with the
    sink split (``split_blocks`` > 0, default ``set_flex_tuning``'s) also ``key_rows``, the
    padded key rows of the extended key space (``[P + copies * B]``); ``with_bits``: also the
    selection bits the full mask_mod reads (``selected_bits``; not for the causal one)."""
    layout = selection.layout
    nb, nbp = layout.num_blocks, layout.padded_blocks
    ng, _, kmax = selection.kv_indices.shape
    dev = selection.kv_num.device
    split = _TUNING["split_blocks"] if split_blocks is None else int(split_blocks)
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
    sel = selection.kv_indices
    cap, out = 0, {}
    if split > 0:
        cap, row_sink, row_copy, key_rows = _sink_split(layout, split)
        # slot 0 is the diagonal, never a redirected sink (a split row is not a first block)
        rc = row_copy[:nb].view(1, nb, 1)
        sel = torch.where((sel == row_sink[:nb].view(1, nb, 1)) & (rc >= 0), rc, sel)
        out["key_rows"] = key_rows
    # blocks of the (square) space: the padded space and the copies; with copies the query side
    # gets as many empty blocks (a key space longer than the query space made torch 2.11's
    # kernels 18% slower on an H100)
    nbk = nbp + cap
    if cap:
        if ("flex_full_ext", cap) not in memo:
            memo[("flex_full_ext", cap)] = (
                torch.cat([full_num, full_num.new_zeros(ng, cap)], 1),
                torch.cat([full_valid, full_valid.new_zeros(ng, cap, kf)], 1))
        full_num, full_valid = memo[("flex_full_ext", cap)]
    full_idx = torch.zeros(ng, nbk, kf, dtype=torch.int32, device=dev)
    full_idx[:, :nb, :kmax - 1] = sel[..., 1:]
    fq_num, fq_idx = _transpose_lists(full_num, full_idx, full_valid, wq)
    if with_bits:   # one bit per (query block, key block): the selection, for mask_mod
        words = (nbk + 7) // 8
        bits = torch.zeros(ng, nbk, words, dtype=torch.int32, device=dev)
        bits[:, :nb].scatter_add_(2, sel // 8,
                                  (memo["flex_slot_bit_valid"] << (sel % 8)).int())
        out["selected_bits"] = bits.to(torch.uint8)
    kv_num, kv_idx = _diagonal_lists(layout, ng, kf, "kv", rows=nbk)
    q_num, q_idx = _diagonal_lists(layout, ng, wq, "q", rows=nbk)
    return dict(kv_num_blocks=kv_num, kv_indices=kv_idx,
                full_kv_num_blocks=full_num.unsqueeze(1), full_kv_indices=full_idx.unsqueeze(1),
                q_num_blocks=q_num, q_indices=q_idx,
                full_q_num_blocks=fq_num.unsqueeze(1), full_q_indices=fq_idx.unsqueeze(1),
                **out)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def build_block_mask(selection: BlockSelection, split_blocks: int = None,
                     causal_only: bool = False, static_width: bool = False):
    """BlockMask ``[ng, 1, PK, PK]`` over the padded layout encoding the selection (``PK = P``,
    or ``P + copies * B`` with the sink split), and the padded key rows of its key space
    (``None`` without the sink split).

    ``causal_only``: mask_mod is causality alone, for compiled kernels only. They apply mask_mod
    to the partial blocks, which are the diagonal blocks: one document's tokens then padding, so
    for every real query the rest of the full mask_mod holds already (a test checks the two
    agree there). Eager flex applies mask_mod everywhere and needs the full one.
    ``static_width``: every list padded to the block space's width (counts unchanged)."""
    from torch.nn.attention.flex_attention import BlockMask
    layout = selection.layout
    bs, p = layout.block_size, layout.padded_tokens
    t = mask_tensors(selection, split_blocks, with_bits=not causal_only)
    bits = t.pop("selected_bits", None)
    key_rows = t.pop("key_rows", None)
    if static_width:
        rows = t["kv_num_blocks"].shape[-1]
        for name in ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices"):
            t[name] = torch.nn.functional.pad(t[name],
                                              (0, max(0, rows - 1 - t[name].shape[-1])))
    if causal_only:
        pk = p if key_rows is None else key_rows.numel()
        return BlockMask(seq_lengths=(pk, pk), BLOCK_SIZE=(bs, bs), mask_mod=_causal,
                         **t), key_rows
    slot_doc, slot_real = _slot_tables(layout)
    pk = p
    if key_rows is not None:
        pk = key_rows.numel()
        memo_key = ("flex_split_slots", pk)
        if memo_key not in layout.memo:     # the copies' slots carry their source's document
            pad = torch.full((pk - p,), -2, dtype=slot_doc.dtype, device=slot_doc.device)
            layout.memo[memo_key] = (torch.cat([slot_doc, pad]), slot_doc[key_rows],
                                     slot_real[key_rows])
        q_doc, slot_doc, slot_real = layout.memo[memo_key]
    else:
        q_doc = slot_doc

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // bs, kv_idx // bs
        kept = ((bits[b, qb, kb // 8].to(torch.int32) >> (kb % 8)) & 1) == 1
        # a copy (kv_idx >= P) repeats a first block, before every query of its document
        return (((q_idx >= kv_idx) | (kv_idx >= p)) & (q_doc[q_idx] == slot_doc[kv_idx])
                & slot_real[kv_idx] & kept)

    return BlockMask(seq_lengths=(pk, pk), BLOCK_SIZE=(bs, bs), mask_mod=mask_mod, **t), key_rows


def flex_attention_padded(q_pad: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor,
                          selection: BlockSelection, softmax_scale: float,
                          compile_backend="inductor", kernel: str = "triton") -> torch.Tensor:
    """q_pad ``[P, np, hn]``, k/v_pad ``[P, ng, hn]`` -> ``[P, np, hn]``.

    ``compile_backend``: torch.compile backend (``None``: eager flex, mask_mod only).
    ``kernel``: the compiled flex kernel, ``"triton"`` (torch's default) or ``"flash"``
    (FlashAttention-4 through ``kernel_options BACKEND=FLASH``; compiled only)."""
    if kernel not in ("triton", "flash"):
        raise ValueError(f"kernel={kernel!r}: expected 'triton' or 'flash'")
    if kernel == "flash" and compile_backend is None:
        raise ValueError("kernel='flash' with compile_backend=None: flex's FlashAttention-4 "
                         "kernel runs compiled only")
    p, nh, hn = q_pad.shape
    ng = k_pad.shape[1]
    rep = nh // ng
    # FlashAttention-4 gets the causal mask_mod alone: nothing captured to lower
    static = not _TUNING["dynamic_lists"]
    block_mask, key_rows = build_block_mask(selection, causal_only=kernel == "flash",
                                            static_width=static)
    bs = selection.layout.block_size
    kernel_options = None
    if kernel == "flash":
        kernel_options = {"BACKEND": "FLASH"}
    elif bs < 128:
        # default tiles are up to 128 wide; they must divide the sparse block size
        kernel_options = {"BLOCK_M": bs, "BLOCK_N": bs, "BLOCK_M1": min(bs, 32),
                          "BLOCK_N1": bs, "BLOCK_M2": bs, "BLOCK_N2": min(bs, 32)}
    if _TUNING["kernel_options"]:
        kernel_options = {**(kernel_options or {}), **_TUNING["kernel_options"]}
    if compile_backend is not None and not static:
        # the list widths follow the budget and the longest document: one graph for all
        for t in (block_mask.kv_indices, block_mask.full_kv_indices, block_mask.q_indices,
                  block_mask.full_q_indices):
            torch._dynamo.maybe_mark_dynamic(t, 3)
    if key_rows is not None:             # the sink split: copies of the sinks' K/V rows
        # appended (not the whole key space gathered): the backward then scatter-adds the
        # copies' rows only, not every key row
        copies = key_rows[p:]
        k_pad, v_pad = (torch.cat([x, x.index_select(0, copies)]) for x in (k_pad, v_pad))
        q_pad = torch.cat([q_pad, q_pad.new_zeros(copies.numel(), nh, hn)])   # empty rows
    pk = q_pad.shape[0]
    q4 = q_pad.view(pk, ng, rep, hn).permute(1, 2, 0, 3)                 # [ng, rep, PK, hn]
    k4, v4 = (x.permute(1, 0, 2).unsqueeze(1) for x in (k_pad, v_pad))   # [ng, 1, PK, hn]
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
    if kernel == "flash" and FLASH_MODULE not in sys.modules:
        # a torch release without the option runs its Triton kernel and says nothing
        raise RuntimeError(f"backend 'flash': torch {torch.__version__} ran flex's Triton "
                           f"kernel, not FlashAttention-4 ({FLASH_MODULE} was never loaded: "
                           f"this release ignores kernel_options BACKEND='FLASH'); use the "
                           f"flex backend")
    return out[:, :, :p].permute(2, 0, 1, 3).reshape(p, nh, hn)         # [P, np, hn]
