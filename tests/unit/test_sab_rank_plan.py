"""SAB's per-rank packing (``batching.assignment``): a rank's own micro-batches, made from the
shared assignment, its own units and the agreement, are row r of ``sab_plan``'s whole plan bit
for bit (segments, slots, predicted cost), with and without the slot search, the fallback to
the sequential bins included; the slot search over the candidates alone makes the moves the
search over every rank makes (brute force: the search run on all ranks); the cost order's radix
key sorts as ``-cost`` does."""

import numpy as np
import pytest

from sparsebalance_megatron.batching import SensitivityTracker, latency_sample_cost_fn
from sparsebalance_megatron.batching.assignment import cost_ranks
from sparsebalance_megatron.batching.packing import sab_assignment, sab_plan
from sparsebalance_megatron.batching.slots import (PARTNERS, ROUNDS, candidates, search,
                                                   seed_slots)
from sparsebalance_megatron.data.packing import GlobalBatchSampler
from sparsebalance_megatron.latency import LatencyModel


def _batch(seed, dp, m, cap, n_docs=600, scale=300):
    rng = np.random.default_rng(seed)
    lengths = (rng.pareto(1.1, size=n_docs) * scale + 16).astype(np.int64)
    return GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                              seed=seed).next_global_batch()


def _rows_equal(dp, m, cap, segs, **kw):
    whole = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap, **kw)
    asg = sab_assignment(segs, dp=dp, num_microbatches=m, max_tokens=cap, **kw)
    agreed = asg.agree(asg.units())                 # in a run: the ranks' reductions
    for r in range(dp):
        own = asg.rank_plan(asg.units([r]), agreed)
        assert own.dp == 1 and own.micro_batches[0] == whole.micro_batches[r], (dp, r)
        assert own.predicted_rank_cost_s[0] == whole.predicted_rank_cost_s[r]
        assert own.fallback == whole.fallback and own.length_multiple == whole.length_multiple
        np.testing.assert_array_equal(own.unit_csr(True)[1],
                                      np.concatenate(whole.flat_lengths(True)[r * m:(r + 1) * m]))
    return whole


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_ranks_own_plan_is_its_row_of_the_whole(dp, seed):
    m, cap = 4, 4096
    segs = _batch(seed, dp, m, cap)
    model = LatencyModel.analytic(pp=2)
    tracker = SensitivityTracker()
    rng = np.random.default_rng(seed)
    ids = np.unique([i for i, _, _ in segs])[::3]
    tracker.update(ids, rng.integers(16, 3000, ids.size), rng.uniform(1, 6, ids.size))
    for kw in (dict(cost_fn=latency_sample_cost_fn(model, 0.3), sensitivity=tracker),
               dict(cost_fn=latency_sample_cost_fn(model, 0.3), length_multiple=128),
               dict(cost_fn=latency_sample_cost_fn(model, 0.3), arrange=False),
               dict()):
        _rows_equal(dp, m, cap, segs, seed=seed, **kw)


def test_a_ranks_own_plan_after_the_fallback_is_its_row_too():
    """Tight batches (a few fall back to the sequential bins), the latency cost and a
    quadratic one; and the batch whose cost-first packing fragments the bins."""
    rng, fell = np.random.default_rng(5), 0
    model = LatencyModel.analytic(pp=2)
    for case in range(60):
        dp, m, cap = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 128
        lengths = (np.random.default_rng(100 + case).pareto(1.1, size=200) * 40 + 16)
        segs = GlobalBatchSampler(lengths.astype(np.int64), capacity=cap, dp=dp,
                                  num_microbatches=m, seed=case).next_global_batch()
        for cost_fn in (latency_sample_cost_fn(model, 0.5), lambda x: x.astype(float) ** 2):
            fell += _rows_equal(dp, m, cap, segs, cost_fn=cost_fn, seed=case).fallback
    segs = [(0, 0, 60), (1, 0, 40), (2, 0, 70), (3, 0, 30), (4, 0, 55), (5, 0, 45),
            (6, 0, 80), (7, 0, 20)]
    fell += _rows_equal(2, 2, 100, segs, cost_fn=latency_sample_cost_fn(model, 0.5)).fallback
    assert fell >= 3


