"""Megatron's pipeline layouts in the latency model, the simulator and DST: uneven first/last
splits, the embedding/loss accounting, layout strings and the interleaved schedule (VPP)."""

from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance_megatron.latency import (LatencyModel, LayoutError, ModelShape,
                                            PipelineLayout, analytic_table, candidate_layouts)
from sparsebalance_megatron.policy import UnitCosts, density_grid
from tests.unit._bands import band_plan
from tests.unit._floats import event_float_s
from sparsebalance_megatron.sim.pipeline import pipeline_makespan_s, simulate_1f1b

L = PipelineLayout


@pytest.mark.parametrize("kw, layers", [
    (dict(num_layers=24, pp=4), (6, 6, 6, 6)),
    (dict(num_layers=24, pp=4, first=8, last=2), (8, 7, 7, 2)),
    (dict(num_layers=24, pp=4, last=3), (7, 7, 7, 3)),
    (dict(num_layers=22, pp=4, account_for_embedding=True, account_for_loss=True), (5, 6, 6, 5)),
    (dict(num_layers=7, pp=2, account_for_loss=True), (4, 3)),
    (dict(num_layers=24, pp=4, vp=2), (3,) * 8),
    (dict(num_layers=16, pp=2, vp=2, first=4), (2, 6, 2, 6)),
])
def test_counts_follow_megatrons_get_num_layers_to_build(kw, layers):
    n, pp = kw.pop("num_layers"), kw.pop("pp")
    assert L.from_counts(n, pp, **kw).layers == layers


@pytest.mark.parametrize("kw, needle", [
    (dict(num_layers=24, pp=4, first=8, last=3), "must divide evenly over the 2 other"),
    (dict(num_layers=4, pp=2, first=4), "cannot fill the 1 other pipeline stage"),
    (dict(num_layers=24, pp=4, first=0), "expected an integer >= 1"),
    (dict(num_layers=24, pp=4, first=8, account_for_loss=True), "Megatron refuses the mix"),
    (dict(num_layers=24, pp=4, account_for_loss=True), "= 25 is not divisible"),
    (dict(num_layers=16, pp=2, vp=2, first=3), "not divisible by the 2 virtual stages"),
    (dict(num_layers=4, pp=1, first=2), "need --pipeline-model-parallel-size >= 2"),
])
def test_bad_counts_name_the_flag(kw, needle):
    n, pp = kw.pop("num_layers"), kw.pop("pp")
    with pytest.raises(LayoutError, match=None) as e:
        L.from_counts(n, pp, **kw)
    assert needle in str(e.value)


def test_layout_strings_parse_like_megatron():
    lay = L.from_string("E|(tt|)*4,L", 2)
    assert (lay.pp, lay.vp, lay.layers) == (2, 3, (0, 2, 2, 2, 2, 0))
    assert lay.rank_layers() == [4, 4] and lay.kinds()[0] == "first"
    assert L.from_string("Et*3|t*5L", 2, num_layers=8).layers == (3, 5)
    for bad, needle in (("Ett|tmL", "multi-token"), ("tEt|tL", "embedding 'E'"),
                        ("Ett|Lt", "loss 'L'"), ("Ett|tt|tL", "not divisible by"),
                        ("Etx|tL", "unknown character")):
        with pytest.raises(LayoutError, match="pipeline-model-parallel-layout") as e:
            L.from_string(bad, 2)
        assert needle in str(e.value)
    with pytest.raises(LayoutError, match="expected --num-layers=9"):
        L.from_string("Ett|tL", 2, num_layers=9)


@pytest.mark.parametrize("lay", [L.even(24, 4), L.from_counts(24, 4, first=8, last=2),
                                 L.from_counts(24, 4, vp=2), L.from_string("Ettt|tttttL", 2),
                                 L.from_counts(16, 2, vp=2, first=4)])
