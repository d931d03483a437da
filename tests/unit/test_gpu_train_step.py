"""gpu_check's train step on CPU (studies/device.py, gpu_trace.py, full_depth.py): the
full-depth model's runs in order, cut by time and by memory, profiled, re-priced at cuDNN's
kernel and beside their bounds; and DST with GPU timings (studies/dst_gpu.py) on a tiny model."""

import os
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO, load_script as _script


def _studies(name):
    """A module of scripts/studies, imported as gpu_check imports it."""
    import importlib
    _script("gpu_check")                       # scripts/ on sys.path
    return importlib.import_module(f"studies.{name}")


def test_the_train_step_runs_the_target_comparisons_first_and_megatrons_dense_last():
    """Issue 74: the full-depth model; the comparisons its targets count come first (dense +
    SAB, the base of every re-pricing and bound, then d0 0.25 and 0.5 at 32K, dense + SAB and
    d0 0.25 at 64K, the measured cuDNN run), Megatron's fixed-micro-batch dense runs last (run 3
    spent its budget on them before the sparse runs could start)."""
    ts = _studies("device")
    assert ts.SHAPE[ts.SHAPE.index("--num-layers") + 1] == "24"
    order = ts.train_order({"long_docs": [], "long_docs_64k": [], "long_docs_128k": [],
                            "files": []})
    assert order[:6] == list(ts.TARGET_RUNS) == [
        ("long_docs", "dense_sab"), ("long_docs", "sb_d0.25"), ("long_docs", "sb_d0.5"),
        ("long_docs_64k", "dense_sab"), ("long_docs_64k", "sb_d0.25"),
        ("long_docs", "dense_sab_sdpa")]
    assert order[-2:] == [("long_docs", "dense"), ("files", "dense")]
    assert ts.train_order({"files": []}) == [("files", "dense_sab"), ("files", "sb_d0.5"),
                                             ("files", "dense")]
    assert ts.TRAIN_VARIANTS["dense_sab_sdpa"] == ["--sb-batching", "--sb-dense-kernel", "sdpa"]


def _fake_train(monkeypatch, tmp_path, ts, seconds=40.0):
    now, ran = [0.0], []

    def fake_run(cmd, log, left, env):
        ran.append((os.path.basename(log), cmd))
        now[0] += seconds
        return 0, seconds, ""

    monkeypatch.setattr(ts, "run_logged", fake_run)
    monkeypatch.setattr(ts, "te_available", lambda env: False)
    monkeypatch.setattr(ts, "long_docs_prefix", lambda out: (str(tmp_path / "long"), 70))
    monkeypatch.setattr(ts, "time", types.SimpleNamespace(time=lambda: now[0]))  # its clock only
    table = tmp_path / "table.json"
    table.write_text("{}")
    monkeypatch.setattr(ts, "run_table", lambda work, data, backend, given: str(table))
    return ran


@pytest.mark.parametrize("limit, gib, ok, runs", [(280, 139.0, True, 7), (220, 139.0, False, 5),
                                                  (1000, 78.0, False, 8)])
def test_the_train_step_fails_for_a_target_run_cut_short_or_not_fitting(monkeypatch, tmp_path,
                                                                       limit, gib, ok, runs):
    """Every run takes 40 s of a fake clock. On an H200 (139 GiB) at 280 s the six target runs
    fit and the seventh starts (the step passes); at 220 s the measured cuDNN run is cut (it
    fails). 64K runs with Megatron's full recomputation, 32K without; 128K is held back by the
    memory estimate. On an H100 (78 GiB) 32K recomputes and 64K does not fit (it fails)."""
    ts = _studies("device")
    ran = _fake_train(monkeypatch, tmp_path, ts)
    res = ts.step_train(str(tmp_path), None, limit, {}, "auto", memory_gib=gib)
    assert res["ok"] is ok and len(ran) == runs and res["layers"] == 24
    names = [n for n, _ in ran]
    if gib > 100:
        assert names[:6] == [f"train_{d}_{v}.log" for d, v in ts.TARGET_RUNS][:runs]
        cmds = dict(ran)
        assert "--recompute-granularity" not in cmds["train_long_docs_sb_d0.25.log"]
        assert "--recompute-granularity" in cmds["train_long_docs_64k_sb_d0.25.log"]
        assert "65536" in cmds["train_long_docs_64k_dense_sab.log"]
        assert res["runs"]["long_docs_64k/sb_d0.25"]["recompute"] == "full"
        assert res["runs"]["long_docs_128k/dense_sab"]["skipped"].startswith("memory: ")
    else:
        assert res["runs"]["long_docs_64k/sb_d0.25"]["skipped"].startswith("memory: ")
        assert "--recompute-granularity" in dict(ran)["train_long_docs_sb_d0.25.log"]
    assert ("train_long_docs_dense_sab_sdpa.log" in names) is (limit > 220)
    # the SAB and sparse runs plan with a table (given or priced), Megatron's dense with none
    for name, cmd in ran:
        assert ("--sb-latency-table" in cmd) is not name.endswith("_dense.log"), name
    assert res["runs"]["long_docs/dense"].get("skipped") == (None if gib < 100 else
                                                             "out of time")


