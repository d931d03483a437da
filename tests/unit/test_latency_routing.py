"""Routing in the latency model and the planners: the features follow the two kernels (sparse work
of long documents at the unit's density, dense work of short ones whatever the density), the fit
has a coefficient per kernel, a unit of short documents alone cannot be cut, and routed documents
count at density 1 in every mean density."""

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, LatencyTableError, analytic_table
from sparsebalance_megatron.latency.analytic import DeviceProfile, flop_price
from sparsebalance_megatron.latency.crossover import crossover_lengths, crossover_tokens
from sparsebalance_megatron.latency.features import MODEL_FEATURES, UnitFeatures
from sparsebalance_megatron.latency.table import validate_table
from sparsebalance_megatron.latency.work import (attention_work, chunked_attention_work,
                                                 selection_work)
from sparsebalance_megatron.policy import UnitCosts, density_grid
from tests.unit._bands import band_plan

UNITS = [[40, 300, 10, 23, 267], [500], [20, 30]]
BS, N = 16, 100
D0, DMIN, DMAX = 0.5, 0.125, 1.0


def _blocks(n):
    return -(-n // BS)


@pytest.mark.parametrize("work_mode", ["kept", "chunked"])
def test_features_follow_the_two_kernels(work_mode):
    f = UnitFeatures.build(UNITS, BS, 1, 1, work_mode, 4, dense_below_tokens=N)
    long = [[n for n in u if n >= N] for u in UNITS]
    short = [[n for n in u if n < N] for u in UNITS]
    work = attention_work if work_mode == "kept" else \
        lambda docs, d, bs, s, l: chunked_attention_work(docs, d, bs, s, l, 4) if docs else 0.0
    for d in (0.25, 1.0):
        want = [work(u, d, BS, 1, 1) if u else 0.0 for u in long]
        np.testing.assert_array_equal(f.attention_work(d), want)
        np.testing.assert_array_equal(f.work_grid([d])[:, 0], want)
    np.testing.assert_array_equal(f.selection_work, [selection_work(u, BS) if u else 0.0
                                                     for u in long])
    np.testing.assert_array_equal(f.dense_work, [sum(_blocks(n) * (_blocks(n) + 1) / 2
                                                     for n in u) for u in short])
    # routed work at density 1 is exactly what the unrouted features count there
    full = UnitFeatures.build(UNITS, BS, 1, 1, "kept", 4)
    routed = UnitFeatures.build(UNITS, BS, 1, 1, "kept", 4, dense_below_tokens=N)
    np.testing.assert_array_equal(routed.attention_work(1.0) + routed.dense_work,
                                  full.attention_work(1.0))
    np.testing.assert_array_equal(f.tokens, [sum(u) for u in UNITS])
    np.testing.assert_array_equal(f.sequences, [len(u) for u in UNITS])
    assert f.matrix(0.5, MODEL_FEATURES).shape == (3, 8)
    # one call of each kernel per unit that has a document on its path
    np.testing.assert_array_equal(f.sparse_calls, [1, 1, 0])
    np.testing.assert_array_equal(f.dense_calls, [1, 0, 1])


@pytest.mark.parametrize("work_mode", ["kept", "chunked"])
@pytest.mark.parametrize("routing", [0, N])
def test_features_pickle_small_and_come_back_equal(work_mode, routing):
    """The planner process sends a step's features back pickled: without the arrays offsets and
    lengths give back (half the bytes), which unpickling rebuilds equal, routing included."""
    import pickle

    f = UnitFeatures.build(UNITS * 50, BS, 1, 1, work_mode, 4, dense_below_tokens=routing)
    f.work_grid([0.25, 1.0])                               # the caches a draft fills
    g = pickle.loads(pickle.dumps(f))
    for name, a in vars(f).items():
        if isinstance(a, np.ndarray):
            b = getattr(g, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    for d in (0.25, 0.5, 1.0):
        np.testing.assert_array_equal(g.work_grid([d]), f.work_grid([d]))
        np.testing.assert_array_equal(g.attention_work(d), f.attention_work(d))
    np.testing.assert_array_equal(g.sparse_calls, f.sparse_calls)
    # the per-document block counts and units are not sent
    assert len(pickle.dumps(f)) < len(pickle.dumps(dict(vars(f)))) - f.doc_unit.nbytes


def test_no_routing_keeps_the_features_as_they_were():
    a = UnitFeatures.build(UNITS, BS, 1, 0)
    b = UnitFeatures.build(UNITS, BS, 1, 0, dense_below_tokens=0)
    np.testing.assert_array_equal(a.matrix(0.3), b.matrix(0.3))
    assert not b.dense_work.any()
    with pytest.raises(ValueError, match=r"dense_below_tokens=-1: expected an integer >= 0"):
        UnitFeatures.build(UNITS, BS, dense_below_tokens=-1)


# The analytic table's own sparse kernel (flex, measured) never beats its (measured cuDNN) dense
# one at d0 0.5 on 32K: every document would route dense. An idealised FLOP-priced sparse kernel
# at twice the published throughputs, with flex's former 0.637 ms per call, routes short
# documents only (crossover 8K), which these tests need.
FAST_SPARSE = flop_price(DeviceProfile(attn_fwd_flops=700e12, attn_bwd_flops=560e12),
                         call_s=0.637e-3)


def _routed_table(**kw):
    return analytic_table(routing_density=D0, sparse_price=FAST_SPARSE, **kw)


def _routed_model(**kw):
    return LatencyModel.from_table(_routed_table(**kw))


def test_a_unit_of_short_documents_takes_the_same_time_at_every_density():
    m = _routed_model()
    n = m.dense_below_tokens
    assert 0 < n < m.table["model"]["seq_length"]
    short, mixed = [n // 2] * 40, [n // 2] * 40 + [8 * n]
    grid = m.unit_terms([short, mixed], 0).time_grid_s(density_grid(D0, DMIN, DMAX))
    assert np.ptp(grid[0]) == 0.0 and grid[0, 0] > 0
    assert np.all(np.diff(grid[1]) >= 0) and np.ptp(grid[1]) > 0
    # a table without routing, run with it (--sb-dense-below-tokens): the same, priced by the
    # sparse kernel's per-pair cost
    plain = LatencyModel.analytic().with_routing(n)
    assert np.ptp(plain.unit_terms([short], 0).time_grid_s([0.125, 0.5, 1.0])) == 0.0


def test_fit_recovers_separate_dense_and_sparse_coefficients(tmp_path):
    table = _routed_table(pp=2, seed=3)
    truth = table["coefficients"], table["dense_coefficients"]
    for key in ("coefficients", "dense_coefficients"):
        del table[key]
    m = LatencyModel.fit(table)
    for kind in ("first", "last", "middle"):
        for p in ("fwd", "bwd"):
            np.testing.assert_allclose(m.coef[kind][p], truth[0][kind][p], rtol=1e-6,
                                       atol=1e-12)
            assert m.table["dense_coefficients"][kind][p] == pytest.approx(truth[1][kind][p],
                                                                          rel=1e-6)
    assert truth[1]["first"]["fwd"] != pytest.approx(truth[0]["first"]["fwd"][2], rel=0.05)
    m.save(str(tmp_path / "t.json"))                       # round trip keeps both
    back = LatencyModel.load(str(tmp_path / "t.json"))
    assert back.dense_below_tokens == m.dense_below_tokens
    assert back.predict([64] * 30 + [4096], 0.3, 1) == pytest.approx(
        m.predict([64] * 30 + [4096], 0.3, 1), rel=1e-12)


def test_a_grid_without_routed_documents_writes_no_dense_coefficient():
    table = analytic_table()
    del table["coefficients"]
    m = LatencyModel.fit(table)
    assert "dense_coefficients" not in m.table and m.dense_below_tokens == 0
    routed = m.with_routing(256)
    assert routed.table is m.table and routed.dense_below_tokens == 256


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.__setitem__("dense_crossover_tokens", -1), r"'dense_crossover_tokens': -1"),
    (lambda t: t.__setitem__("dense_crossover_tokens", True), r"'dense_crossover_tokens': True"),
    (lambda t: t.__setitem__("dense_crossover", [1]), r"'dense_crossover': \[1\]"),
    (lambda t: t["dense_coefficients"]["only"].__setitem__("fwd", -1.0),
     r"'dense_coefficients.only.fwd': -1.0: expected a finite number >= 0"),
    (lambda t: t["dense_coefficients"].__setitem__("first", {"fwd": 0, "bwd": 0}),
     r"'dense_coefficients.first': expected one of the measured stage kinds"),
])
def test_bad_routing_entries_are_refused_naming_the_field(mutate, needle):
    table = analytic_table(routing_density=D0)
    mutate(table)
    with pytest.raises(LatencyTableError, match=needle):
        validate_table(table)


