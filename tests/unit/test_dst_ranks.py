"""DST planned per DP rank (policy/dst_ranks.py): the band search over all rows
(``_bands.central_plan``, the same code run another way) bit for bit, its verdicts replayed on
the agreed sums, then a descent per rank (at DP 1 the one's) that keeps the global floors, with
a predicted step close to the descent over all ranks at once (``_bands.central_descent``). The
quality objective's last rule is left out of these comparisons (``rule_free``); its own test is
``test_dst_quality``."""

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance_megatron.policy import DSTSettings, plan_dst, weighted_mean_density
from sparsebalance_megatron.policy.bands import candidate_tree
from sparsebalance_megatron.policy.dst_ranks import rank_slice
from sparsebalance_megatron.policy.dst_band import SPEED_TIE
from sparsebalance_megatron.policy.quality_bound import bind_quality
from tests.unit._bands import (central_descent, central_plan, rule_free, stage_mean_densities,
                               without_adoption)

from test_policy_dst import D0, DMAX, DMIN, _quality, step_time_of, synthetic_costs

FLOORS = dict(density_floor=0.9, stage_density_floor=0.75)


def _central(costs, sens, s, quality=None, rank_scale=None):
    from sparsebalance_megatron.policy.agreed_stats import straggler_present
    return central_plan(costs, sens, s, None if quality is None else bind_quality(quality, costs),
                        narrow=straggler_present(rank_scale, s.tolerance))


def _descended(costs, sens, s, quality=None) -> np.ndarray:
    """The densities of the descent over every rank at once from the central band plan."""
    q = None if quality is None else bind_quality(quality, costs)
    return central_descent(central_plan(costs, sens, s, q), costs, s, q)


def _case(rng, dp):
    m, pp = int(rng.integers(2, 9)), int(rng.integers(2, 5))
    costs = synthetic_costs(dp, m, pp, seed=int(rng.integers(1 << 30)),
                            lm_head=float(rng.uniform(0.3, 3)))
    return costs, rng.random((dp, m)), pp


@pytest.mark.parametrize("objective", ["quality", "density"])
def test_dp1_keeps_the_central_band_plan_or_descends_from_it(objective):
    """At DP 1 the rounds are the same, every reduction the identity: the plan is the central
    band plan, report and all, or the probed descent's, predicted faster by more than
    ``SPEED_TIE``, its report its own densities' and the descent's floors kept."""
    rng = np.random.default_rng(11 if objective == "quality" else 12)
    descended = 0
    for _ in range(8):
        costs, sens, pp = _case(rng, 1)
        q = _quality(pp) if objective == "quality" else None
        for kw in (FLOORS, dict(FLOORS, descent=False)) if q is None else (FLOORS,):
            s = DSTSettings(D0, DMIN, DMAX, **kw)
            central = _central(costs, sens, rule_free(s), quality=q)
            dec = plan_dst(costs, sens, rule_free(s), quality=q)
            if np.array_equal(dec.densities, central.densities):
                assert without_adoption(dec.report) == central.report
                continue
            assert s.descent
            descended += 1
            r, d, w = dec.report, dec.densities, costs.attn_work
            assert r.step_time_planned_s < central.report.step_time_planned_s * (1 - SPEED_TIE)
            assert step_time_of(costs, d) == pytest.approx(r.step_time_planned_s, rel=1e-12)
            assert r.mean_density == pytest.approx(weighted_mean_density(d, w), rel=1e-12)
            assert weighted_mean_density(d, w) >= D0 - 1e-9          # the descent's floors
            assert stage_mean_densities(d, w).min() >= 0.75 * D0 - 1e-9
            if q is not None:
                assert bind_quality(q, costs).plan_cost(d) <= 1e-12
    assert descended >= 2, descended


