"""Do no harm (issue 27, ``policy.stand_down``): constructed costs where DST's plan or SAB's
packing is predicted slower than the static baseline, the tie rule of a raised plan, the ablation,
the counters, and the runtime's own DST under the rule. Deterministic, well under a second."""

import numpy as np
import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.policy import UnitCosts, density_grid
from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process
from sparsebalance_megatron.policy.stand_down import (StandDownCounts, choose_step,
                                                      outcome_rounds, plan_step_time_s)
from sparsebalance_megatron.sim.pipeline import simulate_1f1b
from tests.unit._costs import affine_costs
from test_policy_dst import plan_dst_from_config

D0 = 0.5
GRID = density_grid(D0, 0.125, 1.0)


def dst_outcome(costs, d0, p2p_s=0.0, plan=None, enabled=True, payload=None):
    """The DST rule on one packing in one process: ``outcome_rounds`` with a DP group of one."""
    return plan_rounds_in_process([outcome_rounds(costs, d0, p2p_s, plan, enabled,
                                                  payload)])[0]


def affine(fixed, attn):
    return affine_costs(GRID, np.asarray(fixed, float), np.asarray(attn, float))


def plan_with(costs, changes):
    """The static plan with some units moved: {(rank, micro-batch, stage): density}."""
    d = np.full(costs.shape, D0)
    for k, v in changes.items():
        d[k] = v
    return d


def test_step_time_is_the_simulators():
    costs = affine(np.ones((2, 3, 2)), np.arange(12).reshape(2, 3, 2) / 6)
    d = plan_with(costs, {(0, 1, 0): 1.0, (1, 2, 1): 0.125})
    idx = np.searchsorted(costs.densities, d - 1e-12)
    sim = simulate_1f1b(*costs.at(idx))
    assert plan_step_time_s(costs, d) == pytest.approx(sim.step_time_s, rel=1e-12)
    with pytest.raises(ValueError, match="do not match"):
        plan_step_time_s(costs, d[:, :2])


@pytest.mark.reliability(area="budget", case="DST plan predicted slower than the static plan "
                         "(a raise that lengthens the pipeline fill at equal stage busy time)",
                         expect="the static plan is committed and the step counts as stood down")
def test_a_plan_with_equal_stage_busy_times_but_a_longer_pipeline_fill_stands_down():
    """A pipeline-schedule effect a busy-time proxy misses: on one rank of 2 stages, raising the
    first micro-batch on stage 0 and cutting the last one by the same seconds keeps stage 0's
    busy time, but the raise delays the fill of stage 1 and the step grows."""
    costs = affine(np.ones((1, 4, 2)), np.full((1, 4, 2), 2.0))
    plan = plan_with(costs, {(0, 0, 0): 0.75, (0, 3, 0): 0.25})
    t = costs.total_s
    i = {d: costs.index_of(d) for d in (0.25, 0.5, 0.75)}
    assert t[0, 0, 0, i[0.75]] - t[0, 0, 0, i[0.5]] == pytest.approx(
        t[0, 3, 0, i[0.5]] - t[0, 3, 0, i[0.25]])                    # busy time unchanged
    out = dst_outcome(costs, D0, plan=plan)
    assert out.planned_s > out.static_s * 1.01                      # predicted slower
    assert out.dst_stood_down is True
    assert np.all(out.densities == D0) and out.step_s == out.static_s
    kept = dst_outcome(costs, D0, plan=plan, enabled=False)        # the ablation commits it
    assert kept.dst_stood_down is False and np.array_equal(kept.densities, plan)
    assert kept.step_s == out.planned_s


def test_a_raised_plan_may_equal_the_static_step_time_but_not_exceed_it():
    """--sb-raise-to static: raising units off the critical path up to the static step time is
    what DST is for; a hair above it is not committed."""
    fixed = np.ones((2, 2, 1))
    attn = np.zeros((2, 2, 1))
    attn[0] = 1.0                                   # rank 0 is the bottleneck; rank 1 idles
    costs = affine(fixed, attn)
    static_s = plan_step_time_s(costs, np.full(costs.shape, D0))
    # rank 1 has no attention: any density costs the same, its step time stays 2 s < static
    raised = plan_with(costs, {(1, 0, 0): 1.0, (1, 1, 0): 1.0})
    out = dst_outcome(costs, D0, plan=raised)
    assert out.dst_stood_down is False and np.array_equal(out.densities, raised)
    assert out.step_s <= static_s
    # equal: rank 0 itself at a density whose time is the same (a flat cost grid)
    flat = affine_costs(GRID, np.full((1, 2, 1), 3.0), np.zeros((1, 2, 1)))
    up = plan_with(flat, {(0, 0, 0): 1.0})
    tie = dst_outcome(flat, D0, plan=up)
    assert tie.planned_s == tie.static_s and tie.dst_stood_down is False
    # a hair above: stands down
    over = affine_costs(GRID, np.full((1, 2, 1), 3.0), np.full((1, 2, 1), 1e-6))
    assert dst_outcome(over, D0, plan=plan_with(over, {(0, 0, 0): 1.0})).dst_stood_down


