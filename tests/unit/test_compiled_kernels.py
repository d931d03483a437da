"""The planner's compiled loops (``kernels``, numba) give the numpy paths' numbers bit for
bit: the simulator's earliest finishes and starts, the float pass's latest finishes and the grid
look-up ``highest_at_most``, on plain and interleaved graphs, with p2p latency or none, NaN
durations, deadlines per column or one for all; and a whole DST plan (band search, quality
water-filling, critical-path descent) is the same whichever path runs, so a plan does not depend
on whether numba is installed."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import grid_search
from sparsebalance_megatron.policy import DSTSettings, UnitCosts, plan_dst_with_floor, slack
from sparsebalance_megatron import kernels
from sparsebalance_megatron.sim.pipeline import event_graph

from test_policy_dst import D0, DMAX, DMIN, _quality, synthetic_costs

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


@pytest.fixture
def numpy_paths(monkeypatch):
    """Call ``fn`` with the compiled kernels off (the numpy paths the callers fall back to)."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(kernels, "enabled", lambda: False)
            return fn(*args, **kwargs)
    return run


@pytest.mark.parametrize("m, pp, vp", [(16, 4, 2), (16, 4, 1), (5, 3, 1), (1, 2, 1), (12, 4, 3),
                                       (4, 1, 1)])
@pytest.mark.parametrize("cols", [1, 7, 101])
def test_simulator_and_float_pass_are_the_numpy_paths_numbers(numpy_paths, m, pp, vp, cols):
    g = event_graph(m, pp, vp)
    rng = np.random.default_rng(m * 100 + pp * 10 + vp + cols)
    for p in (0.0, 2.5e-3):
        dur = rng.random((g.size, cols)) * (rng.random((g.size, cols)) > 0.1)
        if cols > 1:
            dur[rng.integers(g.size), 0] = np.nan               # NaN spreads as np.maximum's
        want_start, got_start = np.empty_like(dur), np.empty_like(dur)
        want = numpy_paths(g.earliest_finish, dur, p, want_start)
        got = g.earliest_finish(dur, p, got_start)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_start, want_start)
        np.testing.assert_array_equal(g.earliest_finish(np.asfortranarray(dur), p), want)
        top = np.nanmax(want)
        for deadline in (want.max(axis=0), float(top), rng.random(cols) * top):
            want_lf = numpy_paths(slack.latest_finish, g, dur, deadline, p)
            np.testing.assert_array_equal(slack.latest_finish(g, dur, deadline, p), want_lf)
            want_u = numpy_paths(slack.unit_floats_from, g, dur, want, deadline, p)
            got_u = slack.unit_floats_from(g, dur, want, deadline, p)
            assert got_u.shape == want_u.shape == (m * pp * vp, cols)
            np.testing.assert_array_equal(got_u, want_u)


def test_highest_at_most_is_the_binary_liftings_answer(numpy_paths):
    rng = np.random.default_rng(5)
    g = 57
    table = np.sort(rng.random((40, g)), axis=1)              # non-decreasing rows
    table[3] = 0.5                                            # flat rows tie everywhere
    units = rng.integers(0, 40, (6, 50)) * g
    lo = rng.integers(0, g, (6, 50))
    hi = np.minimum(lo + rng.integers(0, g, (6, 50)), g - 1)
    limit = rng.random((6, 50)) * 1.2 - 0.1
    limit[0, :5] = (np.nan, np.inf, -np.inf, 0.5, 0.0)
    for args in ((units, limit, lo, hi), (units, limit, 0, g - 1), (units[0], 0.3, lo, hi),
                 (units, limit, lo, lo), (units[:0], limit[:0], lo[:0], hi[:0]),
                 (units[0], limit, lo[0], hi[0]), (units[0], limit, 3, hi[0]),   # [k, n] rows
                 (units[0, :0], limit[:, :0], lo[0, :0], 0)):
        want = numpy_paths(grid_search.highest_at_most, table, *args)
        got = grid_search.highest_at_most(table, *args)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    rough = rng.random((40, g))                               # not monotone: the same schedule
    np.testing.assert_array_equal(grid_search.highest_at_most(rough, units, limit, lo, hi),
                                  numpy_paths(grid_search.highest_at_most, rough, units, limit,
                                              lo, hi))


