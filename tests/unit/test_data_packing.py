"""Sampling and packing: documents used exactly once, never crossed, split or refused, resumable."""

import numpy as np
import pytest

from sparsebalance_megatron.data.packing import (PAD_SEQ_TOKENS, GlobalBatchSampler,
                                                 LongDocumentError, materialize,
                                                 packed_length, padding_lengths,
                                                 sequential_pack)

EOD = 999_999


class FakeCorpus:
    """Token j of document d is d * 10_000 + j: any token names its document and position."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.eod_id = EOD

    def __len__(self):
        return self.lengths.size

    def tokens(self, doc_id):
        return doc_id * 10_000 + np.arange(self.lengths[doc_id], dtype=np.int64)


def heavy_tailed_lengths(n, seed=0, max_len=3000):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.5, 1.2, size=n).astype(np.int64), 1, max_len)


def doc_of(token):
    return -1 if token == EOD else int(token) // 10_000


def whole_documents(segments, lengths):
    """Group a flat segment stream into documents, checking each is covered contiguously."""
    docs, cur, pos = [], None, 0
    for d, s, e in segments:
        if cur is None:
            assert s == 0, f"document {d} starts at {s}"
            cur, pos = d, 0
        assert d == cur and s == pos, f"segment {(d, s, e)} does not continue document {cur}@{pos}"
        pos = e
        if pos == lengths[d] + 1:
            docs.append(d)
            cur = None
    return docs, cur


def test_global_batch_each_segment_exactly_once_in_dp_x_m_microbatches():
    lengths = heavy_tailed_lengths(300)
    cap, dp, m = 512, 2, 3
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m, seed=7)
    for _ in range(20):
        segments = sampler.next_global_batch()
        packed = sequential_pack(segments, capacity=cap, dp=dp, num_microbatches=m)
        assert len(packed) == dp and all(len(r) == m for r in packed)
        flat = [s for r in packed for mb in r for s in mb]
        assert sorted(flat) == sorted(segments) and len(set(flat)) == len(flat)
        for r in packed:
            for mb in r:
                assert mb, "sequential packing leaves no micro-batch of a full step empty"
                assert sum(e - s for _, s, e in mb) <= cap
        # Megatron's order: the j-th micro-batch in fill order is rank j % dp, slot j // dp.
        in_fill_order = [packed[j % dp][j // dp] for j in range(dp * m)]
        assert [s for mb in in_fill_order for s in mb] == segments
        # The step is full: the next step's first unit would not fit in its last micro-batch.
        state = sampler.state_dict()
        nxt = sampler.next_global_batch()
        sampler.load_state_dict(state)
        last_free = cap - sum(e - s for _, s, e in in_fill_order[-1])
        assert nxt[0][2] - nxt[0][1] > last_free


def test_every_document_once_per_epoch_over_steps():
    lengths = heavy_tailed_lengths(120, seed=1)
    sampler = GlobalBatchSampler(lengths, capacity=256, dp=2, num_microbatches=2, seed=3)
    stream = []
    while sampler.epoch < 2:
        stream += sampler.next_global_batch()
    docs, _ = whole_documents(stream, lengths)
    n = lengths.size
    assert sorted(docs[:n]) == list(range(n))
    assert sorted(docs[n:2 * n]) == list(range(n))
    assert docs[:n] != docs[n:2 * n], "each epoch is reshuffled"
    assert list(docs[:n]) == list(sampler.epoch_order(0))
    # Same seed, same order; another seed, another order.
    other = GlobalBatchSampler(lengths, capacity=256, dp=2, num_microbatches=2, seed=4)
    assert list(other.epoch_order(0)) != list(sampler.epoch_order(0))


def test_materialize_labels_and_cu_seqlens_never_cross_a_document():
    lengths = np.array([5, 1, 30, 3, 200, 7])
    corpus = FakeCorpus(lengths)
    cap = 64
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=1, num_microbatches=4, seed=0)
    segments = sampler.next_global_batch()
    seen_eod_label = False
    for mb_segments in sequential_pack(segments, capacity=cap, dp=1, num_microbatches=4)[0]:
        mb = materialize(mb_segments, corpus, cap)
        cu = mb.cu_seqlens
        assert mb.tokens.shape == mb.labels.shape == mb.loss_mask.shape == (cap,)
        assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == cap
        assert np.all(np.diff(cu) > 0)
        seq_id = np.repeat(np.arange(cu.size - 1), np.diff(cu))        # [T]
        # Attention mask from cu_seqlens (causal, block diagonal): no pair spans two documents.
        allowed = (seq_id[:, None] == seq_id[None, :]) & np.tri(cap, dtype=bool)
        tok_doc = np.array([doc_of(t) for t in mb.tokens])
        pos = mb.tokens % 10_000
        real = np.arange(cap) < mb.n_real_tokens
        for i, j in zip(*np.nonzero(allowed & real[:, None] & real[None, :])):
            if tok_doc[i] >= 0 and tok_doc[j] >= 0:
                assert tok_doc[i] == tok_doc[j]
        assert np.all(mb.loss_mask[~real] == 0), "padding carries no loss"
        for t in np.nonzero(mb.loss_mask)[0]:
            lab = mb.labels[t]
            if lab == EOD:   # the model learns to end a document: EOD after its last token
                seen_eod_label = True
                assert tok_doc[t] >= 0 and pos[t] == lengths[tok_doc[t]] - 1
            else:
                assert doc_of(lab) == tok_doc[t] and lab == mb.tokens[t] + 1
        # Each sequence is one segment; positions restart at 0 in each.
        for k, (d, s, e) in enumerate(mb_segments):
            a, b = cu[k], cu[k + 1]
            assert b - a == e - s
            assert np.array_equal(mb.position_ids[a:b], np.arange(e - s))
            if e == lengths[d] + 1:   # last piece: ends with EOD, which predicts nothing
                assert mb.tokens[b - 1] == EOD and mb.loss_mask[b - 1] == 0
        if mb.n_real_tokens < cap:
            k = len(mb_segments)
            assert cu[k] == mb.n_real_tokens, "padding follows the documents"
            assert list(np.diff(cu[k:])) == padding_lengths(cap - mb.n_real_tokens)
    assert seen_eod_label


def test_long_documents_are_split_into_pieces_of_at_most_capacity():
    lengths = np.array([10, 1000, 20, 129, 128, 127])
    cap = 128
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=1, num_microbatches=3, seed=0)
    stream = []
    while sampler.epoch < 1:
        stream += sampler.next_global_batch()
    assert all(0 < e - s <= cap for _, s, e in stream)
    n_first_epoch = sum(1 + int(n) // cap for n in lengths)     # pieces of n + 1 positions
    stream = stream[:n_first_epoch]
    pieces = [(s, e) for d, s, e in stream if d == 1]
    assert pieces == [(k * cap, min((k + 1) * cap, 1001)) for k in range(8)]
    assert [(s, e) for d, s, e in stream if d == 5] == [(0, 128)]    # 127 + EOD fits exactly
    assert [(s, e) for d, s, e in stream if d == 4] == [(0, 128), (128, 129)]
    docs, _ = whole_documents(stream, lengths)
    assert sorted(docs[:6]) == list(range(6))
    corpus = FakeCorpus(lengths)
    mb = materialize([(1, 128, 256)], corpus, cap)   # a middle piece: no EOD, last label in-doc
    assert mb.loss_mask.sum() == cap and mb.labels[-1] == 1 * 10_000 + 256


def test_long_documents_refused_with_policy_error():
    with pytest.raises(LongDocumentError, match=r"document 2 has 300 tokens \+ EOD > capacity 256"):
        GlobalBatchSampler([10, 255, 300, 500], capacity=256, dp=1, num_microbatches=1, seed=0,
                           long_sample_policy="error")
    # 255 tokens + EOD fit exactly: accepted.
    GlobalBatchSampler([10, 255], capacity=256, dp=1, num_microbatches=1, seed=0,
                       long_sample_policy="error")


def test_resume_from_state_replays_the_uninterrupted_sequence():
    lengths = heavy_tailed_lengths(60, seed=5, max_len=900)
    kw = dict(capacity=300, dp=2, num_microbatches=2, seed=11)
    full = GlobalBatchSampler(lengths, **kw)
    expected = [full.next_global_batch() for _ in range(40)]
    assert full.epoch >= 1, "the run crosses an epoch boundary"
    probe = GlobalBatchSampler(lengths, **kw)
    resumed_any_mid_document = False
    for k in (1, 7, 19, 33):
        while probe.step < k:
            probe.next_global_batch()
        state = dict(probe.state_dict())
        resumed_any_mid_document |= state["offset"] > 0
        again = GlobalBatchSampler(lengths, **kw)
        again.load_state_dict(state)
        assert [again.next_global_batch() for _ in range(40 - k)] == expected[k:]
    assert resumed_any_mid_document, "some resume point falls inside a split document"
    skipped = GlobalBatchSampler(lengths, **kw)
    skipped.skip_steps(25)
    assert [skipped.next_global_batch() for _ in range(15)] == expected[25:]


def test_bad_arguments_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match="capacity=0"):
        GlobalBatchSampler([5], capacity=0, dp=1, num_microbatches=1, seed=0)
    with pytest.raises(ValueError, match="dp=0"):
        GlobalBatchSampler([5], capacity=8, dp=0, num_microbatches=1, seed=0)
    with pytest.raises(ValueError, match="long_sample_policy='drop'"):
        GlobalBatchSampler([5], capacity=8, dp=1, num_microbatches=1, seed=0,
                           long_sample_policy="drop")
    with pytest.raises(ValueError, match="seed=-1"):
        GlobalBatchSampler([5], capacity=8, dp=1, num_microbatches=1, seed=-1)
    s = GlobalBatchSampler([5, 6], capacity=8, dp=1, num_microbatches=1, seed=0)
    with pytest.raises(ValueError, match="seed 1 over 2 documents"):
        s.load_state_dict({**s.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="micro-batches"):
        sequential_pack([(0, 0, 6), (1, 0, 7)], capacity=8, dp=1, num_microbatches=1)
    with pytest.raises(ValueError, match="end <= 6"):
        materialize([(0, 0, 7)], FakeCorpus([5]), 8)
    with pytest.raises(ValueError, match="capacity 8"):
        materialize([(0, 0, 6), (1, 0, 6)], FakeCorpus([5, 5]), 8)


def test_padding_is_cut_into_short_sequences_that_carry_no_loss():
    assert padding_lengths(0) == []
    assert padding_lengths(PAD_SEQ_TOKENS) == [PAD_SEQ_TOKENS]
    assert padding_lengths(2 * PAD_SEQ_TOKENS + 5) == [PAD_SEQ_TOKENS, PAD_SEQ_TOKENS, 5]
    with pytest.raises(ValueError, match="-1 tokens"):
        padding_lengths(-1)
    cap = 3 * PAD_SEQ_TOKENS + 100
    mb = materialize([(0, 0, 51)], FakeCorpus([50]), cap)
    cu = mb.cu_seqlens
    assert cu[0] == 0 and cu[1] == 51 and cu[-1] == cap
    assert list(np.diff(cu[1:])) == padding_lengths(cap - 51)
    assert max(np.diff(cu[1:])) <= PAD_SEQ_TOKENS
    for a, b in zip(cu[1:-1], cu[2:]):       # every padding sequence restarts its positions
        assert np.array_equal(mb.position_ids[a:b], np.arange(b - a))
    assert np.all(mb.tokens[51:] == EOD) and mb.loss_mask[50:].sum() == 0
    assert mb.loss_mask[:50].sum() == 50 and mb.n_real_tokens == 51


def test_short_global_batch_leaves_trailing_microbatches_as_padding():
    packed = sequential_pack([(0, 0, 4)], capacity=8, dp=2, num_microbatches=2)
    assert packed == [[[(0, 0, 4)], []], [[], []]]
    mb = materialize([], FakeCorpus([3]), 8)
    assert mb.loss_mask.sum() == 0 and list(mb.cu_seqlens) == [0, 8]


def test_variable_length_micro_batches_end_at_their_documents_rounded_up():
    """``length_multiple`` k: the micro-batch holds its segments' positions rounded up to k (at
    least k, at most the capacity); the documents' tokens, labels, loss and positions are those
    of the fixed-length micro-batch, only the trailing padding is shorter."""
    corpus = FakeCorpus([50, 7, 30])
    segs = [(0, 0, 51), (1, 0, 8), (2, 0, 31)]                      # 90 positions
    fixed = materialize(segs, corpus, 512)
    for k, want in ((1, 90), (32, 96), (90, 90), (1000, 512)):
        mb = materialize(segs, corpus, 512, length_multiple=k)
        assert mb.tokens.size == want == packed_length(90, 512, k) and mb.cu_seqlens[-1] == want
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert np.array_equal(getattr(mb, name), getattr(fixed, name)[:want]), (k, name)
        assert mb.cu_seqlens[:4].tolist() == fixed.cu_seqlens[:4].tolist()
        assert mb.loss_mask.sum() == fixed.loss_mask.sum() == 50 + 7 + 30
    assert materialize([], corpus, 512, length_multiple=32).tokens.size == 32   # one multiple
    cp_segs = [(0, 0, 52), (1, 0, 8), (2, 0, 32)]                   # padded to 4 (CP=2): 92
    cp = materialize(cp_segs, corpus, 512, pad_multiple=4, length_multiple=8)
    assert cp.tokens.size == 96 and np.all(np.diff(cp.cu_seqlens) % 4 == 0)
    assert packed_length(np.array([0, 90, 600]), 512, 32).tolist() == [32, 96, 512]
    assert packed_length(np.array([0, 90]), 512).tolist() == [512, 512]
    with pytest.raises(ValueError, match="length_multiple 6: expected a multiple of pad_multiple 4"):
        materialize(segs, corpus, 512, pad_multiple=4, length_multiple=6)
    with pytest.raises(ValueError, match="segments hold 90 tokens: expected at most capacity 64"):
        materialize(segs, corpus, 64, length_multiple=32)
    with pytest.raises(ValueError, match="multiple=-2"):
        packed_length(5, 64, -2)


def _stream_oracle(s: GlobalBatchSampler, n_bins: int) -> list:
    """The sampler's stream a document at a time in Python, on its own state (the brute-force
    reference ``next_bin_array``'s compiled pass must equal)."""
    out, left, free = [], n_bins, 0
    while True:
        if s.current is not None:
            src = s.current
        else:
            behind = [t / w for t, w in zip(s.taken, s.weights.tolist())]
            src = behind.index(min(behind))
        doc = int(s.source_order(src, s.epochs[src])[s.positions[src]])
        n = int(s.n_positions[doc])
        end = min(n, s.offset + s.capacity)
        if end - s.offset > free:
            if left == 0:
                break
            left, free = left - 1, s.capacity
        if s.offset == 0:
            s.taken[src] += n
        out.append((doc, s.offset, end))
        free -= end - s.offset
        s.offset, s.current = end, src
        if s.offset == n:
            s.offset, s.current = 0, None
            s.positions[src] += 1
            if s.positions[src] == s.sources[src].size:
                s.positions[src], s.epochs[src] = 0, s.epochs[src] + 1
    s.bins += n_bins
    return out


