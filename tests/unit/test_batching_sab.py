"""SAB and its baselines: every sample used exactly once, capacity, determinism, cost balance,
sensitivity grouping, long samples, bad input, fallback and planning time (the sensitivity
estimates themselves: ``test_sensitivity_tracker.py``)."""

import pickle
import re

import numpy as np
import pytest

from _plans import check_plan_covers
from sparsebalance_megatron.batching import (BatchingError, LongSampleError, SensitivityTracker,
                                             latency_sample_cost_fn,
                                             sab_plan, sequential_plan, token_balanced_plan,
                                             unit_sensitivity)
from sparsebalance_megatron.data.packing import PAD_SEQ_TOKENS, GlobalBatchSampler


def quad_cost(lengths):
    """Linear + quadratic (attention) seconds of a document, 32K-token scale."""
    L = np.asarray(lengths, dtype=np.float64)
    return L / 32768 + 1.5 * (L / 32768) ** 2


def global_batch(seed, dp, m, cap, n_docs=3000, alpha=1.1, scale=300):
    rng = np.random.default_rng(seed)
    lengths = (rng.pareto(alpha, size=n_docs) * scale + 16).astype(np.int64)
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m, seed=seed)
    return sampler.next_global_batch()


def rank_costs(plan):
    return np.asarray([sum(quad_cost([e - s for _, s, e in mb]).sum() for mb in rank)
                       for rank in plan.micro_batches])


PLANNERS = {
    "sequential": lambda segs, **kw: sequential_plan(segs, **kw),
    "token_balanced": lambda segs, **kw: token_balanced_plan(segs, seed=3, **kw),
    "sab": lambda segs, **kw: sab_plan(segs, cost_fn=quad_cost, seed=3, **kw),
}


def test_every_sample_used_exactly_once_and_capacity_respected():
    rng = np.random.default_rng(1)
    for case in range(25):
        dp, m = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        cap = int(rng.choice([256, 1024, 4096]))
        segs = global_batch(case, dp, m, cap, n_docs=400, scale=cap / 8)
        for name, planner in PLANNERS.items():
            plan = planner(segs, dp=dp, num_microbatches=m, max_tokens=cap)
            assert plan.dp == dp and plan.num_microbatches == m, name
            check_plan_covers(plan, segs, cap)
            assert plan.method == name


def test_same_seed_same_plan_and_seed_only_breaks_ties():
    segs = global_batch(0, 4, 4, 2048)
    a = sab_plan(segs, dp=4, num_microbatches=4, max_tokens=2048, cost_fn=quad_cost, seed=5)
    b = sab_plan(list(segs), dp=4, num_microbatches=4, max_tokens=2048, cost_fn=quad_cost,
                 seed=5)
    assert a.micro_batches == b.micro_batches
    equal = [(k, 0, 100) for k in range(32)]          # all ties: the seed decides
    p1 = sab_plan(equal, dp=4, num_microbatches=2, max_tokens=1024, seed=1)
    p2 = sab_plan(equal, dp=4, num_microbatches=2, max_tokens=1024, seed=2)
    assert p1.micro_batches != p2.micro_batches
    check_plan_covers(p1, equal, 1024)


def test_sab_balances_predicted_cost_better_than_tokens_and_sequential():
    dp, m, cap = 16, 4, 8192
    segs = global_batch(7, dp, m, cap, n_docs=4000, scale=400)
    imb = {}
    for name, planner in PLANNERS.items():
        c = rank_costs(planner(segs, dp=dp, num_microbatches=m, max_tokens=cap))
        imb[name] = c.max() / c.mean()
    assert imb["sab"] < imb["token_balanced"] and imb["sab"] < imb["sequential"], imb
    assert imb["sab"] < 1.05, imb


def test_micro_batches_group_similar_sensitivity():
    dp, m, cap = 2, 4, 4096
    rng = np.random.default_rng(0)
    segs = [(k, 0, int(n)) for k, n in enumerate(rng.integers(100, 400, size=64))]
    tracker = SensitivityTracker(signal="recall")
    ids = [s[0] for s in segs]
    recall = np.where(np.arange(64) % 2 == 0, 0.95, 0.55)   # interleaved: even ids insensitive
    tracker.update(ids, [s[2] for s in segs], recall)
    plan = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap, cost_fn=quad_cost,
                    sensitivity=tracker)
    check_plan_covers(plan, segs, cap)
    unit = unit_sensitivity(plan, tracker)
    # each micro-batch is (nearly) pure: its mean sensitivity is near 0.05 or near 0.45
    assert np.all(np.minimum(np.abs(unit - 0.05), np.abs(unit - 0.45)) < 0.11), unit
    seq = sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap)
    assert unit.std() > unit_sensitivity(seq, tracker).std()