@pytest.mark.parametrize("quality", [False, True])
def test_a_whole_dst_plan_is_the_same_with_the_kernels_or_without(numpy_paths, quality):
    rng = np.random.default_rng(11)
    for case in range(3):
        dp, m = int(rng.integers(2, 9)), 4 * int(rng.integers(1, 3))
        flat = synthetic_costs(dp, m, 8, seed=900 + case, lm_head=float(rng.uniform(0.5, 2)))
        costs = UnitCosts(flat.densities, flat.fwd_s, flat.bwd_s, flat.attn_work,
                          pipeline_ranks=4)               # 4 ranks x 2 chunks: interleaved
        sens = rng.random((dp, m))
        settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                               raise_headroom=0.02, p2p_s=1e-4)
        kw = dict(quality=_quality(8) if quality else None,
                  rank_scale=np.where(np.arange(dp * 4).reshape(dp, 4) == 5, 1.2, 1.0))
        want = numpy_paths(plan_dst_with_floor, costs, sens, settings, **kw)
        got = plan_dst_with_floor(costs, sens, settings, **kw)
        np.testing.assert_array_equal(got.densities, want.densities)
        assert got.report.as_dict() == want.report.as_dict()


@pytest.mark.parametrize("pp, vp", [(2, 1), (3, 1), (4, 2), (1, 1)])
def test_a_band_pass_is_the_numpy_paths_pass(numpy_paths, pp, vp):
    """``kernels.band``' cut and raise tries (one compiled loop per row) plan every
    candidate of a band pass as the numpy path does, rows of both objectives mixed, with p2p
    latency and raise headroom; pp = 1 keeps the numpy path (it sums a stage pairwise)."""
    from sparsebalance_megatron.policy.dst_band import plan_dst_candidates

    rng = np.random.default_rng(40 + pp * 10 + vp)
    cands = [("mean", t) for t in (0.0, 0.03, 0.2, 1.5)] + [("max", 0.1), ("median", 0.05)]
    raised = 0
    for case in range(3):
        dp, m = int(rng.integers(2, 7)), pp * int(rng.integers(1, 4))
        flat = synthetic_costs(dp, m, pp * vp, seed=70 + case,
                               lm_head=float(rng.uniform(0.2, 2)))
        costs = UnitCosts(flat.densities, flat.fwd_s, flat.bwd_s, flat.attn_work,
                          pipeline_ranks=pp)
        sens = rng.random((dp, m))
        water = [bool(x) for x in rng.integers(0, 2, len(cands))]
        kw = dict(cache=None, quality=_quality(pp * vp), water=water)
        args = (costs, sens, DSTSettings(D0, DMIN, DMAX, p2p_s=1e-4 * case,
                                         raise_headroom=0.02 * case), cands)
        want = numpy_paths(plan_dst_candidates, *args, **kw)
        got = plan_dst_candidates(*args, **kw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.densities, w.densities)
            assert g.report.as_dict() == w.report.as_dict()
        raised += sum(p.report.units_raised for p in want)
    assert raised > 0                                             # the raise ran


def test_a_raise_try_with_one_searched_column_is_left_to_numpy():
    """numpy sums a water-filled column's slots pairwise when the whole try searches one
    column: the compiled try reports that instead of answering (the caller runs numpy's)."""
    from sparsebalance_megatron.policy.dst_moves import GainIndex, unit_base
    from types import SimpleNamespace

    g = 3
    t = np.tile(np.arange(1.0, g + 1), (1, 2, 2, 1))
    costs = SimpleNamespace(total_s=2.0 * t, fwd_s=t, bwd_s=t.copy())
    units = unit_base((1, 2, 2), np.arange(1), g)
    marg = np.array([[np.inf, 2.0, 1.0], [np.inf, 3.0, 1.0]])
    band = kernels.band.BandPass(costs, units, 1, event_graph(2, 2, 1), 0.0,
                                 np.zeros((1, 2, 2)), GainIndex(marg, 2, 2, 1),
                                 np.ones((1, 2, 2)))
    cur, cap, water = np.zeros((1, 2, 2), dtype=np.int64), np.full((1, 2, 2), 9.0), \
        np.array([True])
    one = band.raise_try(cur, cap, np.array([[0.5, 99.0]]), np.arange(1), np.ones(1), water,
                         g - 1, 12)
    two = band.raise_try(cur, cap, np.array([[0.5, 0.5]]), np.arange(1), np.ones(1), water,
                         g - 1, 12)
    assert one is None and two is not None
    assert two[0].shape == (1, 2, 2) and np.all(two[1] > 0)