def test_the_band_search_is_the_central_one():
    """Without the descent the decomposed plan is the central band plan: every candidate's
    plan is per rank but for the agreed anchor, T0 and T1, and the verdicts are replayed."""
    rng = np.random.default_rng(21)
    for dp in (2, 3, 4, 6):
        costs, sens, _ = _case(rng, dp)
        s = DSTSettings(D0, DMIN, DMAX, descent=False, **FLOORS)
        central = _central(costs, sens, rule_free(s))
        dec = plan_dst(costs, sens, rule_free(s))
        np.testing.assert_array_equal(dec.densities, central.densities)
        assert dec.report.step_time_planned_s == central.report.step_time_planned_s
        assert dec.report.mean_density == pytest.approx(central.report.mean_density, rel=1e-12)


@pytest.mark.parametrize("objective", ["quality", "density"])
def test_the_decomposed_plan_keeps_the_floors_and_is_close(objective):
    rng = np.random.default_rng(31 if objective == "quality" else 32)
    ratios = []
    for case in range(10):
        dp = int(rng.integers(1, 7))
        costs, sens, pp = _case(rng, dp)
        q = _quality(pp) if objective == "quality" else None
        s = DSTSettings(D0, DMIN, DMAX, **FLOORS)
        central = _descended(costs, sens, rule_free(s), quality=q)
        dec = plan_dst(costs, sens, rule_free(s), quality=q)
        d, w = dec.densities, costs.attn_work
        t = step_time_of(costs, d)
        assert t == pytest.approx(dec.report.step_time_planned_s, rel=1e-12)
        assert t <= step_time_of(costs, np.full(d.shape, D0)) * (1 + 1e-12)
        assert np.all((d >= DMIN - 1e-12) & (d <= DMAX + 1e-12))
        assert weighted_mean_density(d, w) >= 0.9 * D0 - 1e-9
        assert stage_mean_densities(d, w).min() >= 0.75 * D0 - 1e-9
        if q is not None:
            assert bind_quality(q, costs).plan_cost(d) <= 1e-12
        ratios.append(t / step_time_of(costs, central))
    # the decomposed step is within 0.5% of the descent over all ranks at once (max 1.0018 on
    # these 20, two of them DP 1)
    assert max(ratios) <= 1.005 and np.median(ratios) <= 1.0, ratios


def test_the_other_ranks_raises_pay_a_critical_ranks_cuts():
    """The miss a rank descending alone made (issue 77): DP 3, rank 1 critical; the descent's
    start has no slack over the floors, so rank 1 alone could barely cut (1.47% slower than the
    central plan, whose rounds raise the other ranks while they cut rank 1). With the other
    ranks' fills agreed as supply and the slack split by demand, the decomposed plan keeps the
    floors and is no slower than the central one."""
    costs = synthetic_costs(3, 5, 4, seed=1016568231, lm_head=0.8111650382573556)
    q, s = _quality(4), DSTSettings(D0, DMIN, DMAX, **FLOORS)
    central = _descended(costs, None, rule_free(s), quality=q)
    dec = plan_dst(costs, None, rule_free(s), quality=q)
    d, w = dec.densities, costs.attn_work
    assert step_time_of(costs, d) <= step_time_of(costs, central)
    assert step_time_of(costs, d) < dec.report.step_time_static_s * 0.93
    assert weighted_mean_density(d, w) >= D0 - 1e-9 and bind_quality(q, costs).plan_cost(d) <= 1e-12
    assert stage_mean_densities(d, w).min() >= 0.75 * D0 - 1e-9
    critical = int(np.argmax([step_time_of(costs, np.full(costs.shape, D0), r)
                              for r in range(3)]))
    assert critical == 1 and (d[1] < D0).sum() > 0 and (d[2] > D0).sum() > 0


def test_the_tree_holds_every_candidate_the_search_asks_for():
    s = DSTSettings(D0, DMIN, DMAX, **FLOORS)
    tree = candidate_tree(s, narrow=False)
    assert len(tree) == 2 + 3 * (1 + 4 + 16)           # the band, no cut, 3 rounds' tolerances
    assert len(candidate_tree(s, narrow=True)) == len(tree) + 3


def test_a_rank_slice_is_the_ranks_rows():
    costs = synthetic_costs(3, 4, 2, seed=5)
    c = rank_slice(costs, 1)
    assert c.shape == (1, 4, 2)
    np.testing.assert_array_equal(c.total_s[0], costs.total_s[1])
    np.testing.assert_array_equal(c.attn_work[0], costs.attn_work[1])