def test_long_samples_split_or_refused_never_dropped():
    segs = [(0, 0, 2500), (1, 0, 300), (2, 0, 1000)] + [(k, 0, 50) for k in range(3, 12)]
    for name, planner in PLANNERS.items():
        plan = planner(segs, dp=2, num_microbatches=3, max_tokens=1000)
        assert plan.num_split_samples == 1, name
        check_plan_covers(plan, segs, 1000)
        pieces = sorted((s, e) for mb in plan.segments() for i, s, e in [mb] if i == 0)
        assert pieces == [(0, 1000), (1000, 2000), (2000, 2500)]
    with pytest.raises(LongSampleError, match="2500 tokens > max_tokens 1000"):
        sab_plan(segs, dp=2, num_microbatches=3, max_tokens=1000, long_sample_policy="error")
    with pytest.raises(ValueError, match="--sb-long-sample-policy"):
        sab_plan(segs, dp=2, num_microbatches=3, max_tokens=1000, long_sample_policy="drop")


def test_empty_or_too_small_or_too_large_batches_say_why():
    with pytest.raises(BatchingError, match="empty global batch"):
        sab_plan([], dp=2, num_microbatches=2, max_tokens=100)
    with pytest.raises(BatchingError, match="cannot fill dp=4 DP ranks"):
        sab_plan([(0, 0, 10), (1, 0, 10)], dp=4, num_microbatches=2, max_tokens=100)
    with pytest.raises(BatchingError, match="does not fit"):
        token_balanced_plan([(k, 0, 90) for k in range(9)], dp=2, num_microbatches=2,
                            max_tokens=100)
    with pytest.raises(ValueError, match="num_microbatches"):
        sab_plan([(0, 0, 10)], dp=1, num_microbatches=0, max_tokens=100)


def test_sab_fits_whatever_sequential_fits():
    # Tight: sequential fills 4 bins exactly; a cost-first order would fragment them.
    segs = [(0, 0, 60), (1, 0, 40), (2, 0, 70), (3, 0, 30), (4, 0, 55), (5, 0, 45),
            (6, 0, 80), (7, 0, 20)]
    seq = sequential_plan(segs, dp=2, num_microbatches=2, max_tokens=100)
    check_plan_covers(seq, segs, 100)
    plan = sab_plan(segs, dp=2, num_microbatches=2, max_tokens=100, cost_fn=quad_cost)
    check_plan_covers(plan, segs, 100)
    assert plan.fallback                            # the sequential bins, re-assigned by cost
    c = rank_costs(plan)
    assert c.max() / c.mean() <= rank_costs(seq).max() / rank_costs(seq).mean() + 1e-12
    rng = np.random.default_rng(5)
    for case in range(30):                          # random tight batches from the sampler
        dp, m, cap = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 128
        segs = global_batch(100 + case, dp, m, cap, n_docs=200, scale=40)
        check_plan_covers(sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                   cost_fn=quad_cost), segs, cap)


def test_latency_sample_cost_fn_is_additive_attention_cost():
    from sparsebalance_megatron.latency import LatencyModel
    lm = LatencyModel.analytic(pp=2)
    cost = latency_sample_cost_fn(lm, 0.5)
    c = cost(np.array([1024, 4096, 16384]))
    assert np.all(np.diff(c) > 0) and c[2] / c[1] > 4.0   # superlinear in length
    # a micro-batch pays each kernel's per-call cost once, whatever its documents: the
    # per-document cost leaves it out
    plain = lm.without_call_costs()
    calls = sum(lm.predict([1024], 0.5, s) - plain.predict([1024], 0.5, s) for s in range(2))
    assert calls > 0
    both = sum(plain.predict([1024, 4096], 0.5, s) for s in range(2))
    empty = sum(plain.predict([], 0.5, s) for s in range(2))
    # Additive up to the selection term: the kernel scores a dense NB^2 block matrix per
    # micro-batch, so two documents packed together cost slightly more than apart.
    assert both - empty == pytest.approx(c[0] + c[1], rel=5e-3)
    assert both - empty >= (c[0] + c[1]) * (1 - 1e-12)     # exactly additive without it