def test_water_fill_grid_index_is_the_numpy_paths(numpy_paths):
    """``GainIndex.for_stages``'s look-up (clip(-(e x b), low, high) + shift searched in the
    stages' gain tables, clipped to [lo, hi]) at lambdas from far below to far above every
    gain, on an interleaved layout (4 ranks x 2 chunks)."""
    from sparsebalance_megatron.policy.dst_moves import GainIndex

    rng = np.random.default_rng(2)
    slots, pp, vp, g = 8, 4, 2, 57
    marg = np.sort(rng.random((pp * vp, g)) * 0.3, axis=1)[:, ::-1].copy()
    marg[:, 0] = np.inf
    marg[3, 10:20] = marg[3, 10]                              # a segment of equal gains
    gains = GainIndex(marg, slots, pp, vp)
    ranks = rng.integers(0, pp, 30)
    b = rng.random((slots, 30)) * 2
    b[0, :3] = 0.0
    lo = rng.integers(0, g, (slots, 30))
    hi = np.minimum(lo + rng.integers(0, g, (slots, 30)), g - 1)
    got_at = gains.for_stages(ranks, b, lo, hi)
    want_at = numpy_paths(gains.for_stages, ranks, b, lo, hi)
    for log_lam in (np.full(30, -20.0), np.full(30, 20.0), rng.uniform(-20, 20, 30),
                    np.linspace(-5, 2, 30)):
        np.testing.assert_array_equal(got_at(log_lam), want_at(log_lam))


