"""Critical-path descent (policy/critical_path.py, issue 27's headroom): after the band search, DST
cuts the units on paths longer than the step's target and raises the units with float; the plan
is kept only when it meets the floors (and quality rule), spends no density (mean >= d0) and is
predicted faster."""

import numpy as np
import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.policy import (DSTSettings, density_grid, plan_dst,
                                           weighted_mean_density)
from sparsebalance_megatron.policy.critical_path import descend_at, descent_round
from sparsebalance_megatron.policy.quality_bound import bind_quality
from tests.unit._bands import stage_mean_densities
from tests.unit._floats import unit_floats

from test_policy_dst import (D0, DMAX, DMIN, _quality, plan_dst_from_config, step_time_of,
                             synthetic_costs)

FLOORS = dict(density_floor=0.9, stage_density_floor=0.75)


def test_descent_never_slower_keeps_the_floors_and_quality():
    rng = np.random.default_rng(7)
    faster = 0
    for case in range(10):
        dp, m, pp = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 5))
        costs = synthetic_costs(dp, m, pp, seed=700 + case, lm_head=float(rng.uniform(0.3, 3)))
        sens = rng.random((dp, m))
        q = _quality(pp) if case % 2 else None
        band = plan_dst(costs, sens, DSTSettings(D0, DMIN, DMAX, descent=False,
                                                            **FLOORS), quality=q)
        plan = plan_dst(costs, sens, DSTSettings(D0, DMIN, DMAX, **FLOORS), quality=q)
        d, r = plan.densities, plan.report
        t, t_band = step_time_of(costs, d), step_time_of(costs, band.densities)
        assert t <= t_band * (1 + 1e-12)                      # never slower than the band plan
        assert t <= step_time_of(costs, np.full(d.shape, D0)) * (1 + 1e-12)
        assert np.all((d >= DMIN - 1e-12) & (d <= DMAX + 1e-12))
        w = costs.attn_work
        assert weighted_mean_density(d, w) >= 0.9 * D0 - 1e-9
        assert stage_mean_densities(d, w).min() >= 0.75 * D0 - 1e-9
        if q is not None:
            assert bind_quality(q, costs).plan_cost(d) <= 1e-12
        if not np.array_equal(d, band.densities):             # descended: spends no density
            assert weighted_mean_density(d, w) >= D0 - 1e-9
        # the report describes the plan returned
        assert r.step_time_planned_s == pytest.approx(t)
        assert r.mean_density == pytest.approx(weighted_mean_density(d, w))
        assert r.speedup == pytest.approx(r.step_time_static_s / t)
        faster += t < t_band * (1 - 1e-3)
    assert faster >= 3                                        # the descent does find time


def test_descent_only_under_a_floor_a_cut_and_the_bottleneck_target():
    """The paper's rule without a floor, the never-cut ``max`` anchor and the accuracy-first
    raise target are left as they were."""
    costs = synthetic_costs(3, 6, 4, seed=1)
    for kw in (dict(), dict(anchor="max", **FLOORS), dict(raise_to="static", **FLOORS)):
        on = plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, **kw))
        off = plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, descent=False, **kw))
        np.testing.assert_array_equal(on.densities, off.densities)
    on = plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, **FLOORS))
    off = plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, descent=False, **FLOORS))
    assert on.report.step_time_planned_s < off.report.step_time_planned_s * 0.99


def descend(costs, idx, i_min, i_max, p2p_s=0.0, raise_headroom=0.0, meets=None, floors=None):
    """``descend_at`` with floors given on a plan's densities: (grid indices, step)."""
    return descend_at(descent_round(costs, i_min, i_max, p2p_s), idx, raise_headroom,
                      lambda i: meets(costs.densities[i]),
                      None if floors is None else lambda i: floors(costs.densities[i]))