def test_flags_rebuild_the_same_layout(lay):
    """``megatron_flags`` is what the layout tool prints: parsed back as Megatron would, it
    gives the same layout."""
    flags = dict(zip(lay.megatron_flags()[::2], lay.megatron_flags()[1::2]))
    args = SimpleNamespace(
        num_layers=lay.num_layers, pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=(
            int(flags["--num-virtual-stages-per-pipeline-rank"])
            if "--num-virtual-stages-per-pipeline-rank" in flags else None),
        pipeline_model_parallel_layout=flags.get("--pipeline-model-parallel-layout"),
        decoder_first_pipeline_num_layers=(int(flags["--decoder-first-pipeline-num-layers"])
                                           if "--decoder-first-pipeline-num-layers" in flags
                                           else None),
        decoder_last_pipeline_num_layers=(int(flags["--decoder-last-pipeline-num-layers"])
                                          if "--decoder-last-pipeline-num-layers" in flags
                                          else None))
    assert L.from_megatron_args(args) == lay


def test_candidates_cover_the_splits_megatron_flags_allow():
    c = candidate_layouts(24, 4, (1, 2))
    assert c[0] == L.even(24, 4) and L.from_counts(24, 4, first=8, last=2) in c
    assert L.from_counts(24, 4, vp=2, first=8, last=4) in c
    assert len({x.layers for x in c}) == len(c)
    assert all(x.num_layers == 24 for x in c)


@pytest.fixture(scope="module")
def qwen():
    return LatencyModel.analytic(ModelShape(), pp=4)


def test_the_tables_own_layout_is_predicted_unchanged(qwen):
    same = qwen.with_layout(L.even(24, 4))
    docs = [4096] * 8
    for s in range(4):
        assert same.predict(docs, 0.5, s) == qwen.predict(docs, 0.5, s)


@pytest.mark.parametrize("lay", [L.from_counts(24, 4, first=8, last=2), L.even(24, 2),
                                 L.even(24, 8), L.from_counts(24, 4, vp=2),
                                 L.from_string("E|t*12|t*12|L", 4)])
def test_any_layout_moves_layers_not_time(qwen, lay):
    """Moving layers between stages keeps the step's total work: the sum over stages is the
    same for every layout; the embedding and the LM head stay on the first and last stage."""
    docs = [8192, 8192, 16384]
    base = sum(qwen.predict(docs, 0.5, s) for s in range(4))
    m = qwen.with_layout(lay)
    t = [m.predict(docs, 0.5, s) for s in range(m.num_stages)]
    assert sum(t) == pytest.approx(base, rel=1e-9)
    layer = qwen.predict(docs, 0.5, 1) / 6            # a middle stage of 6 layers
    assert t[-1] - lay.layers[-1] * layer == pytest.approx(
        qwen.predict(docs, 0.5, 3) - 6 * layer, rel=1e-9)   # the LM head's share


def test_a_table_without_a_middle_stage_predicts_only_its_own_layout():
    t = analytic_table(ModelShape(num_layers=4, seq_length=4096), pp=2)
    t["measurements"] = [m for m in t["measurements"] if m["kind"] != "middle"]
    for section in ("coefficients", "dense_coefficients", "call_coefficients"):
        if section in t:      # every per-stage-kind section of the table drops its middle entry
            t[section].pop("middle", None)
    m = LatencyModel.from_table(t)
    assert m.with_layout(L.even(4, 2)).num_stages == 2
    with pytest.raises(LayoutError, match="no middle-stage measurement"):
        m.with_layout(L.from_counts(4, 2, first=3))
    with pytest.raises(LayoutError, match=r"lacks stage kind\(s\) \['only'\]"):
        m.with_layout(L.even(4, 1))


def test_costs_weight_densities_by_layers_and_carry_the_schedule(qwen):
    m = qwen.with_layout(L.from_counts(24, 4, vp=2, first=8, last=4))
    c = UnitCosts.from_latency(m, [[4096] * 4] * 8, 2, 4, density_grid(0.5, 0.125, 1.0))
    assert c.shape == (2, 4, 8) and c.pipeline_ranks == 4 and c.vp == 2
    per_layer = c.attn_work / np.asarray(m.layout.layers)[None, None, :]
    assert np.allclose(per_layer, per_layer[..., :1])


