"""Megatron's dp_balanced packer and every dense packing in the simulated study (issue 41): the
runs, the stand-down a dense SAB run makes, and the packer table over a study's rows. Small
analytic model, deterministic, seconds."""

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance_megatron.experiments import StudyConfig, run_study
from sparsebalance_megatron.experiments.layout_search import LayoutChoice, stand_down_config
from sparsebalance_megatron.experiments.packers import format_packers, packer_summary
from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout

CFG = StudyConfig(microbatches=4, seq_length=8192, steps=2)
LAYOUT = PipelineLayout.from_counts(8, 4, first=3, last=1)
DENSE = ("dense", "dense_token_balanced", "dense_dp_balanced", "dense_sab")


@pytest.fixture(scope="module")
def lm():
    return LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=4)


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(3)
    return np.concatenate([rng.integers(64, 1024, 300), rng.integers(4000, 8192, 40)])


def test_every_dense_packing_and_dp_balanced_run_on_the_same_batches(lm, lengths):
    runs = {v: (v, LAYOUT) for v in (*DENSE, "dp_balanced", "static")}
    rows = run_study(4, replace(CFG, dense_stand_down="token_balanced"), lm, lengths, runs,
                     baseline="static")
    for v in DENSE:       # every document routed dense: no sparse path at all
        assert rows[v]["mean_density"] == 1.0 and np.isnan(rows[v]["sparse_density"])
    assert rows["dp_balanced"]["mean_density"] == CFG.sb.density
    # Megatron's order needs more micro-batches than the sampler's fill of dp x m
    assert rows["dense_dp_balanced"]["microbatches_per_rank"] > CFG.microbatches
    assert rows["dense"]["microbatches_per_rank"] == CFG.microbatches
    # SAB stands down to token-balanced where it is predicted no faster: never slower than it
    assert rows["dense_sab"]["step_time_s"] <= \
        rows["dense_token_balanced"]["step_time_s"] * (1 + 1e-9)
    assert rows["dense_sab"]["sab_stood_down_steps"][1] == CFG.steps
    # Megatron's dp_balanced too (issue 76: the runtime commits it with its own count)
    own = run_study(4, replace(CFG, dense_stand_down="dp_balanced"), lm, lengths, runs,
                    baseline="static")
    assert own["dense_sab"]["step_time_s"] <= \
        own["dense_dp_balanced"]["step_time_s"] * (1 + 1e-9)
    with pytest.raises(ValueError, match="dense_stand_down='sab'"):
        run_study(4, replace(CFG, dense_stand_down="sab"), lm, lengths, runs)


def test_sab_packs_on_each_runs_own_layout_as_the_runtime_does(lm, lengths):
    """SAB arranges its micro-batches on the run's pipeline (``batching.slots``): the study's
    dense SAB row on a layout is SAB packed with that layout's latency model, step by step."""
    from sparsebalance_megatron.batching import (SensitivityTracker, latency_sample_cost_fn,
                                                 sab_plan)
    from sparsebalance_megatron.data import GlobalBatchSampler
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.sim.pipeline import pipeline_makespan_s

    vp2 = PipelineLayout(4, 2, (1, 1, 1, 1, 1, 1, 1, 1))
    cfg = CFG.with_flags(stand_down="off")
    rows = run_study(4, cfg, lm, lengths, {"a": ("dense_sab", LAYOUT), "b": ("dense_sab", vp2)})
    sampler = GlobalBatchSampler(lengths, capacity=cfg.seq_length, dp=4,
                                 num_microbatches=cfg.microbatches, seed=cfg.seed,
                                 long_sample_policy="split")
    batches = [sampler.next_global_batch() for _ in range(cfg.steps)]
    for name, lay in (("a", LAYOUT), ("b", vp2)):
        model = lm.all_dense().with_layout(lay)
        total = 0.0
        for segs in batches:
            plan = sab_plan(segs, dp=4, num_microbatches=cfg.microbatches,
                            max_tokens=cfg.seq_length, seed=cfg.seed,
                            cost_fn=latency_sample_cost_fn(model, 1.0),
                            sensitivity=SensitivityTracker())
            c = UnitCosts.from_latency(model, plan.flat_lengths(with_padding=True), 4,
                                       cfg.microbatches, np.array([1.0]))
            f, b = c.at(np.zeros(c.shape, dtype=int))
            total += pipeline_makespan_s(f, b, lm.p2p_s, pp=c.pipeline_ranks).max()
        assert rows[name]["step_time_s"] == pytest.approx(total / cfg.steps, rel=1e-12)


def test_dp_balanced_pays_no_fill_unless_every_run_varies(lm, lengths):
    """Megatron packs a micro-batch's documents back to back: with fixed-length micro-batches
    only the other packings pay the fill; with a multiple every packing rounds alike."""
    runs = {"dp": ("dp_balanced", LAYOUT), "seq": ("static", LAYOUT)}
    fixed = run_study(4, CFG, lm, lengths, runs)
    var = run_study(4, replace(CFG, microbatch_multiple=1), lm, lengths, runs)
    assert var["dp"]["step_time_s"] == pytest.approx(fixed["dp"]["step_time_s"])
    assert var["seq"]["step_time_s"] < fixed["seq"]["step_time_s"]


