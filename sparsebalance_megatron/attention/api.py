"""One entry point for budgeted block-sparse attention over a packed micro-batch.

``block_sparse_attention(q, k, v, cu_seqlens, density, ...)`` validates the inputs, lays the
documents out in blocks, selects key blocks under the budget (no gradient) and runs one of the
kernels, all of which compute the same function. What depends only on the micro-batch's
documents (the layout, masks, kept-count bounds, loop plans) is computed once per micro-batch
and shared through ``cache``; the per-layer path then reads nothing back from the device.

- ``flex``: FlexAttention with a BlockMask (CUDA), compiled once per run (``flex.py``);
- ``flash``: the same BlockMask through flex's FlashAttention-4 kernel (Hopper or newer,
  ``flash-attn-4`` installed; experimental);
- ``fa4``: FlashAttention-4's block-sparse CuTe kernels called directly on the selection's
  block lists (Hopper, block 128, bf16/fp16, ``flash-attn-4`` installed; experimental,
  ``fa4_cute.py``);
- ``triton``: the plugin's own block-sparse FlashAttention in Triton (``sparse_triton.py``;
  CUDA, or CPU tensors under ``TRITON_INTERPRET=1``), one launch per micro-batch per kernel and
  no recompiles across lengths;
- ``torch``: blockwise PyTorch with autograd (CPU and portable fallback);
- ``reference``: dense SDPA with the expanded boolean mask (the oracle, O(t^2) memory);
- ``auto``: on CUDA triton for variable-length micro-batches, else the kernel this device's
  profile measured fastest (flex before any measurement), torch elsewhere (``auto_backend``).

Layouts: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (GQA: ``np`` a multiple of ``ng``; query head h
uses key/value head ``h // (np // ng)``), out ``[t, np, hn]``.

Routing (``dense_below_tokens=N > 0``): documents shorter than ``N`` tokens run through ONE dense
varlen call (``dense.py``), the others through the block-sparse path above (``routing.py``);
``N`` is the device's measured crossover, not a constant of this module.

Every argument is validated before any work, the same way for every backend: a bad value raises
a ``ValueError`` that names the argument and the value (``blocks.py`` holds the checks).
Must not import megatron.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Optional, Tuple, Union

import torch

from ..config import BACKENDS
from .blocks import (build_layout, check_block_size, check_density, check_fraction, check_int,
                     check_qkv, check_softmax_scale)
from .dense import DENSE_KERNELS
from .flex import FLEX_KERNELS
from .kernels import (blockwise_attention, from_blocks_q, reference_attention, to_blocks_kv,
                      to_blocks_q)
from .routing import RoutedSelection, attend_routed, route_of
from .selection import (ESTIMATORS, BlockSelection, estimate_block_shares,
                        query_block_sums_padded, select_from_shares, selection_range,
                        shares_from_block_sums)


# ``auto``, in one place. On CUDA it is the sparse kernel this device's profile measured fastest:
# ``megatron/crossover.fastest_backend`` times every kernel that can run (at profiling, and
# records it in the latency table as ``attention.backend``); whoever measures or loads that pick
# registers it here (``set_auto_backend``) and every later ``auto`` (the layers, the launch
# checks, the benchmark, a direct API call) runs it. A launch with variable-length micro-batches
# registers the first length-free kernel that serves the model (``fa4`` where flash-attn-4 is
# installed on Hopper, else ``triton``: ``megatron/launch/lengths.py``), and its profile times
# only the length-free ones and keeps the faster. With no registration in this process it is
# AUTO_UNMEASURED, ``flex``: verified on an H100 (outputs, gradients, graphs and syncs,
# docs/GPU.md); on an H200 ``fa4``, ``flash`` and ``triton`` beat it (BENCHMARKS.md, "On a
# GPU"), but each needs what flex does not (flash-attn-4; triton's head dims). Off CUDA
# ``auto`` is ``torch`` (the only sparse kernel that runs there without the Triton interpreter).
AUTO_UNMEASURED = "flex"
_AUTO_MEASURED: dict = {}        # device type -> (backend, where the measurement came from)


def set_auto_backend(backend: Optional[str], source: str, device="cuda") -> None:
    """Make ``auto`` on ``device``'s type run ``backend`` (the measured fastest; ``source`` says
    where it was measured). ``None`` forgets the measurement."""
    kind = torch.device(device).type
    if backend is None:
        _AUTO_MEASURED.pop(kind, None)
        return
    _check_choice("backend", backend, tuple(b for b in BACKENDS if b != "auto"))
    _AUTO_MEASURED[kind] = (backend, source)


def auto_backend(device) -> Tuple[str, str]:
    """(the backend ``auto`` runs on ``device``, why): see AUTO_UNMEASURED above."""
    kind = torch.device(device).type
    if kind != "cuda":
        return "torch", f"not CUDA ({kind}): the blockwise torch kernel"
    if kind in _AUTO_MEASURED:
        backend, source = _AUTO_MEASURED[kind]
        return backend, f"measured fastest on this device ({source})"
    return AUTO_UNMEASURED, ("no measurement of this device in this process (a latency table "
                             "profiled here records one): flex, the one sparse kernel verified "
                             "on a GPU")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs on ``device``: ``auto`` as ``auto_backend`` says, else ``backend``."""
    _check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return auto_backend(device)[0]
    return backend