def test_a_slow_gpu_narrows_the_band_alike():
    """The slow-GPU verdict (``narrow``) is agreed: the narrower bands are candidates of every
    rank, and the band plan is the central one (a 10% slow rank, cut under the default band)."""
    from test_dst_bands import BAND, _scale, _slow_rank_costs

    costs = _slow_rank_costs()
    central = _central(costs, None, rule_free(BAND), rank_scale=_scale())
    dec = plan_dst(costs, None, rule_free(BAND), rank_scale=_scale())
    np.testing.assert_array_equal(dec.densities, central.densities)
    assert (dec.densities[1] < D0).sum() > 0                 # the slow rank is cut


def test_routed_work_counts_in_the_agreed_densities():
    """Documents routed dense (``dense_work``) count at density 1 in the floors: the agreed
    sums carry them, and the band plan is the central one."""
    from sparsebalance_megatron.policy import UnitCosts

    rng = np.random.default_rng(41)
    for dp in (2, 4):
        c, sens, _ = _case(rng, dp)
        costs = UnitCosts(c.densities, c.fwd_s, c.bwd_s, c.attn_work,
                          pipeline_ranks=c.pipeline_ranks,
                          dense_work=c.attn_work * rng.uniform(0, 0.5, c.shape))
        s = DSTSettings(D0, DMIN, DMAX, descent=False, **FLOORS)
        central = _central(costs, sens, rule_free(s))
        dec = plan_dst(costs, sens, rule_free(s))
        np.testing.assert_array_equal(dec.densities, central.densities)
        assert dec.report.mean_density == pytest.approx(central.report.mean_density, rel=1e-12)
        full = plan_dst(costs, sens, DSTSettings(D0, DMIN, DMAX, **FLOORS))
        w = costs.attn_work
        assert weighted_mean_density(full.densities, w, costs.dense_work) >= 0.9 * D0 - 1e-9


def _draft_costs(dp: int, m: int, pp: int, steps: int, seq: int) -> list:
    """Every packing of the runtime's drafts of ``steps`` steps of the built-in corpus (the
    Qwen2.5-0.5B analytic table, its best static layout, default flags): (costs, sensitivity,
    settings, quality)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.batching.sensitivity import unit_sensitivity
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.choice import raise_headroom
    from sparsebalance_megatron.megatron.step.drafting import Drafter
    from sparsebalance_megatron.policy import UnitCosts, density_grid, dst_inputs

    sb = SparseBalanceConfig(sparse_balance=True)
    corpus = corpus_steps(dp, m, sb.density, steps, seq=seq, layout="best", pp=pp)
    lm = corpus.lm
    drafter = Drafter(sb, lm, SensitivityTracker(signal=sb.sensitivity_signal), dp=dp,
                      capacity=seq, attention_layers=lm.layout.attention_layers)
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    out = []
    for k, segs in enumerate(corpus.segments):
        d = drafter.draft(k, 0, segs, m, with_dst=False)          # the packings only
        for batch, units in (d.packing(i) for i in range(d.options)):
            costs = UnitCosts.from_latency(lm, units, dp, batch.num_microbatches, grid,
                                           kept_units=batch.unit_csr())
            settings, q = dst_inputs(sb, costs.shape[2], lm.p2p_s,
                                     raise_headroom(sb, lm, dp), drafter.attention_layers)
            out.append((costs, unit_sensitivity(batch, drafter.tracker), settings, q))
    return out


def test_the_runtimes_drafts_at_dp1_are_planned_as_over_all_rows():
    """The runtime's DP-1 drafts: the band plan is the central one bit for bit (the descent
    off), and the probed descent's step within 0.5% of the descent over all rows."""
    from sparsebalance_megatron.policy.stand_down import plan_step_time_s

    for costs, sens, settings, q in _draft_costs(1, 4, 2, steps=1, seq=8192):
        s = rule_free(settings)
        band = plan_dst(costs, sens, replace(s, descent=False), quality=q)
        want = _central(costs, sens, replace(s, descent=False), quality=q)
        np.testing.assert_array_equal(band.densities, want.densities)
        plan = plan_dst(costs, sens, s, quality=q)
        t, t_want = (plan_step_time_s(costs, d, s.p2p_s)
                     for d in (plan.densities, _descended(costs, sens, s, quality=q)))
        assert t <= t_want * 1.005, t / t_want