def test_packers_only_mode_runs_the_dense_rows_of_the_full_study(tmp_path):
    """``sim_study --packers-only``: the full study's dense rows exactly (the same
    layout searches, so the same candidates), without its other runs, and the packer table."""
    import json

    from tests.conftest import load_study

    script = load_study("sim_study")
    argv = ["--mixes", "long_tail", "--seeds", "0", "--ranks", "2", "--densities", "0.5",
            "--steps", "1", "--pp", "2", "--vp", "1", "--microbatches", "2", "--seq-length",
            "8192", "--total-tokens", "200000"]
    docs = {}
    for name, extra in (("full", ["--floor-sweep"]), ("packers", ["--packers-only"])):
        script.main([*argv, *extra, "--json", str(tmp_path / f"{name}.json")])
        docs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    key = "long_tail/seed=0/d0=0.5/dp=2"
    full, only = docs["full"]["results"][key], docs["packers"]["results"][key]
    assert set(only["rows"]) == {"best_dense", "dense_sequential", "dense_token_balanced",
                                 "dense_dp_balanced", "dense_sab"}
    assert "summary" not in docs["packers"] and docs["packers"]["packers"]["rows"]
    for name in only["rows"]:
        assert full["rows"][name]["step_time_s"] == only["rows"][name]["step_time_s"]
        assert full["layouts"][name] == only["layouts"][name]
    row = docs["packers"]["packers"]["rows"][0]
    assert row["sab_vs_dp_balanced"] == pytest.approx(
        only["rows"]["dense_dp_balanced"]["step_time_s"] / only["rows"]["dense_sab"]["step_time_s"])


def test_the_stand_down_never_names_a_packing_the_runtime_cannot_pack():
    def choice(variant, t):
        return LayoutChoice(LAYOUT, variant, t, {})

    # Megatron's dp_balanced is one the runtime packs (issue 76); SAB's own packing is not a
    # baseline: the fastest dense configuration being dense SAB, the next one's packing
    static = [choice("dp_balanced", 1.0), choice("token_balanced", 1.1), choice("static", 1.2)]
    dense = [choice("dense_sab", 1.9), choice("dense_dp_balanced", 2.0), choice("dense", 2.1),
             choice("dense_token_balanced", 2.2)]
    cfg = stand_down_config(CFG, static[0], static, dense)
    assert (cfg.sb.stand_down, cfg.dense_stand_down) == ("dp_balanced", "dp_balanced")
    cfg = stand_down_config(CFG, static[1], static[1:], dense[2:])
    assert (cfg.sb.stand_down, cfg.dense_stand_down) == ("token_balanced", "sequential")
    assert stand_down_config(CFG.with_flags(stand_down="off"), static[0], static, dense) == \
        CFG.with_flags(stand_down="off")


def test_the_packer_table_has_one_dense_row_per_mix_and_dp():
    def row(t, **kw):
        return {"step_time_s": t, **kw}

    rows = {"dense_sequential": row(1.2), "dense_token_balanced": row(1.1),
            "dense_dp_balanced": row(1.15, microbatches_per_rank=9.0),
            "dense_sab": row(1.0, sab_stood_down=0.0)}
    res = {f"file/d0={d}/dp=8": {"rows": rows, "layouts": {}} for d in (0.5, 0.25)}
    s = packer_summary(res)
    assert [r["key"] for r in s["rows"]] == ["file/dp=8"]
    r = s["rows"][0]
    assert r["sab_vs_dp_balanced"] == pytest.approx(1.15)
    assert r["sab_vs_best_seq_tb"] == pytest.approx(1.1) and r["best_dense"] == "sab"
    assert s["sab_vs_dp_balanced"]["median"] == pytest.approx(1.15)
    assert "target >= 1.15x: met" in format_packers(s)


def test_the_packer_table_states_sab_net_of_its_own_cost():
    """dense_sab pays the plugin's cost, the other packings nothing: net, SAB's lead shrinks by
    exactly its cost, and the best dense packing can change."""
    rows = {"dense_sequential": {"step_time_s": 1.2, "step_time_net_s": 1.2},
            "dense_token_balanced": {"step_time_s": 1.04, "step_time_net_s": 1.04},
            "dense_dp_balanced": {"step_time_s": 1.15, "step_time_net_s": 1.15,
                                  "microbatches_per_rank": 9.0},
            "dense_sab": {"step_time_s": 1.0, "step_time_net_s": 1.05, "plugin_cost_ms": 50.0,
                          "sab_stood_down": 0.0}}
    s = packer_summary({"file/d0=0.5/dp=8": {"rows": rows, "layouts": {}}})
    r = s["rows"][0]
    assert r["best_dense"] == "sab" and r["best_dense_net"] == "token_balanced"
    assert r["sab_vs_dp_balanced_net"] == pytest.approx(1.15 / 1.05)
    assert r["sab_vs_best_seq_tb_net"] == pytest.approx(1.04 / 1.05)
    assert s["sab_vs_dp_balanced_net"]["median"] == pytest.approx(1.15 / 1.05)
    table = format_packers(s)
    assert "SAB vs dp_balanced, net: median 1.095x" in table and "50.00" in table
