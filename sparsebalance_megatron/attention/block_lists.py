"""Block lists of a selection, built on the device by one Triton kernel: what sparse kernels read.

``build_block_lists(selection)`` turns a ``BlockSelection`` (kept key blocks per KV group and
query block, in the selection's top-k order, slot 0 the diagonal) into two sorted,
int32 list pairs: per query block, the kept key blocks (the forward and dQ loop), and per key
block, the query blocks that keep it (the dK/dV loop). One kernel launch per call (one program
per query block and KV group, which scans the blocks of its document: no sort, work
``O(document blocks x K)`` per program); no host sync: the widths come from host-side bounds
(the selection's width ``K`` and the layout's longest document).

Format (``ng`` KV groups, ``NB`` blocks of the layout, global block ids as in ``BlockLayout``):

==========  ================  =====  ==========================================================
tensor      shape             dtype  meaning
==========  ================  =====  ==========================================================
``q_num``   ``[ng, NB]``      int32  kept key blocks of query block ``i`` *besides* the diagonal
``q_idx``   ``[ng, NB, Wq]``  int32  ``q_idx[g, i, :q_num[g, i]]``: those key blocks, ascending
                                     global ids, all ``< i`` and in ``i``'s document
``kv_num``  ``[ng, NB]``      int32  query blocks ``i != j`` that keep key block ``j``
``kv_idx``  ``[ng, NB, Wk]``  int32  ``kv_idx[g, j, :kv_num[g, j]]``: those query blocks,
                                     ascending, all ``> j`` and in ``j``'s document
==========  ================  =====  ==========================================================

``Wq = max(K - 1, 1)`` (``K``: the selection's ``kv_indices`` width), ``Wk = max(L - 1, 1)``
(``L``: the longest document's block count; a sink block is kept by every later query block
of its document). Entries past a count hold the row's own block (``i`` in ``q_idx[g, i]``,
``j`` in ``kv_idx[g, j]``), like the selection's padding slots, and must be ignored.
Every tensor is contiguous, on the selection's device.

The diagonal block ``i`` is not in the lists: it is always kept, and it is the only block of a
query block that needs a mask (causal inside the block, and the real length of a document's
short last block). Every listed block is *full*: all its keys are visible to every real query
of block ``i``. In FlashAttention-4 / FlexAttention terms the lists are the "full blocks" and
the diagonal is the single "mask block" of every row and column.

``lists_from_ranking(layout, order, kv_num, shares)`` is the same launch over a ranking (the
top-k order of the selection's priority): it also writes the selection's ``kv_indices`` and its
per-row recall, so the fused per-layer call (``sparse_triton_select``) needs no separate
selection epilogue.

Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import doc_bounds
from .selection import BlockSelection

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    HAVE_TRITON = False

# bytes of one [blocks, kept slots] tile of selection ids a scan step holds in registers:
# 16 KB is 32 registers per thread at 4 warps, beside the rest of the kernel's state
_SCAN_BYTES = 16384


def scan_block(kp: int, itemsize: int) -> int:
    """Blocks per scan step (``BLOCK``) for ``kp`` kept slots of ``itemsize``-byte ids: the
    largest power of 2 up to 64 whose ``[BLOCK, kp]`` tile fits in ``_SCAN_BYTES``, or 1
    where one row alone is larger."""
    return max(1, min(64, _SCAN_BYTES // (itemsize * kp)))


@dataclass
class BlockLists:
    """The forward (query-side) and transposed (key-side) lists of a selection (module
    docstring: shapes, dtypes, meaning)."""

    q_num: torch.Tensor     # [ng, NB] int32
    q_idx: torch.Tensor     # [ng, NB, Wq] int32
    kv_num: torch.Tensor    # [ng, NB] int32
    kv_idx: torch.Tensor    # [ng, NB, Wk] int32

    def column_chunks(self, chunk: int) -> int:
        """Programs per key block when each reads at most ``chunk`` entries of its transposed
        list (a host-side bound from the width, no device read): ``ceil(Wk / chunk)``."""
        if chunk < 1:
            raise ValueError(f"chunk={chunk!r}: expected an integer >= 1")
        return -(-self.kv_idx.shape[-1] // chunk)


if HAVE_TRITON:
    # the strides and widths follow each micro-batch's block count and selection width: not
    # specialised on, so only the constexpr widths make new compiles (triton_warmup compiles them)
    @triton.jit(do_not_specialize=["s_sel_g", "s_sel_i", "s_num_g", "WQ", "WK", "K"])
    def _lists_kernel(SEL, SEL_NUM, DOC_START, DOC_END, Q_NUM, Q_IDX, KV_NUM, KV_IDX,
                      KEPT, SHARES, RECALL, s_sel_g, s_sel_i, s_num_g, WQ, WK, K,
                      KP: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr,
                      SELECT: tl.constexpr):
        i = tl.program_id(0)
        g = tl.program_id(1)
        nb = tl.num_programs(0)
        slots = 1 + tl.arange(0, KP)                         # slot 0 (the diagonal) is skipped
        start = tl.load(DOC_START + i)
        end = tl.load(DOC_END + i)
        # forward list of query block i: the blocks of [start, i) its kept slots hold
        n = tl.load(SEL_NUM + g * s_num_g + i).to(tl.int32)
        row = tl.load(SEL + g * s_sel_g + i * s_sel_i + slots, mask=slots < n, other=-1)
        if SELECT:      # SEL is the ranking: also the selection's kv_indices and its recall
            all_slots = tl.arange(0, KP * 2)
            ranked = tl.load(SEL + g * s_sel_g + i * s_sel_i + all_slots,
                             mask=all_slots < K, other=0)
            kept = tl.where(all_slots < n, ranked, i)
            tl.store(KEPT + (g * nb + i) * K + all_slots, kept, mask=all_slots < K)
            share = tl.load(SHARES + (g * nb + i) * nb + kept, mask=all_slots < n, other=0.0)
            tl.store(RECALL + g * nb + i, tl.sum(share, 0))
        out = Q_IDX + (g * nb + i) * WQ
        count = i * 0
        for b0 in range(start, i, BLOCK):
            cand = b0 + tl.arange(0, BLOCK)
            hit = tl.max((row[None, :] == cand[:, None]).to(tl.int32), axis=1)
            tl.store(out + count + tl.cumsum(hit, 0) - 1, cand, mask=hit == 1)
            count += tl.sum(hit, 0)
        rest = tl.arange(0, WP)
        tl.store(out + rest, tl.full([WP], 0, tl.int32) + i, mask=(rest >= count) & (rest < WQ))
        tl.store(Q_NUM + g * nb + i, count)
        # transposed list of key block j = i: the query blocks of (j, end) that keep it
        j = i
        out = KV_IDX + (g * nb + j) * WK
        count = j * 0
        for r0 in range(j + 1, end, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            row_ok = rows < end
            rn = tl.load(SEL_NUM + g * s_num_g + rows, mask=row_ok, other=0).to(tl.int32)
            ids = tl.load(SEL + g * s_sel_g + rows[:, None] * s_sel_i + slots[None, :],
                          mask=row_ok[:, None] & (slots[None, :] < rn[:, None]), other=-1)
            hit = tl.max((ids == j).to(tl.int32), axis=1)
            tl.store(out + count + tl.cumsum(hit, 0) - 1, rows, mask=hit == 1)
            count += tl.sum(hit, 0)
        tl.store(out + rest, tl.full([WP], 0, tl.int32) + j, mask=(rest >= count) & (rest < WK))
        tl.store(KV_NUM + g * nb + j, count)


def _doc_span(layout):
    """[NB] int32 first block and one past the last block of each block's document (memoised
    on the layout)."""
    if "lists_doc_span" not in layout.memo:
        bounds = doc_bounds(layout)[0].to(torch.int32)
        layout.memo["lists_doc_span"] = (bounds[:-1][layout.block_doc],
                                         bounds[1:][layout.block_doc])
    return layout.memo["lists_doc_span"]


def build_block_lists(selection: BlockSelection) -> BlockLists:
    """The selection's forward and transposed lists (module docstring), built on its device by
    one Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    return _build(selection.layout, selection.kv_indices, selection.kv_num)