def test_the_missed_row_at_128k():
    """The row that once missed by most (DP 2 at 128K, step 1, the baseline packing: 1.0141
    when each rank descended alone): the decomposed step is within 0.5% of the descent over
    both ranks at once."""
    from sparsebalance_megatron.policy.stand_down import plan_step_time_s

    costs, sens, settings, q = _draft_costs(2, 16, 4, steps=2, seq=131072)[3]
    plan = plan_dst(costs, sens, rule_free(settings), quality=q)
    want = _descended(costs, sens, rule_free(settings), quality=q)
    p2p = settings.p2p_s
    t, t_want = (plan_step_time_s(costs, d, p2p) for d in (plan.densities, want))
    assert plan.report.step_time_static_s > t_want * 1.01       # the descent has work to do
    assert t <= t_want * 1.005, t / t_want
    assert weighted_mean_density(plan.densities, costs.attn_work,
                                 costs.dense_work) >= 0.5 - 1e-9
    assert bind_quality(q, costs).plan_cost(plan.densities) <= 1e-12


def test_the_reductions_do_not_grow_with_dp(monkeypatch):
    """Every rank's parts of the five reductions (AR1, AR2, AR3, AR3b, AR4) have the same
    sizes at DP 1, DP 2 and DP 7 (at DP 1 the same rounds run): what crosses the DP group is fixed by m, the stages and the
    settings (AR3b, the largest: P x (3 stages + 6) + stages + 2 floats)."""
    from sparsebalance_megatron.policy import dst_probes, dst_ranks
    from sparsebalance_megatron.policy.dst_probes import PROBES

    sizes, run = {}, {}

    def spy(cls, name):
        f = getattr(cls, name)

        def wrapped(self, *a):
            out = f(self, *a)
            size = sum(np.size(v) for part in out.values() for v in part.values())
            sizes.setdefault(run["dp"], {}).setdefault(name, set()).add(size)
            return out
        monkeypatch.setattr(cls, name, wrapped)

    for name in ("ar1", "cut", "raise_", "descent_start"):
        spy(dst_ranks.RankDST, name)
    spy(dst_probes.RankProbes, "probe")
    m, pp = 6, 3
    for dp in (1, 2, 7):
        run["dp"] = dp
        costs = synthetic_costs(dp, m, pp, seed=50 + dp, lm_head=1.5)
        plan_dst(costs, None, DSTSettings(D0, DMIN, DMAX, **FLOORS), quality=_quality(pp))
    assert sizes[1] == sizes[2] == sizes[7]
    assert all(len(v) == 1 for v in sizes[7].values())
    assert sizes[7]["descent_start"] == {PROBES * (3 * pp + 6) + pp + 2}
    assert sizes[7]["probe"] == {2 * PROBES * (pp + 2)}


def test_a_ranks_budget_is_its_demand_and_a_share_of_what_is_left():
    """``dst_probes._share``: where the ranks' summed demand fits the slack, a rank gets its
    demand and an even part of the rest; where it does not, its part of the slack in
    proportion to its demand (the budgets never sum past the slack)."""
    from sparsebalance_megatron.policy.dst_probes import _share

    slack, total, n = np.array([10.0, 4.0]), np.array([6.0, 8.0]), np.array([2.0, 2.0])
    a, b = _share(slack, np.array([1.0, 2.0]), total, n), _share(slack, np.array([5.0, 6.0]),
                                                                   total, n)
    np.testing.assert_allclose(a, [1.0 + 2.0, 4.0 * 2 / 8])
    np.testing.assert_allclose(b, [5.0 + 2.0, 4.0 * 6 / 8])
    assert np.all(a + b <= slack + 1e-12)
