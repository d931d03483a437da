"""Context parallelism's token orders and per-document padding: Megatron's zigzag split, the
gather back to whole documents, and padded packing that drops or duplicates nothing."""

import numpy as np
import pytest
import torch

from sparsebalance_megatron.data.context_parallel import (gather_index, padded_length,
                                                          zigzag_positions)
from sparsebalance_megatron.data.packing import GlobalBatchSampler, materialize, sequential_pack
from tests.unit.test_data_packing import EOD, FakeCorpus, heavy_tailed_lengths


def _padded_cu(lengths, multiple):
    return np.cumsum([0] + [padded_length(n, multiple) for n in lengths])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_split_is_megatrons_rope_order_and_a_partition(cp):
    """Every rank holds 1/cp of every sequence, chunks r and 2cp-1-r; the ranks together hold
    every position once; and the positions are the ones Megatron's THD RoPE gives a CP rank's
    tokens (``_get_thd_freqs_on_this_cp_rank``, fed positions as frequencies)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cu = _padded_cu([1, 7, 40, 2 * cp, 129], 2 * cp)
    held = [zigzag_positions(cu, cp, r) for r in range(cp)]
    assert all(h.size == cu[-1] // cp for h in held)
    assert sorted(np.concatenate(held).tolist()) == list(range(cu[-1]))
    freqs = torch.arange(int(np.diff(cu).max()))
    for r in range(cp):
        local = np.split(held[r], np.cumsum(np.diff(cu) // cp)[:-1])
        for s, pos in zip(cu[:-1], local):
            rope = _get_thd_freqs_on_this_cp_rank(r, cp, torch.zeros(pos.size), freqs)
            assert (pos - s).tolist() == rope.tolist()


def test_zigzag_refuses_sequences_that_do_not_split_evenly():
    with pytest.raises(ValueError, match="sequence 1 has 6 tokens: .* multiple of 2 x cp_size = 4"):
        zigzag_positions([0, 8, 14], 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gather_index_reads_whole_documents_without_padding(cp):
    lengths = [5, 1, 33, 8, 2]
    real = np.cumsum([0] + lengths)
    padded = _padded_cu(lengths, 2 * cp)
    gathered = np.concatenate([zigzag_positions(padded, cp, r) for r in range(cp)]) if cp > 1 \
        else np.arange(padded[-1])
    idx = gather_index(real, padded, cp)
    natural = np.concatenate([np.arange(s, s + n) for s, n in zip(padded[:-1], lengths)])
    assert gathered[idx].tolist() == natural.tolist()


def test_padded_materialize_keeps_every_loss_token_and_splits_evenly():
    """Documents padded to a multiple after their EOD: the same tokens, labels and loss tokens
    as without padding, every sequence a multiple long, padding outside the loss."""
    lengths = heavy_tailed_lengths(80, seed=3, max_len=300)
    corpus = FakeCorpus(lengths)
    cap, q = 512, 4
    plain = GlobalBatchSampler(lengths, capacity=cap, seed=1, long_sample_policy="split")
    padded = GlobalBatchSampler(lengths, capacity=cap, seed=1, pad_multiple=q)
    want, got = {}, {}
    for sampler, mult, out in ((plain, 1, want), (padded, q, got)):
        for _ in range(6):
            for mb in sequential_pack(sampler.next_bins(3), capacity=cap, dp=3,
                                      num_microbatches=1):
                m = materialize(mb[0], corpus, cap, pad_multiple=mult)
                assert m.tokens.size == cap
                if mult > 1:
                    assert np.all(np.diff(m.cu_seqlens) % q == 0)
                    assert m.cu_seqlens_real is not None or not mb[0]
                real_cu = m.cu_seqlens if m.cu_seqlens_real is None else m.cu_seqlens_real
                for i, (d, s, e) in enumerate(m.segments):
                    a, n_real = m.cu_seqlens[i], real_cu[i + 1] - real_cu[i]
                    assert n_real == min(e, lengths[d] + 1) - s
                    assert np.all(m.loss_mask[a + n_real:m.cu_seqlens[i + 1]] == 0)
                    assert np.all(m.tokens[a + n_real:m.cu_seqlens[i + 1]] == EOD)
                    seg = out.setdefault(d, [])
                    seg.append((m.tokens[a:a + n_real], m.labels[a:a + n_real],
                                m.loss_mask[a:a + n_real]))
    common = sorted(set(want) & set(got))
    assert len(common) > 20
    for d in common:
        for k in range(3):   # tokens, labels, loss mask of the whole document
            np.testing.assert_array_equal(np.concatenate([x[k] for x in want[d]]),
                                          np.concatenate([x[k] for x in got[d]]))


def test_padded_sampler_counts_padded_positions_and_uses_every_document_once():
    """A document spans its positions rounded up to the multiple; over an epoch the segments of
    every document cover them once, in order, cut at multiples of the multiple."""
    lengths = heavy_tailed_lengths(60, seed=5, max_len=700)
    sampler = GlobalBatchSampler(lengths, capacity=256, seed=2, pad_multiple=8)
    segments = []
    while sampler.epoch == 0:
        segments += sampler.next_bins(4)
    covered = {}
    for d, s, e in segments:
        assert e - s <= 256 and s % 8 == 0
        covered.setdefault(d, []).append((s, e))
    for d in sampler.epoch_order(0).tolist():
        end, want = 0, padded_length(int(lengths[d]) + 1, 8)
        for s, e in covered[d]:
            if end == want:
                break                                  # the document again, next epoch
            assert s == end
            end = e
        assert end == want
    with pytest.raises(ValueError, match="capacity 250: expected a multiple of pad_multiple 8"):
        GlobalBatchSampler(lengths, capacity=250, seed=2, pad_multiple=8)