def test_the_compiled_stream_is_the_document_at_a_time_stream():
    """``next_bins`` (``next_bin_array``'s compiled pass) cuts the same segments and leaves the
    same state as the stream read a document at a time: one and several sources, blend weights,
    CP padding, split documents, epochs turning mid-call, calls of any size one after another."""
    rng = np.random.default_rng(1)
    for case in range(150):
        n = int(rng.integers(3, 40))
        lengths = rng.integers(1, 300, n)
        cap = int(rng.choice([8, 16, 64, 256]))
        kw = dict(capacity=cap, seed=int(rng.integers(0, 5)),
                  pad_multiple=int(rng.choice([1, 2, 4, 8])))
        if case % 2:
            perm = rng.permutation(n)
            kw["sources"] = np.split(perm, sorted(rng.choice(np.arange(1, n), 2, replace=False)))
            if case % 4 == 1:
                kw["weights"] = (rng.random(3) + 0.1).tolist()
        got, want = GlobalBatchSampler(lengths, **kw), GlobalBatchSampler(lengths, **kw)
        for _ in range(5):
            bins = int(rng.integers(1, 30))
            segs = got.next_bins(bins)
            assert segs == _stream_oracle(want, bins), case
            assert all(type(x) is int for seg in segs for x in seg)
            assert (got.epochs, got.positions, got.taken, got.offset, got.current, got.bins) \
                == (want.epochs, want.positions, want.taken, want.offset, want.current,
                    want.bins), case
        assert np.array_equal(got.next_bin_array(7), np.asarray(_stream_oracle(want, 7)))
