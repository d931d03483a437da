"""Read a Megatron indexed data set (``PREFIX.bin`` + ``PREFIX.idx``) as whole documents.

The one place where the data pipeline touches megatron: the index is parsed by
``megatron.core.datasets.indexed_dataset.IndexedDataset`` (so the on-disk format is Megatron's
own), the token file is memory-mapped. A document is the contiguous run of its sequences
(``document_indices``), so access stays O(1) and nothing is copied.
Must not depend on torch.distributed; pure data code imports this module lazily.
"""

from __future__ import annotations

import os
import struct

import numpy as np


def read_indexed_documents(path_prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(flat, starts, lengths)``: the memory-mapped ``[n_tokens]`` token array of ``.bin`` and,
    per document, its first token's index into ``flat`` and its length in tokens (int64 each).

    Raises ``ValueError`` naming the prefix when megatron cannot read the index.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(path_prefix, multimodal=False, mmap=True)
    except (AssertionError, OSError, ValueError, struct.error) as e:
        raise ValueError(f"--data-path {path_prefix!r}: not a readable Megatron indexed data set "
                         f"(PREFIX.bin + PREFIX.idx): {type(e).__name__}: {e}") from e
    index = ds.index
    dtype = np.dtype(index.dtype)
    seq_lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)          # [n_seq]
    seq_pointers = np.asarray(index.sequence_pointers, dtype=np.int64)     # [n_seq] bytes
    doc_index = np.asarray(ds.document_indices, dtype=np.int64)           # [n_docs + 1]
    bin_path = path_prefix + ".bin"
    flat = np.memmap(bin_path, dtype=dtype, mode="r") if os.path.getsize(bin_path) else np.zeros(0, dtype)

    first_seq, end_seq = doc_index[:-1], doc_index[1:]
    nonempty = end_seq > first_seq
    first_seq, end_seq = first_seq[nonempty], end_seq[nonempty]
    cum = np.concatenate([[0], np.cumsum(seq_lengths)])
    lengths = cum[end_seq] - cum[first_seq]
    starts = seq_pointers[first_seq] // dtype.itemsize
    if lengths.size and int((starts + lengths).max()) > flat.size:
        raise ValueError(f"--data-path {path_prefix!r}: the index points past the end of "
                         f"{bin_path} ({flat.size} tokens); the .bin and .idx do not match")
    return flat, starts.astype(np.int64), lengths.astype(np.int64)