def test_planning_4096_samples_for_64_ranks_covers_every_token():
    """The benchmark's scale (its CPU time is in scripts/bench.py planner_cost, not here)."""
    rng = np.random.default_rng(0)
    lengths = np.minimum((rng.pareto(1.1, size=4096) * 600 + 50).astype(np.int64), 32768)
    costs = quad_cost(lengths)
    kw = dict(dp=64, num_microbatches=8, max_tokens=32768, cost_fn=lambda _: costs)
    plan = sab_plan(lengths, **kw)
    check_plan_covers(plan, lengths, 32768)
    assert plan.method == "sab" and not plan.fallback


def test_flat_lengths_with_padding_fill_every_micro_batch_to_max_tokens():
    segs = global_batch(2, 2, 3, 1024)
    plan = sequential_plan(segs, dp=2, num_microbatches=3, max_tokens=1024)
    bare, padded = plan.flat_lengths(), plan.flat_lengths(with_padding=True)
    assert len(bare) == len(padded) == 6
    for b, p in zip(bare, padded):
        assert int(p.sum()) == 1024 and np.array_equal(p[:b.size], b)
        assert np.all(p[b.size:] <= PAD_SEQ_TOKENS) and p.dtype == np.int64


def test_unit_csr_is_the_padded_lengths_and_computed_once():
    """The vectorised CSR form equals the per-micro-batch definition (documents, then
    ``padding_lengths`` of the rest), with empty and exactly full micro-batches."""
    from sparsebalance_megatron.data.packing import padding_lengths

    segs = global_batch(4, 3, 4, 2048) + [(10_000, 0, 2048)]
    for plan in (sab_plan(segs, dp=3, num_microbatches=5, max_tokens=2048, cost_fn=quad_cost),
                 sequential_plan(segs, dp=3, num_microbatches=5, max_tokens=2048)):
        for pad in (False, True):
            offsets, lengths = plan.unit_csr(with_padding=pad)
            assert offsets[0] == 0 and offsets[-1] == lengths.size and offsets.size == 16
            got = np.split(lengths, offsets[1:-1])
            for rank in range(3):
                for slot in range(5):
                    docs = [e - s for _, s, e in plan.micro_batches[rank][slot]]
                    want = docs + (padding_lengths(2048 - sum(docs)) if pad else [])
                    assert got[rank * 5 + slot].tolist() == want
            assert plan.unit_csr(with_padding=pad) is plan.unit_csr(with_padding=pad)
            assert [x.tolist() for x in plan.flat_lengths(pad)] == [x.tolist() for x in got]
        assert (plan.tokens() == 2048).any()
        # pickled (the planner process's draft) as the segments' arrays, which give back the
        # unpadded CSR; the padded one is computed again
        back = pickle.loads(pickle.dumps(plan))
        assert set(back._cache) == {("csr", False), "segments"}
        assert back.micro_batches == plan.micro_batches and plan.micro_batches == back.micro_batches
        assert np.array_equal(back.tokens(), plan.tokens()) and back.segments() == plan.segments()
        assert [np.array_equal(a, b) for a, b in zip(back.unit_csr(True), plan.unit_csr(True))] \
            == [True, True]