def test_the_full_depth_estimate_fits_each_data_set_to_the_device():
    """``full_depth``: the memory plan per data set (H200: 32K plain, 64K recomputed, 128K not;
    H100: 32K recomputed, 64K not), and run 5's 8-layer parts (dense + SAB's step = its
    non-attention + 8 layers of varlen attention) scaled to 24 layers."""
    fd = _studies("full_depth")
    h200 = {d: fd.memory_plan(s, 139.0) for d, s in fd.SEQUENCES.items()}
    assert [p["fits"] for p in h200.values()] == [True, True, False]
    assert [bool(p["flags"]) for p in h200.values()] == [False, True, False]
    h100 = {d: fd.memory_plan(s, 78.0) for d, s in fd.SEQUENCES.items()}
    assert [p["fits"] for p in h100.values()] == [True, False, False]
    assert h100["long_docs"]["flags"] == fd.RECOMPUTE_FLAGS
    parts = fd.run5_parts()
    for d in ("long_docs", "long_docs_64k"):
        p = parts[d]
        assert p["nonattention_s"] + p["attention_varlen_s"] == pytest.approx(p["step_s"])
        assert 0 < p["attention_cudnn_s"] < p["attention_varlen_s"]
    est = fd.estimate(139.0)
    assert 1.9 < fd.nonattention_scale() < 2.0
    e32 = est["long_docs"]
    assert e32["nonattention_s"] == pytest.approx(parts["long_docs"]["nonattention_s"]
                                                  * fd.nonattention_scale())
    # the cuDNN-priced dense step: non-attention + 3x run 5's cuDNN attention
    assert e32["cudnn_priced_step_s"] == pytest.approx(
        e32["nonattention_s"] + 3 * parts["long_docs"]["attention_cudnn_s"])
    # the target runs fit the e2e call's train step on the H200 (their estimated seconds)
    ts = _studies("device")
    gc = _script("gpu_check")
    total = sum(est[d]["runs"][v]["run_s"] for d, v in ts.TARGET_RUNS[:5])
    assert total + 20 < gc.LIMIT_S["train"]
    # all six with the tile costs first (15 s) and what each profiled one adds
    six = sum(est[d]["runs"][v]["run_s"] + (ts.PROFILE_S if (d, v) in ts.TRAIN_PROFILED else 0)
              for d, v in ts.TARGET_RUNS)
    assert six + 15 <= gc.LIMIT_S["train"]


