"""Block layout of a packed micro-batch: documents split into blocks of ``block_size`` tokens.

Every document (``cu_seqlens``) is cut into blocks; the last block of a document may be short.
All blocks of all documents are numbered globally (``NB`` blocks) and laid out in a *padded*
token space where each document starts on a block boundary, so the kernels see uniform
``[NB, block_size]`` tiles and attention can never cross a document. The padded space may hold
empty blocks after the last document (``padded_blocks >= NB``): the FlexAttention path pads every
micro-batch of the same token count to the same length, so its compiled kernel sees one shape.

A layout depends only on the micro-batch's documents: it is built once per micro-batch (this is
where ``cu_seqlens`` is read on the host) and shared by every layer, together with the tensors and
host-side numbers derived from it (``memo``). Nothing on a layout's methods reads device values
back to the host. Input validation shared by every backend lives here too.
Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch


@dataclass
class BlockLayout:
    """Where every block and token of a packed micro-batch lives.

    ``block_*`` tensors are ``[NB]`` (long, on the input's device); ``token_slot`` is ``[t]``:
    the padded position of every real token (``None`` when tokens keep their positions).
    ``block_local_host`` is the same as ``block_local``, on the host (for shapes and loop plans).
    """

    block_size: int
    doc_lens: List[int]            # tokens per document
    doc_block_start: List[int]     # global index of each document's first block; len ndoc + 1
    num_tokens: int                # t, real tokens
    block_doc: torch.Tensor        # [NB] document of each block
    block_local: torch.Tensor      # [NB] index of the block inside its document
    block_len: torch.Tensor        # [NB] real tokens in the block (1..block_size)
    token_slot: Optional[torch.Tensor]  # [t] padded slot of each token, None if identity
    padded_blocks: int = 0         # blocks of the padded token space (>= NB; 0: NB)
    block_local_host: np.ndarray = field(default=None, repr=False)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-micro-batch results derived from the layout (masks, budgets, loop plans)."""

    def __post_init__(self):
        if self.padded_blocks < self.num_blocks:
            self.padded_blocks = self.num_blocks
        if self.block_local_host is None:
            self.block_local_host = np.concatenate(
                [np.arange(b - a) for a, b in zip(self.doc_block_start[:-1],
                                                  self.doc_block_start[1:])])

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def num_blocks(self) -> int:
        return self.doc_block_start[-1]

    @property
    def padded_tokens(self) -> int:
        return self.padded_blocks * self.block_size

    @property
    def max_doc_blocks(self) -> int:
        """Blocks of the longest document."""
        return int(np.diff(self.doc_block_start).max())

    def block_available(self) -> torch.Tensor:
        """[NB] causal in-document key blocks of each query block (its own included)."""
        return self.block_local + 1

    def allowed(self) -> torch.Tensor:
        """[NB, NB] bool: key block j is causal (j <= i) and in the document of query block i."""
        if "allowed" not in self.memo:
            nb = self.num_blocks
            ar = torch.arange(nb, device=self.block_doc.device)
            self.memo["allowed"] = ((self.block_doc[:, None] == self.block_doc[None, :])
                                    & (ar[None, :] <= ar[:, None]))
        return self.memo["allowed"]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[t, ...] -> [padded_tokens, ...] with zeros in the padding slots (differentiable)."""
        tail = self.padded_tokens - self.num_tokens
        if self.token_slot is None:
            if tail == 0:
                return x
            return torch.cat([x, x.new_zeros((tail,) + tuple(x.shape[1:]))])
        out = x.new_zeros((self.padded_tokens,) + tuple(x.shape[1:]))
        return out.index_copy(0, self.token_slot, x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[padded_tokens, ...] -> [t, ...] (differentiable)."""
        if self.token_slot is None:
            return x if x.shape[0] == self.num_tokens else x[:self.num_tokens]
        return x.index_select(0, self.token_slot)

    def token_block(self) -> torch.Tensor:
        """[t] global block index of every real token."""
        slots = (torch.arange(self.num_tokens, device=self.block_doc.device)
                 if self.token_slot is None else self.token_slot)
        return torch.div(slots, self.block_size, rounding_mode="floor")


# dtypes the kernels and the estimators compute in (softmax in float32 at least).
_QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_int(name: str, value, minimum: int = 0) -> int:
    """An integer (Python or numpy; not bool, not float) >= ``minimum`` -> int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def check_fraction(name: str, value) -> float:
    """A real number in (0, 1] (not bool, not a tensor) -> float; NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value <= 1):
        raise ValueError(f"{name}={value!r}: expected a number in (0, 1]")
    return float(value)