@functools.lru_cache(maxsize=8)
def _flash_missing(device: str) -> Optional[str]:
    """``flex.flash_kernel_missing``, probed once per device (it looks for a package)."""
    from .flex import flash_kernel_missing
    return flash_kernel_missing(device)


def backend_missing(backend: str, device, *, dtype=None, head_dim: Optional[int] = None,
                    block_size: Optional[int] = None) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` (and, where given, inputs of this dtype, head
    dim and block size), or None when it can. The device and package probe runs once per
    (backend, device): every layer's call asks. Never raises for a known backend."""
    _check_choice("backend", backend, BACKENDS)
    why = _device_missing(backend, str(torch.device(device)))
    if why is not None:
        return why
    if backend == "fa4" and None not in (dtype, head_dim, block_size):
        from .fa4_cute import fa4_shape_problem
        return fa4_shape_problem(dtype, head_dim, block_size)
    if backend == "triton":
        from .sparse_triton import missing
        return missing(device, dtype, head_dim, block_size)
    return None


@functools.lru_cache(maxsize=16)
def _device_missing(backend: str, device: str) -> Optional[str]:
    """``backend_missing``'s device and package part, probed once per (backend, device)."""
    if backend in ("flex", "flash") and torch.device(device).type != "cuda":
        return "it needs a CUDA device"
    if backend == "flash":
        return _flash_missing(device)
    if backend == "fa4":
        from .fa4_cute import fa4_missing
        return fa4_missing(device)
    if backend == "triton":
        from .sparse_triton import missing
        return missing(device)
    return None


def _check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _layout(cache, cu_seqlens, num_tokens, block_size, device, fixed_length, pad_tokens=None):
    """The micro-batch's layout: built (reading ``cu_seqlens`` on the host) on the first call,
    then taken from ``cache`` by every later layer and by a recomputed forward."""
    key = ("layout", num_tokens, block_size, str(device), fixed_length, pad_tokens)
    if cache is not None and key in cache:
        return cache[key]
    layout = build_layout(cu_seqlens, num_tokens, block_size, device, fixed_length=fixed_length,
                          pad_tokens=pad_tokens)
    if cache is not None:
        cache[key] = layout
    return layout


def _density(layout, density):
    """(``[ndoc]`` float64 tensor, host list); a Python number is memoised on the layout."""
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        return check_density(density, layout.num_docs, layout.block_doc.device)
    key = ("density", float(density))
    if key not in layout.memo:
        layout.memo[key] = check_density(density, layout.num_docs, layout.block_doc.device)
    return layout.memo[key]


def block_sparse_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
        density: Union[float, torch.Tensor], *, block_size: int = 64, sink_blocks: int = 1,
        local_blocks: int = 0, selection_mode: str = "density", mass_threshold: float = 0.9,
        min_density: float = 0.125, max_density: float = 1.0, estimator: str = "maxkey",
        backend: str = "auto", softmax_scale: Optional[float] = None,
        query_chunk_blocks: int = 16, cache: Optional[dict] = None,
        compile_backend: Optional[str] = "inductor",
        reduce_shares: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        dense_below_tokens: int = 0, dense_kernel: str = "auto",
        pad_to_tokens: Optional[int] = None,
) -> Tuple[torch.Tensor, Union[BlockSelection, RoutedSelection]]:
    """Budgeted block-sparse causal attention within documents.

    ``cu_seqlens``: ``[ndoc + 1]`` document boundaries (tensor or list, ``0 ... t``).
    ``density``: scalar or ``[ndoc]`` in (0, 1] (kept key blocks / causal key blocks); a Python
    number costs no device round trip, a tensor one.
    ``cache``: a dict owned by one micro-batch (e.g. ``SparsePackedSeqParams.sb_cache``): the
    first call lays the documents out (reading ``cu_seqlens`` on the host) and keeps the layout
    and everything derived from it there; later calls with the same dict (the other layers, the
    recomputed forward) reuse it and read nothing from the device. ``cu_seqlens`` is not
    re-validated on those calls.
    ``compile_backend`` (flex only): torch.compile backend; ``None`` runs flex eagerly.
    ``softmax_scale``: a finite number > 0, or ``None`` for ``1/sqrt(hn)``.
    ``reduce_shares``: applied to the estimated shares ``[ng, NB, NB]`` before the selection
    (context parallelism with fewer KV groups than ranks: a rank holds some of a group's query
    heads, and this averages the shares over the ranks that hold the others).
    ``dense_below_tokens``: 0 (off), or route documents shorter than this many tokens through
    one dense varlen call (``dense_varlen_attention``, kernel ``dense_kernel``: auto, varlen or
    sdpa) and only the others through the selection and the sparse kernel (``routing.py``); the
    split is made once per micro-batch and kept in ``cache``. With every document long this is
    the unrouted computation; with every document short no sparse call is made.
    ``pad_to_tokens`` (flex and flash): lay the tokens out padded as a micro-batch of this many
    tokens would be (routing pads its long documents as the whole micro-batch), so that calls of
    different lengths share the compiled kernel's one shape; None: the call's own token count.
    q, k and v must share one floating dtype (float16, bfloat16, float32 or float64) and one
    device; any bad argument raises a ``ValueError`` naming it, whatever the backend.
    Returns ``(out [t, np, hn], selection)``; ``selection.density_kept`` and
    ``selection.recall`` are ``[ndoc]`` per-document statistics (detached; 1.0 for a document
    that ran dense, whose selection is then a ``RoutedSelection``).
    """
    num_heads, num_groups, head_dim = check_qkv(q, k, v)
    backend = resolve_backend(backend, q.device)
    estimator = _check_choice("estimator", estimator, tuple(ESTIMATORS))
    selection_mode = _check_choice("selection_mode", selection_mode, ("density", "mass"))
    block_size = check_block_size(block_size)
    mass_threshold = check_fraction("mass_threshold", mass_threshold)
    min_density = check_fraction("min_density", min_density)
    max_density = check_fraction("max_density", max_density)
    if min_density > max_density:
        raise ValueError(f"min_density={min_density} > max_density={max_density}: expected "
                         f"min_density <= max_density")
    sink_blocks = check_int("sink_blocks", sink_blocks)
    local_blocks = check_int("local_blocks", local_blocks)
    query_chunk_blocks = check_int("query_chunk_blocks", query_chunk_blocks, minimum=1)
    softmax_scale = check_softmax_scale(softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if cache is not None and not isinstance(cache, dict):
        raise ValueError(f"cache is a {type(cache).__name__}: expected a dict owned by one "
                         f"micro-batch, or None")
    if compile_backend is not None and not (isinstance(compile_backend, str)
                                            or callable(compile_backend)):
        raise ValueError(f"compile_backend={compile_backend!r}: expected a torch.compile "
                         f"backend (name or callable), or None for eager flex")
    if reduce_shares is not None and not callable(reduce_shares):
        raise ValueError(f"reduce_shares={reduce_shares!r}: expected a callable or None")
    dense_below_tokens = check_int("dense_below_tokens", dense_below_tokens)
    if pad_to_tokens is not None:
        pad_to_tokens = check_int("pad_to_tokens", pad_to_tokens)
    dense_kernel = _check_choice("dense_kernel", dense_kernel, DENSE_KERNELS)
    if backend in ("flash", "fa4", "triton"):
        why = backend_missing(backend, q.device, dtype=q.dtype, head_dim=head_dim,
                              block_size=block_size)
        if why is not None:
            raise ValueError(f"backend={backend!r}: {why}; use backend 'flex', 'torch' or 'auto'")
    sparse = functools.partial(
        _sparse_attention, num_groups=num_groups, block_size=block_size, backend=backend,
        estimator=estimator, softmax_scale=softmax_scale, query_chunk_blocks=query_chunk_blocks,
        compile_backend=compile_backend, reduce_shares=reduce_shares,
        budget=dict(sink_blocks=sink_blocks, local_blocks=local_blocks,
                    selection_mode=selection_mode, mass_threshold=mass_threshold,
                    min_density=min_density, max_density=max_density))
    if dense_below_tokens:
        route = route_of(cache, cu_seqlens, q.shape[0], dense_below_tokens, q.device)
        if route.dense_docs:
            # the long documents are padded like the whole micro-batch (one compiled shape)
            pad = max(q.shape[0], pad_to_tokens or 0)
            return attend_routed(q, k, v, route, density, softmax_scale, dense_kernel,
                                 functools.partial(sparse, pad_tokens=pad))
        cu_seqlens = route.bounds          # every document is long: the layout reads no device
    return sparse(q, k, v, cu_seqlens, density, cache, pad_tokens=pad_to_tokens)


def _fused_selection(q: torch.Tensor, block_size: int) -> bool:
    """Whether triton's fused selection (``sparse_triton_select``) takes these inputs: its
    tiles need a power-of-two head dim (fa4 takes any multiple of 8 up to 128)."""
    from .sparse_triton import missing
    return missing(q.device, q.dtype, q.shape[-1], block_size) is None


def _sparse_attention(q, k, v, cu_seqlens, density, cache, *, num_groups, block_size, backend,
                      estimator, softmax_scale, query_chunk_blocks, compile_backend,
                      reduce_shares, budget, pad_tokens=None):
    """The block-sparse path on validated arguments: layout, selection, kernel."""
    flex_kernel = FLEX_KERNELS.get(backend)
    layout = _layout(cache, cu_seqlens, q.shape[0], block_size, q.device,
                     fixed_length=flex_kernel is not None, pad_tokens=pad_tokens)
    density_doc, density_host = _density(layout, density)
    budget = dict(budget, density_host=density_host)
    if backend == "triton" or (backend == "fa4" and _fused_selection(q, block_size)):
        from .sparse_triton_select import triton_block_sparse   # fused selection and lists
        return triton_block_sparse(q, k, v, layout, density_doc, estimator=estimator,
                                   softmax_scale=softmax_scale, reduce_shares=reduce_shares,
                                   kernel=backend, **budget)

    q_pad, k_pad, v_pad = layout.pad(q), layout.pad(k), layout.pad(v)
    if flex_kernel is not None or backend == "fa4":
        with torch.no_grad(), selection_range():
            qsum = query_block_sums_padded(q_pad.detach(), layout, num_groups)  # [ng,NB,rep,hn]
            keys = k_pad.detach()[:layout.num_blocks * block_size].permute(1, 0, 2)
            shares = shares_from_block_sums(qsum, keys, layout, estimator, softmax_scale)
            if reduce_shares is not None:
                shares = reduce_shares(shares)
            selection = select_from_shares(shares, layout, density_doc, **budget)
            if backend == "fa4":   # a head dim the fused selection's tiles do not take (96, 80)
                from .block_lists import build_block_lists
                lists = build_block_lists(selection)
        if backend == "fa4":
            from .fa4_cute import fa4_block_sparse_attention
            out = fa4_block_sparse_attention(q_pad, k_pad, v_pad, lists.q_num, lists.q_idx,
                                             lists.kv_num, lists.kv_idx,
                                             block_size=block_size, softmax_scale=softmax_scale)
        else:
            from .flex import flex_attention_padded
            out = flex_attention_padded(q_pad, k_pad, v_pad, selection, softmax_scale,
                                        compile_backend, flex_kernel)
        return layout.unpad(out), selection

    q_blk = to_blocks_q(q_pad, num_groups, block_size)       # [ng, NB, rep, B, hn]
    k_blk = to_blocks_kv(k_pad, block_size)                  # [ng, NB, B, hn]
    shares = estimate_block_shares(q_blk.detach(), k_blk.detach(), layout, estimator,
                                   softmax_scale)
    if reduce_shares is not None:
        with torch.no_grad():
            shares = reduce_shares(shares)
    selection = select_from_shares(shares, layout, density_doc, **budget)
    if backend == "reference":
        out = reference_attention(q, k, v, selection, softmax_scale)
    else:
        v_blk = to_blocks_kv(v_pad, block_size)
        out_blk = blockwise_attention(q_blk, k_blk, v_blk, selection, softmax_scale,
                                      query_chunk_blocks)
        out = layout.unpad(from_blocks_q(out_blk))
    return out, selection
