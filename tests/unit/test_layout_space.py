"""The whole layout space (issue 27): layout strings Megatron accepts for any split, the search
over it with its proven lower bound, and the memory limit. Analytic model: deterministic,
seconds."""

import numpy as np
import pytest

from sparsebalance_megatron.experiments import best_layouts
from sparsebalance_megatron.experiments.layout_space import (StepEvaluator, compositions,
                                                              packed_features, search_space)
from sparsebalance_megatron.latency import LayoutError, ModelShape, PipelineLayout
from sparsebalance_megatron.latency.memory import GIB, MemoryModel

from test_layout_search import CFG, lengths, lm  # noqa: F401  (the same small model and data)

L = PipelineLayout

LAYOUTS = [L(4, 1, (8, 8, 8, 0)), L(4, 1, (0, 8, 8, 8)), L(4, 1, (9, 7, 8, 0)),
           L(4, 2, (0, 3, 3, 4, 3, 4, 3, 4)), L(4, 2, (3, 4, 3, 2, 4, 5, 3, 0)),
           L(2, 2, (2, 1, 1, 0)), L(2, 3, (1, 0, 2, 0, 1, 0)), L(2, 4, (1, 1, 0, 1, 1, 1, 0, 1)),
           L(8, 1, (3, 3, 3, 3, 3, 3, 3, 3)), L(4, 1, (7, 8, 8, 1))]


@pytest.fixture(scope="module")
def evaluator(lm, lengths):
    return StepEvaluator(lm, packed_features(lm, lengths, CFG, 4, "token_balanced"), 4, 4, 0.5)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda x: x.describe())
def test_emitted_flags_are_what_megatron_core_builds(lay):
    """Every layout's flags, parsed by megatron-core's own ``PipelineParallelLayerLayout``, are
    accepted and give the same decoder layers per (rank, chunk); a split the count flags cannot
    build is written as a layout string."""
    pl = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    from megatron.core.transformer.enums import LayerType

    flags = lay.megatron_flags()
    if 0 in lay.layers or lay.layers == (3, 4, 3, 2, 4, 5, 3, 0):
        assert flags[0] == "--pipeline-model-parallel-layout"
    if flags[:1] != ["--pipeline-model-parallel-layout"]:
        return                                  # count flags: test_pipeline_layout checks them
    mc = pl.PipelineParallelLayerLayout(flags[1], lay.pp)
    mc.validate_layer_layout(lay.num_layers, None)
    assert mc.virtual_pipeline_model_parallel_size == lay.vp
    for r in range(lay.pp):
        for c in range(lay.vp):
            assert mc.layout[r][c].count(LayerType.decoder) == lay.layers[lay.stage_of(r, c)]
    assert L.from_string(flags[1], lay.pp, lay.num_layers) == lay


def test_empty_and_lm_head_only_stages_cost_their_embedding_head_and_p2p(lm):
    """A 0-layer middle stage costs nothing but its p2p; a 0-layer first stage still embeds,
    a 0-layer last stage still runs the LM head and loss."""
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.sim.pipeline import simulate_1f1b

    lay = L(4, 1, (0, 8, 0, 0))
    c = UnitCosts.from_latency(lm.with_layout(lay), [[4096, 4096]] * 4, 1, 4, np.asarray([0.5]))
    f, b = c.fwd_s[..., 0], c.bwd_s[..., 0]                      # [1, 4, 4]
    assert np.all(f[..., 2] == 0) and np.all(b[..., 2] == 0)
    assert np.all(f[..., 0] > 0) and np.all(f[..., 3] > 0)
    assert np.all(f[..., 0] < f[..., 1])              # the embedding alone: less than 8 layers
    step = simulate_1f1b(f, b, lm.p2p_s).step_time_s
    assert step > (f + b)[0, :, :].sum(axis=0).max()             # p2p and fill on top
    assert c.attn_work[..., 2].sum() == 0 == c.attn_work[..., 0].sum()
    assert lay.layout_string() == "E|t*8||L"


def test_compositions_enumerate_every_split():
    got = list(compositions(4, 3))
    assert len(got) == 15 == len(set(got)) and all(sum(x) == 4 for x in got)


@pytest.mark.parametrize("vp", [1, 2])
def test_the_lower_bound_holds_for_every_layout(evaluator, vp):
    """The proven bound is below the simulated step of every layout (all of vp 1, a sample of
    vp 2) and the search's best is one of them."""
    lb = evaluator.lower_bound_s(8, 4, vp)
    rng = np.random.default_rng(vp)
    comps = list(compositions(8, 4 * vp))
    sample = comps if vp == 1 else [comps[i] for i in rng.choice(len(comps), 150, replace=False)]
    steps = [evaluator.step_s(L(4, vp, c)) for c in sample]
    assert lb is not None and lb <= min(steps) * (1 + 1e-9)
    assert lb > 0.5 * min(steps)                                 # a bound, not a zero


def test_local_search_finds_the_enumerated_optimum(evaluator):
    """vp=1 at 8 layers is small enough to enumerate: the exact search's best is the minimum
    over all 165 splits (gap 0), and the local search from the count-flag splits reaches it."""
    exact = search_space(evaluator, 8, 4, 1)
    assert exact.exact and exact.gap == 0 and exact.evaluated == 165
    best = min(evaluator.step_s(L(4, 1, c)) for c in compositions(8, 4))
    assert exact.best_s == best
    local = search_space(evaluator, 8, 4, 1, enumerate_limit=0)
    assert not local.exact and local.starts < 165 and local.best_s == pytest.approx(best)
    assert local.gap is not None and local.gap >= 0