def test_each_step_is_stated_beside_its_bound():
    """``step_bounds``: a step's non-attention seconds are dense + SAB's less its attention at
    varlen's tile cost; the bound adds d x the same tiles at cuDNN's (d the step's kept
    density; 1 for dense); ``vs_bound`` over the steps."""
    tr = _studies("gpu_trace")
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128}}
    # 24 layers x 10,000 tiles: 0.18 s of varlen attention, 0.12 s of cuDNN's
    runs = {"long_docs/dense_sab": {"step_s": {"4": 0.3, "5": 0.4},
                                    "step_dense_work": {"4": 10000, "5": 10000}},
            "long_docs/sb_d0.25": {"step_s": {"4": 0.2, "5": 0.3},
                                   "step_density": {"4": 0.25, "5": 0.5}},
            "long_docs/dense_sab_sdpa": {"step_s": {"4": 0.26, "5": 0.36}}}
    tr.step_bounds(runs, "long_docs", tiles, layers=24)
    sb, base = runs["long_docs/sb_d0.25"], runs["long_docs/dense_sab"]
    assert base["nonattention_s"] == {"4": pytest.approx(0.12), "5": pytest.approx(0.22)}
    assert sb["bound_s"] == {"4": pytest.approx(0.12 + 0.25 * 0.12),
                             "5": pytest.approx(0.22 + 0.5 * 0.12)}
    assert sb["vs_bound"] == pytest.approx(0.5 / (0.15 + 0.28))
    assert runs["long_docs/dense_sab_sdpa"]["bound_s"]["4"] == pytest.approx(0.24)
    assert _studies("gpu_trace").step_bound(1.0, 2.0, 0.25) == 1.5   # the one body
    gc = _script("gpu_check")
    t = gc.targets({"train": {"runs": runs}})
    assert t["train_long_docs/sb_d0.25_within_5%_of_bound"] is False
    assert "train_long_docs/dense_sab_sdpa_within_5%_of_bound" not in t
    runs2 = {"long_docs/dense_sab": {"step_s": {"4": 0.3}}}
    tr.step_bounds(runs2, "long_docs", tiles)              # no dense work: nothing stated
    assert "bound_s" not in runs2["long_docs/dense_sab"]


def test_the_runs_plan_with_a_table_of_the_full_depth_model(tmp_path):
    """Without ``--latency-table`` each data set's sparse runs get the 24-layer model's table
    priced by run 5's kernel table (fa4 where it can run, else triton: off CUDA, triton)."""
    ts = _studies("device")
    from sparsebalance_megatron.latency import LatencyModel, read_table
    path = ts.run_table(str(tmp_path), "long_docs_64k", "auto", None)
    assert os.path.basename(path) == "latency_triton_65536.json"
    table = read_table(path)
    assert table["model"]["num_layers"] == 24 and table["model"]["seq_length"] == 65536
    assert table["sparse_call"]["backend"] == "triton" and table["sparse_call"]["measured"]
    assert LatencyModel.from_table(table).predict([65536], 0.25, 0) > 0
    assert ts.run_table(str(tmp_path), "long_docs", "fa4", "given.json") == "given.json"


def test_dense_sab_is_re_priced_at_cudnns_kernel_and_each_sparse_run_compared():
    """Dense + SAB's steps less 8 layers x dense work x (varlen - cuDNN) per tile; a sparse run
    against it over all steady steps, without its compile steps, and step for step."""
    gc = _script("gpu_check")
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128},
             "65536": {"cudnn": 0.25, "varlen": 1.25, "block": 128}}
    # 8 layers x 10,000 tiles x 0.25 us = 0.02 s off each 0.1 s dense step (32K micro-batches)
    runs = {"long_docs/dense_sab": {"step_s": {"4": 0.1, "5": 0.1},
                                    "step_tokens": {"4": 1000, "5": 1000},
                                    "step_dense_work": {"4": 10000, "5": 10000}},
            "long_docs/sb_d0.5": {"step_s": {"4": 0.05, "5": 0.1},
                                  "step_s_no_compile": {"4": 0.05},
                                  "step_tokens": {"4": 1000, "5": 1000}}}
    gc.cudnn_priced(runs, "long_docs", tiles, layers=8)
    assert runs["long_docs/dense_sab"]["cudnn_priced_tokens_per_s"] == pytest.approx(2000 / 0.16)
    sb = runs["long_docs/sb_d0.5"]
    assert sb["vs_cudnn_priced"] == pytest.approx((2000 / 0.15) / (2000 / 0.16))
    assert sb["vs_cudnn_priced_no_compile"] == pytest.approx((1000 / 0.05) / (2000 / 0.16))
    assert sb["paired_vs_cudnn_priced"] == pytest.approx(0.08 / 0.05)   # the upper median
    assert gc.targets({"train": {"runs": runs}})["train_never_below_cudnn_priced_dense"] is True
    # 64K micro-batches take the 64K tile costs: 8 x 10,000 x 1.0 us = 0.08 s off
    runs64 = {f"long_docs_64k/{k[len('long_docs/'):]}": dict(v) for k, v in runs.items()}
    gc.cudnn_priced(runs64, "long_docs_64k", tiles, layers=8)
    assert runs64["long_docs_64k/dense_sab"]["cudnn_priced_tokens_per_s"] == \
        pytest.approx(2000 / 0.04)
    assert gc.dense_tile_costs() == {} or torch_cuda()              # {} without CUDA


