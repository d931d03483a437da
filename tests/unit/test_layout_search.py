"""The layout search (experiments.layout_search) and its console script sparsebalance-layout,
on a small analytic model: deterministic (no wall clock), seconds."""

import json

import numpy as np
import pytest

from sparsebalance_megatron.experiments import StudyConfig, best_layouts, run_study
from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout
from sparsebalance_megatron.layout_cli import main, read_lengths

SHAPE = ModelShape(num_layers=8, seq_length=8192)
# variable-length micro-batches: Megatron's dp_balanced packs without a fill up to seq_length, so
# every packing is compared at the same padding rule (with fixed lengths the fill is a cost only
# the other packings pay)
CFG = StudyConfig(microbatches=4, seq_length=8192, steps=2, microbatch_multiple=256)


@pytest.fixture(scope="module")
def lm():
    return LatencyModel.analytic(SHAPE, pp=4)


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(3)
    return np.concatenate([rng.integers(64, 1024, 300), rng.integers(4000, 8192, 40)])


@pytest.fixture(scope="module")
def result(lm, lengths):
    return best_layouts(lm, lengths, CFG, 4, pp=4, vps=(1, 2))


def test_the_best_static_is_the_fastest_of_every_split_and_packing(result, lm, lengths):
    static = result["static"]
    assert static[0].step_time_s == min(c.step_time_s for c in static)
    assert {c.variant for c in static} == {"static", "token_balanced", "dp_balanced"}
    assert any(c.layout.vp == 2 for c in static)
    even = result["even_static"]
    assert even.layout == PipelineLayout.even(8, 4) and even.variant == "static"
    # the search's numbers are the study's numbers for that run
    best = static[0]
    row = run_study(4, CFG, lm, lengths, {"x": (best.variant, best.layout)})["x"]
    assert row["step_time_s"] == pytest.approx(best.step_time_s)


def test_the_best_dense_configuration_is_every_packing_on_its_own_layouts(result):
    """What users run today: dense attention with each packing (sequential, token-balanced,
    Megatron's dp_balanced, SAB) on its own fastest layout, the baseline of the scale study's
    ``speedup_vs_dense``; the dense packings' searched winners join the static layouts."""
    from sparsebalance_megatron.experiments.layout_search import DENSE_PACKINGS
    dense = result["dense"]
    assert {c.variant for c in dense} == set(DENSE_PACKINGS)
    assert dense[0].step_time_s == min(c.step_time_s for c in dense)
    assert {c.layout for c in dense} >= {c.layout for c in result["static"]}
    assert all(c.row["mean_density"] == 1.0 for c in dense)
    best = {v: min(c.step_time_s for c in dense if c.variant == v) for v in DENSE_PACKINGS}
    # SAB stands down to the fastest dense packing the runtime packs: never slower than it
    assert best["dense_sab"] <= min(best["dense"], best["dense_token_balanced"]) * (1 + 1e-9)


def test_sparse_balance_layouts_keep_every_stage_above_the_floor(result):
    sb = result["sparsebalance"]
    assert all(c.variant == "sab_dst" for c in sb)
    assert {c.layout.vp for c in sb} == {1, 2}          # DST plans the interleaved schedule too
    floor = CFG.sb.stage_density_floor * CFG.sb.density
    for c in sb:
        if c.qualifies:
            assert c.row["mean_density"] >= CFG.sb.density - 1e-9
            assert c.row["min_stage_density"] >= floor - 1e-9
    assert sb[0].qualifies


def test_layer_weighted_density_of_a_plan(lm, lengths):
    """Stage densities are weighted by layers x work: the mean is their layer-weighted mean."""
    lay = PipelineLayout.from_counts(8, 4, first=3, last=1)
    row = run_study(2, CFG, lm, lengths, {"sb": ("sab_dst", lay)})["sb"]
    st = np.asarray(row["density_per_stage"])
    assert len(st) == 4
    assert min(st) <= row["mean_density"] <= max(st)


