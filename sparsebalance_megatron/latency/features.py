"""Per-unit features of many micro-batches at once, computed once and reused at every density.

A *unit* is one micro-batch (a list of document lengths). ``UnitFeatures`` holds the documents of
n units in CSR form (``offsets [n + 1]``, ``lengths [total_docs]``) and the density-independent
features (tokens, selection work); attention work at any per-unit density, or on a whole density
grid, is a table lookup (``work.cumulative_work_table``) plus a segmented sum, never a walk over
blocks. This is what keeps DST's "time of unit u at density d" cheap.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from .work import (as_doc_lengths, check_block_params, check_densities, cumulative_work_table,
                   num_blocks)

FEATURES = ("const", "tokens", "attention_work", "selection_work")


@dataclass
class UnitFeatures:
    """Documents of n units (CSR) and their density-independent features."""

    block_size: int
    sink_blocks: int
    local_blocks: int
    offsets: np.ndarray         # [n + 1] int64, documents of unit u: lengths[offsets[u]:offsets[u+1]]
    lengths: np.ndarray         # [total_docs] int64 tokens per document
    doc_blocks: np.ndarray      # [total_docs] int64 blocks per document
    doc_unit: np.ndarray        # [total_docs] int64 unit of every document
    tokens: np.ndarray          # [n] float64
    selection_work: np.ndarray  # [n] float64 key blocks scored

    @property
    def num_units(self) -> int:
        return self.offsets.size - 1

    @classmethod
    def build(cls, mb_doc_lengths, block_size: int, sink_blocks: int = 1,
              local_blocks: int = 0) -> "UnitFeatures":
        """From a list of per-unit length arrays, or a CSR tuple ``(offsets, lengths)``."""
        check_block_params(block_size, sink_blocks, local_blocks)
        if isinstance(mb_doc_lengths, tuple) and len(mb_doc_lengths) == 2 \
                and np.ndim(mb_doc_lengths[0]) == 1 and np.ndim(mb_doc_lengths[1]) == 1 \
                and len(mb_doc_lengths[0]) >= 1 and int(np.asarray(mb_doc_lengths[0])[0]) == 0 \
                and int(np.asarray(mb_doc_lengths[0])[-1]) == len(mb_doc_lengths[1]):
            offsets = np.asarray(mb_doc_lengths[0], dtype=np.int64)
            lengths = as_doc_lengths(mb_doc_lengths[1], "CSR lengths")
            if np.any(np.diff(offsets) < 0):
                raise ValueError(f"CSR offsets {offsets[:8].tolist()}...: expected non-decreasing")
        else:
            parts = [np.asarray(x) for x in mb_doc_lengths]
            for i, x in enumerate(parts):
                if x.ndim != 1:
                    raise ValueError(f"mb_doc_lengths[{i}] has shape {x.shape}: expected a 1-D "
                                     f"list of token counts")
            counts = np.fromiter((x.size for x in parts), dtype=np.int64, count=len(parts))
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            lengths = as_doc_lengths(np.concatenate(parts) if parts else np.zeros(0, np.int64),
                                     "mb_doc_lengths (all units)")
        n = offsets.size - 1
        doc_unit = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
        nb = num_blocks(lengths, block_size)
        tokens = np.bincount(doc_unit, weights=lengths, minlength=n).astype(np.float64)
        nbf = nb.astype(np.float64)
        sel = np.bincount(doc_unit, weights=nbf * (nbf + 1) / 2, minlength=n)
        return cls(block_size, sink_blocks, local_blocks, offsets, lengths, nb, doc_unit,
                   tokens, sel.astype(np.float64))

    def _max_blocks(self) -> int:
        return int(self.doc_blocks.max()) if self.doc_blocks.size else 0

    def attention_work(self, densities) -> np.ndarray:
        """[n] kept block pairs of every unit at its own density (scalar or [n])."""
        d = check_densities(densities)
        n = self.num_units
        d = np.broadcast_to(d, (n,)) if d.ndim == 0 else d.reshape(-1)
        if d.size != n:
            raise ValueError(f"densities has {d.size} entries: expected 1 or one per unit ({n})")
        if self.lengths.size == 0:
            return np.zeros(n)
        uniq, inv = np.unique(d, return_inverse=True)
        table = cumulative_work_table(uniq, self._max_blocks(), self.sink_blocks,
                                      self.local_blocks)          # [U, N + 1]
        per_doc = table[inv[self.doc_unit], self.doc_blocks]
        return np.bincount(self.doc_unit, weights=per_doc, minlength=n)

    def work_grid(self, density_grid) -> np.ndarray:
        """[n, g] kept block pairs of every unit at every density of the grid."""
        grid = check_densities(density_grid).reshape(-1)
        n = self.num_units
        if self.lengths.size == 0:
            return np.zeros((n, grid.size))
        table = cumulative_work_table(grid, self._max_blocks(), self.sink_blocks,
                                      self.local_blocks)          # [g, N + 1]
        per_doc = table[:, self.doc_blocks]                        # [g, total_docs]
        # segmented sum via cumulative sums (the documents of a unit are contiguous in CSR)
        csum = np.zeros((grid.size, per_doc.shape[1] + 1))
        np.cumsum(per_doc, axis=1, out=csum[:, 1:])
        out = csum[:, self.offsets[1:]] - csum[:, self.offsets[:-1]]
        return out.T.copy()

    def matrix(self, densities) -> np.ndarray:
        """[n, 4] design matrix in the order of ``FEATURES``."""
        return np.stack([np.ones(self.num_units), self.tokens, self.attention_work(densities),
                         self.selection_work], axis=1)


def features_of(mb_doc_lengths: Union["UnitFeatures", Sequence, tuple], block_size: int,
                sink_blocks: int, local_blocks: int) -> UnitFeatures:
    """Reuse a ``UnitFeatures`` whose block parameters match, else build one."""
    if isinstance(mb_doc_lengths, UnitFeatures):
        f = mb_doc_lengths
        if (f.block_size, f.sink_blocks, f.local_blocks) != (block_size, sink_blocks, local_blocks):
            raise ValueError(
                f"UnitFeatures built with block_size={f.block_size}, sink_blocks={f.sink_blocks}, "
                f"local_blocks={f.local_blocks}: expected {block_size}, {sink_blocks}, "
                f"{local_blocks} (the latency model's)")
        return f
    return UnitFeatures.build(mb_doc_lengths, block_size, sink_blocks, local_blocks)
