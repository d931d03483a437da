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
- ``sdpa``: cuDNN's fused SDPA kernel (then flash, then memory-efficient) over the documents
  grouped by length, at a bounded set of shapes: torch builds a cuDNN graph for every new
  ``[n, heads, L, hn]`` it meets, so a graph per document length would be built all through a
  run. Every call pads its documents to ``B(L) = sdpa_padded_len(L)``, a multiple of 128 and
  of 1/32 of the next power of two (32 lengths up to 4K, then 16 per octave: 80 up to 32K, 96
  up to 64K), and runs ``n``, a power of two, of them. Documents, sorted longest first, join
  the group of the longest while its padded work (``n x B(Lmax)^2``) stays within
  ``SDPA_PAD_SLACK`` of theirs at their own lengths (``sum B(L)^2``); a group runs as calls of
  the powers of two that sum to its ``n`` (longest first), each at its own longest
  document's ``B``. Padding sits at the END of each document, where a causal query never
  reads: real outputs are exact, padded rows' outputs are dropped and pass no gradient.
  Added work: a group's calls do at most ``SDPA_PAD_SLACK x sum B(L)^2`` of its documents,
  and ``B(L) - L < max(128, L / 16)``: at most 1.1 x 1.13 x ``sum L^2`` for documents of 2K+
  tokens (1/32 rather than 1/16: half the padding for twice the lengths, as a length's graph
  is built once in a run and its padding paid at every step). A call of one document is a
  view of the packed tokens, no copy, where the ``B(L)`` rows from its first token lie inside
  the micro-batch (the rows past the document are the next documents' tokens, padding like
  any other; a contiguous copy cost 4-10% of the forward on the H200). Other calls are padded
  copies. GQA through ``enable_gqa`` where cuDNN takes it (tried once per device type), else
  K/V expanded to ``np`` heads.
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
from typing import List, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..config import DENSE_KERNELS
from .blocks import check_cu_seqlens, check_qkv, check_softmax_scale

_FUSED_DTYPES = (torch.float16, torch.bfloat16)
SDPA_PAD_SLACK = 1.1      # a group's padded work at most 1.1x its documents' at their own B(L)
SDPA_LEN_MIN = 128        # padded lengths are multiples of 128 ...
SDPA_LEN_STEPS = 32       # ... and of 1/32 of the next power of two (sdpa_padded_len)
_SDPA_GQA: dict = {}      # device type -> "enable_gqa" or "expand", once its first GQA call decided