def test_crossover_rule_and_lengths():
    assert crossover_lengths(64, 1000) == [64, 128, 192, 256, 384, 512, 768, 1000]
    L = [64, 128, 256, 512]
    assert crossover_tokens(L, [1, 1, 1, 1], [2, 2, 0.5, 0.5]) == 256
    assert crossover_tokens(L, [1, 1, 1, 1], [2, 0.5, 2, 0.5]) == 512    # must stay faster
    assert crossover_tokens(L, [1, 1, 1, 1], [0.5] * 4) == 0             # never route
    assert crossover_tokens(L, [1, 1, 1, 1], [2] * 4) == 513             # always dense
    with pytest.raises(ValueError, match="expected the same number"):
        crossover_tokens(L, [1], [1])


def test_context_parallel_divides_dense_work_like_attention_work():
    m = _routed_model()
    cp = m.with_context_parallel(2, a2a_bytes_per_s=1e30, collective_latency_s=0.0)
    for p in ("fwd", "bwd"):
        assert cp._stage_coef[0][p][5] == pytest.approx(m._stage_coef[0][p][5] / 2)


def test_dst_does_not_cut_a_unit_it_cannot_and_counts_routed_documents_at_density_one():
    m = _routed_model()
    n = m.dense_below_tokens
    # rank 0 is the straggler: a heavy unit of short documents and a long one; rank 1 is light
    units = [[n // 2] * 120, [16 * n] * 2, [4 * n], [2 * n]]
    costs = UnitCosts.from_latency(m, units, dp=2, num_microbatches=2,
                                   densities=density_grid(D0, DMIN, DMAX))
    assert costs.dense_work[0, 0, 0] > 0 and costs.attn_work[0, 0, 0] == 0
    plan = band_plan(costs, None, D0, DMIN, DMAX, anchor="mean", tolerance=0.0)
    d, rep = plan.densities, plan.report
    assert d[0, 0, 0] == D0 and d[0, 1, 0] < D0          # only the long unit was cut
    assert rep.units_cut == 1
    assert rep.mean_density_static > D0                   # the routed documents at density 1
    dense, sparse = costs.dense_work.sum(), costs.attn_work.sum()
    assert rep.mean_density == pytest.approx(((d * costs.attn_work).sum() + dense)
                                             / (sparse + dense))
    unrouted = UnitCosts.from_latency(LatencyModel.analytic(), units, dp=2, num_microbatches=2,
                                      densities=density_grid(D0, DMIN, DMAX))
    assert unrouted.dense_work is None


def test_reported_density_counts_routed_documents_at_one():
    from types import SimpleNamespace

    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.step.report_sums import (rank_parts, step_figures,
                                                                  summed_parts, unit_work)
    from sparsebalance_megatron.megatron.step.reporting import step_record
    from sparsebalance_megatron.plan import BudgetPlan

    sb = SparseBalanceConfig(sparse_attention=True, block_size=16)
    batch = sequential_plan([(0, 0, 40), (1, 0, 200), (2, 0, 200)], dp=2, num_microbatches=1,
                            max_tokens=256)
    step = SimpleNamespace(batch=batch, plan=BudgetPlan.static(0, 0.5, 2, 1, 1), report=None,
                           first_bin=0, consumed_samples=2)
    from sparsebalance_megatron.megatron.step.record import StepSummary

    gathered = StepSummary(loss=(1.0, 1.0))

    def record(routing):      # both DP ranks' sums, as the DP group's reduce adds them
        total = summed_parts([rank_parts(batch.row_plan(r), sb, step.plan.densities[r:r + 1],
                                         dense_below_tokens=routing) for r in range(2)])
        return step_record(1, step, gathered, {}, overhead_s=0.0,
                           figures=step_figures(total))

    work, dense = unit_work(batch, sb)
    assert dense is None
    plain = record(0)
    assert plain["mean_density"] == pytest.approx(0.5)
    work, dense = unit_work(batch, sb, dense_below_tokens=100)
    assert dense.sum() > 0 and np.all(work + dense == unit_work(batch, sb)[0])
    rec = record(100)
    want = (0.5 * work.sum() + dense.sum()) / (work.sum() + dense.sum())
    assert rec["mean_density"] == pytest.approx(want) and rec["mean_density"] > 0.5
    assert rec["density_per_stage"] == [pytest.approx(want)]


def test_the_studys_dense_run_is_priced_by_the_dense_kernel():
    """The simulator's ``dense`` baseline runs every document through the dense kernel (the
    table's dense coefficients), not the sparse kernel at density 1; sparse runs keep routing
    at the table's crossover."""
    import copy

    from sparsebalance_megatron.experiments import StudyConfig, run_study

    table = _routed_table(pp=2)
    cheap = copy.deepcopy(table)
    for kind in cheap["dense_coefficients"].values():
        for p in kind:
            kind[p] *= 0.25
    lengths = np.random.default_rng(0).integers(200, 6000, size=400)
    cfg = StudyConfig(microbatches=4, seq_length=8192, steps=2)
    runs = {"dense": ("dense", None), "static": ("static", None)}
    # routing at 2K (the table's crossover is derived for 32K micro-batches)
    rows = [run_study(2, cfg, LatencyModel.from_table(t).with_routing(2048), lengths, runs,
                      baseline="static") for t in (table, cheap)]
    assert rows[1]["dense"]["step_time_s"] < rows[0]["dense"]["step_time_s"]
    # static sparse: only its routed short documents get cheaper, much less than dense
    gain_dense = rows[0]["dense"]["step_time_s"] - rows[1]["dense"]["step_time_s"]
    gain_static = rows[0]["static"]["step_time_s"] - rows[1]["static"]["step_time_s"]
    assert 0 <= gain_static < gain_dense
