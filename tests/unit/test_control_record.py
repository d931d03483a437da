"""The per-step control plane's records (``megatron/step/record.py``): what a rank reports travels
as fixed-size float64 vectors. Their round trips are exact, the combining levels (cell,
pipeline, job) give what the old per-rank dicts gave (the slowest TP/CP rank's time, losses and
document sums added, the first violation named), and a record that does not fit its layout is
refused with an error naming the size."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparsebalance_megatron.megatron.step.checks import Violation, budget_violations
from sparsebalance_megatron.megatron.step.record import (MAX_BYTES, RankReport, RecordShape,
                                                          check_record, combine_cell,
                                                          decode_step, doc_slots,
                                                          encode_rank, join_pipeline)
from sparsebalance_megatron.plan import BudgetPlan

DP, PP, TP, M = 3, 2, 2, 4


def _job(rng, *, units: bool = True, untimed=(), bad=None):
    """Every rank's RankReport of a DP 3 x PP 2 x TP 2 step with random timings, losses on the
    last stage and document sums, and what the old dict path computed from them."""
    batch = [[[(int(d), 0, 10) for d in rng.choice(40, 3, replace=False)] for _ in range(M)]
             for _ in range(DP)]
    slots = doc_slots(batch)
    reports = {}
    for dp, pp, tp in itertools.product(range(DP), range(PP), range(TP)):
        n = M - 1 if (dp, pp, tp) in untimed else M       # a rank that missed an interval
        docs = {int(d): (float(rng.uniform(1, 9)), float(rng.integers(1, 50)))
                for d in rng.choice(slots[dp], 2, replace=False)} if pp == PP - 1 else {}
        reports[dp, pp, tp] = RankReport(
            dp, pp, fingerprint=1234567890123, fwd_s=rng.uniform(0.1, 1, n).tolist(),
            bwd_s=rng.uniform(0.1, 1, n).tolist(), units=[(j, pp) for j in range(n)],
            step_s=float(rng.uniform(5, 6)), loss=(float(rng.uniform(1, 9)), 100.0 * (pp == 1)),
            violations=[bad] if bad is not None and (dp, pp, tp) == (2, 1, 1) else [],
            doc_values=docs)
    shape = RecordShape(1, M, M if units else 0, max(len(s) for s in slots))
    return reports, shape, slots


def _exchange(reports, shape, slots):
    """The three levels, as ``StepExchange.gather`` runs them on every rank."""
    cells = {(dp, pp): combine_cell(np.stack([encode_rank(reports[dp, pp, t], shape, slots[dp])
                                              for t in range(TP)]), shape)
             for dp, pp in itertools.product(range(DP), range(PP))}
    lines = np.stack([join_pipeline(np.stack([cells[dp, s] for s in range(PP)]), shape)
                      for dp in range(DP)])
    return decode_step(lines, shape.with_stages(PP), slots)


def test_the_gathered_summary_is_what_every_rank_reported():
    rng = np.random.default_rng(0)
    reports, shape, slots = _job(rng, untimed={(1, 0, 0), (2, 1, 0), (2, 1, 1)})
    s = _exchange(reports, shape, slots)
    for dp, pp in itertools.product(range(DP), range(PP)):
        timed = [sum(r.fwd_s) + sum(r.bwd_s) for t in range(TP)
                 for r in [reports[dp, pp, t]] if len(r.fwd_s) == M]
        if timed:   # the slowest TP rank with every interval timed, as measured_busy took it
            assert s.busy_s[dp, pp] == max(timed)
        else:
            assert np.isnan(s.busy_s[dp, pp])
    assert s.step_s == max(r.step_s for r in reports.values())
    assert s.loss == pytest.approx((sum(r.loss[0] for r in reports.values()),
                                    sum(r.loss[1] for r in reports.values())), rel=1e-15)
    want: dict = {}
    for r in reports.values():
        for d, (a, n) in r.doc_values.items():
            want[d] = (want.get(d, (0, 0))[0] + a, want.get(d, (0, 0))[1] + n)
    assert s.doc_ids.tolist() == sorted(want)
    assert s.doc_sums == pytest.approx(np.array([want[d] for d in sorted(want)]), rel=1e-14)
    assert s.fingerprints_agree and s.violations == 0 and s.examples == []
    # per-interval times of a cell: the slowest of its ranks that timed every interval
    units, fwd, bwd = s.unit_times[0, 1]
    assert units == [(j, 1) for j in range(M)]
    assert fwd == np.maximum(reports[0, 1, 0].fwd_s, reports[0, 1, 1].fwd_s).tolist()
    assert (2, 1) not in s.unit_times                 # no rank of that cell timed them all
    assert s.unit_times[1, 0][1] == reports[1, 0, 1].fwd_s


def test_a_violation_and_a_different_packing_reach_every_rank():
    rng = np.random.default_rng(1)
    bad = Violation("kept", 1, 3, 0.2, 0.5)
    reports, shape, slots = _job(rng, bad=bad)
    reports[0, 0, 1].fingerprint = 99                 # one TP rank packed something else
    s = _exchange(reports, shape, slots)
    assert not s.fingerprints_agree
    assert s.violations == 1
    assert s.examples == ["(dp 2, stage 1, micro-batch 3): kept 0.2000 of the blocks, plan 0.5"]


def test_every_ranks_planner_events_are_counted_once():
    """A TP rank's, another stage's and another DP rank's planner deaths or stalls: summed over
    the cell, the pipeline and the data-parallel group, the same count on every rank."""
    import dataclasses
    rng = np.random.default_rng(2)
    reports, shape, slots = _job(rng)
    assert _exchange(reports, shape, slots).planner_events == 0
    for key, n in (((0, 0, 1), 1), ((1, 1, 0), 2), ((2, 0, 0), 1)):
        reports[key] = dataclasses.replace(reports[key], planner_events=n)
    assert _exchange(reports, shape, slots).planner_events == 4
    with pytest.raises(ValueError, match="planner_events=-1"):
        encode_rank(dataclasses.replace(reports[0, 0, 0], planner_events=-1), shape, slots[0])


def test_budget_violations_are_found_locally_in_unit_order():
    plan = BudgetPlan(0, np.array([[[0.5], [0.25]]]))
    bad = budget_violations(plan, 0, {(1, 0): 0.3, (0, 0): 0.5}, {(0, 0): 0.1, (1, 0): 0.25})
    assert bad == [Violation("request", 0, 1, 0.3, 0.25), Violation("kept", 0, 0, 0.1, 0.5)]
    assert bad[0].describe(0) == "(dp 0, stage 0, micro-batch 1): 0.3 != 0.25"
    assert budget_violations(plan, 0, {}, {(0, 0): 0.1}, check_used=False) == []


def test_one_rank_round_trips_exactly():
    slots = [np.array([4, 8, 15])]
    r = RankReport(0, 0, fingerprint=-(2 ** 62) + 7, fwd_s=[0.1, 1 / 3], bwd_s=[2 / 7, 1e-9],
                   units=[(0, 0), (1, 0)], step_s=None, loss=(np.pi, 4096.0),
                   doc_values={15: (0.1, 3.0), 4: (2.5, 1.0)})
    shape = RecordShape(1, 2, 2, 3)
    buf = encode_rank(r, shape, slots[0])
    assert buf.dtype == np.float64 and buf.shape == (shape.words,)
    s = decode_step(join_pipeline(combine_cell(buf[None], shape)[None], shape)[None],
                    shape, slots)
    assert s.busy_s.tolist() == [[0.1 + 1 / 3 + 2 / 7 + 1e-9]]
    assert s.step_s is None and s.loss == (np.pi, 4096.0)
    assert s.doc_ids.tolist() == [4, 15] and s.doc_sums.tolist() == [[2.5, 1.0], [0.1, 3.0]]
    assert s.unit_times == {(0, 0): ([(0, 0), (1, 0)], [0.1, 1 / 3], [2 / 7, 1e-9])}


def test_record_size_is_set_by_the_step_shape_not_the_world():
    """A rank's or cell's record: 6 + 16 words (the 16th since issue 76: the attention kernel a
    fallback put in place), 4 per timed interval where they travel, 2 per document slot; a DP
    rank's line has a block per stage and one set of document slots. At 64 micro-batches and
    1,000 document slots a cell's record stays under 20 KB, at any DP size."""
    shape = RecordShape(1, 64, 0, 1000)
    assert shape.words == 6 + 16 + 2 * 1000 and shape.nbytes < 20_000
    assert RecordShape(1, 64, 64, 10).words == 6 + 16 + 4 * 64 + 20
    assert shape.with_stages(8).words == 6 + 8 * 16 + 2 * 1000


