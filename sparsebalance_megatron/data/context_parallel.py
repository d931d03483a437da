"""Token orders of context parallelism (CP) over packed THD micro-batches: pure index arithmetic.

Megatron splits a packed micro-batch for CP per document with load-balanced ("zigzag") chunks, as
transformer-engine's ``thd_get_partitioned_indices`` does (megatron/core/utils.py,
``_get_batch_on_this_cp_rank_per_document_balancing``): every sequence of ``cu_seqlens_padded``
(its length a multiple of ``2 * cp_size``) is cut into ``2 * cp_size`` equal chunks and CP rank
``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence, sequence after sequence.
Megatron's THD RoPE assumes exactly this order. So that every sequence has such a length, the
data path pads each document (after its EOD) to a multiple of ``pad_multiple`` positions.

- ``padded_length``: a length rounded up to the multiple;
- ``zigzag_positions``: the micro-batch positions CP rank ``r`` holds, in its local order;
- ``gather_index``: after an all-to-all that gathers every rank's tokens (rank 0's first), where
  each real token of the micro-batch lies, in natural order (documents whole, padding left out).

Arrays in, arrays out; must not depend on torch or megatron.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def padded_length(n, multiple: int):
    """``n`` rounded up to a multiple of ``multiple`` (ints or integer arrays)."""
    m = int(multiple)
    if m < 1:
        raise ValueError(f"multiple={multiple!r}: expected an integer >= 1")
    if isinstance(n, np.ndarray):
        return (n + m - 1) // m * m
    return (int(n) + m - 1) // m * m


def _lengths(cu_seqlens: Sequence[int]) -> np.ndarray:
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens {cu.tolist()[:8]}...: expected 0 followed by "
                         f"non-decreasing offsets")
    return np.diff(cu)


def zigzag_positions(cu_seqlens_padded: Sequence[int], cp_size: int, cp_rank: int) -> np.ndarray:
    """[T / cp_size] int64: the positions of the micro-batch that CP rank ``cp_rank`` holds, in its
    local order (per sequence: chunk ``cp_rank``, then chunk ``2 * cp_size - 1 - cp_rank``)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank}: expected 0 <= cp_rank < cp_size={cp_size}")
    lengths = _lengths(cu_seqlens_padded)
    bad = np.flatnonzero(lengths % (2 * cp_size))
    if bad.size:
        raise ValueError(f"sequence {int(bad[0])} has {int(lengths[bad[0]])} tokens: with "
                         f"context parallelism every sequence must hold a multiple of "
                         f"2 x cp_size = {2 * cp_size} tokens (pad it)")
    starts = np.asarray(cu_seqlens_padded, dtype=np.int64).reshape(-1)[:-1]
    chunk = lengths // (2 * cp_size)
    out = []
    for s, c in zip(starts.tolist(), chunk.tolist()):
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(np.arange(s + k * c, s + (k + 1) * c, dtype=np.int64))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def gather_index(cu_seqlens_real: Sequence[int], cu_seqlens_padded: Sequence[int],
                 cp_size: int) -> np.ndarray:
    """[T_real] int64: for every real token of the micro-batch in natural order (sequence ``i``'s
    first ``len_real[i]`` positions; its padding left out), its row in the tensor that gathers
    every CP rank's local tokens in rank order (``zigzag_positions`` of rank 0, then 1, ...).
    With ``cp_size == 1`` these are the real tokens' positions in the micro-batch."""
    real, padded = _lengths(cu_seqlens_real), _lengths(cu_seqlens_padded)
    if real.shape != padded.shape or np.any(real > padded):
        raise ValueError(f"cu_seqlens {np.asarray(cu_seqlens_real).tolist()[:8]}... and "
                         f"cu_seqlens_padded {np.asarray(cu_seqlens_padded).tolist()[:8]}...: "
                         f"expected as many sequences, none longer than its padded length")
    total = int(padded.sum())
    order = np.concatenate([zigzag_positions(cu_seqlens_padded, cp_size, r)
                            for r in range(cp_size)]) if cp_size > 1 \
        else np.arange(total, dtype=np.int64)
    row_of = np.empty(total, dtype=np.int64)
    row_of[order] = np.arange(total, dtype=np.int64)               # position -> gathered row
    starts = np.asarray(cu_seqlens_padded, dtype=np.int64).reshape(-1)[:-1]
    keep = np.concatenate([np.arange(s, s + n, dtype=np.int64)
                           for s, n in zip(starts.tolist(), real.tolist())]) \
        if real.size else np.zeros(0, dtype=np.int64)
    return row_of[keep]
