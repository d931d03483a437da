"""Dense causal attention over packed (THD) documents: the fair dense baseline, and the dense half
of routing (``api.block_sparse_attention(dense_below_tokens=...)``).

``dense_varlen_attention(q, k, v, cu_seqlens, softmax_scale, kernel=...)``: q ``[t, np, hn]``,
k/v ``[t, ng, hn]`` (GQA: ``np`` a multiple of ``ng``), causal inside every document of
``cu_seqlens``, never across; returns ``[t, np, hn]``. Kernels (``DENSE_KERNELS``):

- ``varlen``: ONE call of ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen
  kernel over the packed tokens): what a transformer-engine user gets as one fused THD call.
  GQA goes in through whatever this torch release takes (``torch_compat.varlen_attention``:
  ``enable_gqa`` from torch 2.13; on 2.11 K/V with their ``ng`` heads straight to the flash
  kernel, which shares each among its query heads; K/V repeated only where a kernel refuses).
- ``sdpa``: ONE ``scaled_dot_product_attention`` call over the documents padded to the longest
  (``[ndoc, np, Lmax, hn]``, padding on the right, which a causal query never reads), cuDNN
  first, then flash, then memory-efficient. K/V are expanded to ``np`` heads: whether cuDNN
  takes GQA is not relied on. It computes ``ndoc x Lmax^2`` pairs instead of ``sum L^2``: meant
  for many short documents of similar lengths.
- ``auto``: ``varlen``. Which of the two is faster is a device measurement (the profiler
  records the dense kernel it timed next to the crossover, ``megatron/launch/crossover.py``).

Both need CUDA and float16/bfloat16. Anything else (CPU, float32/float64) runs the exact
per-document SDPA loop, whatever ``kernel`` says: on CPU the loop is the only exact kernel.

What depends only on the documents (host bounds, the int32 ``cu_seqlens`` on the device, the
padded slots) is a ``PackedDocs``, built once per micro-batch (one host read of ``cu_seqlens``)
and passed instead of ``cu_seqlens`` by every later layer.
Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..config import DENSE_KERNELS
from .blocks import check_cu_seqlens, check_qkv, check_softmax_scale

_FUSED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class PackedDocs:
    """The documents of a packed micro-batch, for the dense kernels; built by ``packed_docs``."""

    bounds: List[int]                 # cu_seqlens on the host, [0, ..., t]
    device: torch.device
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1]

    @property
    def num_docs(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    def cu(self) -> torch.Tensor:
        """``[ndoc + 1]`` int32 on the device (the varlen kernel's ``cu_seq_q/k``)."""
        if "cu" not in self.memo:
            self.memo["cu"] = torch.tensor(self.bounds, dtype=torch.int32, device=self.device)
        return self.memo["cu"]

    def slots(self) -> torch.Tensor:
        """``[t]`` long: token ``j`` of document ``i`` -> ``i * max_len + j`` (padded layout)."""
        if "slots" not in self.memo:
            lens = torch.tensor([b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])],
                                dtype=torch.long, device=self.device)
            starts = torch.tensor(self.bounds[:-1], dtype=torch.long, device=self.device)
            doc = torch.repeat_interleave(torch.arange(self.num_docs, device=self.device), lens,
                                          output_size=self.num_tokens)
            pos = torch.arange(self.num_tokens, device=self.device) - starts[doc]
            self.memo["slots"] = doc * self.max_len + pos
        return self.memo["slots"]


    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[t, heads, hn]`` -> ``[docs, heads, max_len, hn]``: every document from position 0,
        zeros after it (the layout of a padded SDPA call; differentiable)."""
        b, n = self.num_docs, self.max_len
        out = x.new_zeros((b * n,) + tuple(x.shape[1:])).index_copy(0, self.slots(), x)
        return out.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2)


def packed_docs(cu_seqlens, num_tokens: int, device, cache: Optional[dict] = None) -> PackedDocs:
    """``cu_seqlens`` (tensor or sequence, validated like the sparse path's) as ``PackedDocs``;
    a device tensor is read back here, once: with ``cache`` (a per-micro-batch dict) later calls
    return the memoised object and read nothing."""
    key = ("dense_docs", num_tokens, str(device))
    if cache is not None and key in cache:
        return cache[key]
    docs = PackedDocs(check_cu_seqlens(cu_seqlens, num_tokens), torch.device(device))
    if cache is not None:
        cache[key] = docs
    return docs


def resolve_dense_kernel(kernel: str, device, dtype: torch.dtype) -> str:
    """The kernel that runs for ``kernel`` on ``device`` in ``dtype``: ``varlen`` or ``sdpa`` on
    CUDA in float16/bfloat16 (``auto`` is ``varlen``), else ``loop`` (the exact loop)."""
    if torch.device(device).type != "cuda" or dtype not in _FUSED_DTYPES:
        return "loop"
    return "varlen" if kernel == "auto" else kernel


def dense_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: Union[torch.Tensor, Sequence[int], PackedDocs],
                           softmax_scale: Optional[float] = None, *,
                           kernel: str = "auto") -> torch.Tensor:
    """Exact causal attention inside every document (module docstring). ``cu_seqlens``: a
    ``PackedDocs`` (no host read), or a tensor / sequence of document bounds (read on the host
    here). ``softmax_scale``: a finite number > 0, or None for ``1/sqrt(hn)``."""
    check_qkv(q, k, v)
    if not isinstance(kernel, str) or kernel not in DENSE_KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {', '.join(DENSE_KERNELS)}")
    scale = check_softmax_scale(softmax_scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    docs = cu_seqlens if isinstance(cu_seqlens, PackedDocs) \
        else packed_docs(cu_seqlens, q.shape[0], q.device)
    if docs.num_tokens != q.shape[0]:
        raise ValueError(f"cu_seqlens ends at {docs.num_tokens} but there are {q.shape[0]} "
                         f"tokens: expected the last entry to equal the token count")
    run = resolve_dense_kernel(kernel, q.device, q.dtype)
    if run == "loop":
        return causal_per_document(q, k, v, docs.bounds, scale)
    return _padded_sdpa(q, k, v, docs, scale) if run == "sdpa" else _varlen(q, k, v, docs, scale)


def causal_per_document(q, k, v, bounds: Sequence[int], softmax_scale: float) -> torch.Tensor:
    """The exact loop: every document alone through causal SDPA (host ``bounds``)."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, L, hn]
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=softmax_scale,
                                           enable_gqa=kd.shape[0] != qd.shape[0])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _varlen(q, k, v, docs: PackedDocs, scale: float) -> torch.Tensor:
    from .torch_compat import varlen_attention

    return varlen_attention(q, k, v, docs.cu(), docs.max_len, scale)


def _padded_sdpa(q, k, v, docs: PackedDocs, scale: float) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        o = F.scaled_dot_product_attention(docs.pad(q), docs.pad(k), docs.pad(v),
                                           is_causal=True, scale=scale)
    n = docs.num_docs * docs.max_len
    return o.transpose(1, 2).reshape(n, q.shape[1], q.shape[2]).index_select(0, docs.slots())