def _random_times(dp, m, nv, seed):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 2.0, (dp, m, nv)), rng.uniform(1.0, 4.0, (dp, m, nv))


@pytest.mark.parametrize("m, pp, vp", [(4, 2, 2), (6, 3, 2), (8, 4, 2), (4, 4, 1)])
def test_event_float_is_the_growth_the_step_absorbs(m, pp, vp):
    """Growing one event by its float keeps the makespan (up to the deadline); by more than
    its float (when it is finite) grows it: checked against the simulator, plain and
    interleaved."""
    f, b = _random_times(1, m, pp * vp, seed=m * 10 + pp)
    mk = pipeline_makespan_s(f, b, 0.01, pp=pp)
    ff, fb = event_float_s(f, b, mk, 0.01, pp=pp)
    rng = np.random.default_rng(0)
    for _ in range(12):
        i, v, kind = rng.integers(m), rng.integers(pp * vp), rng.integers(2)
        fl = (ff if kind == 0 else fb)[0, i, v]
        assert fl >= -1e-12
        for extra, grows in ((fl, False), (fl + 0.05, True)):
            f2, b2 = f.copy(), b.copy()
            (f2 if kind == 0 else b2)[0, i, v] += extra
            new = pipeline_makespan_s(f2, b2, 0.01, pp=pp)[0]
            assert (new > mk[0] + 1e-9) == grows


def test_makespan_matches_the_interleaved_simulation():
    f, b = _random_times(3, 8, 8, seed=1)
    assert np.allclose(pipeline_makespan_s(f, b, 0.0, pp=4),
                       simulate_1f1b(f, b, 0.0, pp=4).rank_time_s)
    assert np.allclose(pipeline_makespan_s(f, b, 0.0), simulate_1f1b(f, b, 0.0).rank_time_s)
    with pytest.raises(ValueError, match="the interleaved schedule needs pp=4 <="):
        pipeline_makespan_s(f[:, :2], b[:, :2], pp=4)


@pytest.mark.parametrize("lay", [L.from_counts(24, 4, first=8, last=2), L.from_counts(24, 4, vp=2),
                                 L.from_counts(24, 2, vp=3)])
def test_dst_plans_every_layout_and_never_slows_the_step(qwen, lay):
    m = qwen.with_layout(lay)
    rng = np.random.default_rng(7)
    dp, mb = 4, 8
    docs = [list(rng.integers(512, 12000, size=rng.integers(1, 6))) for _ in range(dp * mb)]
    costs = UnitCosts.from_latency(m, docs, dp, mb, density_grid(0.5, 0.125, 1.0))
    plan = band_plan(costs, None, 0.5, 0.125, 1.0, p2p_s=m.p2p_s)
    r = plan.report
    assert plan.densities.shape == (dp, mb, lay.num_stages)
    assert r.step_time_planned_s <= r.step_time_static_s * (1 + 1e-9)
    assert len(r.density_per_stage) == lay.num_stages
    # the report's step time is the simulator's, under the layout's own schedule
    idx = np.searchsorted(costs.densities, plan.densities - 1e-12)
    fwd, bwd = costs.at(idx)
    assert max(pipeline_makespan_s(fwd, bwd, m.p2p_s, pp=lay.pp)) == pytest.approx(
        r.step_time_planned_s)


def test_layer_stages_number_the_layers_in_model_order():
    """Megatron's global 1-based layer number n sits in virtual stage layer_stages()[n - 1]."""
    lay = PipelineLayout(2, 2, (1, 2, 3, 1))      # v0 rank 0, v1 rank 1, v2 rank 0, v3 rank 1
    assert lay.layer_stages() == [0, 1, 1, 2, 2, 2, 3]
    assert [lay.rank_of(v) for v in lay.layer_stages()] == [0, 1, 1, 0, 0, 0, 1]