def sdpa_padded_len(length: int) -> int:
    """The length a document of ``length`` tokens is padded to in an ``sdpa`` call: up to a
    multiple of ``SDPA_LEN_MIN`` and of ``1/SDPA_LEN_STEPS`` of the next power of two (a power
    of two of 128+ stays as it is); ``sdpa_padded_len(L) - L < max(128, L / 16)``."""
    p = 1 << max(0, (int(length) - 1).bit_length())
    step = max(SDPA_LEN_MIN, p // SDPA_LEN_STEPS)
    return -(-int(length) // step) * step


class SdpaCall(NamedTuple):
    """One cuDNN SDPA call of the ``sdpa`` kernel: ``n`` documents at ``length`` positions
    each (``[n, heads, length, hn]``), outputs ``rows`` real tokens."""

    n: int                              # documents (a power of two)
    length: int                         # each padded to this (``sdpa_padded_len``)
    start: Optional[int]                # one document as a view: its first token, else None
    rows: int                           # real tokens (the view's first ``rows`` outputs)
    tokens: Optional[torch.Tensor]      # a padded copy: [rows] long token indices ...
    slots: Optional[torch.Tensor]       # ... and their places in its [n * length] layout


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

    def sdpa_groups(self) -> List["SdpaCall"]:
        """The ``sdpa`` kernel's calls (module docstring), in the order their outputs are
        concatenated; memoised with the permutation back to token order (``sdpa_order``).
        Host work is per document."""
        if "groups" not in self.memo:
            bounds = np.asarray(self.bounds, dtype=np.int64)
            lens = np.diff(bounds)
            padded = [sdpa_padded_len(int(n)) for n in lens]
            groups, cur, work = [], [], 0
            for i in np.argsort(-lens, kind="stable").tolist():
                b = padded[i]
                top = padded[cur[0]] if cur else b
                if cur and (len(cur) + 1) * top * top > SDPA_PAD_SLACK * (work + b * b):
                    groups.append(cur)
                    cur, work = [], 0
                cur.append(i)
                work += b * b
            groups.append(cur)
            out, order = [], []
            for g in groups:
                while g:                      # the powers of two of len(g), longest first
                    n = 1 << (len(g).bit_length() - 1)
                    chunk, g = g[:n], g[n:]
                    top = padded[chunk[0]]
                    idx = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in chunk])
                    order.append(idx)
                    a = int(bounds[chunk[0]])
                    if n == 1 and a + top <= self.num_tokens:     # a view, no copy
                        out.append(SdpaCall(1, top, a, int(lens[chunk[0]]), None, None))
                        continue
                    slots = np.concatenate([j * top + np.arange(lens[i])
                                            for j, i in enumerate(chunk)])
                    out.append(SdpaCall(n, top, None, len(idx),
                                        torch.from_numpy(idx).to(self.device),
                                        torch.from_numpy(slots).to(self.device)))
            order = np.concatenate(order)
            self.memo["groups"] = out
            if np.array_equal(order, np.arange(self.num_tokens)):
                self.memo["order"] = None
            else:
                inverse = np.empty_like(order)
                inverse[order] = np.arange(self.num_tokens)
                self.memo["order"] = torch.from_numpy(inverse).to(self.device)
        return self.memo["groups"]

    def sdpa_order(self) -> Optional[torch.Tensor]:
        """``[t]`` long: token ``i``'s row in the groups' concatenated outputs (None: in order)."""
        self.sdpa_groups()
        return self.memo["order"]


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
    return _grouped_sdpa(q, k, v, docs, scale) if run == "sdpa" else _varlen(q, k, v, docs, scale)


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


def cudnn_call(q, k, v, scale: float, *, cudnn_only: bool = False) -> torch.Tensor:
    """One causal SDPA call on ``[n, heads, L, hn]``, cuDNN first (``cudnn_only``: no other
    backend); GQA through ``enable_gqa`` if cuDNN takes it on this device type (tried once per
    process), else with K/V expanded to q's heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep, dev = q.shape[1] // k.shape[1], q.device.type
    if rep > 1 and _SDPA_GQA.get(dev, "enable_gqa") == "enable_gqa":
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=True)
            _SDPA_GQA[dev] = "enable_gqa"
            return out
        except (RuntimeError, TypeError):
            _SDPA_GQA[dev] = "expand"
    if rep > 1:
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    backends = [SDPBackend.CUDNN_ATTENTION] + ([] if cudnn_only else [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _grouped_sdpa(q, k, v, docs: PackedDocs, scale: float) -> torch.Tensor:
    outs = []
    for c in docs.sdpa_groups():
        if c.tokens is None:        # one document: a view of ``length`` rows from its start
            o = cudnn_call(*(x[c.start:c.start + c.length].transpose(0, 1).unsqueeze(0)
                             for x in (q, k, v)), scale)
            outs.append(o[0, :, :c.rows].transpose(0, 1))
            continue
        padded = []
        for x in (q, k, v):
            flat = x.new_zeros((c.n * c.length,) + tuple(x.shape[1:]))
            flat = flat.index_copy(0, c.slots, x.index_select(0, c.tokens))
            padded.append(flat.view(c.n, c.length, x.shape[1], x.shape[2]).transpose(1, 2))
        o = cudnn_call(*padded, scale)
        outs.append(o.transpose(1, 2).reshape(c.n * c.length, q.shape[1], q.shape[2])
                    .index_select(0, c.slots))
    out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    order = docs.sdpa_order()
    return out if order is None else out.index_select(0, order)