def test_study_reports_the_predicted_loss_of_both_objectives(lm, lengths):
    """Every run's row carries the shipped quality cost's predicted loss change against uniform
    d0 on its layout: 0 for static d0, never above 0 for the default (quality) objective's plans
    (a plan may not lose predicted quality), and defined for the density objective too, so the
    two compare on one measure; the default objective plans what an explicit quality one does."""
    lay = PipelineLayout.even(8, 4)
    runs = {"static": ("static", lay), "sb": ("sab_dst", lay), "acc": ("sab_dst_acc", lay)}
    default = run_study(4, CFG, lm, lengths, runs, baseline="static")
    quality = run_study(4, CFG.with_flags(dst_objective="quality"), lm, lengths, runs,
                        baseline="static")
    density = run_study(4, CFG.with_flags(dst_objective="density"), lm, lengths, runs,
                        baseline="static")
    for name in runs:
        assert default[name]["predicted_loss"] == quality[name]["predicted_loss"]
        assert default[name]["mean_density"] == quality[name]["mean_density"]
    assert default["static"]["predicted_loss"] == density["static"]["predicted_loss"] == 0.0
    for name in ("sb", "acc"):
        assert default[name]["predicted_loss"] <= 1e-12
        assert np.isfinite(density[name]["predicted_loss"])


def test_variable_length_micro_batches_leave_the_fill_out_of_every_run(lm, lengths):
    """``microbatch_multiple``: the static run computes the same documents without the fill, so
    it is faster; with fixed lengths the fill is in every unit (sequential bins leave some)."""
    from dataclasses import replace
    lay = PipelineLayout.even(8, 4)
    runs = {"static": ("static", lay), "sb": ("sab_dst", lay)}
    fixed = run_study(4, replace(CFG, microbatch_multiple=0), lm, lengths, runs,
                      baseline="static")
    var = run_study(4, CFG, lm, lengths, runs, baseline="static")
    assert var["static"]["step_time_s"] < fixed["static"]["step_time_s"]
    assert var["static"]["mean_density"] == fixed["static"]["mean_density"]
    assert var["sb"]["step_time_s"] < fixed["static"]["step_time_s"]


def test_cli_prints_flags_and_writes_json(tmp_path, capsys, lengths):
    hist = tmp_path / "h.json"
    vals, counts = np.unique(lengths, return_counts=True)
    hist.write_text(json.dumps({str(int(v)): int(c) for v, c in zip(vals, counts)}))
    out = tmp_path / "o.json"
    assert main(["--analytic", "--num-layers", "8", "--pp", "2", "--dp", "2",
                 "--microbatches", "4", "--seq-length", "8192", "--steps", "1",
                 "--lengths", str(hist), "--json", str(out), "--vp", "1", "2"]) == 0
    text = capsys.readouterr().out
    assert "Best static configurations" in text and "sparse-balance vs the best static" in text
    data = json.loads(out.read_text())
    assert data["static"][0]["megatron_flags"] is not None
    assert data["even_static"]["describe"] == "4/4"


@pytest.mark.parametrize("content, needle", [
    ("[1, 0, 3]", "0: expected document lengths as integers >= 1"),
    ('{"a": 3}', "expected \"length\": count"),
    ("[]", "no documents"),
    ("3", "expected a JSON list or object"),
    ("{", "cannot read a JSON file"),
])
def test_bad_length_files_are_named(tmp_path, content, needle):
    p = tmp_path / "l.json"
    p.write_text(content)
    with pytest.raises(ValueError) as e:
        read_lengths(str(p))
    assert str(p) in str(e.value) and needle in str(e.value)


def test_free_accuracy_layouts_are_no_slower_than_the_best_static(result):
    """The accuracy search keeps only layouts whose SAB + DST (raising to the static step time)
    is no slower than the best static configuration; under the quality objective (the default)
    the lowest predicted loss first."""
    acc = result["accuracy"]
    limit = result["static"][0].step_time_s * (1 + 1e-9)
    assert len(acc) >= 2
    assert all(c.variant == "sab_dst_acc" and c.step_time_s <= limit for c in acc)
    loss = [c.row["predicted_loss"] for c in acc]
    assert loss == sorted(loss)