def _two_packings(sab_heavy_rank: bool):
    """Costs of two packings of the same documents: the 'SAB' one puts the long documents'
    attention on one rank (slower) or spreads it (faster) against a middling baseline."""
    fixed = np.ones((2, 2, 2))
    spread = np.full((2, 2, 2), 1.0)
    heavy = np.zeros((2, 2, 2))
    heavy[0] = 2.0
    middle = np.full((2, 2, 2), 1.0)
    middle[0, 0] = 1.5
    middle[1, 0] = 0.5
    return [affine(fixed, heavy if sab_heavy_rank else spread), affine(fixed, middle)]


def test_sab_packs_the_baseline_way_unless_predicted_faster():
    worse = choose_step(_two_packings(True), D0)
    assert worse.step_s[0] > worse.step_s[1]
    assert worse.index == 1 and worse.sab_stood_down is True
    assert worse.outcome.step_s == worse.step_s[1]
    better = choose_step(_two_packings(False), D0)
    assert better.step_s[0] < better.step_s[1]
    assert better.index == 0 and better.sab_stood_down is False
    # a tie is no gain: the baseline packing
    same = _two_packings(False)
    tie = choose_step([same[1], same[1]], D0)
    assert tie.index == 1 and tie.sab_stood_down is True
    # the ablation keeps SAB's packing whatever the prediction
    off = choose_step(_two_packings(True), D0, enabled=False)
    assert off.index == 0 and off.sab_stood_down is False
    # one packing (no SAB): no packing choice, nothing counted
    one = choose_step(_two_packings(True)[:1], D0)
    assert one.index == 0 and one.sab_stood_down is None and one.dst_stood_down is None


def _cut_sab_heavy_rank(seen):
    def plan_fn(i, c):
        seen.append(i)
        d = np.full(c.shape, D0)
        if i == 0:
            d[0] = 0.125                     # cut the heavy rank
        return d, f"plan{i}"
    return plan_fn


def test_planned_judges_each_packing_under_the_plan_dst_would_commit_for_it():
    """--sb-stand-down-compare planned (the default): SAB's packing is slower at d0 but DST
    balances it below the baseline's best, so SAB stays. The plan function sees each
    candidate's own costs."""
    seen = []
    ch = choose_step(_two_packings(True), D0, plan_fn=_cut_sab_heavy_rank(seen))
    assert seen == [0, 1]
    assert ch.index == 0 and ch.sab_stood_down is False and ch.dst_stood_down is False
    assert ch.outcome.plan == "plan0" and ch.step_s[0] < ch.step_s[1]
    d = ch.as_dict()
    assert d["sab_stood_down"] is False and d["packing_index"] == 0


def test_static_races_the_static_plans_and_plans_only_the_packing_chosen():
    """--sb-stand-down-compare static: the same case, but the packings race at
    d0, where SAB's is slower, so the baseline is chosen and only it is planned; the record
    keeps SAB's static step and the baseline's committed one. Where SAB's static plan is the
    faster, only SAB's packing is planned and the baseline's static step is recorded."""
    costs = _two_packings(True)
    seen = []
    ch = choose_step(costs, D0, plan_fn=_cut_sab_heavy_rank(seen), compare="static")
    static = [plan_step_time_s(c, np.full(c.shape, D0)) for c in costs]
    assert static[0] > static[1]
    assert seen == [1] and ch.index == 1 and ch.sab_stood_down is True
    assert ch.outcome.plan == "plan1" and ch.step_s == [static[0], ch.outcome.step_s]
    assert ch.baseline_s == static[1]
    seen.clear()
    good = choose_step(_two_packings(False), D0, plan_fn=_cut_sab_heavy_rank(seen),
                       compare="static")
    static = [plan_step_time_s(c, np.full(c.shape, D0)) for c in _two_packings(False)]
    assert static[0] < static[1]
    assert seen == [0] and good.index == 0 and good.sab_stood_down is False
    assert good.step_s == [good.outcome.step_s, static[1]] and good.baseline_s == static[1]
    assert good.outcome.step_s <= static[0] * (1 + 1e-9)
    # without a plan function the two comparisons are the same one
    for flag in ("static", "planned"):
        for sab_heavy in (True, False):
            a = choose_step(_two_packings(sab_heavy), D0, compare=flag)
            assert a.index == (1 if sab_heavy else 0)
    # the ablation plans both packings whatever is compared
    seen.clear()
    off = choose_step(costs, D0, plan_fn=_cut_sab_heavy_rank(seen), enabled=False,
                      compare="static")
    assert seen == [0, 1] and off.index == 0
    with pytest.raises(ValueError, match="compare='both'"):
        choose_step(costs, D0, compare="both")