@pytest.mark.parametrize("split", [False, True])
def test_packers_arrays_are_their_micro_batches(split):
    """A packer that works on item indices hands its plan the segment array gathered from them
    (``BatchPlan.of_items``): its CSR equals the one a plan walks out of the same micro-batches
    given as nested lists of tuples, for every packer, SAB's fallback, split long samples,
    empty micro-batches and a length multiple (the padded CSR too)."""
    from sparsebalance_megatron.batching.dp_balanced import dp_balanced_plan

    segs = global_batch(5, 3, 4, 2048) + ([(10_000, 0, 5000)] if split else [])
    kw = dict(dp=3, num_microbatches=5, max_tokens=2048)
    plans = [f(segs, **kw) for f in PLANNERS.values()]
    from sparsebalance_megatron.latency import LatencyModel
    lm = LatencyModel.analytic(pp=2)
    plans += [sab_plan(segs, cost_fn=latency_sample_cost_fn(lm, 0.5), seed=1,
                       length_multiple=64, **kw),
              sequential_plan(segs, **kw).with_length_multiple(128),
              dp_balanced_plan(segs, **kw)]
    # SAB's fallback (the cost-aware cut does not fit: the sequential bins by LPT)
    tight = [(0, 0, 60), (1, 0, 40), (2, 0, 70), (3, 0, 30), (4, 0, 55), (5, 0, 45),
             (6, 0, 80), (7, 0, 20)]
    plans.append(sab_plan(tight, cost_fn=quad_cost, dp=2, num_microbatches=2, max_tokens=100))
    assert plans[-1].fallback
    for plan in plans:
        walked = type(plan)([[list(mb) for mb in rank] for rank in plan.micro_batches],
                            plan.method, plan.max_tokens, length_multiple=plan.length_multiple)
        assert np.array_equal(plan.segment_array(), walked.segment_array())
        assert plan.segment_array().dtype == walked.segment_array().dtype == np.int64
        for pad in (False, True):
            for a, b in zip(plan.unit_csr(pad), walked.unit_csr(pad)):
                assert a.dtype == b.dtype and np.array_equal(a, b)