def check_softmax_scale(value) -> Optional[float]:
    """``None`` (1/sqrt(head dim)) or a finite real number > 0 -> float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"softmax_scale={value!r}: expected a finite number > 0 (or None for "
                         f"1/sqrt(head dim))")
    return float(value)


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) \
            or block_size <= 0 or (block_size & (block_size - 1)) != 0:
        raise ValueError(f"block_size={block_size!r}: expected a positive power of two (e.g. 64)")
    return int(block_size)


def check_cu_seqlens(cu_seqlens, num_tokens: int) -> List[int]:
    """Validate document boundaries; returns them as a Python list ``[0, ..., num_tokens]``.

    A 1-D integer tensor, or a sequence of integers (floats are refused, not truncated),
    starting at 0, strictly increasing (no empty document), ending at ``num_tokens``.
    A device tensor is read back to the host here: call it once per micro-batch, not per layer.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens: expected a 1-D integer tensor, got dtype "
                             f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        try:
            cu = [operator.index(x) for x in cu_seqlens]
        except TypeError:
            raise ValueError(f"cu_seqlens={cu_seqlens!r}: expected a 1-D integer tensor or a "
                             f"sequence of integers [0, end_1, ..., t]") from None
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens={cu[:8]}: expected [0, end_1, ..., t] with at least one document")
    for a, b in zip(cu[:-1], cu[1:]):
        if b <= a:
            raise ValueError(f"cu_seqlens={cu[:16]}: expected strictly increasing values "
                             f"(found {a} followed by {b})")
    if cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are {num_tokens} tokens: "
                         f"expected the last entry to equal the token count")
    return cu


def check_density(density, num_docs: int, device):
    """Scalar or per-document density in (0, 1] -> (float64 tensor ``[ndoc]``, host list).

    A Python number is checked on the host (no device round trip: the per-layer path passes
    one); a real-valued tensor is read back once to check it and to size the selection. The
    host list holds the tensor's values as they are (a float32 0.3 is 0.30000001); the kept
    count's rounding (``selection.kept_count``) absorbs that.
    """
    if isinstance(density, torch.Tensor):
        if density.is_complex() or density.dtype == torch.bool:
            raise ValueError(f"density: expected a real tensor, got dtype {density.dtype}")
        host = [float(x) for x in density.detach().reshape(-1).tolist()]
        if len(host) == 1:
            host = host * num_docs
        elif len(host) != num_docs:
            raise ValueError(f"density has {len(host)} entries: expected a scalar or one per "
                             f"document ({num_docs})")
    else:
        if isinstance(density, bool) or not isinstance(density, numbers.Real):
            raise ValueError(f"density={density!r}: expected a number in (0, 1] or a tensor")
        host = [float(density)] * num_docs
    for d in host:
        if not 0.0 < d <= 1.0:  # also catches NaN
            raise ValueError(f"density={d!r}: expected a value in (0, 1]")
    if isinstance(density, torch.Tensor):
        d = torch.tensor(host, dtype=torch.float64, device=device)
    else:
        d = torch.full((num_docs,), host[0], dtype=torch.float64, device=device)
    return d, host


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q ``[t, np, hn]``, k/v ``[t, ng, hn]``, one floating dtype and device -> (np, ng, hn)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} is a {type(x).__name__}: expected a torch.Tensor "
                             f"[t, heads, hn]")
        if x.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: expected 3 dims [t, heads, hn]")
        if x.dtype not in _QKV_DTYPES:
            raise ValueError(f"{name} dtype {x.dtype}: expected one of "
                             f"{', '.join(str(d) for d in _QKV_DTYPES)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} dtype {x.dtype} != q dtype {q.dtype}: expected q, k and v "
                             f"in one dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: expected one device")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}: expected equal")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens, k/v have {k.shape[0]}: expected equal")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim of q ({q.shape[2]}) != head dim of k/v ({k.shape[2]})")
    if q.shape[2] < 1:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected a head dim >= 1")
    num_heads, num_groups = q.shape[1], k.shape[1]
    if num_heads < 1 or num_groups < 1 or num_heads % num_groups != 0:
        raise ValueError(f"{num_heads} query heads with {num_groups} key/value heads: expected "
                         f"the query head count to be a multiple of the key/value head count")
    return num_heads, num_groups, q.shape[2]