def test_memory_estimate_counts_weights_activations_in_flight_and_logits():
    qwen = MemoryModel.from_table_model(ModelShape().as_table_model())
    assert qwen.layer_params() * 24 == pytest.approx(357.9e6, rel=1e-3)   # Qwen2.5-0.5B
    lay = L.even(24, 4)
    per = qwen.rank_bytes(lay, 32768, 8)
    act = qwen.layer_activation_bytes(32768) * 6
    # 1F1B: rank r holds pp - r micro-batches' activations at its peak
    assert per[1] - per[2] == pytest.approx(act)
    assert per[0] > per[1] and per[3] > per[2]                   # embedding; LM head + logits
    inter = qwen.rank_bytes(L.even(24, 4, 2), 32768, 8)
    assert inter[0] > per[0]                                     # interleaving holds more
    assert qwen.peak_gib(lay, 32768, 8) == pytest.approx(max(per) / GIB)


def test_the_memory_limit_is_never_exceeded_and_counted(lm, lengths):
    mm = MemoryModel.from_table_model(lm.table["model"])
    peaks = sorted(mm.peak_gib(L(4, 1, c), 8192, 4) for c in compositions(8, 4))
    limit = peaks[len(peaks) // 2]
    res = best_layouts(lm, lengths, CFG, 2, pp=4, vps=(1,), device_memory_gib=limit)
    assert res["excluded_memory"] > 0
    for key in ("static", "dense", "sparsebalance"):
        assert all(mm.peak_gib(c.layout, 8192, 4) <= limit for c in res[key])
    assert res["plain_static"].variant == "static" and res["static_optimum_proven"]
    with pytest.raises(LayoutError, match="--device-memory-gib"):
        best_layouts(lm, lengths, CFG, 2, pp=4, vps=(1,), device_memory_gib=peaks[0] / 2)
    with pytest.raises(ValueError, match="--device-memory-gib -1"):
        best_layouts(lm, lengths, CFG, 2, pp=4, vps=(1,), device_memory_gib=-1)


def test_cli_states_the_plain_megatron_row_the_bound_and_the_memory_limit(capsys):
    from sparsebalance_megatron.layout_cli import main

    assert main(["--analytic", "--num-layers", "8", "--pp", "4", "--dp", "2", "--steps", "1",
                 "--seq-length", "8192", "--microbatches", "4", "--vp", "1", "2",
                 "--device-memory-gib", "1000"]) == 0
    out = capsys.readouterr().out
    assert "Best plain Megatron (sequential packing, no plugin)" in out
    assert "vp=1: best" in out and "exact" in out and "gap <=" in out
    assert "layouts over --device-memory-gib 1000.0: 0 left out" in out
    with pytest.raises(SystemExit):
        main(["--analytic", "--pp", "2", "--device-memory-gib", "0"])
    assert "--device-memory-gib 0.0: expected a number of GiB > 0" in capsys.readouterr().err


def test_sabs_layout_search_runs_its_micro_batches_in_the_slots_sab_gives_them(lm, lengths):
    """SAB arranges its micro-batches on the run's own pipeline (``batching.slots``), so its
    layout search does too: never slower than the packed order on any layout, and no proven
    bound claimed (the bound's fill terms assume the packed first and last micro-batches)."""
    feats = packed_features(lm, lengths, CFG, 4, "sab")
    plain = StepEvaluator(lm, feats, 4, 4, 0.5)
    arranged = StepEvaluator(lm, feats, 4, 4, 0.5, arrange=True)
    for lay in (L(4, 1, (8, 8, 8, 0)), L(4, 2, (3, 4, 3, 2, 4, 5, 3, 0))):
        assert arranged.step_s(lay) <= plain.step_s(lay) * (1 + 1e-12)
    assert plain.lower_bound_s(24, 4, 1) is not None
    assert arranged.lower_bound_s(24, 4, 1) is None


def test_dp_balanced_interleaves_as_megatron_packs_it_under_vpp(lm, lengths):
    """Without Megatron's VPP rule, dp_balanced's step-to-step micro-batch counts include one
    the interleaved schedule refuses (5 at dp 4, pp 4); packed with
    ``microbatch_group_size_per_vp_stage`` = pp, as Megatron packs under VPP, every count is a
    multiple of pp and vp=2 is searched."""
    from sparsebalance_megatron.sim.pipeline import interleaved_refusal
    plain = StepEvaluator(lm, packed_features(lm, lengths, CFG, 4, "dp_balanced"), 4, 4, 0.5)
    vpp = StepEvaluator(lm, packed_features(lm, lengths, CFG, 4, "dp_balanced", 4), 4, 4, 0.5)
    assert search_space(plain, 8, 4, 2, max_evaluations=20).refused_microbatches == (5,)
    counts = {vpp.microbatches(s) for s in range(len(vpp.feats))}
    assert all(m % 4 == 0 and interleaved_refusal(m, 4) is None for m in counts)
    res = search_space(vpp, 8, 4, 2, max_evaluations=20)
    assert res.ranked and not res.refused_microbatches


def test_the_study_runs_dp_balanced_interleaved_where_megatron_does(lm, lengths):
    """run_study packs dp_balanced per layout: on a vp=2 layout with Megatron's VPP rule, the
    run is timed, not refused, and its micro-batch counts are multiples of pp."""
    from sparsebalance_megatron.experiments.study import run_study
    lay2, lay1 = L(4, 2, (1,) * 8), L(4, 1, (2,) * 4)
    rows = run_study(4, CFG, lm, lengths, {"vpp": ("dp_balanced", lay2),
                                           "plain": ("dp_balanced", lay1)})
    assert not rows["vpp"].get("refused") and rows["vpp"]["step_time_s"] > 0
    assert rows["vpp"]["step_time_s"] != rows["plain"]["step_time_s"]