def torch_cuda():
    import torch
    return torch.cuda.is_available()


def test_the_measured_cudnn_run_is_the_baseline_and_the_re_priced_one_its_check():
    """With its calls at bounded padded lengths, dense + SAB through cuDNN is measured, not
    re-priced: each sparse run against it (all steps, without compile steps, step for step),
    its steps that ran slow against the varlen run of the same batch named (a cuDNN graph
    built), and its rate against the re-priced one beside it as the check."""
    gc = _script("gpu_check")
    steps = {"4": 0.1, "5": 0.1, "6": 0.1}
    tokens = {"4": 1000, "5": 1000, "6": 1000}
    runs = {"long_docs/dense_sab": {"tokens_per_s": 3000 / 0.3, "step_s": dict(steps),
                                    "step_tokens": tokens,
                                    "step_dense_work": {k: 10000 for k in steps}},
            # step 5 built a graph: 2x its varlen step where the others are 0.8x
            "long_docs/dense_sab_sdpa": {"tokens_per_s": 3000 / 0.36, "step_tokens": tokens,
                                         "step_s": {"4": 0.08, "5": 0.2, "6": 0.08}},
            "long_docs/sb_d0.5": {"tokens_per_s": 3000 / 0.24, "step_tokens": tokens,
                                  "step_s": {"4": 0.06, "5": 0.1, "6": 0.08},
                                  "tokens_per_s_no_compile": 2000 / 0.14}}
    gc.cudnn_measured(runs, "long_docs")
    cudnn, sb = runs["long_docs/dense_sab_sdpa"], runs["long_docs/sb_d0.5"]
    assert cudnn["cudnn_graph_steps"] == {"5": 0.2}
    assert cudnn["tokens_per_s_no_graph"] == pytest.approx(2000 / 0.16)
    assert sb["vs_cudnn_dense"] == pytest.approx(0.36 / 0.24)
    assert sb["vs_cudnn_dense_no_compile"] == pytest.approx((2000 / 0.14) / (3000 / 0.36))
    assert sb["paired_vs_cudnn_dense"] == pytest.approx(0.08 / 0.06)   # ratios 1.33, 2, 1
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128}}
    gc.cudnn_priced(runs, "long_docs", tiles, layers=8)   # 0.02 s off each varlen step
    assert cudnn["vs_cudnn_priced"] == pytest.approx((3000 / 0.36) / (3000 / 0.24))
    t = gc.targets({"train": {"runs": runs}})
    assert t["train_never_below_cudnn_dense"] is True
    assert t["train_never_below_cudnn_priced_dense"] is True
    runs["long_docs/sb_d0.5"]["tokens_per_s"] = 3000 / 0.4
    gc.cudnn_measured(runs, "long_docs")
    assert gc.targets({"train": {"runs": runs}})["train_never_below_cudnn_dense"] is False