def test_descent_first_fit_is_every_candidate_simulated(numpy_paths):
    """``_Step.first_fit`` (a compiled binary search per DP rank) picks what simulating every
    candidate and taking the first that fits picks, with its makespan, durations and finishes,
    where some ranks fit at once, some late and some never."""
    from sparsebalance_megatron.policy.critical_path import CUT_FRACTIONS, _Step

    rng = np.random.default_rng(4)
    flat = synthetic_costs(6, 8, 8, seed=31)
    costs = UnitCosts(flat.densities, flat.fwd_s, flat.bwd_s, flat.attn_work, pipeline_ranks=4)
    st = _Step(costs, 1e-4)
    idx = np.full(costs.shape, 40)
    f, b = st.times(idx)
    dur, _, mk = st.run(f, b)
    units = np.sort(rng.choice(idx.size, 150, replace=False))
    units = units[units // st.per_rank != 2]                  # a rank that holds none
    cuts = np.minimum.accumulate(np.sort(rng.integers(0, 41, (CUT_FRACTIONS.size, units.size)),
                                         axis=0)[::-1], axis=0)  # each candidate no higher
    checked = set()
    for limit in (mk * 0.97, mk * 1.01, np.full(mk.size, mk.min() * 0.5),
                  np.where(np.arange(mk.size) % 2, mk * 0.9, mk)):
        want = numpy_paths(st.first_fit, dur, units, cuts, limit)
        k = CUT_FRACTIONS.size                                # a fit known: where it starts
        tight = np.where(want[2], want[3], k)
        loose = np.where(want[2], rng.integers(want[3], k), k)
        for probe_first, known in ((False, None), (True, None), (False, tight), (False, loose)):
            got = st.first_fit(dur, units, cuts, limit, probe_first=probe_first,
                               fits_from=known)
            assert len(got) == len(want) == 7
            for a, w in zip(got, want):
                np.testing.assert_array_equal(a, w)
        checked.update(got[2].tolist())
    assert checked == {True, False}                           # both outcomes were tested


def test_the_descent_on_the_tables_formula_plans_what_it_plans_on_the_tables():
    """``UnitCosts.from_latency`` keeps its tables' formula (``formula``), which the descent's
    kernels evaluate instead of reading the tables: the formula gives the tables' entries bit
    for bit, and the descent plans the same with it and without it, uncalibrated and with
    per-(DP rank, pipeline rank) corrections."""
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.policy import density_grid
    from sparsebalance_megatron.policy.grid_search import highest_at_most
    from sparsebalance_megatron.policy.critical_path import descend

    lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=4)
    rng = np.random.default_rng(12)
    dp, m = 4, 8
    lengths = [rng.integers(100, 2500, rng.integers(1, 6)) for _ in range(dp * m)]
    grid = density_grid(0.25, 0.125, 1.0)
    moved = 0
    for step in range(2):
        costs = UnitCosts.from_latency(lm, lengths, dp, m, grid)
        assert costs.formula is not None and costs.formula[4] == (step == 1)
        work, per_pair, fixed, corr, scaled = costs.formula
        for k, table in enumerate((costs.fwd_s, costs.bwd_s)):
            t = work[:, None, :] * per_pair[k][None, :, None] + fixed[k][:, :, None]
            if scaled:
                t = t * corr[:, :, None]
            np.testing.assert_array_equal(t.reshape(table.shape), table)
        i_min, i_max = costs.index_of(0.125), costs.index_of(1.0)
        units = np.sort(rng.choice(costs.fwd_s[..., 0].size, 40, replace=False))
        lo = rng.integers(0, grid.size, units.size)
        t = costs.total_s.reshape(-1, grid.size)[units]
        limit = rng.uniform(t.min(), t.max(), (3, units.size))
        np.testing.assert_array_equal(
            kernels.fit.highest_formula(costs.formula, units, lo, i_max, limit),
            highest_at_most(costs.total_s, units * grid.size, limit, lo, i_max))
        start = np.full(costs.shape, costs.index_of(0.25))
        got = descend(costs, start, i_min, i_max, 1e-4, 0.02, meets=lambda d: True)
        costs.formula = None
        want = descend(costs, start, i_min, i_max, 1e-4, 0.02, meets=lambda d: True)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]
        moved += int((got[0] != start).sum())
        busy = rng.uniform(1.0, 2.0, (dp, 4))
        lm.calibrate_ranks(busy, busy * rng.uniform(0.8, 1.2, (dp, 4)))   # now corrected
    assert moved > 0


def test_unit_cost_tables_are_the_numpy_paths(numpy_paths):
    """``UnitCosts.from_latency``'s tables, (work x per pair + fixed) x correction, in one
    compiled pass: equal to the numpy passes, uncalibrated and with per-(DP rank, pipeline
    rank) corrections."""
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.policy import density_grid

    lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=4)
    rng = np.random.default_rng(8)
    dp, m = 3, 4
    lengths = [rng.integers(100, 2000, rng.integers(1, 6)) for _ in range(dp * m)]
    grid = density_grid(0.5, 0.125, 1.0)
    for step in range(2):
        want = numpy_paths(UnitCosts.from_latency, lm, lengths, dp, m, grid)
        got = UnitCosts.from_latency(lm, lengths, dp, m, grid)
        np.testing.assert_array_equal(got.fwd_s, want.fwd_s)
        np.testing.assert_array_equal(got.bwd_s, want.bwd_s)
        np.testing.assert_array_equal(got.total_s, want.total_s)     # the kernel's own sum
        np.testing.assert_array_equal(got.total_s, got.fwd_s + got.bwd_s)
        busy = rng.uniform(1.0, 2.0, (dp, 4))
        lm.calibrate_ranks(busy, busy * rng.uniform(0.8, 1.2, (dp, 4)))   # now corrected
    assert not np.all(lm.correction_grid(dp, 4) == 1.0)


