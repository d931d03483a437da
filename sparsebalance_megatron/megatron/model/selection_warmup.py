"""The fused selection's Triton kernels compiled at start-up, from the run's Megatron flags.

``selection_shape(args, sb, backend)`` is what ``attention.triton_warmup`` needs to know
about a run: this rank's query heads and KV groups (tensor, then context parallelism), head
dim, dtype, block size, the longest micro-batch (``--seq-length``), the estimator, the sink and
local blocks, and which list kernel runs (fused in ``density`` mode; generic in ``mass`` mode or
where context-parallel ranks share a KV group's shares); None where the fused selection does
not run (a backend other than ``triton`` and ``fa4``, a head dim its tiles do not take).
``warm_up(args, sb, backend, device)`` compiles them once and returns the line the post-wrap
hook logs; a failed warm-up is reported in that line, never raised: the kernels then compile in
the steps that first need them, as they did before.
Part of the megatron adapter layer (reads Megatron's parsed arguments); no torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...attention.triton_warmup import SelectionShape, warm_selection
from ...config import SparseBalanceConfig


def selection_shape(args, sb: SparseBalanceConfig, backend: str) -> Optional[SelectionShape]:
    """The run's ``SelectionShape`` (module docstring), or None; whatever the device (the
    warm-up itself is a no-op off CUDA)."""
    from ...attention.sparse_triton import missing

    if backend not in ("triton", "fa4"):
        return None
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    hn = int(args.kv_channels)
    if missing("cuda", dtype, hn, sb.block_size) is not None:      # the tiles it takes
        return None
    tp = int(args.tensor_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    nh, ng = args.num_attention_heads // tp, max(1, int(groups) // tp)
    shared = cp > 1 and ng < cp             # shares averaged over ranks: the generic selection
    nh, ng = nh // cp, max(1, ng // cp)
    return SelectionShape(nh, ng, hn, sb.block_size, int(args.seq_length), dtype,
                          sb.estimator, sb.sink_blocks, sb.local_blocks,
                          "generic" if shared or sb.selection_mode == "mass" else "fused")


def warm_up(args, sb: SparseBalanceConfig, backend: str, device) -> Optional[str]:
    """Compile the run's selection kernels (module docstring) -> the line to log, or None
    where there is nothing to compile (off CUDA, another backend)."""
    shape = selection_shape(args, sb, backend)
    if shape is None:
        return None
    try:
        got = warm_selection(shape, device)
    except Exception as e:  # noqa: BLE001 - the steps compile what they need, as before
        return (f"Triton selection warm-up failed ({type(e).__name__}: {str(e)[:200]}): its "
                f"kernels compile in the steps that first need them")
    if got is None:
        return None
    return (f"Triton selection warm-up ({backend}): {got['compiles']} kernels, "
            f"{got['widths']} list widths up to {shape.max_tokens} tokens at block "
            f"{shape.block_size}, in {got['seconds']:.1f} s"
            f"{' (parallel)' if got['parallel'] else ''}")


__all__ = ["selection_shape", "warm_up"]
