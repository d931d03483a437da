"""Per-unit features of many micro-batches at once, computed once and reused at every density.

A *unit* is one micro-batch (a list of document lengths). ``UnitFeatures`` holds the documents of
n units in CSR form (``offsets [n + 1]``, ``lengths [total_docs]``) and the density-independent
features (tokens, selection work, dense work); attention work at any per-unit density, or on a
whole density grid, is a table lookup (``work.cumulative_work_table``) plus a segmented sum, never
a walk over blocks. This is what keeps DST's "time of unit u at density d" cheap.

Routing (``dense_below_tokens`` N > 0, the measured crossover): documents shorter than N tokens
run through the dense kernel, the others through the selection and the sparse kernel, so the
features follow the two kernels: ``attention_work`` (at the unit's density) and
``selection_work`` count the long documents only, and ``dense_work`` counts the short documents'
causal block pairs (what attention work would be at density 1), whatever the density: a unit of
short documents alone takes the same time at every density, which is how DST and SAB know it
cannot be cut. ``tokens`` and ``sequences`` count every document. N = 0 routes nothing.
``sparse_calls`` and ``dense_calls`` are 1 for a unit that makes that kernel's call (it has a
document on that path), else 0: the per-call fixed cost of each kernel.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from .. import kernels
from .work import (as_doc_lengths, block_kept, check_block_params, check_densities,
                   cumulative_work_table, num_blocks)

FEATURES = ("const", "tokens", "attention_work", "selection_work", "sequences")
# The features of a latency table's ``coefficients``. The dense kernel's cost per causal block pair
# of a routed document is a feature of its own, so that the fit has a coefficient per kernel; a
# table keeps it apart (``dense_coefficients``), so tables without routing keep their format.
DENSE_FEATURE = "dense_work"
# Per-call fixed costs: one sparse call (selection, padding, the kernels' launches) per layer for a
# unit with any document on the sparse path, one dense varlen call for a unit with any routed
# document. A table keeps them apart too (``call_coefficients``, format_version 3); a grid where
# every unit makes the same calls cannot tell them from ``const``, where they then stay.
CALL_FEATURES = ("sparse_calls", "dense_calls")
MODEL_FEATURES = FEATURES + (DENSE_FEATURE,) + CALL_FEATURES
# "sequences": the packed micro-batch's sequences (documents and padding pieces). Each costs a
# little besides its tokens (Megatron's THD rotary embedding loops over them, the kernels set up
# per document): measured on an H100 at 16K tokens, 50-58 short sequences took twice as long as
# one to four long ones at the same token count and density.
# How attention work is counted: "kept" = exact kept pairs (FlexAttention on GPU), "chunked" =
# the CPU kernel's chunks padded to their largest kept count (see work.chunked_attention_work).
WORK_MODES = ("kept", "chunked")


@dataclass
class UnitFeatures:
    """Documents of n units (CSR) and their density-independent features."""

    block_size: int
    sink_blocks: int
    local_blocks: int
    offsets: np.ndarray         # [n + 1] int64, documents of unit u: lengths[offsets[u]:offsets[u+1]]
    lengths: np.ndarray         # [total_docs] int64 tokens per document
    doc_blocks: np.ndarray      # [sparse docs] int64 blocks of every document on the sparse path
    doc_unit: np.ndarray        # [sparse docs] int64 unit of every document on the sparse path
    tokens: np.ndarray          # [n] float64
    selection_work: np.ndarray  # [n] float64 block pairs scored (NB ** 2 of the sparse path)
    sequences: np.ndarray       # [n] float64 sequences (documents) of every unit
    dense_work: np.ndarray      # [n] float64 causal block pairs of the documents routed dense
    work_mode: str = "kept"
    query_chunk_blocks: int = 16
    dense_below_tokens: int = 0   # documents shorter than this run dense (0: none)
    _blocks: tuple | None = None  # chunked mode: (block_local, block_unit, chunk_starts, chunk_unit)
    _runs: tuple | None = None    # kept mode: runs of equal documents (block count, unit, n)
    _sparse_calls: np.ndarray | None = None   # ``sparse_calls``, once (every stage asks)
    _grid: tuple | None = None    # the last ``work_grid``: (its densities, [n, g] work)

    @property
    def num_units(self) -> int:
        return self.offsets.size - 1

    def __getstate__(self) -> dict:
        """Pickled without what ``offsets`` and ``lengths`` give back cheaply (the sparse path's
        block counts and units, the chunked layout): half the bytes the planner process sends
        back with each draft. The document runs stay: rebuilding them costs more than their
        bytes."""
        state = dict(self.__dict__)
        state["doc_blocks"] = state["doc_unit"] = state["_blocks"] = None
        state["_sparse_calls"] = state["_grid"] = None
        state.pop("_terms_memo", None)      # the latency model's terms (``unit_terms``)
        state.pop("_x_stack", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        nb, doc_unit, short = _doc_blocks(self.offsets, self.lengths, self.block_size,
                                          self.dense_below_tokens)
        self.doc_blocks, self.doc_unit = nb[~short], doc_unit[~short]

    @classmethod
    def build(cls, mb_doc_lengths, block_size: int, sink_blocks: int = 1,
              local_blocks: int = 0, work_mode: str = "kept",
              query_chunk_blocks: int = 16, dense_below_tokens: int = 0) -> "UnitFeatures":
        """From a list of per-unit length arrays, or a CSR tuple ``(offsets, lengths)``;
        documents shorter than ``dense_below_tokens`` are routed dense (module docstring)."""
        check_block_params(block_size, sink_blocks, local_blocks)
        if work_mode not in WORK_MODES:
            raise ValueError(f"work_mode={work_mode!r}: expected one of {WORK_MODES}")
        if not isinstance(query_chunk_blocks, (int, np.integer)) or query_chunk_blocks < 1:
            raise ValueError(f"query_chunk_blocks={query_chunk_blocks!r}: expected an integer >= 1")
        if isinstance(dense_below_tokens, bool) or not isinstance(dense_below_tokens,
                                                                  (int, np.integer)) \
                or dense_below_tokens < 0:
            raise ValueError(f"dense_below_tokens={dense_below_tokens!r}: expected an integer "
                             f">= 0 (0: no routing)")
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
        nb, doc_unit, short = _doc_blocks(offsets, lengths, block_size, dense_below_tokens)
        tokens = np.bincount(doc_unit, weights=lengths, minlength=n).astype(np.float64)
        dense_work = np.zeros(n)
        if dense_below_tokens:
            dense_work = np.bincount(doc_unit[short], weights=nb[short] * (nb[short] + 1) / 2,
                                     minlength=n).astype(np.float64)
            nb, doc_unit = nb[~short], doc_unit[~short]
        unit_blocks = np.bincount(doc_unit, weights=nb, minlength=n).astype(np.float64)
        return cls(block_size, sink_blocks, local_blocks, offsets, lengths, nb, doc_unit,
                   tokens, unit_blocks * unit_blocks, np.diff(offsets).astype(np.float64),
                   dense_work, work_mode, int(query_chunk_blocks), int(dense_below_tokens))

    @property
    def sparse_calls(self) -> np.ndarray:
        """[n] 1.0 where the unit has a document on the sparse path (one sparse call), else 0
        (computed once: every stage's terms read it)."""
        if self._sparse_calls is None:
            self._sparse_calls = (np.bincount(self.doc_unit, minlength=self.num_units)
                                  > 0).astype(np.float64)
        return self._sparse_calls

    @property
    def dense_calls(self) -> np.ndarray:
        """[n] 1.0 where the unit has a routed document (one dense varlen call), else 0."""
        return (self.dense_work > 0).astype(np.float64)

    def _block_arrays(self):
        """Density-independent block layout for the chunked count, built once."""
        if self._blocks is None:
            nb = self.doc_blocks
            total = int(nb.sum())
            doc_start = np.cumsum(nb) - nb                          # first block of each doc
            block_doc = np.repeat(np.arange(nb.size), nb)
            block_local = np.arange(total) - doc_start[block_doc]
            block_unit = self.doc_unit[block_doc]
            unit_start = np.zeros(self.num_units + 1, dtype=np.int64)
            np.cumsum(np.bincount(self.doc_unit, weights=nb, minlength=self.num_units)
                      .astype(np.int64), out=unit_start[1:])
            pos = np.arange(total) - unit_start[block_unit]         # block index in its unit
            new_chunk = np.ones(total, dtype=bool)
            new_chunk[1:] = (block_unit[1:] != block_unit[:-1]) | (
                pos[1:] // self.query_chunk_blocks != pos[:-1] // self.query_chunk_blocks)
            starts = np.flatnonzero(new_chunk)
            sizes = np.diff(np.r_[starts, total]).astype(np.float64)
            self._blocks = (block_local, block_unit, starts, sizes, block_unit[starts])
        return self._blocks

    def _chunked_work(self, d_unit: np.ndarray) -> np.ndarray:
        block_local, block_unit, starts, sizes, chunk_unit = self._block_arrays()
        k = block_kept(block_local, d_unit[block_unit], self.sink_blocks, self.local_blocks)
        kmax = np.maximum.reduceat(k, starts) if k.size else np.zeros(0)
        return np.bincount(chunk_unit, weights=kmax * sizes, minlength=self.num_units)

    def _max_blocks(self) -> int:
        return int(self.doc_blocks.max()) if self.doc_blocks.size else 0

    def attention_work(self, densities) -> np.ndarray:
        """[n] kept block pairs of every unit at its own density (scalar or [n])."""
        d = check_densities(densities)
        n = self.num_units
        d = np.broadcast_to(d, (n,)) if d.ndim == 0 else d.reshape(-1)
        if d.size != n:
            raise ValueError(f"densities has {d.size} entries: expected 1 or one per unit ({n})")
        if self.doc_blocks.size == 0:
            return np.zeros(n)
        if self._grid is not None:          # every density on the last work grid: look up
            grid, table = self._grid        # (integer pair counts: the same numbers)
            idx = np.minimum(np.searchsorted(grid, d), grid.size - 1)
            if np.array_equal(grid[idx], d):
                return table[np.arange(n), idx]
        if self.work_mode == "chunked":
            return self._chunked_work(d)
        uniq, inv = np.unique(d, return_inverse=True)
        table = cumulative_work_table(uniq, self._max_blocks(), self.sink_blocks,
                                      self.local_blocks)          # [U, N + 1]
        blocks, unit, count = self._doc_runs()
        return np.bincount(unit, weights=table[inv[unit], blocks] * count, minlength=n)

    def work_grid(self, density_grid) -> np.ndarray:
        """[n, g] kept block pairs of every unit at every density of the grid (kept for
        ``attention_work`` at densities on the grid: DST's plans are)."""
        grid = check_densities(density_grid).reshape(-1)
        out = self._work_grid(grid)
        if grid.size and np.all(np.diff(grid) >= 0):        # searchable
            out.flags.writeable = False
            self._grid = (grid.copy(), out)
        return out

    def _work_grid(self, grid: np.ndarray) -> np.ndarray:
        n = self.num_units
        if self.doc_blocks.size == 0:
            return np.zeros((n, grid.size))
        if self.work_mode == "chunked":
            return np.stack([self._chunked_work(np.full(n, d)) for d in grid], axis=1)
        return self.kept_grid(grid)

    def kept_grid(self, grid: np.ndarray) -> np.ndarray:
        """[n, g] kept block pairs of every unit at every density of the ascending ``grid`` by
        the selection's rule (``work.py``), whatever ``work_mode`` prices: what the attention
        keeps, non-decreasing along the grid in every query block (DST's
        ``UnitCosts.kept_grid``: two densities of a unit keep the same blocks where they keep
        as many)."""
        n = self.num_units
        grid = np.asarray(grid, dtype=np.float64)
        if self.doc_blocks.size == 0:
            return np.zeros((n, grid.size))
        table = cumulative_work_table(grid, self._max_blocks(), self.sink_blocks,
                                      self.local_blocks)          # [g, N + 1]
        # A document's work depends only on its block count, and a packed micro-batch's padding
        # is many equal pieces in a row: one gather per run of equal documents, summed per unit
        # (runs are in unit order). Exact: integer pair counts, so the sums do not depend on
        # their order, and a run's row of the transposed table is one contiguous gather.
        blocks, unit, count = self._doc_runs()
        out = np.zeros((n, grid.size))
        kernels.features.run_sums(np.ascontiguousarray(table.T), blocks, unit, count, out)
        return out

    def _doc_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs of consecutive documents of one unit with the same block count: (block count,
        unit, documents) per run, in unit order (CSR order)."""
        if self._runs is None:
            nb, unit = self.doc_blocks, self.doc_unit
            new = np.ones(nb.size, dtype=bool)
            new[1:] = (nb[1:] != nb[:-1]) | (unit[1:] != unit[:-1])
            start = np.flatnonzero(new)
            count = np.diff(np.append(start, nb.size)).astype(np.float64)
            self._runs = (nb[start], unit[start], count)
        return self._runs

    def matrix(self, densities, features=FEATURES) -> np.ndarray:
        """[n, len(features)] design matrix of the named features (default ``FEATURES``; the
        latency model fits ``MODEL_FEATURES``, dense work and the calls included)."""
        cols = {"const": lambda: np.ones(self.num_units), "tokens": lambda: self.tokens,
                "attention_work": lambda: self.attention_work(densities),
                "selection_work": lambda: self.selection_work,
                "sequences": lambda: self.sequences, DENSE_FEATURE: lambda: self.dense_work,
                "sparse_calls": lambda: self.sparse_calls,
                "dense_calls": lambda: self.dense_calls}
        return np.stack([cols[name]() for name in features], axis=1)


def _doc_blocks(offsets: np.ndarray, lengths: np.ndarray, block_size: int,
                dense_below_tokens: int) -> tuple:
    """(blocks, unit, routed dense) of every document of a CSR (``UnitFeatures.build`` and
    unpickling both read the sparse path's documents from it)."""
    doc_unit = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    short = lengths < dense_below_tokens if dense_below_tokens else \
        np.zeros(lengths.size, dtype=bool)
    return num_blocks(lengths, block_size), doc_unit, short


def features_of(mb_doc_lengths: Union["UnitFeatures", Sequence, tuple], block_size: int,
                sink_blocks: int, local_blocks: int, work_mode: str = "kept",
                query_chunk_blocks: int = 16, dense_below_tokens: int = 0) -> UnitFeatures:
    """Reuse a ``UnitFeatures`` whose block and routing parameters match, else build one."""
    want = (block_size, sink_blocks, local_blocks, work_mode, query_chunk_blocks,
            dense_below_tokens)
    if isinstance(mb_doc_lengths, UnitFeatures):
        f = mb_doc_lengths
        have = (f.block_size, f.sink_blocks, f.local_blocks, f.work_mode, f.query_chunk_blocks,
                f.dense_below_tokens)
        if have != want:
            raise ValueError(
                f"UnitFeatures built with (block_size, sink_blocks, local_blocks, work_mode, "
                f"query_chunk_blocks, dense_below_tokens)={have}: expected {want} (the latency "
                f"model's)")
        return f
    return UnitFeatures.build(mb_doc_lengths, *want)


def unit_rows(units, lo: int, hi: int, n: int) -> tuple:
    """Units ``lo:hi`` of ``n`` (a ``UnitFeatures``, an (offsets, lengths) CSR or a list of length
    arrays) as a CSR of their own."""
    if isinstance(units, tuple) and len(units) == 2 and np.ndim(units[0]) == 1 \
            and len(units[0]) == n + 1:
        offsets, lengths = units
    elif isinstance(units, UnitFeatures):
        offsets, lengths = units.offsets, units.lengths
    else:
        return (np.r_[0, np.cumsum([len(x) for x in units[lo:hi]])].astype(np.int64),
                np.concatenate([np.asarray(x, dtype=np.int64) for x in units[lo:hi]]))
    if len(offsets) != n + 1:
        raise ValueError(f"{len(offsets) - 1} micro-batches given: expected {n}")
    offsets = np.asarray(offsets, dtype=np.int64)
    return offsets[lo:hi + 1] - offsets[lo], np.asarray(lengths)[offsets[lo]:offsets[hi]]
