"""Read a Megatron indexed data set (``PREFIX.bin`` + ``PREFIX.idx``) as whole documents.

The format is Megatron's (``megatron/core/datasets/indexed_dataset.py``, written by its
``IndexedDatasetBuilder`` and ``tools/preprocess_data.py``): the ``.idx`` holds a 9-byte header
``MMIDIDX\\x00\\x00``, the version (little-endian uint64, 1), the token dtype's code (uint8), the
sequence and document counts (uint64 each), then ``sequence_lengths`` (int32 [n_seq]),
``sequence_pointers`` (int64 [n_seq], byte offsets into the ``.bin``) and ``document_indices``
(int64 [n_docs + 1], the first sequence of each document). It is parsed here with numpy alone, so
the data pipeline reads a user's data set without importing megatron; the tests write data sets
with Megatron's own builder and read them back through this module. A document is the contiguous
run of its sequences, the token file is memory-mapped: access stays O(1) and nothing is copied.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import os
import struct

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
"""Megatron's ``DType`` codes of the token file's element type."""


def _bad(prefix: str, why: str) -> ValueError:
    return ValueError(f"--data-path {prefix!r}: not a readable Megatron indexed data set "
                      f"(PREFIX.bin + PREFIX.idx): {why}")


def read_indexed_documents(path_prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(flat, starts, lengths)``: the memory-mapped ``[n_tokens]`` token array of ``.bin`` and,
    per document, its first token's index into ``flat`` and its length in tokens (int64 each).

    Raises ``ValueError`` naming the prefix when the index cannot be read or does not match the
    token file."""
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    with open(idx_path, "rb") as f:
        head = f.read(len(HEADER) + 8 + 1 + 8 + 8)
    if len(head) < len(HEADER) + 25 or head[:len(HEADER)] != HEADER:
        raise _bad(path_prefix, f"{idx_path} does not start with Megatron's index header")
    version, code, n_seq, n_docs = struct.unpack_from("<QBQQ", head, len(HEADER))
    if version != VERSION:
        raise _bad(path_prefix, f"index version {version}, expected {VERSION}")
    if code not in DTYPES:
        raise _bad(path_prefix, f"token dtype code {code}, expected one of {sorted(DTYPES)}")
    offset = len(head)
    need = offset + 4 * n_seq + 8 * n_seq + 8 * n_docs
    if os.path.getsize(idx_path) < need:
        raise _bad(path_prefix, f"{idx_path} holds {os.path.getsize(idx_path)} bytes, its counts "
                                f"({n_seq} sequences, {n_docs - 1 if n_docs else 0} documents) "
                                f"need {need}")
    index = np.memmap(idx_path, dtype=np.uint8, mode="r")
    seq_lengths = np.frombuffer(index, np.int32, n_seq, offset).astype(np.int64)      # [n_seq]
    offset += seq_lengths.size * 4
    seq_pointers = np.frombuffer(index, np.int64, n_seq, offset)                       # [n_seq]
    offset += seq_pointers.size * 8
    doc_index = np.frombuffer(index, np.int64, n_docs, offset)                         # [n_docs+1]
    dtype = np.dtype(DTYPES[code])
    flat = (np.memmap(bin_path, dtype=dtype, mode="r") if os.path.getsize(bin_path)
            else np.zeros(0, dtype))
    if doc_index.size < 1 or doc_index.min(initial=0) < 0 or doc_index.max(initial=0) > n_seq \
            or np.any(np.diff(doc_index) < 0):
        raise _bad(path_prefix, "its document index is not an increasing list of sequences")

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


__all__ = ["read_indexed_documents"]
