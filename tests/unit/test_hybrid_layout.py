"""HybridModel layouts (``--hybrid-layer-pattern``) and what their stages cost.

The layout must split the layers as megatron-core's ``select_pipeline_segment`` does, count only
``*`` layers as attention (the layers the plan budgets), and the latency model must give an MLP
layer no attention term while an attention layer plus an MLP layer cost one GPT layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, LayoutError, ModelShape
from sparsebalance_megatron.latency.analytic import analytic_table
from sparsebalance_megatron.latency.hybrid import attention_share, layer_kind_coefficients
from sparsebalance_megatron.latency.layout import PipelineLayout as L
from sparsebalance_megatron.policy import UnitCosts, density_grid
from tests.unit._bands import band_plan


def megatron_segments(monkeypatch, pattern: str, pp: int, vp: int, first=None, last=None
                      ) -> list[str]:
    """Megatron's own split (``select_pipeline_segment``) of every (rank, chunk), in virtual
    stage order; torch.distributed's rank/size answered, and its logging skipped, without a
    process group."""
    import torch.distributed as dist
    from megatron.core.models.hybrid import hybrid_layer_allocation as alloc

    monkeypatch.setattr(alloc, "log_on_each_pipeline_stage", lambda *a, **k: None)
    monkeypatch.setattr(alloc, "log_single_rank", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: pp)
    out = {}
    for rank in range(pp):
        monkeypatch.setattr(dist, "get_rank", lambda g=None, r=rank: r)
        for chunk in range(vp):
            seg, _ = alloc.select_pipeline_segment(pattern, object(), chunk if vp > 1 else None,
                                                   first_stage_layers=first,
                                                   last_stage_layers=last)
            out[chunk * pp + rank] = "".join(seg)
    return [out[v] for v in range(pp * vp)]


@pytest.mark.parametrize("pattern, pp, vp, first, last", [
    ("*-*-", 1, 1, None, None),
    ("*-*-", 2, 1, None, None),
    ("*-*-*-", 2, 1, 4, None),
    ("*-|*-|*--|-", 2, 2, None, None),
    ("*--*|-*", 2, 1, None, None),
])
def test_pattern_layouts_split_like_megatron(monkeypatch, pattern, pp, vp, first, last):
    lay = L.from_hybrid_pattern(pattern, pp, first=first, last=last)
    assert (lay.pp, lay.vp) == (pp, vp)
    assert lay.stage_patterns() == megatron_segments(monkeypatch, pattern, pp, vp, first, last)
    assert lay.attention_layers == tuple(s.count("*") for s in lay.stage_patterns())
    # the 1-based global layer number Megatron gives a layer -> its plan stage
    assert lay.layer_stages() == [v for v, s in enumerate(lay.stage_patterns()) for _ in s]
    assert L.from_dict(lay.as_dict()) == lay


def test_pattern_layouts_rebuild_from_megatron_args_and_flags():
    import types

    lay = L.from_hybrid_pattern("*-|*-|*--|-", 2)
    assert lay.describe() == "[2+3]/[2+1] (*-|*-|*--|-)"
    assert lay.megatron_flags() == ["--hybrid-layer-pattern", "*-|*-|*--|-"]
    args = types.SimpleNamespace(pipeline_model_parallel_size=2, num_layers=8,
                                 hybrid_layer_pattern="*-|*-|*--|-")
    assert L.from_megatron_args(args) == lay
    gpt = L.from_megatron_args(types.SimpleNamespace(pipeline_model_parallel_size=2,
                                                     num_layers=4))
    assert gpt.pattern is None and gpt.attention_layers == gpt.layers == (2, 2)


@pytest.mark.parametrize("pattern, pp, needle", [
    ("*-*-/*-", 1, "multi-token prediction ('/')"),
    ("*-x-", 1, "unknown layer symbol(s) ['x']"),
    ("*-|*-|*-", 2, "3 '|' segments are not divisible by --pipeline-model-parallel-size=2"),
    ("*-*", 2, "not divisible by --pipeline-model-parallel-size=2"),
])
def test_bad_patterns_name_the_flag(pattern, pp, needle):
    with pytest.raises(LayoutError) as e:
        L.from_hybrid_pattern(pattern, pp)
    assert "--hybrid-layer-pattern" in str(e.value) or "--num-layers" in str(e.value)
    assert needle in str(e.value)


@pytest.fixture(scope="module")
def tiny():
    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256, pp=2)
    return LatencyModel.from_table(analytic_table(shape, pp=2, block_size=32,
                                                  transformer_impl="local"))


def test_attention_plus_mlp_layer_is_one_gpt_layer(tiny):
    per = tiny.layer_coefficients()
    parts = layer_kind_coefficients(per, attention_share(tiny.table["model"]))
    for p in ("fwd", "bwd"):
        assert np.allclose(parts["*"][p] + parts["-"][p], per[p])
        assert np.all(parts["-"][p][2:] == 0)      # an MLP layer: no attention, selection, docs
    # 8 hybrid layers ('*-' x 4) are 4 GPT layers: the same stage times as the GPT's even split
    hyb = tiny.with_layout(L.from_hybrid_pattern("*-*-|*-*-", 2))
    gpt = tiny.with_layout(L.even(4, 2))
    for s in range(2):
        for d in (0.25, 1.0):
            assert hyb.predict([200, 56], d, s) == pytest.approx(gpt.predict([200, 56], d, s))


def test_an_mlp_only_stage_has_no_attention_term(tiny):
    m = tiny.with_layout(L.from_hybrid_pattern("*-|--", 2))
    t = m.unit_terms([[128, 128]], stage=1)
    assert t.fwd_attn_s_per_pair == 0.0 and t.bwd_attn_s_per_pair == 0.0
    assert m.predict([128, 128], 0.25, 1) == m.predict([128, 128], 1.0, 1) > 0
    assert m.predict([128, 128], 0.25, 0) < m.predict([128, 128], 1.0, 0)


def test_layer_kinds_without_a_cost_model_are_refused(tiny):
    with pytest.raises(LayoutError, match=r"layer 'M' \(Mamba\) has no latency model"):
        tiny.with_layout(L.from_hybrid_pattern("M*-M", 2))


def test_dst_budgets_only_the_attention_layers(tiny):
    """Costs weight densities by attention layers: the MLP-only stage has no weight, and DST
    plans the layout without slowing the step."""
    m = tiny.with_layout(L.from_hybrid_pattern("*-*|--", 2))
    grid = density_grid(0.5, 0.25, 1.0)
    units = [[256], [32] * 8, [128, 128], [64] * 4]
    costs = UnitCosts.from_latency(m, units, 2, 2, grid)
    assert np.all(costs.attn_work[:, :, 1] == 0) and np.all(costs.attn_work[:, :, 0] > 0)
    plan = band_plan(costs, None, 0.5, 0.25, 1.0, p2p_s=m.p2p_s)
    r = plan.report
    assert plan.densities.shape == (2, 2, 2)
    assert r.step_time_planned_s <= r.step_time_static_s * (1 + 1e-9)


def test_a_one_stage_table_prices_a_one_stage_hybrid_from_its_mean_layer():
    """A pp=1 table has no middle stage: its layers' mean stands for one GPT layer, so '*-*-'
    (two GPT layers' worth) costs half the 4-layer table's stage, attention term included."""
    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256, pp=1)
    m = LatencyModel.from_table(analytic_table(shape, pp=1, block_size=32,
                                               transformer_impl="local"))
    hyb = m.with_layout(L.from_hybrid_pattern("*-*-"))
    for p in ("fwd", "bwd"):
        assert np.allclose(hyb._stage_coef[0][p], m._coef_full["only"][p] / 2)
    with pytest.raises(LayoutError, match="lacks stage kind"):
        m.with_layout(L.from_hybrid_pattern("*-|*-", 2))
