"""Dense where dense wins: a micro-batch's short documents through one dense varlen call, the long
ones through the block-sparse path (``api.block_sparse_attention(dense_below_tokens=N)``).

A sparse kernel call has a cost that does not shrink with the density (on an H100 flex costs
about 3 ms per call at 8K tokens at any density, dense cuDNN 1.2 ms), and most documents of a
packed micro-batch of real text are short. So documents shorter than ``N`` tokens (the measured
crossover, ``megatron/launch/crossover.py``) are packed together and run through
``dense.dense_varlen_attention`` in one call; the others are packed together and run through the
layout, the block selection and the sparse kernel, which therefore see only long documents.

What depends only on the documents is a ``Route``, built once per micro-batch from
``cu_seqlens`` on the host (the one host read) and kept in the per-micro-batch ``cache`` like the
block layout; the later layers reuse its index tensors and read nothing from the device. Tokens
move by ``index_select`` (gather) and ``cat`` + ``index_select`` (scatter back), both
differentiable. Statistics stay per document for ALL documents in ``cu_seqlens`` order: a dense
document reports kept density 1.0 and recall 1.0 (``RoutedSelection``).
Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch

from .blocks import check_cu_seqlens, check_density, upload
from .dense import PackedDocs, dense_varlen_attention
from .selection import BlockSelection


@dataclass
class Route:
    """Which documents of a micro-batch run dense, and the index tensors that move their tokens.

    ``perm`` ``[t]``: the long documents' tokens (in order), then the short ones'; ``inverse`` its
    inverse. ``sparse_docs`` ``[n_long]`` (device) the long documents' indices in ``cu_seqlens``.
    ``sparse_cache``: the per-micro-batch cache of the sparse call over the long documents.
    """

    bounds: List[int]               # cu_seqlens on the host
    dense_docs: List[int]           # documents shorter than the threshold
    sparse_bounds: List[int]        # cu_seqlens of the long documents packed together
    dense: Optional[PackedDocs]     # the short documents packed together (None: there are none)
    perm: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    sparse_docs: Optional[torch.Tensor]
    ones: torch.Tensor              # [ndoc] float32 ones: statistics of dense documents
    sparse_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_docs(self) -> int:
        return len(self.bounds) - 1

    @property
    def sparse_tokens(self) -> int:
        return self.sparse_bounds[-1]


@dataclass
class RoutedSelection:
    """Per-document statistics of a micro-batch some of whose documents ran dense.

    ``density_kept`` / ``recall``: ``[ndoc]`` float32 in ``cu_seqlens`` order, 1.0 for a dense
    document (it keeps every causal block); ``sparse``: the ``BlockSelection`` of the long
    documents over their own layout (None when every document ran dense); ``dense_docs``: the
    indices of the documents that ran dense.
    """

    density_kept: torch.Tensor
    recall: torch.Tensor
    sparse: Optional[BlockSelection]
    dense_docs: tuple


def build_route(cu_seqlens, num_tokens: int, dense_below_tokens: int, device) -> Route:
    """Split the documents at ``dense_below_tokens`` (reads ``cu_seqlens`` on the host)."""
    cu = check_cu_seqlens(cu_seqlens, num_tokens)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    short = [i for i, n in enumerate(lens) if n < dense_below_tokens]
    long = [i for i, n in enumerate(lens) if n >= dense_below_tokens]
    ones = torch.ones(len(lens), dtype=torch.float32, device=device)

    def packed(docs):
        out = [0]
        for i in docs:
            out.append(out[-1] + lens[i])
        return out

    sparse_bounds = packed(long)
    dense = PackedDocs(packed(short), torch.device(device)) if short else None
    perm = inverse = sparse_docs = None
    if short and long:
        perm_h = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in long + short])
        inverse_h = np.empty_like(perm_h)
        inverse_h[perm_h] = np.arange(num_tokens)
        perm, inverse, sparse_docs = upload([perm_h, inverse_h, long], device)   # one copy
    return Route(cu, short, sparse_bounds, dense, perm, inverse, sparse_docs, ones)


def route_of(cache: Optional[dict], cu_seqlens, num_tokens: int, dense_below_tokens: int,
             device) -> Route:
    """The micro-batch's ``Route``: built on the first call, then taken from ``cache``."""
    key = ("route", num_tokens, dense_below_tokens, str(device))
    if cache is not None and key in cache:
        return cache[key]
    route = build_route(cu_seqlens, num_tokens, dense_below_tokens, device)
    if cache is not None:
        cache[key] = route
    return route


def attend_routed(q, k, v, route: Route, density, softmax_scale: float, dense_kernel: str,
                  sparse: Callable):
    """Routed attention of a micro-batch with at least one short document.

    ``sparse(q, k, v, cu_host, density, cache) -> (out, BlockSelection)`` runs the block-sparse
    path on the long documents packed together. Returns ``(out [t, np, hn], RoutedSelection)``.
    """
    # every entry checked, the dense documents' too, with the sparse path's messages (on the
    # host: a number costs nothing, a tensor one read, as on the sparse path)
    check_density(density, route.num_docs, "cpu")
    if not route.sparse_bounds[-1]:                   # every document is short: no sparse call
        out = dense_varlen_attention(q, k, v, route.dense, softmax_scale, kernel=dense_kernel)
        return out, RoutedSelection(route.ones, route.ones, None, tuple(route.dense_docs))
    if isinstance(density, torch.Tensor) and density.numel() > 1:
        density = density.reshape(-1).index_select(0, route.sparse_docs.to(density.device))
    ts = route.sparse_tokens
    q, k, v = (x.index_select(0, route.perm) for x in (q, k, v))
    out_s, sel = sparse(q[:ts], k[:ts], v[:ts], route.sparse_bounds, density,
                        route.sparse_cache)
    out_d = dense_varlen_attention(q[ts:], k[ts:], v[ts:], route.dense, softmax_scale,
                                   kernel=dense_kernel)
    out = torch.cat([out_s, out_d]).index_select(0, route.inverse)
    kept, recall = (route.ones.index_copy(0, route.sparse_docs, x.float())
                    for x in (sel.density_kept, sel.recall))
    return out, RoutedSelection(kept, recall, sel, tuple(route.dense_docs))
