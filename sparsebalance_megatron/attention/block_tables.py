"""Where every block's tokens are, as the Triton kernels read them: ``[NB]`` int32 tables.

``block_tables(layout, padded)`` -> ``(block_len, block_start)``: real tokens of every block and
the row of its first token, in the padded token space (``i * B``, ``layout.pad``) or in the
micro-batch's own tokens (a document's blocks follow each other from its first token; its last
block may be short). Built once per micro-batch (memoised on the layout) and read by
``sparse_triton``, ``sparse_triton_select`` and ``maxkey_triton``, so a kernel can mask a
block's real length instead of reading a padded copy; derived on the device from the tables
the layout uploaded (no host data sent). Imports only ``blocks``.
Pure torch; must not import megatron.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .blocks import doc_bounds


def block_tables(layout, padded: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(block_len, block_start)`` ``[NB]`` int32 of ``layout`` (module docstring)."""
    key = ("triton_blocks", padded)
    if key not in layout.memo:
        bs, dev = layout.block_size, layout.block_doc.device
        if padded:
            start = torch.arange(layout.num_blocks, dtype=torch.int32, device=dev) * bs
        else:
            first = doc_bounds(layout)[1][:-1]                  # each document's first token
            start = (first[layout.block_doc] + layout.block_local * bs).to(torch.int32)
        layout.memo[key] = (layout.block_len.to(torch.int32), start)
    return layout.memo[key]


__all__ = ["block_tables"]