@pytest.mark.parametrize("k, m, pp", [(6, 16, 4), (1, 1, 1), (3, 40, 2)])
def test_sensitivity_order_moves_are_the_numpy_paths(numpy_paths, k, m, pp):
    """DST's cut and raise in sensitivity order (the density objective's rows), one compiled
    loop per (row, stage): the numpy path's running sums (np.cumsum less the unit's own), minima
    and grid look-ups, bit for bit; budgets from nothing to everything, zero and NaN floats."""
    from sparsebalance_megatron.policy.dst_moves import cut_densities, raise_densities

    rng = np.random.default_rng(k * m + pp)
    g, i_min, i_max = 57, 0, 56
    t_grid = np.sort(rng.random((k, m, pp, g)), axis=-1) * rng.uniform(0.5, 2.0, (k, 1, 1, 1))
    units = ((np.arange(k)[:, None, None] * m + np.arange(m)[None, :, None]) * pp
             + np.arange(pp)[None, None, :]) * g
    order = np.argsort(rng.random((k, m, pp)), axis=1)
    cur = rng.integers(0, g, (k, m, pp))
    total = t_grid.sum(axis=(1, 3)) / g
    budget = total * rng.uniform(-0.1, 1.5, (k, pp))
    cap = rng.random((k, m, pp)) * rng.uniform(0.0, 0.5)
    cap.reshape(-1)[:: 7] = 0.0
    if cap.size > 3:
        cap.reshape(-1)[3] = np.nan
    for fn, args in ((cut_densities, (t_grid, units, cur, budget, order, i_min)),
                     (raise_densities, (t_grid, units, cur, budget, cap, order, i_max))):
        want = numpy_paths(fn, *args)
        got = fn(*args)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
        if k * m > 4:
            assert np.any(got != cur)                         # some units moved


@pytest.mark.parametrize("work_mode", ["kept", "chunked"])
def test_work_grid_is_the_numpy_paths(numpy_paths, work_mode):
    """``UnitFeatures.work_grid`` (kept block pairs of every unit on a density grid) summed per
    run of equal documents in one compiled loop: the numpy path's gather and segmented sums,
    bit for bit, with padding runs, empty units and routed short documents."""
    from sparsebalance_megatron.latency.features import UnitFeatures

    rng = np.random.default_rng(5)
    units = [np.r_[rng.integers(50, 9000, rng.integers(0, 6)), [128] * rng.integers(0, 9)]
             .astype(np.int64) for _ in range(40)]
    grid = np.r_[np.linspace(0.125, 1.0, 57), 1.0]
    for dense_below in (0, 1024):
        feats = UnitFeatures.build(units, 64, 1, 2, work_mode, 16, dense_below)
        want = numpy_paths(feats.work_grid, grid)
        got = feats.work_grid(grid)
        np.testing.assert_array_equal(got, want)
        assert got.shape == (40, 58) and np.all(got[:, -1] >= got[:, 0])
    assert np.any(want[:, 0] == 0) and np.any(want[:, 0] > 0)


@pytest.mark.parametrize("m, vp, rows, negative", [(16, 2, 6, False), (4, 1, 1, False),
                                                   (40, 4, 3, False), (8, 2, 40, False),
                                                   (16, 2, 6, True)])
def test_water_filling_is_the_numpy_paths(numpy_paths, m, vp, rows, negative):
    """``dst_moves.water_fill`` with the compiled search (every (row, stage) column's bisection
    and common level in one loop, numpy's exps of the grid) gives the numpy path's grid indices:
    limits between all-at-lo and all-at-hi, a few below everything and above everything, one
    column (numpy's path: it sums one column pairwise), 160 slots (beyond numpy's block of 128),
    stages with a segment of equal gains; ``negative``: a column with seconds per density
    below 0, which the kernel searches in full instead of between the bisection's ends."""
    from sparsebalance_megatron.policy.dst_moves import GainIndex, water_fill

    rng = np.random.default_rng(m * vp + rows)
    pp, g = 4, 57
    slots, nv = m * vp, 4 * vp
    marg = np.sort(rng.random((nv, g)) * 0.3, axis=1)[:, ::-1].copy()
    marg[:, 0] = np.inf
    marg[1, 20:40] = marg[1, 20]
    gains = GainIndex(marg, slots, pp, vp)
    t_grid = np.sort(rng.random((rows, slots, pp, g)), axis=-1) * rng.uniform(0.5, 2.0,
                                                                                (rows, 1, 1, 1))
    units = ((np.arange(rows)[:, None, None] * slots + np.arange(slots)[None, :, None]) * pp
             + np.arange(pp)[None, None, :]) * g
    b = rng.random((rows, slots, pp)) * 3
    if negative:
        b[0, :3, 1] *= -1
    lo = rng.integers(0, 20, (rows, slots, pp))
    hi = np.minimum(lo + rng.integers(0, 40, (rows, slots, pp)), g - 1)
    flat = t_grid.reshape(-1)
    at_lo, at_hi = flat.take(units + lo).sum(axis=1), flat.take(units + hi).sum(axis=1)
    limit = at_lo + rng.uniform(-0.1, 1.1, (rows, pp)) * (at_hi - at_lo)
    want = numpy_paths(water_fill, t_grid, units, gains, b, lo, hi, limit)
    got = water_fill(t_grid, units, gains, b, lo, hi, limit)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, hi)                       # some columns were searched