def test_descend_keeps_the_start_when_nothing_meets():
    costs = synthetic_costs(2, 4, 3, seed=3)
    idx = np.full(costs.shape, costs.index_of(D0))
    out, step = descend(costs, idx, costs.index_of(DMIN), costs.index_of(DMAX), 0.0, 0.05,
                        meets=lambda d: False)
    np.testing.assert_array_equal(out, idx)
    assert step == pytest.approx(step_time_of(costs, np.full(costs.shape, D0)))


def test_config_flag_switches_the_descent_and_names_itself_on_bad_values():
    with pytest.raises(ConfigError, match="--sb-dst-descent='on'"):
        SparseBalanceConfig(dst_descent="on")
    assert SparseBalanceConfig().dst_descent == "critical_path"
    costs = synthetic_costs(3, 6, 4, seed=1, grid=density_grid(D0, DMIN, DMAX))
    kw = dict(sparse_balance=True, density=D0, min_density=DMIN, max_density=DMAX,
              dst_objective="density", raise_headroom="0.05")
    on = plan_dst_from_config(SparseBalanceConfig(**kw), costs, None)
    off = plan_dst_from_config(SparseBalanceConfig(dst_descent="off", **kw), costs, None)
    ref = plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, raise_headroom=0.05,
                                                       descent=False, **FLOORS))
    np.testing.assert_array_equal(off.densities, ref.densities)
    assert on.report.step_time_planned_s < off.report.step_time_planned_s


def test_issue27_long_tail_interleaved_case_gains_what_the_band_leaves():
    """The issue's case (long_tail seed 0, its best static layout, vp 2; 4 DP ranks to keep it
    cheap): SAB-free DST under the runtime's defaults (quality objective, floors, raise headroom)
    was within 0.2% of static; the descent finds the longest path's time, losing no predicted
    quality."""
    from sparsebalance_megatron.experiments import StudyConfig, run_study
    from sparsebalance_megatron.experiments.mixes import mix_lengths
    from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout
    from sparsebalance_megatron.latency.analytic import ideal_price

    # the ideal FLOP-priced kernel the case was found with (the descent is the subject here)
    lm = LatencyModel.analytic(ModelShape(seq_length=32768), pp=4, sparse_price=ideal_price())
    lengths = mix_lengths("long_tail", 0, total_tokens=4 * 8 * 32768, tokenizer="qwen")
    lay = PipelineLayout.from_string("Et*3|t*3|t*3|t*2|t*4|t*5|t*4|L", pp=4)  # [3+4]/[3+5]/..
    rows = {}
    for descent in ("off", "critical_path"):
        cfg = StudyConfig(steps=1, seed=0, sb=SparseBalanceConfig(sparse_balance=True,
                                                                  dst_descent=descent))
        rows[descent] = run_study(4, cfg, lm, lengths, {"static": ("static", lay),
                                                        "dst": ("dst", lay)})["dst"]
    assert rows["off"]["speedup_vs_static"] < 1.02
    on = rows["critical_path"]
    assert on["speedup_vs_static"] > 1.05
    assert on["mean_density"] >= 0.5 - 1e-9 and on["min_stage_density"] >= 0.75 * 0.5 - 1e-9
    assert on["predicted_loss"] <= 1e-9