@pytest.mark.parametrize("seed", range(6))
def test_runtime_dst_under_the_rule_is_never_slower_than_the_baseline_at_d0(seed):
    """The runtime's own planner (quality objective, floors, headroom) on random packings: the
    committed step is never predicted slower than the baseline packing's static step."""
    rng = np.random.default_rng(seed)
    dp, m, pp = 3, 4, 2
    cands = [affine(1 + 0.3 * rng.random((dp, m, pp)),
                    np.repeat(rng.pareto(1.2, (dp, m, 1)), pp, axis=2)) for _ in range(2)]
    cfg = SparseBalanceConfig(sparse_balance=True, density=D0)

    def plan_fn(i, c):
        p = plan_dst_from_config(cfg, c, None, stage_layers=[2] * pp)
        return p.densities, p

    base_static = plan_step_time_s(cands[1], np.full((dp, m, pp), D0))
    for compare in ("static", "planned"):
        ch = choose_step(cands, D0, plan_fn=plan_fn, compare=compare)
        assert ch.outcome.step_s <= base_static * (1 + 1e-9)
        assert ch.outcome.step_s == pytest.approx(plan_step_time_s(cands[ch.index],
                                                                   ch.outcome.densities))


def test_counts_describe_and_round_trip():
    c = StandDownCounts()
    assert c.describe() == ""
    for dst, sab in ((True, False), (False, None), (False, True), (None, True)):
        c.add(dst, sab)
    assert (c.dst_steps, c.dst_stood_down, c.sab_steps, c.sab_stood_down) == (3, 1, 3, 2)
    assert c.describe() == "stood down DST 1/3 (33%) SAB 2/3 (67%)"
    d = StandDownCounts()
    d.load_state_dict(c.state_dict())
    assert d == c
    d.load_state_dict(None)
    assert d == c


def _runtime_options(lm, lengths, dp=2, m=2):
    from sparsebalance_megatron.batching import latency_sample_cost_fn, sab_plan, sequential_plan

    kw = dict(dp=dp, num_microbatches=m, max_tokens=4096)
    sab = sab_plan(lengths, cost_fn=latency_sample_cost_fn(lm, D0), **kw)
    seq = sequential_plan(lengths, **kw)
    return [(b, lm.unit_features(b.unit_csr(with_padding=True))) for b in (sab, seq)]


@pytest.mark.reliability(area="budget", case="runtime: DST returns a plan predicted slower than "
                         "static (every unit at d_max)", expect="rank 0 commits the static plan "
                         "and reports it, not DST's; --sb-stand-down off commits DST's plan")