def test_free_accuracy_layouts_under_the_density_objective_are_densest_first(lm, lengths):
    cfg = CFG.with_flags(dst_objective="density")
    acc = best_layouts(lm, lengths, cfg, 4, pp=4, vps=(1,))["accuracy"]
    assert len(acc) >= 2
    dens = [c.row["mean_density"] for c in acc]
    assert dens == sorted(dens, reverse=True)


def test_layout_gap_names_a_faster_split(lm, lengths):
    """The runtime's start-up check: the even split of a model whose last stage carries a big
    LM head is predicted slower than an uneven one; the best layout is its own gap 1."""
    from sparsebalance_megatron.experiments.layout_search import layout_gap

    rng = np.random.default_rng(1)
    mbs = [list(rng.integers(200, 4000, size=3)) for _ in range(2 * 4)]
    gap, best = layout_gap(lm, mbs, 2, 4, PipelineLayout.even(8, 4), 0.5)
    assert gap > 1.05 and best != PipelineLayout.even(8, 4)
    again, same = layout_gap(lm, mbs, 2, 4, best, 0.5)
    assert again == pytest.approx(1.0) and same == best


def test_layout_gap_runs_interleaved_layouts_on_the_interleaved_schedule(lm):
    """An interleaved layout's step is Megatron's interleaved 1F1B, not plain 1F1B over its
    virtual stages (which would count the chunks of one rank as separate stages)."""
    from sparsebalance_megatron.experiments.layout_search import layout_gap
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.sim import simulate_1f1b

    rng = np.random.default_rng(2)
    mbs = [list(rng.integers(200, 4000, size=3)) for _ in range(2 * 4)]

    def step(lay):
        c = UnitCosts.from_latency(lm.with_layout(lay), mbs, 2, 4, np.asarray([0.5]))
        f, b = c.fwd_s[..., 0], c.bwd_s[..., 0]
        if lay.vp > 1:
            return simulate_1f1b(f, b, lm.p2p_s, pp=lay.pp).step_time_s
        return simulate_1f1b(f, b, lm.p2p_s).step_time_s

    lay = PipelineLayout.even(8, 4, vp=2)
    gap, best = layout_gap(lm, mbs, 2, 4, lay, 0.5)
    assert gap == pytest.approx(step(lay) / step(best), rel=1e-12)


@pytest.mark.parametrize("argv, needle", [
    (["--pp", "0"], "--pp 0: expected an integer >= 1"),
    (["--pp", "2", "--dp", "0"], "--dp 0: expected an integer >= 1"),
    (["--pp", "4", "--num-layers", "2"], "--num-layers 2 is less than --pp 4"),
])
def test_cli_bad_flags_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--analytic", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_cli_without_megatrons_even_split(capsys):
    """7 layers over 2 stages: Megatron's default split does not exist; the tool still ranks
    the splits its flags allow."""
    assert main(["--analytic", "--num-layers", "7", "--pp", "2", "--dp", "2", "--steps", "1",
                 "--seq-length", "8192", "--microbatches", "4", "--vp", "1"]) == 0
    out = capsys.readouterr().out
    assert "default split does not exist for 7 layers" in out
    assert "--decoder-" in out


def test_corpus_steps_pack_every_segment_and_pick_the_layout():
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps

    run = corpus_steps(2, 4, 0.5, 2, seq=8192, layout="best")
    assert len(run.plans) == len(run.segments) == 2
    for segs, plan in zip(run.segments, run.plans):        # every segment packed once
        assert sorted(plan.segments()) == sorted(segs)
    even = corpus_steps(2, 4, 0.5, 1, seq=8192)
    assert tuple(even.lm.layout.layers) == (6, 6, 6, 6)
    assert tuple(run.lm.layout.layers) != (6, 6, 6, 6)   # the LM-head stage takes fewer
    with pytest.raises(ValueError, match="layout='diag': expected one of even, best"):
        corpus_steps(2, 4, 0.5, layout="diag")