def fixed_padded_blocks(num_tokens: int, num_blocks: int, block_size: int) -> int:
    """Padded block count that depends on the token count alone, unless the documents overflow.

    ``ceil(t / block_size)`` blocks plus a slack of a quarter of that (at least 8) for the short
    last blocks of documents, rounded up to a multiple of 8. Every micro-batch of ``t`` tokens
    with fewer than about ``slack`` documents gets the same padded length; one with more doubles
    the slack until it fits (a new shape, rare: documents averaging under 4 blocks).
    """
    base = -(-num_tokens // block_size)
    slack = max(8, -(-base // 4))
    while base + slack < num_blocks:
        slack *= 2
    return -(-(base + slack) // 8) * 8


def upload(arrays, device) -> List[torch.Tensor]:
    """Host integer sequences -> int64 tensors on ``device``, in ONE copy: on CUDA from pinned
    memory without blocking (the host does not wait for the stream), elsewhere a plain copy.
    Each tensor is a view of the one buffer, 16-byte aligned (Triton specialises its launches
    on pointer alignment). What a micro-batch's setup sends to the device goes through here."""
    device = torch.device(device)
    host = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    offsets = np.cumsum([0] + [-(-a.size // 2) * 2 for a in host])        # 2 x 8 bytes
    buf = np.zeros(int(offsets[-1]), dtype=np.int64)
    for a, o in zip(host, offsets):
        buf[o:o + a.size] = a
    dev = torch.from_numpy(buf)
    if device.type == "cuda":
        dev = dev.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        dev = dev.to(device)
    return [dev[int(o):int(o) + a.size] for a, o in zip(host, offsets)]


def doc_bounds(layout: BlockLayout):
    """``(first block, first token)`` of every document and one past the last, ``[ndoc + 1]``
    int64 on the layout's device: uploaded with the layout (none for a layout built
    elsewhere: then uploaded here, once)."""
    if "doc_bounds" not in layout.memo:
        tok = np.concatenate([[0], np.cumsum(layout.doc_lens)])
        layout.memo["doc_bounds"] = tuple(upload([layout.doc_block_start, tok],
                                                 layout.block_doc.device))
    return layout.memo["doc_bounds"]


def build_layout(cu_seqlens, num_tokens: int, block_size: int, device,
                 fixed_length: bool = False, pad_tokens: Optional[int] = None) -> BlockLayout:
    """Split every document into blocks (last one may be short) and number them globally.

    ``fixed_length``: pad to ``fixed_padded_blocks`` (the same length for every micro-batch of
    ``num_tokens`` tokens) instead of the documents' own block count; ``pad_tokens``: the token
    count that length is taken for, when larger (routing's long documents of a micro-batch are
    padded like the whole micro-batch, so the compiled kernel keeps one shape).
    """
    block_size = check_block_size(block_size)
    cu = check_cu_seqlens(cu_seqlens, num_tokens)
    doc_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    nblocks = [(n + block_size - 1) // block_size for n in doc_lens]
    starts = [0]
    for n in nblocks:
        starts.append(starts[-1] + n)
    # the one upload of the micro-batch's setup: every later table is derived on the device
    lens_t, nblk_t, starts_t, cu_t = upload([doc_lens, nblocks, starts, cu], device)
    start_t = starts_t[:-1]
    ndoc, nb = len(doc_lens), starts[-1]
    block_doc = torch.repeat_interleave(torch.arange(ndoc, device=device), nblk_t,
                                        output_size=nb)
    block_local = torch.arange(nb, device=device) - start_t[block_doc]
    block_len = torch.clamp(lens_t[block_doc] - block_local * block_size, max=block_size)
    token_slot = None
    if any(n % block_size for n in doc_lens[:-1]):
        token_doc = torch.repeat_interleave(torch.arange(ndoc, device=device), lens_t,
                                            output_size=num_tokens)
        token_slot = start_t[token_doc] * block_size + (
            torch.arange(num_tokens, device=device) - cu_t[:-1][token_doc])
    padded = fixed_padded_blocks(max(num_tokens, pad_tokens or 0), nb, block_size) \
        if fixed_length else nb
    layout = BlockLayout(block_size, doc_lens, starts, num_tokens, block_doc, block_local,
                         block_len, token_slot, padded)
    layout.memo["doc_bounds"] = (starts_t, cu_t)
    return layout