WARM_CHECK = r"""
import numpy as np
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.policy import UnitCosts, density_grid
from sparsebalance_megatron.policy import DSTSettings, plan_dst_with_floor
from sparsebalance_megatron import kernels
import sys
sys.path.insert(0, "tests/unit")
from test_policy_dst import _quality

from sparsebalance_megatron.batching import sab_plan, sequential_plan
from sparsebalance_megatron.batching.packing import latency_sample_cost_fn
from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels
warm_up_kernels()                      # what the planner and training processes call
def signatures():
    import importlib
    out = {}
    for room in kernels.ROOMS:
        mod = importlib.import_module(f"sparsebalance_megatron.kernels.{room}")
        out.update({f"{room}.{k}": len(v.signatures) for k, v in vars(mod).items()
                    if hasattr(v, "signatures") and v.__module__ == mod.__name__})
    return out
before = signatures()
lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=4)
rng = np.random.default_rng(1)
lengths = [rng.integers(200, 3000, rng.integers(1, 5)) for _ in range(6 * 8)]
grid = density_grid(0.5, 0.125, 1.0)
segs = [(i, 0, int(x)) for i, x in enumerate(np.concatenate(lengths))]
sab_plan(segs, dp=6, num_microbatches=8, max_tokens=8192,
         cost_fn=latency_sample_cost_fn(lm, 0.5))
sequential_plan(segs, dp=6, num_microbatches=8, max_tokens=8192)
costs = UnitCosts.from_latency(lm, lengths, 6, 8, grid)
plan_dst_with_floor(costs, rng.random((6, 8)), DSTSettings(
    0.5, 0.125, 1.0, density_floor=0.9, stage_density_floor=0.75, raise_headroom=0.02),
    quality=_quality(4))
lm.calibrate_ranks(np.ones((6, 4)), np.full((6, 4), 1.1))
UnitCosts.from_latency(lm, lengths, 6, 8, grid)
after = signatures()
assert before == after and sum(n > 0 for n in after.values()) == 22, (before, after)
print("ok")
"""


def test_warm_up_compiles_what_a_plan_runs():
    """The planner process warms the kernels up before it says it is ready: afterwards a plan
    (unit costs, the band search with water-filling, the descent) compiles nothing more, so
    no step's draft pays numba's compilation (a fresh interpreter: nothing compiled before)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # numba's disk cache written first (a no-op when it is): from a cold cache the warm-up also
    # compiles every kernel the entry kernels call, each then counting a signature, and the
    # count below is the one a planner process sees, which loads them from the cache
    subprocess.run([sys.executable, "-c", "from sparsebalance_megatron import kernels; "
                    "kernels.warm_up()"], cwd=repo, check=True, capture_output=True, timeout=600)
    done = subprocess.run([sys.executable, "-c", WARM_CHECK], cwd=repo, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_kernel_that_fails_to_compile_falls_back_to_numpy(monkeypatch):
    """A numba that cannot compile on this machine must not stop a run: the warm-up turns the
    kernels off with one warning and the numpy paths run (the same plans)."""
    from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels

    def broken():
        raise RuntimeError("LLVM said no")

    monkeypatch.setitem(kernels._STATE, "on", True)
    monkeypatch.setattr(kernels, "warm_up", broken)
    with pytest.warns(UserWarning, match="compiled kernels are off.*LLVM said no"):
        warm_up_kernels()
    assert not kernels.enabled()