def _plain_descend(costs, idx, i_min, i_max, p2p_s, raise_headroom, meets, rounds=8):
    """The descent as its module docstring states it, with nothing skipped: every round
    searches every unit under every fraction, looks up every candidate plan whole and
    simulates every DP rank (every grid index tried for the grid search)."""
    from sparsebalance_megatron.policy import critical_path as cp
    from sparsebalance_megatron.kernels.descent import CUT_FRACTIONS, RAISE_FRACTIONS
    from sparsebalance_megatron.sim.pipeline import event_graph

    dp, m, nv = costs.shape
    g = event_graph(m, costs.pipeline_ranks, nv // costs.pipeline_ranks)
    t_grid, rows, eps = costs.total_s, np.arange(dp), 1e-9

    def highest(thr, lo, hi):
        lo, hi = np.broadcast_arrays(lo, hi, thr)[:2]
        limit = thr * (1 + eps) + 1e-15
        at = np.broadcast_to(t_grid, thr.shape + (t_grid.shape[-1],))
        out = lo.copy()
        for i in range(t_grid.shape[-1]):                 # the highest that fits wins
            out = np.where((at[..., i] <= limit) & (lo <= i) & (i <= hi), i, out)
        return out

    def sim(i):
        k = i.reshape(-1, dp, m, nv)
        f = np.stack([np.take_along_axis(costs.fwd_s, c[..., None], -1)[..., 0] for c in k])
        b = np.stack([np.take_along_axis(costs.bwd_s, c[..., None], -1)[..., 0] for c in k])
        dur = g.durations(f.reshape(-1, m, nv), b.reshape(-1, m, nv))
        ef = g.earliest_finish(dur, p2p_s)
        return f.reshape(i.shape), b.reshape(i.shape), dur, ef, \
            g.makespan(ef).reshape(i.shape[:-3] + (dp,))

    def floats(dur, ef, deadline):
        return unit_floats(g, dur, ef, deadline, p2p_s).reshape(-1, m, nv)

    f, b, dur, ef, mk = sim(idx)
    step, eta = float(mk.max()), cp.ETA_START
    for _ in range(rounds):
        if eta < cp.ETA_MIN:
            break
        target = step * (1.0 - eta)
        crit = floats(dur, ef, np.full(dp, target)) < 0
        t = f + b
        thr = np.where(crit, t - CUT_FRACTIONS[:, None, None, None]
                       * (t - t_grid[..., i_min]), t)
        cand = highest(thr, i_min, idx)
        fk, bk, dur_k, ef_k, mk_k = sim(cand)
        ok = (mk_k <= target * (1 + eps)) | ~crit.any(axis=(1, 2))
        if not ok.any(axis=0).all():
            eta /= 2
            continue
        pick = np.argmax(ok, axis=0)
        cut, cols, mk_cut = cand[pick, rows], pick * dp + rows, mk_k[pick, rows]
        deadline = np.full(dp, target * (1.0 - raise_headroom))
        cap = np.maximum(floats(dur_k[:, cols], ef_k[:, cols], deadline), 0.0)
        t1 = fk[pick, rows] + bk[pick, rows]
        cand = highest(t1 + RAISE_FRACTIONS[:, None, None, None] * cap, cut, i_max)
        fr, br, dur_r, ef_r, mk_r = sim(cand)
        pick = np.argmax(mk_r <= np.maximum(deadline, mk_cut) * (1 + eps) + 1e-15, axis=0)
        new, new_step = cand[pick, rows], float(mk_r[pick, rows].max())
        if new_step < step * (1 - eps) and meets(costs.densities[new]):
            cols = pick * dp + rows
            idx, f, b, step = new, fr[pick, rows], br[pick, rows], new_step
            dur, ef = dur_r[:, cols], ef_r[:, cols]
            eta = min(eta * 1.5, cp.ETA_MAX)
        else:
            eta /= 2
    return idx, step


def test_descend_plans_exactly_what_the_plain_descent_plans():
    """``descend`` searches and simulates only what a round can change and reuses searches
    across rounds; its plans and step times are the plain descent's, bit for bit (plain and
    interleaved pipelines, p2p latency, raise headroom, floors that reject some rounds, with
    and without ``floors``)."""
    from sparsebalance_megatron.policy import UnitCosts

    rng = np.random.default_rng(11)
    accepted = 0
    for case in range(24):
        dp, m, ranks = int(rng.integers(1, 9)), int(rng.integers(2, 9)), int(rng.integers(2, 5))
        vp = 2 if case % 3 == 0 else 1
        if vp > 1:      # a count Megatron's interleaved schedule runs (a multiple of pp)
            m = ranks * max(1, m // ranks)
        costs = synthetic_costs(dp, m, ranks * vp, seed=900 + case,
                                lm_head=float(rng.uniform(0.2, 3)))
        if vp > 1:
            costs = UnitCosts(costs.densities, costs.fwd_s, costs.bwd_s, costs.attn_work,
                              pipeline_ranks=ranks)
        i_min, i_max = costs.index_of(DMIN), costs.index_of(DMAX)
        start = rng.integers(i_min, i_max + 1, costs.shape) if case % 2 else \
            np.full(costs.shape, costs.index_of(D0))
        floor = float(rng.uniform(0.3, 0.6))               # some rounds fail the floor
        w = costs.attn_work

        def meets(d):
            return weighted_mean_density(d, w) >= floor

        kw = dict(p2p_s=0.003 * (case % 2), raise_headroom=0.05 * (case % 4 > 1))
        got, step = descend(costs, start, i_min, i_max, meets=meets, **kw)
        want, want_step = _plain_descend(costs, start, i_min, i_max, meets=meets, **kw)
        np.testing.assert_array_equal(got, want)
        assert step == want_step
        # a round given up before its raises are simulated (the floor is monotone): the same
        early, early_step = descend(costs, start, i_min, i_max, meets=meets, floors=meets, **kw)
        np.testing.assert_array_equal(early, want)
        assert early_step == want_step
        accepted += not np.array_equal(got, start)
    assert accepted >= 8                                  # the descent did move plans


def test_a_round_from_the_last_rounds_search_plans_what_a_cold_search_plans(monkeypatch):
    """Each round's cut starts from the last round's look-ups and picks on the same plan
    (``kernels.descent.Round``): every cut equals a search from scratch, and the plans and
    step times are the plain descent's, bit for bit, on costs from a latency model (calibrated
    per rank or not), 1F1B and interleaved, with p2p latency and raise headroom."""
    from sparsebalance_megatron import kernels
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.policy import UnitCosts

    calls = []
    real = kernels.descent.Round.cut

    def checked_cut(self, plan, target):
        warm = self._was[0].size > 0
        got = real(self, plan, target)
        cold = kernels.descent.Round(self.graph, self.tables, self.shape, self.i_min,
                                     self.i_max)
        fits, cut = real(cold, plan, target)
        for x, y in zip((got[0], *got[1]), (fits, *cut)):
            np.testing.assert_array_equal(x, y)
        calls.append(warm)
        return got

    monkeypatch.setattr(kernels.descent.Round, "cut", checked_cut)
    rng = np.random.default_rng(5)
    grid = density_grid(D0, DMIN, DMAX)
    accepted = 0
    for case in range(12):
        pp, vp = 2 + 2 * (case % 2), 1 + (case % 4 == 1)   # vp 2: 4 stages on 2 ranks
        dp, m = int(rng.integers(2, 9)), pp * int(rng.integers(2, 5))
        lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=pp)
        if case % 4 > 1:                                   # learned per-GPU factors
            lm.calibrate_ranks(np.ones((dp, pp)), rng.uniform(0.9, 1.2, (dp, pp)))
        lengths = [rng.integers(100, 4000, rng.integers(1, 4)) for _ in range(dp * m)]
        costs = UnitCosts.from_latency(lm, lengths, dp, m, grid)
        if vp > 1:
            costs = UnitCosts(costs.densities, costs.fwd_s, costs.bwd_s, costs.attn_work,
                              pipeline_ranks=pp // vp, tables_checked=True)
        i_min, i_max = costs.index_of(DMIN), costs.index_of(DMAX)
        start = np.full(costs.shape, costs.index_of(D0))
        w = costs.attn_work

        def meets(d, floor=(1.0 if case % 3 else 0.5) * D0):     # d0: the descent's own
            return weighted_mean_density(d, w) >= floor

        kw = dict(p2p_s=0.002 * (case % 2), raise_headroom=0.05 * (case % 4 == 3))
        got, step = descend(costs, start, i_min, i_max, meets=meets, floors=meets, **kw)
        want, want_step = _plain_descend(costs, start, i_min, i_max, meets=meets, **kw)
        np.testing.assert_array_equal(got, want)
        assert step == want_step
        accepted += not np.array_equal(got, start)
    assert sum(calls) >= 10 and accepted >= 4         # warm starts among the cuts checked
