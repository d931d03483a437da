"""SAB's slot arrangement (``batching/slots.py``): where each packed micro-batch runs.

The search is checked against the simulator it optimises: it returns a permutation of the
micro-batches (every one runs exactly once), its makespans are the simulator's, it is never
slower than the packed order, it takes a heavy micro-batch out of 1F1B's warm-up, it swaps
micro-batches between ranks when reordering alone cannot balance them, and it is deterministic.
Through ``sab_plan``: every segment is planned exactly once, the per-stage costs it arranges on
are the latency model's own for the packed micro-batches, and the arranged plan is predicted
no slower than the unarranged one, for dense and sparse costs, fixed and variable lengths.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from _plans import check_plan_covers
from sparsebalance_megatron.batching import (SensitivityTracker, latency_sample_cost_fn,
                                             sab_plan)
from sparsebalance_megatron.batching.slots import arrange_slots
from sparsebalance_megatron.latency import LatencyModel, PipelineLayout
from sparsebalance_megatron.policy import UnitCosts
from sparsebalance_megatron.sim.pipeline import pipeline_makespan_s


def _gather(f, slots):
    dp, m, nv = f.shape
    return f.reshape(dp * m, nv)[slots]


def _costs(dp, m, nv, seed=0):
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 1.5, (dp, m, 1)) * rng.uniform(0.8, 1.2, (1, 1, nv))
    return f, 2.0 * f


@pytest.mark.parametrize("pp, vp", [(4, 1), (2, 2), (4, 2)])
def test_slots_are_a_permutation_with_the_simulators_makespans_never_slower(pp, vp):
    dp, m = 4, 8
    f, b = _costs(dp, m, pp * vp)
    f[1, 1] *= 4.0                                   # one heavy micro-batch early
    b[1, 1] *= 4.0
    slots, span = arrange_slots(f, b, 1e-4, pp=pp)
    assert sorted(slots.ravel().tolist()) == list(range(dp * m))
    got = pipeline_makespan_s(_gather(f, slots), _gather(b, slots), 1e-4, pp=pp)
    np.testing.assert_allclose(span, got, rtol=1e-12)
    packed = pipeline_makespan_s(f, b, 1e-4, pp=pp)
    assert span.max() <= packed.max() * (1 + 1e-12)
    again = arrange_slots(f, b, 1e-4, pp=pp)
    assert np.array_equal(again[0], slots) and np.array_equal(again[1], span)


def test_a_heavy_micro_batch_leaves_1f1bs_warm_up():
    # one rank, 1F1B over 4 stages: the old rule (cheapest first and last, the rest as cut)
    # left the heavy micro-batch in slot 1, in the warm-up that every later stage waits for
    m, pp = 8, 4
    f = np.ones((1, m, pp))
    f[0, 1] = 3.0
    b = 2.0 * f
    slots, span = arrange_slots(f, b, 0.0, pp=pp)
    packed = pipeline_makespan_s(f, b, 0.0, pp=pp)[0]
    assert span[0] < packed * 0.98                   # 53 s against 55 s
    assert slots[0].tolist().index(1) not in (0, 1, m - 1)
    # and it is the best order there is (all 8! orders simulated)
    perms = np.asarray(list(itertools.permutations(range(m))))
    best = min(pipeline_makespan_s(f[0][perms[i:i + 8000]], b[0][perms[i:i + 8000]], 0.0,
                                   pp=pp).min() for i in range(0, len(perms), 8000))
    assert span[0] <= best * (1 + 1e-9)


def test_micro_batches_swap_ranks_when_reordering_cannot_balance_them():
    # rank 0 holds every heavy micro-batch: no order of its own slots helps, a swap does
    dp, m, pp = 2, 4, 2
    f = np.ones((dp, m, pp))
    f[0] = 2.0
    b = 2.0 * f
    perms = np.asarray(list(itertools.permutations(range(m))))
    best_order = pipeline_makespan_s(f[0][perms], b[0][perms], 0.0, pp=pp).min()
    slots, span = arrange_slots(f, b, 0.0, pp=pp)
    assert span.max() < best_order * 0.9
    assert set(slots[0].tolist()) & set(range(m, 2 * m))      # rank 0 got a light one
    assert sorted(slots.ravel().tolist()) == list(range(dp * m))


def test_a_micro_batch_takes_its_new_ranks_calibration():
    dp, m, pp = 2, 4, 2
    f, b = _costs(dp, m, pp, seed=3)
    scale = np.array([[1.0, 1.0], [1.6, 1.6]])               # rank 1's GPUs are slow
    slots, span = arrange_slots(f, b, 0.0, pp=pp, scale=scale)
    s = scale[:, None, :]
    got = pipeline_makespan_s(_gather(f, slots) * s, _gather(b, slots) * s, 0.0, pp=pp)
    np.testing.assert_allclose(span, got, rtol=1e-12)
    assert span.max() <= pipeline_makespan_s(f * s, b * s, 0.0, pp=pp).max() * (1 + 1e-12)
    # the slow rank ends up with less work than the fast one
    work = (_gather(f, slots) + _gather(b, slots)).sum(axis=(1, 2))
    assert work[1] < work[0]


def _segments(n=160, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.exp(rng.normal(7.5, 1.3, n)).astype(np.int64) + 16, 8192)
    return [(i, 0, int(x)) for i, x in enumerate(lengths)]


CASES = [("dense", None, 0), ("dense", (4, 2, (3, 3, 3, 2, 3, 3, 3, 4)), 0),
         ("dense", None, 128), ("sparse", None, 0), ("sparse", (4, 2, (3, 3, 3, 2, 3, 3, 3, 4)),
                                                     128)]


def _model(kind, layout):
    lm = LatencyModel.analytic(pp=4)
    if layout is not None:
        lm = lm.with_layout(PipelineLayout(*layout))
    return (lm.all_dense(), 1.0) if kind == "dense" else (lm, 0.5)


def _step_s(model, plan, d, dp, m):
    costs = UnitCosts.from_latency(model, model.unit_features(plan.unit_csr(True)), dp, m,
                                   np.array([d]))
    f, b = costs.at(np.zeros(costs.shape, dtype=int))
    return float(pipeline_makespan_s(f, b, model.p2p_s, pp=costs.pipeline_ranks).max())


@pytest.mark.parametrize("kind, layout, multiple", CASES)
def test_sab_plan_arranges_on_the_models_own_costs_and_is_never_slower(kind, layout, multiple):
    model, d = _model(kind, layout)
    segs, dp, m, cap = _segments(), 4, 8, 16384
    kw = dict(dp=dp, num_microbatches=m, max_tokens=cap, sensitivity=SensitivityTracker(),
              seed=7, length_multiple=multiple)
    cost = latency_sample_cost_fn(model, d)
    plan = sab_plan(segs, cost_fn=cost, **kw)
    check_plan_covers(plan, segs, cap)
    assert plan.length_multiple == multiple
    # the per-stage costs the arrangement simulates are the model's own for these micro-batches
    f, b = cost.unit_costs(plan.unit_csr(with_padding=True))
    exact = UnitCosts.from_latency(model, model.unit_features(plan.unit_csr(True)), dp, m,
                                   np.array([d]), calibrated=False)
    ef, eb = exact.at(np.zeros(exact.shape, dtype=int))
    np.testing.assert_allclose(f, ef.reshape(dp * m, -1), rtol=1e-12)
    np.testing.assert_allclose(b, eb.reshape(dp * m, -1), rtol=1e-12)
    flat = sab_plan(segs, cost_fn=cost, arrange=False, **kw)
    assert _step_s(model, plan, d, dp, m) <= _step_s(model, flat, d, dp, m) * (1 + 1e-12)
    # the arrangement moves whole micro-batches: the same micro-batches, placed elsewhere
    key = sorted(tuple(sorted(mb)) for rank in plan.micro_batches for mb in rank)
    assert key == sorted(tuple(sorted(mb)) for rank in flat.micro_batches for mb in rank)
    again = sab_plan(segs, cost_fn=latency_sample_cost_fn(model, d), **kw)
    assert again.micro_batches == plan.micro_batches


def test_the_segment_cost_counts_every_virtual_stage():
    # the interleaved layout's second model chunk (its LM head on the last stage) is part of a
    # document's cost
    lm = LatencyModel.analytic(pp=4).with_layout(PipelineLayout(4, 2, (3, 3, 3, 2, 3, 3, 3, 4)))
    cost = latency_sample_cost_fn(lm, 0.5)
    lengths = np.array([128, 4096, 16384])
    empty = np.zeros(2, np.int64), np.zeros(0, np.int64)
    want = sum(lm.without_call_costs().predict_many((np.arange(4), lengths), 0.5, s)
               - lm.without_call_costs().predict_many(empty, 0.5, s)[0] for s in range(8))
    np.testing.assert_allclose(cost(lengths), want, rtol=1e-12)