def test_variable_length_plans_pad_each_micro_batch_to_its_multiple_only():
    """``with_length_multiple(k)``: each unit's padding ends at its tokens rounded up to k (at
    least k, at most max_tokens), the same definition ``materialize`` packs; the documents and
    the original plan are unchanged."""
    from sparsebalance_megatron.data.packing import packed_length, padding_lengths

    segs = global_batch(4, 3, 4, 2048) + [(10_000, 0, 2048)]
    fixed = sab_plan(segs, dp=3, num_microbatches=5, max_tokens=2048, cost_fn=quad_cost)
    fixed.unit_csr(with_padding=True)                      # cached on the fixed plan
    var = fixed.with_length_multiple(96)
    assert var.micro_batches is fixed.micro_batches and var.length_multiple == 96
    assert fixed.length_multiple == 0 and int(fixed.packed_lengths().sum()) == 15 * 2048
    tokens = var.tokens()
    want_len = np.minimum(np.maximum(-(-tokens // 96) * 96, 96), 2048)
    assert np.array_equal(var.packed_lengths(), want_len)
    assert (tokens == 2048).any() and (want_len < 2048).any()
    got = var.flat_lengths(with_padding=True)
    for u, (n, docs) in enumerate(zip(tokens.reshape(-1), var.flat_lengths())):
        assert got[u].tolist() == docs.tolist() + padding_lengths(int(want_len.flat[u]) - int(n))
        assert int(got[u].sum()) == packed_length(int(n), 2048, 96)
    for x, y in zip(fixed.flat_lengths(with_padding=True), fixed.flat_lengths()):
        assert int(x.sum()) == 2048 and x[:y.size].tolist() == y.tolist()
    empty = sequential_plan(segs[:3], dp=3, num_microbatches=5, max_tokens=2048)
    assert (empty.tokens() == 0).any()          # an empty micro-batch is one multiple of padding
    assert empty.with_length_multiple(96).packed_lengths()[empty.tokens() == 0].tolist() == \
        [96] * int((empty.tokens() == 0).sum())
    with pytest.raises(ValueError, match="length_multiple=-1"):
        fixed.with_length_multiple(-1)


@pytest.mark.parametrize("samples", [
    [(3, 0, 5), (1, 2, 9)],
    [[3, 0, 5], [1, 2, 9]],
    [(np.int64(3), np.int64(0), np.int64(5)), (1, 2, 9)],
    [5, (1, 2, 9)],
    np.asarray([5, 7]),
])
def test_segments_from_any_accepted_form_are_int_tuples(samples):
    from sparsebalance_megatron.batching.plan import checked_segments

    checked = checked_segments(samples)
    segs, arr = list(checked), checked.array
    assert arr.tolist() == [list(x) for x in segs]
    assert all(type(x) is tuple and all(type(v) is int for v in x) for x in segs)


@pytest.mark.parametrize("samples", [
    [(3, 0, 5), (1, 2, 9)],
    [[3, 0, 5], [1, 2, 9]],
    [5, (1, 2, 9)],
    np.asarray([5, 7]),
])
def test_checked_segments_are_converted_once_and_pack_the_same(samples):
    # the runtime's draft converts a step's segments once (checked_segments) for its two
    # packings and their checks: the same segments, array and plans as the raw input gives
    from sparsebalance_megatron.batching.plan import checked_segments

    once = checked_segments(samples)
    assert checked_segments(once) is once
    kw = dict(dp=2, num_microbatches=1, max_tokens=64)
    assert sab_plan(once, **kw).micro_batches == sab_plan(samples, **kw).micro_batches
    assert sequential_plan(once, **kw).micro_batches == sequential_plan(samples, **kw).micro_batches
    with pytest.raises(ValueError, match="sample 1: segment"):
        checked_segments([(0, 0, 5), (1, 4, 4)])


@pytest.mark.parametrize("samples, needle", [
    ([(0, 0, 5), (1, 4, 4)], "sample 1: segment (1, 4, 4): expected 0 <= start < end"),
    ([(0, 0, 5), (1, -1, 4)], "sample 1: segment (1, -1, 4): expected 0 <= start < end"),
    ([(0, 0, 5), (1, 2)], "sample 1: (1, 2): expected (sample_id, start, end)"),
    ([(0, 0, 5), ("a", 0, 3)], "sample 1: ('a', 0, 3): expected (sample_id, start, end)"),
])
def test_bad_segments_are_named_by_the_vectorised_check_too(samples, needle):
    with pytest.raises(ValueError) as e:
        sab_plan(samples, dp=1, num_microbatches=1, max_tokens=64)
    assert needle in str(e.value)


def test_a_document_costing_a_micro_batchs_share_gets_one_of_its_own():
    """SAB's cut of a rank's segments: one whose cost alone reaches the rank's mean cost per
    micro-batch is not packed with the segments before it (with variable-length micro-batches
    that costs no fill)."""
    from sparsebalance_megatron.kernels.packing import rank_bins

    def bins(size, cost):
        items, counts = rank_bins(np.arange(6), np.array([0, 6]), np.array(size),
                                  np.array(cost), 3, 1024)
        return [b.tolist() for b in np.split(items, np.cumsum(counts[0])[:-1])]

    # mean per bin of 3: 4.67
    assert bins([100, 100, 900, 100, 100, 100], [1.0, 1.0, 9.0, 1.0, 1.0, 1.0]) == \
        [[0, 1], [2], [3, 4, 5]]
    # without such a segment the cut is by the mean cost alone
    assert bins([100] * 6, [1.0] * 6) == [[0, 1], [2, 3], [4, 5]]


def test_sequential_plan_in_tokens_is_megatrons_fill_as_before():
    # the tokens-priced sequential plan (the draft's baseline) slices the segments into bins:
    # the same micro-batches as sequential_pack and each rank its tokens, empty bins at the
    # end, and the same refusal when the fill needs more micro-batches than dp x m
    from sparsebalance_megatron.batching.packing import prepare_samples
    from sparsebalance_megatron.data.packing import sequential_pack

    rng = np.random.default_rng(6)
    seen = {"planned": 0, "overflow": 0}
    for case in range(60):
        dp, m, cap = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 64
        n = int(rng.integers(dp, dp * m * 3 // 2 + 2))  # every rank gets a segment
        samples = [(int(i), 0, int(x)) for i, x in enumerate(rng.integers(1, cap, n))]
        try:
            arr, *_ = prepare_samples(samples, dp, m, cap, "split")
        except BatchingError:                           # more tokens than dp x m hold
            continue
        try:
            mbs = sequential_pack(list(map(tuple, arr.tolist())), capacity=cap, dp=dp,
                                  num_microbatches=m)
        except ValueError as e:
            with pytest.raises(BatchingError, match=re.escape(f"sequential packing: {e}")):
                sequential_plan(samples, dp=dp, num_microbatches=m, max_tokens=cap)
            seen["overflow"] += 1
            continue
        seen["planned"] += 1
        tokens = [float(sum(e - s for mb in rank for _, s, e in mb)) for rank in mbs]
        got = sequential_plan(samples, dp=dp, num_microbatches=m, max_tokens=cap)
        assert got.micro_batches == mbs, case
        assert np.array_equal(got.predicted_rank_cost_s, tokens)
        assert got.predicted_rank_cost_s.dtype == np.float64
    assert seen["planned"] >= 10 and seen["overflow"] >= 3, seen


def test_seeded_order_is_the_lexsort_it_replaces():
    """``seeded_order(tie, *keys)`` is ``np.lexsort((tie,) + keys)`` for a permutation ``tie``:
    float keys with many equal values (and -0.0 beside 0.0), integer keys, one key or two."""
    from sparsebalance_megatron.batching.plan import seeded_order

    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 300, 4500):
        tie = rng.permutation(n)
        cost = rng.choice(np.array([0.0, -0.0, 1.5, 2.25, 3.0]), n) \
            if n < 300 else np.round(rng.random(n), 2)
        key, rank = rng.choice(np.array([0.0, 0.5, 1.0]), n), rng.integers(0, 8, n)
        for keys in ((-cost,), (key, rank), (cost, key, rank)):
            np.testing.assert_array_equal(seeded_order(tie, *keys), np.lexsort((tie,) + keys))


def test_a_row_plan_is_its_rank_of_the_whole():
    """``BatchPlan.row_plan(r)``: rank r's micro-batches as a one-row plan, its arrays (CSR with
    and without padding, segments, tokens) and predicted cost those of the whole plan's row, on
    a plan and on its pickled copy (arrays, rows made when read)."""
    segs = global_batch(7, 4, 3, 2048)
    for plan in (sab_plan(segs, dp=4, num_microbatches=3, max_tokens=2048, cost_fn=quad_cost),
                 sequential_plan(segs, dp=4, num_microbatches=3, max_tokens=2048)
                 .with_length_multiple(128)):
        for p in (plan, pickle.loads(pickle.dumps(plan))):
            for r in range(4):
                row = p.row_plan(r)
                assert row.dp == 1 and row.micro_batches == [plan.micro_batches[r]]
                assert row.length_multiple == plan.length_multiple
                assert row.predicted_rank_cost_s.tolist() == \
                    plan.predicted_rank_cost_s[r:r + 1].tolist()
                fresh = type(plan)([plan.micro_batches[r]], plan.method, plan.max_tokens,
                                   length_multiple=plan.length_multiple)
                for pad in (False, True):
                    assert [a.tolist() for a in row.unit_csr(pad)] == \
                        [a.tolist() for a in fresh.unit_csr(pad)]
                assert row.segment_array().tolist() == fresh.segment_array().tolist()
                assert row.tokens().tolist() == plan.tokens()[r:r + 1].tolist()
            for bad in (-1, 4, 1.0):
                with pytest.raises(ValueError, match=rf"rank={bad!r}: expected a DP rank"):
                    p.row_plan(bad)


def test_a_ranks_sequential_row_is_its_row_of_the_whole():
    """``sequential_plan(rank=r)`` makes only rank r's row: the whole plan's ``row_plan(r)``
    (segments, cost, arrays), with ranks past the filled bins (empty micro-batches) and split
    documents."""
    from sparsebalance_megatron.data.packing import GlobalBatchSampler

    rng = np.random.default_rng(11)
    for case in range(40):
        dp, m = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        segs = GlobalBatchSampler(rng.integers(1, 9000, 120), capacity=4096, dp=dp,
                                  num_microbatches=m, seed=case).next_global_batch()
        segs = segs[:max(dp, int(len(segs) * rng.uniform(0.3, 1.0)))]
        whole = sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=4096)
        for r in range(dp):
            own, want = sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=4096,
                                        rank=r), whole.row_plan(r)
            assert own.micro_batches == want.micro_batches, (case, r)
            assert own.predicted_rank_cost_s.tolist() == want.predicted_rank_cost_s.tolist()
            assert (own.num_split_samples, own.fallback) == (want.num_split_samples, False)
            for pad in (False, True):
                assert [a.tolist() for a in own.unit_csr(pad)] == \
                    [a.tolist() for a in want.unit_csr(pad)]
            assert own.segment_array().tolist() == want.segment_array().tolist()
    with pytest.raises(ValueError, match=rf"rank={dp}: expected a DP rank in \[0, {dp}\)"):
        sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=4096, rank=dp)
