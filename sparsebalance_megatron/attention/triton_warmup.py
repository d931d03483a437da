"""The fused selection's Triton kernels compiled at start-up, every width a run can meet.

The ``triton`` and ``fa4`` backends select blocks with ``sparse_triton_select``'s kernels. Their
block list kernel (``block_lists._lists_kernel``) takes two widths as constexprs, rounded up to
powers of two: ``KP`` from the selection's kept slots ``K`` (``max(K - 1, 1)``) and ``WP`` from
the longest document's blocks ``L`` (``max(K - 1, L - 1, 1)``; ``K <= L``), and ``BLOCK`` from
``KP``. Triton compiles one kernel per pair, and the pair follows each micro-batch's longest
document and density: with varied documents a new pair first appears steps into a run, and that
step pays the compile (a quarter to half a second on an H200). ``warm_selection`` compiles,
without launching, every pair ``selection_widths`` lists for the run's longest micro-batch
(``KP <= WP <= next_pow2(ceil(max_tokens / block_size) - 1)``: 45 pairs at 32K tokens and block
128, 55 at 64K) and the other selection kernels once (block sums, the maxkey scores, the
shares; their per-micro-batch sizes are not specialised on), in parallel where Triton has an
async compile mode. Compiled kernels also go to Triton's disk cache, so a later process on the
machine loads them instead. It compiles the same kernels a launch would: the same dtypes, the
integer arguments' specialisation (divisible by 16, equal to 1) and the 16-byte-aligned
pointers the launches pass (``tests/unit/test_triton_warmup.py`` checks the keys against real
calls).

A no-op (returns None) off CUDA; under ``TRITON_INTERPRET=1`` the calls run and compile
nothing (the interpreter has nothing to compile). Pure torch + triton; must not import megatron.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .triton_launch import _pow2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SelectionShape:
    """What fixes the selection kernels' compiles in a run (this rank's heads)."""

    num_heads: int
    """Query heads of this rank (after tensor and context parallelism)."""
    num_groups: int
    """KV groups of this rank."""
    head_dim: int
    """Head dim (a power of two in 16..256: the fused selection's tiles)."""
    block_size: int
    """The selection's block size (tokens)."""
    max_tokens: int
    """The longest micro-batch's tokens (``--seq-length``): bounds the longest document."""
    dtype: torch.dtype = torch.bfloat16
    """q, k, v's dtype."""
    estimator: str = "maxkey"
    """``maxkey`` or ``pooled``: which score kernels run."""
    sink_blocks: int = 1
    """As the selection passes it (a value of 1 is specialised on)."""
    local_blocks: int = 0
    """As the selection passes it."""
    lists: str = "fused"
    """``fused``: the shares kernel and the list kernel that also writes the selection
    (``lists_from_ranking``, ``density`` mode); ``generic``: the list kernel of a selection made
    in torch (``build_block_lists``: ``mass`` mode, shares reduced over context-parallel
    ranks). The same widths."""


def selection_widths(max_tokens: int, block_size: int) -> List[Tuple[int, int]]:
    """Every ``(KP, WP)`` the list kernel can be launched with for micro-batches of at most
    ``max_tokens`` tokens (module docstring), ``WP`` then ``KP`` ascending."""
    if max_tokens < 1 or block_size < 1:
        raise ValueError(f"max_tokens={max_tokens}, block_size={block_size}: expected >= 1")
    top = _pow2(max(-(-max_tokens // block_size) - 1, 1))
    pows = [1 << e for e in range(top.bit_length())]
    return [(kp, wp) for wp in pows for kp in pows if kp <= wp]


def selection_compiles(shape: SelectionShape) -> List[Tuple[object, tuple, dict]]:
    """``(kernel, args, constexprs)`` of every compile ``warm_selection`` makes: args as a
    launch passes them, tensors as their dtypes (``JITFunction.warmup`` takes a dtype for a
    16-byte-aligned tensor), integers as values of the same specialisation."""
    from . import block_lists, maxkey_triton, sparse_triton_select as sel
    nh, ng, hn, bs = shape.num_heads, shape.num_groups, shape.head_dim, shape.block_size
    rep = nh // ng
    f32, i32, i64, x = torch.float32, torch.int32, torch.int64, shape.dtype
    nb = 16 * -(-shape.max_tokens // (16 * bs))    # any count: not specialised on
    out = [(sel._block_sums_kernel, (x, i32, i32, f32), dict(H=nh, HN=hn, BS=bs))]
    if shape.estimator == "pooled":
        out.append((sel._block_sums_kernel, (x, i32, i32, f32), dict(H=ng, HN=hn, BS=bs)))
    else:
        # strides of the block sums [ng, NB, rep, hn] (a permuted view) and of k [t, ng, hn]
        # (multiples of hn, whatever the layout Megatron hands over)
        out.append((maxkey_triton._maxkey_kernel,
                    (f32, x, i32, i32, i32, f32, nb * rep, rep, nb, 1.0, rep * hn,
                     ng * rep * hn, hn, hn, ng * hn, nb * rep * nb, nb),
                    dict(HN=hn, BS=bs, BLOCK_R=maxkey_triton._BLOCK_R,
                         IEEE=x == torch.float32)))
    if shape.lists == "fused":
        out.append((sel._shares_kernel,
                    (f32, i32, f32, f32, nb, nb * rep * nb, rep * nb, nb, shape.sink_blocks,
                     shape.local_blocks),
                    dict(REP=rep, RP=max(2, _pow2(rep)), BLOCK_J=64)))
        ptrs = (i64, i64, i32, i32, i32, i32, i32, i32, i64, f32, f32)
    elif shape.lists == "generic":      # SELECT off: q_num stands in for the three outputs
        ptrs = (i64, i64, i32, i32, i32, i32, i32, i32, i32, i32, i32)
    else:
        raise ValueError(f"lists={shape.lists!r}: expected fused or generic")
    for kp, wp in selection_widths(shape.max_tokens, bs):
        out.append((block_lists._lists_kernel, ptrs + (nb * 2, 2, nb, 1, 1, 2),
                    dict(KP=kp, WP=wp, BLOCK=block_lists.scan_block(kp, 8),
                         SELECT=shape.lists == "fused")))
    return out


def warm_selection(shape: SelectionShape, device) -> Optional[dict]:
    """Compile ``selection_compiles(shape)`` on ``device`` (no launch) -> ``{compiles, seconds,
    widths, parallel}``; None off CUDA (under ``TRITON_INTERPRET=1`` the calls run, compiling
    nothing). Compiles in threads where Triton has ``AsyncCompileMode`` (its compiler and
    ``ptxas`` leave the interpreter lock), one by one otherwise."""
    if torch.device(device).type != "cuda" and not _INTERPRET:
        return None
    from .sparse_triton import missing
    why = missing(device, shape.dtype, shape.head_dim, shape.block_size)
    if why is not None:
        raise ValueError(f"the fused selection cannot run here: {why}")
    items = selection_compiles(shape)
    t0 = time.perf_counter()
    parallel = False
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
        parallel = not _INTERPRET
    except ImportError:
        pass

    def compile_all():
        for fn, args, constexprs in items:
            fn.warmup(*args, grid=(1,), **constexprs)

    dev = torch.device(device)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if parallel:
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool, \
                    AsyncCompileMode(pool):
                compile_all()
        else:
            compile_all()
    return dict(compiles=len(items), seconds=time.perf_counter() - t0, parallel=parallel,
                widths=len(selection_widths(shape.max_tokens, shape.block_size)))


__all__ = ["SelectionShape", "selection_compiles", "selection_widths", "warm_selection"]