def lists_from_ranking(layout, order: torch.Tensor, kv_num: torch.Tensor,
                       shares: torch.Tensor):
    """The lists of the selection that keeps the first ``kv_num[g, i]`` blocks of each row of
    ``order`` ``[ng, NB, K]`` (a ranking, slot 0 the diagonal), in the same one launch that
    writes that selection's ``kv_indices`` (padding slots -> the row's block) and its
    per-row recall ``[ng, NB]`` float32 (sum of ``shares`` ``[ng, NB, NB]`` (contiguous) over
    the kept blocks) -> ``(BlockLists, kv_indices, recall_row)``."""
    ng, nb, k = order.shape
    kept = torch.empty(ng, nb, k, dtype=order.dtype, device=order.device)
    recall = torch.empty(ng, nb, dtype=torch.float32, device=order.device)
    return _build(layout, order, kv_num, (kept, shares, recall)), kept, recall


def _build(layout, sel, sel_num, select_out=None) -> BlockLists:
    if not HAVE_TRITON:
        raise RuntimeError("build_block_lists needs triton (pip install triton)")
    ng, nb, k = sel.shape
    wq, wk = max(k - 1, 1), max(layout.max_doc_blocks - 1, 1)
    dev = sel.device
    q_num = torch.empty(ng, nb, dtype=torch.int32, device=dev)
    kv_num = torch.empty_like(q_num)
    q_idx = torch.empty(ng, nb, wq, dtype=torch.int32, device=dev)
    kv_idx = torch.empty(ng, nb, wk, dtype=torch.int32, device=dev)
    if sel.stride(-1) != 1:
        sel = sel.contiguous()
    kp = triton.next_power_of_2(max(k - 1, 1))
    block = scan_block(kp, sel.element_size())
    kept, shares, recall = select_out if select_out is not None else (q_num, q_num, q_num)
    _lists_kernel[(nb, ng)](sel, sel_num, *_doc_span(layout), q_num, q_idx, kv_num, kv_idx,
                            kept, shares, recall, sel.stride(0), sel.stride(1),
                            sel_num.stride(0), wq, wk, k, KP=kp,
                            WP=triton.next_power_of_2(max(wq, wk)), BLOCK=block,
                            SELECT=select_out is not None)
    return BlockLists(q_num, q_idx, kv_num, kv_idx)
