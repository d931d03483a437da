"""Budgeted block-sparse attention: block selection under a density budget and its kernels, and
the dense varlen attention that short documents are routed to.

Pure torch (FlexAttention imported lazily on CUDA only); must not import megatron or
torch.distributed. Entry points: ``block_sparse_attention``, ``dense_varlen_attention``.
"""

from .api import BACKENDS, block_sparse_attention, resolve_backend
from .blocks import BlockLayout, build_layout
from .dense import DENSE_KERNELS, dense_varlen_attention
from .routing import RoutedSelection
from .selection import ESTIMATORS, BlockSelection, estimate_block_shares, select_from_shares

__all__ = ["block_sparse_attention", "resolve_backend", "BACKENDS", "BlockLayout",
           "build_layout", "BlockSelection", "ESTIMATORS", "estimate_block_shares",
           "select_from_shares", "DENSE_KERNELS", "dense_varlen_attention", "RoutedSelection"]