def test_the_search_over_the_candidates_is_the_search_over_every_rank():
    """Many ranks, few candidates: the search run over all of them (the brute force: no rank
    left out) moves the same micro-batches to the same slots."""
    rng = np.random.default_rng(0)
    k = 2 * ROUNDS + PARTNERS + 1
    for case in range(12):
        dp, m, nv = int(rng.integers(2 * k + 1, 4 * k)), int(rng.integers(2, 6)), 2
        f = rng.uniform(0.5, 2.0, (dp, m, nv)) * rng.uniform(0.5, 1.5, (dp, 1, 1))
        b = 2 * f
        sc = rng.uniform(0.9, 1.1, (dp, nv))
        seeds, span = seed_slots(f, b, 0.0, None, sc)
        if case % 3 == 0:                          # ties among the makespans
            span[rng.integers(0, dp, dp // 2)] = span[0]
        every = np.arange(dp)
        want, want_span = search(every, f, b, seeds, span, sc, 0.0, None)
        c = candidates(span)
        assert c.size < dp
        got, got_span = search(c, f[c], b[c], seeds[c], span[c], sc[c], 0.0, None)
        rest = np.setdiff1d(every, c)
        np.testing.assert_array_equal(got, want[c])
        np.testing.assert_array_equal(got_span, want_span[c])
        np.testing.assert_array_equal(want[rest], rest[:, None] * m + seeds[rest])


def descending_key(cost: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The order ``SABAssignment`` gives the LPT, as a sort key: each cost's rank among the
    distinct costs (``cost_ranks``)."""
    at, rank = cost_ranks(cost)
    return rank[at]


def test_the_radix_cost_key_sorts_as_minus_cost():
    rng = np.random.default_rng(1)
    for case in range(20):
        sizes = rng.integers(1, 50 if case % 2 else 100000, 500)
        cost = (sizes.astype(float) ** 1.5 if case % 3 else
                rng.integers(0, 4, 500).astype(float))      # not a function of the size
        if case % 5 == 0:
            cost[sizes == sizes[0]] = 0.0
        key = descending_key(cost, sizes)
        tie = rng.permutation(500)
        np.testing.assert_array_equal(np.lexsort((tie, key)), np.lexsort((tie, -cost)))


def test_latency_costs_priced_once_rank_as_the_radix_key():
    """``packing.sample_costs`` (a ``LatencyCost``'s distinct lengths priced
    once) gives its costs, and their ranks (``cost_ranks``) order as ``descending_key``."""
    from sparsebalance_megatron.batching.packing import latency_sample_cost_fn, sample_costs
    from sparsebalance_megatron.latency import LatencyModel, ModelShape

    cost_fn = latency_sample_cost_fn(LatencyModel.analytic(ModelShape(seq_length=8192), pp=2),
                                     0.5)
    rng = np.random.default_rng(3)
    for case in range(6):
        sizes = rng.integers(1, 40 if case % 2 else 8192, 400).astype(np.int64)
        cost, priced = sample_costs(sizes, cost_fn)
        np.testing.assert_array_equal(cost, priced[1][priced[0]])
        at, rank = cost_ranks(cost, priced)
        np.testing.assert_array_equal(rank[at], descending_key(cost, sizes))
        assert sample_costs(sizes, None)[1] is None


def test_run_sums_are_pythons_sum_of_each_run():
    """``kernels.packing.py_sums`` (a plan's rank costs): each run's sum() of floats."""
    from sparsebalance_megatron.kernels.packing import py_sums

    rng = np.random.default_rng(2)
    x = rng.random(300) * 10.0 ** rng.integers(-8, 8, 300)
    idx = rng.permutation(300)
    offsets = np.r_[0, np.sort(rng.integers(0, 301, 12)), 300]
    got = py_sums(x, idx, offsets)
    want = [sum(x[idx[a:b]].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert got.tolist() == want


def _agree_in_lockstep(asg):
    """Every rank's ``agreement_rounds`` driven in lockstep, reduced in-process (a run's
    all-reduces, ``policy.dst_rounds.reduce_in_process``): their agreements, in rank order."""
    from sparsebalance_megatron.batching.sab_rounds import agreement_rounds
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

    return plan_rounds_in_process([agreement_rounds(asg, asg.units([r]))
                                   for r in range(asg.dp)])


def _same_units(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    np.testing.assert_array_equal(a.ranks, b.ranks)
    assert a.fits == b.fits
    for f in ("items", "counts", "fwd_s", "bwd_s", "slots", "span_s", "scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype, f
            np.testing.assert_array_equal(x, y, err_msg=f)


@pytest.mark.parametrize("dp", [1, 3, 8, 50])
def test_the_ranks_rounds_agree_what_every_ranks_units_agree(dp):
    """The agreement each rank makes from its own units and two rounds of reductions is the one
    made from every rank's units (``SABAssignment.agree``), field for field, past the candidates'
    cut (DP 50 > 2 x 19 candidates), with and without a latency cost; each rank's plan after it
    is its row of ``sab_plan``."""
    m, cap = 4, 4096
    segs = _batch(dp, dp, m, cap, n_docs=40 * dp)
    model = LatencyModel.analytic(pp=2)
    for kw in (dict(cost_fn=latency_sample_cost_fn(model, 0.3)), dict()):
        asg = sab_assignment(segs, dp=dp, num_microbatches=m, max_tokens=cap, seed=dp, **kw)
        want = asg.agree(asg.units())
        whole = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap, seed=dp, **kw)
        for r, got in enumerate(_agree_in_lockstep(asg)):
            assert got.fallback == want.fallback
            _same_units(got.candidates, want.candidates)
            assert asg.rank_plan(asg.units([r]), got).micro_batches[0] == whole.micro_batches[r]


def test_the_ranks_rounds_fall_back_together():
    """A rank's cut does not fit: every rank's rounds agree the sequential bins, as the whole
    agreement does, and each rank's plan is its row of the fallback plan (the batch whose
    cost-first packing fragments the bins, and tight random batches)."""
    model = LatencyModel.analytic(pp=2)
    cases = [((0, 0, 60), (1, 0, 40), (2, 0, 70), (3, 0, 30), (4, 0, 55), (5, 0, 45),
              (6, 0, 80), (7, 0, 20))]
    shapes = [(2, 2, 100)]
    for case in range(30):
        rng = np.random.default_rng(300 + case)
        dp, m, cap = int(rng.integers(2, 5)), int(rng.integers(1, 4)), 128
        lengths = (rng.pareto(1.1, size=200) * 40 + 16).astype(np.int64)
        cases.append(GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                                        seed=case).next_global_batch())
        shapes.append((dp, m, cap))
    fell = 0
    for segs, (dp, m, cap) in zip(cases, shapes):
        kw = dict(dp=dp, num_microbatches=m, max_tokens=cap,
                  cost_fn=latency_sample_cost_fn(model, 0.5))
        asg, whole = sab_assignment(list(segs), **kw), sab_plan(list(segs), **kw)
        want = asg.agree(asg.units())
        for r, got in enumerate(_agree_in_lockstep(asg)):
            assert got.fallback == want.fallback == whole.fallback
            _same_units(got.candidates, want.candidates)
            assert asg.rank_plan(asg.units([r]), got).micro_batches[0] == whole.micro_batches[r]
        fell += whole.fallback
    assert fell >= 1


def test_the_packing_rounds_pack_each_row_and_refuse_a_lost_segment():
    """``packing_rounds``: each rank's own micro-batches after the agreement are its row of
    ``sab_plan``; where one rank's row loses a segment (or holds one twice), the check round's
    sums differ from the batch's and the rounds refuse, naming the counts."""
    from sparsebalance_megatron.batching.plan import BatchPlan
    from sparsebalance_megatron.batching.sab_rounds import _digest, packing_rounds
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

    dp, m, cap = 6, 4, 4096
    segs = _batch(9, dp, m, cap, n_docs=300)
    kw = dict(dp=dp, num_microbatches=m, max_tokens=cap, seed=9,
              cost_fn=latency_sample_cost_fn(LatencyModel.analytic(pp=2), 0.3))
    asg, whole = sab_assignment(segs, **kw), sab_plan(segs, **kw)
    rows = plan_rounds_in_process([packing_rounds(asg, asg.units([r])) for r in range(dp)])
    assert [r.micro_batches[0] for r in rows] == list(whole.micro_batches)
    rng = np.random.default_rng(0)
    perm = whole.segment_array()[rng.permutation(len(whole.segments()))]
    assert np.array_equal(_digest(perm), _digest(whole.segment_array()))
    plan_of = asg.rank_plan
    for change in ("drop", "twice"):
        def tampered(mine, agreed, method="sab"):
            plan = plan_of(mine, agreed, method)
            if mine.ranks[0] != 2:
                return plan
            row = [list(mb) for mb in plan.micro_batches[0]]
            row[0] = row[0][:-1] if change == "drop" else row[0] + row[0][-1:]
            return BatchPlan([row], plan.method, plan.max_tokens)
        asg.rank_plan = tampered
        with pytest.raises(RuntimeError, match="dropped or duplicated segments"):
            plan_rounds_in_process([packing_rounds(asg, asg.units([r])) for r in range(dp)])


def _own_factors(dp, pp, seed):
    """A model calibrated on every rank's (predicted, measured) and one per rank calibrated on
    its own pipeline's alone (``calibrate_ranks(first=r)``: what each DP rank learns in a run),
    whose own row is the whole model's."""
    rng = np.random.default_rng(seed)
    pred = rng.uniform(1, 2, (dp, pp))
    meas = pred * rng.uniform(0.7, 1.6, (dp, pp))
    full = LatencyModel.analytic(pp=pp)
    full.calibrate_ranks(pred, meas)
    owns = []
    for r in range(dp):
        own = LatencyModel.analytic(pp=pp)
        own.calibrate_ranks(pred[r:r + 1], meas[r:r + 1], first=r)
        np.testing.assert_array_equal(own.correction_grid(dp, pp)[r],
                                      full.correction_grid(dp, pp)[r])
        assert own.correction_grid(dp, pp)[(r + 1) % dp].tolist() == [1.0] * pp
        owns.append(own)
    return full, owns


@pytest.mark.parametrize("case", ["search", "fallback"])
def test_ranks_that_know_only_their_own_factors_pack_the_whole_plans_rows(case):
    """Each DP rank calibrates only its own pipeline: the candidates' factors travel with their
    units (``sab_rounds``), so every rank's own micro-batches after the rounds are its row of
    the plan one process makes knowing every rank's factors, the slot search's moves and the
    fallback's included; the factors change the searched plan (the test would see a rank that
    priced the candidates with its own, unlearned, view of them)."""
    from sparsebalance_megatron.batching.sab_rounds import packing_rounds
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

    if case == "search":
        dp, m, cap = 6, 4, 4096
        segs = _batch(11, dp, m, cap, n_docs=300)
    else:
        dp, m, cap = 2, 2, 100          # the batch whose cost-first packing fragments the bins
        segs = [(0, 0, 60), (1, 0, 40), (2, 0, 70), (3, 0, 30), (4, 0, 55), (5, 0, 45),
                (6, 0, 80), (7, 0, 20)]
    full, owns = _own_factors(dp, 2, 11)
    kw = dict(dp=dp, num_microbatches=m, max_tokens=cap, seed=11)
    whole = sab_plan(segs, cost_fn=latency_sample_cost_fn(full, 0.3), **kw)
    assert whole.fallback == (case == "fallback")
    asgs = [sab_assignment(segs, cost_fn=latency_sample_cost_fn(o, 0.3), **kw) for o in owns]
    rows = plan_rounds_in_process([packing_rounds(a, a.units([r])) for r, a in enumerate(asgs)])
    assert [x.micro_batches[0] for x in rows] == list(whole.micro_batches)
    assert [x.predicted_rank_cost_s[0] for x in rows] == list(whole.predicted_rank_cost_s)
    if case == "search":
        bare = sab_plan(segs, cost_fn=latency_sample_cost_fn(LatencyModel.analytic(pp=2), 0.3),
                        **kw)
        assert list(bare.micro_batches) != list(whole.micro_batches)