def test_the_train_step_profiles_the_steady_steps_at_32k_and_64k(monkeypatch, tmp_path):
    """The profiled runs (dense + SAB both ways, d0 0.5 and 0.25, at 32K and 64K) get
    Megatron's profiler flags for step 6 and their step's summary; the step after it (the
    trace's export) counts in no rate; the others get neither."""
    ts = _studies("device")
    cmds = {}

    def fake_run(cmd, log, left, env):
        import gzip
        import json
        name = os.path.basename(log)[len("train_"):-len(".log")]
        cmds[name] = cmd
        metrics = cmd[cmd.index("--sb-metrics-file") + 1]
        with open(metrics, "w") as f:
            for step in range(1, 11):
                f.write(json.dumps({"step": step, "tokens": 1000, "tokens_per_s": 1000.0,
                                    "step_time_s": 9.0 if step == 7 else 1.0}) + "\n")
        if "--profile" in cmd:
            assert cmd[cmd.index("--profile-step-start") + 1] == str(ts.PROFILE_STEP) == "6"
            tb = cmd[cmd.index("--tensorboard-dir") + 1]
            out = os.path.join(os.path.dirname(tb), "torch_profile")
            os.makedirs(out)
            with open(os.path.join(out, "rank-0.json.gz"), "wb") as f:
                f.write(gzip.compress(json.dumps({"traceEvents": [
                    {"ph": "X", "cat": "cpu_op", "name": f"ProfilerStep#{s}", "ts": 1e6 * s,
                     "dur": 1000.0 * s} for s in (5, 6)]}).encode()))
        return 0, 1.0, ""

    monkeypatch.setattr(ts, "run_logged", fake_run)
    monkeypatch.setattr(ts, "te_available", lambda env: False)
    monkeypatch.setattr(ts, "long_docs_prefix", lambda out: (str(tmp_path / "long"), 70))
    monkeypatch.setattr(ts, "run_table", lambda work, data, backend, given: "table.json")
    res = ts.step_train(str(tmp_path), None, 1000, {}, "auto", memory_gib=139.0)
    profiled = {n for n, c in cmds.items() if "--profile" in c}
    assert profiled == {f"{d}_{v}" for d, v in ts.TRAIN_PROFILED} == {
        "long_docs_dense_sab", "long_docs_sb_d0.25", "long_docs_sb_d0.5",
        "long_docs_dense_sab_sdpa", "long_docs_64k_dense_sab", "long_docs_64k_sb_d0.25",
        "long_docs_64k_sb_d0.5"}
    run = res["runs"]["long_docs/sb_d0.25"]
    assert run["gpu_profile"] == {"step": "ProfilerStep#6", "host_step_ms": 6.0, "kernels": 0}
    assert "7" not in run["step_s"] and run["left_out_steps"] == {"7": 9.0}
    assert run["tokens_per_s"] == 1000.0                      # step 7's 9 s left out
    files = res["runs"]["files/dense_sab"]
    assert "gpu_profile" not in files and "7" in files["step_s"]
    assert not any(p.startswith("profile_") for p in os.listdir(tmp_path))   # traces removed


def test_the_profiled_step_cross_checks_the_bound():
    """``profiled_bounds``: the profiled step's non-attention time is dense + SAB's host step
    less its attention kernels; cuDNN's attention is the measured cuDNN run's kernels (32K) or
    dense + SAB's priced at cuDNN's per tile over varlen's (64K); each profiled run's host step
    beside it, with its kept density (1 for dense)."""
    tr = _studies("gpu_trace")
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128}}

    def prof(host, attention):
        return {"step": "ProfilerStep#6", "host_step_ms": host, "kernels": 9,
                "ms": {"attention": attention, "non_attention": 1.0}}

    runs = {"long_docs/dense_sab": {"gpu_profile": prof(3000.0, 1200.0)},
            "long_docs/dense_sab_sdpa": {"gpu_profile": prof(2900.0, 700.0)},
            "long_docs/sb_d0.25": {"gpu_profile": prof(2100.0, 300.0), "step_s": {"6": 2.0},
                                   "step_density": {"6": 0.25}},
            "long_docs/sb_d0.5": {"step_s": {"6": 2.5}}}              # not profiled
    tr.profiled_bounds(runs, "long_docs", tiles, 6)
    sb = runs["long_docs/sb_d0.25"]["profiled_bound"]
    assert sb["non_attention_ms"] == 1800.0 and sb["cudnn_attention_ms"] == 700.0
    assert sb["bound_ms"] == 1800.0 + 0.25 * 700.0 and sb["metrics_step_s"] == 2.0
    assert sb["over_bound"] == pytest.approx(2100.0 / 1975.0 - 1)
    assert sb["cudnn_attention_from"].startswith("measured")
    assert runs["long_docs/dense_sab"]["profiled_bound"]["bound_ms"] == 2500.0
    assert "profiled_bound" not in runs["long_docs/sb_d0.5"]
    runs64 = {"long_docs_64k/dense_sab": {"gpu_profile": prof(3000.0, 1200.0)},
              "long_docs_64k/sb_d0.5": {"gpu_profile": prof(2400.0, 500.0),
                                        "step_density": {"6": 0.5}}}
    tr.profiled_bounds(runs64, "long_docs_64k", tiles, 6)      # 64K: the 32K tile costs
    got = runs64["long_docs_64k/sb_d0.5"]["profiled_bound"]
    assert got["cudnn_attention_ms"] == pytest.approx(800.0)   # 1200 x 0.5 / 0.75
    assert got["bound_ms"] == pytest.approx(1800.0 + 400.0)
    assert got["cudnn_attention_from"].startswith("priced")
    none = {"long_docs_64k/sb_d0.5": {"gpu_profile": prof(2400.0, 500.0)}}
    tr.profiled_bounds(none, "long_docs_64k", tiles, 6)        # no dense profile: nothing
    assert "profiled_bound" not in none["long_docs_64k/sb_d0.5"]


