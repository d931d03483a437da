"""Megatron indexed data set (PREFIX.bin + PREFIX.idx) read back through load_corpus."""

import numpy as np
import pytest

pytest.importorskip("megatron.core.datasets.indexed_dataset")
torch = pytest.importorskip("torch")

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

from sparsebalance_megatron.data import (DataError, GlobalBatchSampler, load_corpus,  # noqa: E402
                                         materialize, sequential_pack)

EOD = 256   # the byte tokenizer's EOD


def write_indexed(prefix, docs, dtype=np.int32, sentences=False):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        if sentences:   # a document of several sequences, as preprocess_data.py --split-sentences
            half = len(doc) // 2
            builder.add_item(torch.tensor(doc[:half]))
            builder.add_item(torch.tensor(doc[half:]))
            builder.end_document()
        else:
            builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(prefix + ".idx")


def make_docs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in (40, 3, 300, 17, 1000)]


@pytest.mark.parametrize("sentences", [False, True])
def test_indexed_round_trip(tmp_path, sentences):
    docs = make_docs()
    # preprocess_data.py --append-eod leaves an EOD at the end of each document: it is stripped,
    # packing appends its own.
    docs[0] = docs[0] + [EOD]
    prefix = str(tmp_path / "data_text_document")
    write_indexed(prefix, docs, sentences=sentences)
    c = load_corpus(prefix, tokenizer="byte", cache_dir=str(tmp_path / "cache"), min_doc_tokens=4)
    kept = [d for d in docs if len(d) >= 4]
    kept[0] = kept[0][:-1]
    assert len(c) == len(kept) == 4
    for i, d in enumerate(kept):
        assert c.tokens(i).tolist() == d
    assert c.eod_id == EOD and c.vocab_size >= 257
    # ".bin" given instead of the prefix works too.
    assert len(load_corpus(prefix + ".bin", tokenizer="byte", min_doc_tokens=4,
                           cache_dir=str(tmp_path / "cache"))) == 4
    s = GlobalBatchSampler(c.lengths, capacity=128, dp=2, num_microbatches=2, seed=0)
    for rank in sequential_pack(s.next_global_batch(), capacity=128, dp=2, num_microbatches=2):
        for segs in rank:
            mb = materialize(segs, c, 128)
            assert mb.tokens.shape == (128,) and mb.cu_seqlens[-1] == 128


def test_indexed_compact_vocab_and_errors(tmp_path):
    prefix = str(tmp_path / "d")
    docs = [[5, 9, 5, 200] * 5, [9, 9, 7] * 6]
    write_indexed(prefix, docs, dtype=np.uint16)
    c = load_corpus(prefix, tokenizer="byte", compact_vocab=True, cache_dir=str(tmp_path))
    assert c.eod_id == 4 and c.tokens(0).tolist() == [0, 2, 0, 3] * 5
    assert c.id_map[c.tokens(1)].tolist() == docs[1] and c.id_map[c.eod_id] == EOD
    (tmp_path / "d.idx").unlink()
    with pytest.raises(DataError, match=r"d\.idx is missing"):
        load_corpus(prefix, tokenizer="byte", cache_dir=str(tmp_path))
    (tmp_path / "d.idx").write_bytes(b"garbage, not an index")
    with pytest.raises(ValueError, match="not a readable Megatron indexed data set"):
        load_corpus(prefix, tokenizer="byte", cache_dir=str(tmp_path))


def test_indexed_bad_headers_are_named(tmp_path):
    """The reader is numpy alone: each way an index can be wrong is named with the prefix."""
    import struct
    from sparsebalance_megatron.data.indexed import HEADER, read_indexed_documents
    prefix = str(tmp_path / "d")
    write_indexed(prefix, [[1, 2, 3] * 4, [4, 5] * 7])
    flat, starts, lengths = read_indexed_documents(prefix)
    assert lengths.tolist() == [12, 14] and flat[starts[1]:starts[1] + 2].tolist() == [4, 5]
    good = (tmp_path / "d.idx").read_bytes()
    cases = {
        "version 2, expected 1": good[:9] + struct.pack("<Q", 2) + good[17:],
        "dtype code 99": good[:17] + bytes([99]) + good[18:],
        "need": good[:40],
    }
    for why, data in cases.items():
        (tmp_path / "d.idx").write_bytes(data)
        with pytest.raises(ValueError, match=f"'{prefix}'.*{why}"):
            read_indexed_documents(prefix)
    (tmp_path / "d.idx").write_bytes(good)
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:20])
    with pytest.raises(ValueError, match="do not match"):
        read_indexed_documents(prefix)
    assert HEADER == good[:9]