@pytest.mark.parametrize("kw, match", [
    (dict(stages=0, timed=4), r"stages=0: expected an integer >= 1"),
    (dict(stages=1, timed=-1), r"timed=-1: expected an integer >= 1"),
    (dict(stages=1, timed=True), r"timed=True"),
    (dict(stages=1, timed=4, units=3), r"units=3: expected 0 or timed=4"),
    (dict(stages=1, timed=4, docs=1.5), r"docs=1.5"),
    (dict(stages=1, timed=4, docs=MAX_BYTES // 16), r"over the 64 MiB"),
])
def test_bad_record_shapes_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        RecordShape(**kw)


def test_records_that_do_not_fit_their_layout_are_refused():
    shape = RecordShape(1, 2, 0, 2)
    r = RankReport(1, 0, 5, fwd_s=[1, 1], bwd_s=[1, 1], doc_values={7: (1.0, 1.0)})
    with pytest.raises(ValueError, match=r"document 7 is not one of DP rank 1's 2 documents"):
        encode_rank(r, shape, np.array([3, 8]))
    with pytest.raises(ValueError, match=r"DP rank 1 has 3 documents, the record 2 slots"):
        encode_rank(r, shape, np.array([3, 7, 8]))
    buf = encode_rank(r, shape, np.array([3, 7]))
    with pytest.raises(ValueError, match=rf"{buf.size - 1} words .* expected {buf.size}"):
        check_record(buf[:-1], RecordShape(1, 2, 0, 2))
    with pytest.raises(ValueError, match=r"header .* does not match .*timed=3"):
        check_record(buf, RecordShape(1, 3, 0, 2))       # same size, another shape
    with pytest.raises(ValueError, match=r"expected a float64 vector"):
        check_record(buf.astype(np.float32), shape)
    other = encode_rank(RankReport(0, 0, 5), shape, np.array([3, 7]))
    with pytest.raises(ValueError, match=r"different \(DP rank, stage\) places"):
        combine_cell(np.stack([buf, other]), shape)
    line = join_pipeline(buf[None], shape)
    with pytest.raises(ValueError, match=r"line 0 .* does not match DP rank 0"):
        decode_step(line[None], shape, [np.array([3, 7])])   # DP rank 1's line in place 0
    with pytest.raises(ValueError, match=r"expected float64 \[dp, "):
        decode_step(line[None, :-1], shape, [np.array([3, 7])])


# --- the checks' sums and the packing's identity ------------------------------------------------

def test_recall_sums_count_training_forwards_only():
    from sparsebalance_megatron.megatron.step.checks import recall_sums

    stats = [(0, (5, 6), 1, [0.5, 0.5], [0.9, 0.7]),
             (0, (5, 6), 2, [0.5, 0.5], [0.8, float("nan")]),   # NaN: no estimate
             (1, (7,), 1, [0.5], [0.6]),
             (None, (99,), 1, [1.0], [0.1])]                      # an evaluation forward
    assert recall_sums(stats) == {5: [0.9 + 0.8, 2], 6: [0.7, 1], 7: [0.6, 1]}


def test_the_furthest_attention_fallback_of_any_rank_reaches_every_rank():
    """Each rank reports the kernel it runs after its own fallbacks (1 + its place in the chain,
    0: none); the step's summary holds the furthest, the same on every rank."""
    slots = [np.array([4]), np.array([4])]
    shape = RecordShape(1, 1, 0, 1)
    lines = []
    for dp, backend in ((0, 0), (1, 2)):
        cell = combine_cell(np.stack([encode_rank(RankReport(dp, 0, fingerprint=1,
                                                             backend=b), shape, slots[dp])
                                      for b in (0, backend)]), shape)
        lines.append(join_pipeline(cell[None], shape))
    assert decode_step(np.stack(lines), shape, slots).backend == 2


def _plans():
    """SAB and sequential plans of random batches (empty micro-batches and split documents
    among them), each with its pickled copy (the planner process's: arrays, rows made lazily)."""
    import pickle

    from sparsebalance_megatron.batching import sab_plan, sequential_plan
    from sparsebalance_megatron.data.packing import GlobalBatchSampler

    rng = np.random.default_rng(3)
    for case in range(30):
        dp, m = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        segs = GlobalBatchSampler(rng.integers(1, 9000, 200), capacity=4096, dp=dp,
                                  num_microbatches=m, seed=case).next_global_batch()
        for pack in (sab_plan, sequential_plan):
            plan = pack(segs[:max(dp, len(segs) // 2)], dp=dp, num_microbatches=m,
                        max_tokens=4096)
            yield plan, pickle.loads(pickle.dumps(plan))


def test_doc_slots_and_lengths_are_the_per_segment_definitions():
    """Each DP rank's sorted document ids and a document's length (its last piece's, rank-major)
    from the plan's arrays, as the per-segment walk defines them, on a plan and its pickled
    copy; a document not in the step is refused by name."""
    from sparsebalance_megatron.megatron.step.checks import doc_lengths

    for plan, back in _plans():
        want = [np.unique(np.asarray([s[0] for mb in rank for s in mb], dtype=np.int64))
                for rank in plan.micro_batches]
        last = {d: e - s for d, s, e in plan.segments()}
        ids = np.asarray(sorted(last), dtype=np.int64)
        for p in (plan, back, plan.micro_batches):
            got = doc_slots(p)
            assert len(got) == len(want)
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
        for p in (plan, back):
            assert doc_lengths(p, ids).tolist() == [last[i] for i in ids.tolist()]
    with pytest.raises(KeyError, match="not in the step's packing"):
        doc_lengths(plan, np.array([ids.max() + 1]))


def test_the_fingerprint_names_the_packing_in_every_process():
    """A plan and its pickled copy have one fingerprint; moving one segment to another rank,
    or swapping two micro-batches, changes it."""
    from sparsebalance_megatron.batching.plan import BatchPlan
    from sparsebalance_megatron.megatron.step.checks import fingerprint

    moved = 0
    for plan, back in _plans():
        assert fingerprint(plan) == fingerprint(back)
        rows = [list(map(list, r)) for r in plan.micro_batches]
        if plan.dp > 1 and rows[0][0]:
            rows[1][0].append(rows[0][0].pop())
            other = BatchPlan(rows, plan.method, plan.max_tokens)
            assert fingerprint(other) != fingerprint(plan)
            moved += 1
        if plan.num_microbatches > 1 and rows[0][0] != rows[0][1]:
            rows[0][0], rows[0][1] = rows[0][1], rows[0][0]
            assert fingerprint(BatchPlan(rows, plan.method, plan.max_tokens)) != fingerprint(plan)
    assert moved >= 10