def test_dst_with_device_timings_composes_the_measured_units_on_a_tiny_model(tmp_path):
    """``dst_gpu --tiny`` (CPU, the torch kernel): the three arms planned from the table on one
    global batch (static at d0 on Megatron's packing, DST as the runtime plans it, dense + SAB
    at density 1), every unit timed, each arm's step the simulator's over the measured units,
    the gain against the predicted one and the targets from them."""
    import json

    import numpy as np
    dg = _studies("dst_gpu")
    from sparsebalance_megatron.sim.pipeline import simulate_1f1b
    out = tmp_path / "dst.json"
    assert dg.main(["--tiny", "--reps", "1", "--budget-s", "900", "--json", str(out)]) == 0
    got = json.load(open(out))
    s = got["shape"]
    assert got["backend"] == "torch" and got["device"] == "cpu"
    assert (s["pp"], s["dp"], s["microbatches"]) == (2, 2, 2)
    arms = got["arms"]
    assert np.allclose(arms["static"]["densities"], got["d0"])
    assert np.allclose(arms["dense_sab"]["densities"], 1.0)
    assert arms["static"]["packing"] == "sequential" and arms["dense_sab"]["packing"] == "sab"
    for arm in dg.ARMS:
        r = arms[arm]
        f, b = np.asarray(r["measured_fwd_s"]), np.asarray(r["measured_bwd_s"])
        assert f.shape == (2, 2, 2) and (f > 0).all() and (b > 0).all()
        assert r["measured_step_s"] == pytest.approx(
            simulate_1f1b(f, b, got["p2p_s"]).step_time_s, rel=1e-12)
    summ = got["summary"]
    assert summ["measured_gain_vs_static"] == pytest.approx(
        arms["static"]["measured_step_s"] / arms["dst"]["measured_step_s"])
    assert summ["gain_gap_points"] == pytest.approx(
        100 * (summ["measured_gain_vs_static"] - summ["predicted_gain_vs_static"]))
    assert set(got["targets"]) == {"dst_gain_within_2_points_of_predicted",
                                   "dst_never_below_static"}
    assert got["units_timed"] <= 3 * 2 * 2 * 2       # shared units timed once
    assert 0 < got["setup_s"] < got["seconds"]          # where the time went, beside it


def test_a_profiled_stage_in_bf16_is_all_bf16_as_pretrain_wraps_it():
    """On the device every profiled stage is bf16 (``build_stage``'s default there). Built with
    bf16 parameters alone, the torch norms stay float32 and feed the next linear float32: the
    H200's dst step failed so (2026-11-30). Wrapped in Float16Module, as get_model wraps it,
    each kind of stage runs forward and backward, every parameter bf16."""
    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch import profile
    dg = _studies("dst_gpu")
    s = dg.TINY_SHAPE
    sb = SparseBalanceConfig(sparse_attention=True, block_size=s["block"],
                             attention_backend="torch", dense_below_tokens="0")
    profile.init_single_process(sb.seed)
    shape = dg.model_shape(s)
    for kind in ("first", "middle", "last"):
        net, dev = profile.build_stage(shape, sb, kind, 1, bf16=True)
        assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
        fwd, bwd = profile.time_microbatch(net, dev, kind, shape, [100, 156], 0.5, 1, 0)
        assert fwd > 0 and bwd > 0