def test_runtime_choice_commits_the_static_plan_and_reports_it(monkeypatch):
    """The callback's glue (``megatron.step_choice.choose``): with DST's plan made slower on
    purpose (every unit raised to d_max), rank 0 commits the static plan of the packing it keeps,
    and the report (what the metrics print) describes that plan, not DST's."""
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.megatron.step import choice as step_choice
    from sparsebalance_megatron.policy import dst_rounds as dst

    lm = LatencyModel.analytic(ModelShape(num_layers=4, seq_length=4096), pp=2)
    lengths = np.array([4000, 96, 2000, 1800, 200, 3900, 150, 2000, 700, 900])
    sb = SparseBalanceConfig(sparse_balance=True, density=D0, dst_objective="density")
    options = _runtime_options(lm, lengths)
    assert step_choice.wants_baseline_packing(sb, lm)
    dens, report, record = step_choice.choose(sb, lm, options, 2, dst=True, raise_headroom=0.05,
                                              stage_layers=[2, 2])
    assert record["dst_stood_down"] is False and report["stand_down"] == record
    real = dst.plan_dst

    def all_raised(costs, *a, **kw):
        p = real(costs, *a, **kw)
        p.densities, p.grid_index = np.full(costs.shape, 1.0), None
        return p

    monkeypatch.setattr(dst, "plan_dst", all_raised)
    dens, report, record = step_choice.choose(sb, lm, options, 2, dst=True, raise_headroom=0.05,
                                              stage_layers=[2, 2])
    assert record["dst_stood_down"] is True
    assert np.all(np.asarray(dens) == D0)
    assert report["step_time_planned_s"] == record["predicted_static_s"] < \
        record["predicted_dst_s"]
    assert report["units_cut"] == report["units_raised"] == 0
    # the ablation commits DST's plan as made
    off = SparseBalanceConfig(sparse_balance=True, density=D0, dst_objective="density",
                              stand_down="off")
    assert not step_choice.wants_baseline_packing(off, lm)
    dens, _, record = step_choice.choose(off, lm, options[:1], 2, dst=True,
                                         raise_headroom=0.05, stage_layers=[2, 2])
    assert record["dst_stood_down"] is False and np.all(np.asarray(dens) == 1.0)
    # without DST: the static plans of the two packings decide (every rank alike)
    _, _, record = step_choice.choose(SparseBalanceConfig(batching=True, sparse_attention=True,
                                                          density=D0), lm, options, 2, dst=False)
    assert record["dst_stood_down"] is None and record["sab_stood_down"] in (True, False)
    assert record["packing_index"] == int(record["sab_stood_down"])


def test_unit_costs_at_grid_indices_gathers_like_take_along_axis():
    # the flat gather (the rule's step times) against numpy's take_along_axis; an index off the
    # grid, or indices not one per unit, would read another unit's row: refused
    rng = np.random.default_rng(8)
    costs = affine(rng.random((3, 4, 2)), rng.random((3, 4, 2)))
    g = costs.densities.size
    idx = rng.integers(0, g, costs.shape)
    want = [np.take_along_axis(t, idx[..., None], axis=-1)[..., 0]
            for t in (costs.fwd_s, costs.bwd_s)]
    assert all(np.array_equal(a, b) for a, b in zip(costs.at(idx), want))
    for bad in (np.full(costs.shape, g), np.full(costs.shape, -1), np.zeros((3, 4, 1), int)):
        with pytest.raises(IndexError):
            costs.at(bad)


def test_runtime_plans_dst_on_both_packings_by_default_and_once_when_static(monkeypatch):
    """The runtime's choice under ``--sb-stand-down-compare``: by default ('planned') DST plans
    both packings, with 'static' only the packing whose static plan won (the same packing the
    no-DST choice takes); either way the committed step is no slower than the baseline's static
    one."""
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.megatron.step import choice as step_choice
    from sparsebalance_megatron.policy import dst_rounds as dst

    lm = LatencyModel.analytic(ModelShape(num_layers=4, seq_length=4096), pp=2)
    lengths = np.array([4000, 96, 2000, 1800, 200, 3900, 150, 2000, 700, 900])
    options = _runtime_options(lm, lengths)
    real, calls = dst.plan_dst, []

    def counted(costs, *a, **kw):
        calls.append(costs.shape)
        return real(costs, *a, **kw)

    monkeypatch.setattr(dst, "plan_dst", counted)
    records = {}
    for compare, planned in (("static", 1), ("planned", 2)):
        calls.clear()
        sb = SparseBalanceConfig(sparse_balance=True, density=D0, dst_objective="density",
                                 stand_down_compare=compare)
        _, report, record = step_choice.choose(sb, lm, options, 2, dst=True,
                                               raise_headroom=0.05, stage_layers=[2, 2])
        assert len(calls) == planned, compare
        assert record["predicted_step_s"][record["packing_index"]] == \
            report["step_time_planned_s"]
        records[compare] = record
    _, _, no_dst = step_choice.choose(SparseBalanceConfig(batching=True, sparse_attention=True,
                                                          density=D0), lm, options, 2, dst=False)
    assert records["static"]["packing_index"] == no_dst["packing_index"]
    assert SparseBalanceConfig().stand_down_compare == "planned"
    grid = np.array([D0])
    base_static = plan_step_time_s(UnitCosts.from_latency(
        lm, options[1][1], 2, options[1][0].num_microbatches, grid),
        np.full((2, options[1][0].num_microbatches, 2), D0))
    for record in records.values():
        assert record["predicted_step_s"][record["packing_index"]] <= base_static * (1 + 1e-9)
