"""The GPU acceptance check's logic on CPU (scripts/gpu_check.py): how it turns step results into
targets, its steps' records, its provenance, the runs' comparisons and profiles. The train
step's runs: test_gpu_train_step.py; the device plan and its carries: test_gpu_plan.py; the
kernel table's own logic: test_kernel_table.py."""

import os
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO, load_script as _script


def test_targets_from_every_step():
    gc = _script("gpu_check")
    bench = {"summary": {"targets": {"32k_d0.25<=0.3x_cudnn": True,
                                     "32k_d0.5<=0.58x_cudnn": False}}}
    recompile = {"ok": True, "flex": {"recompiles_after_warmup": 2,
                                      "host_syncs_per_layer_path": 0},
                 "triton": {"recompiles_after_warmup": 0, "host_syncs_per_layer_path": 0}}
    train = {"runs": {"long_docs/sb_d0.5": {"speedup_vs_dense": 1.35},
                      "files/sb_d0.5": {"speedup_vs_dense": 1.05},
                      "files/sb_d0.25": {"speedup_vs_dense": 0.98}}}
    t = gc.targets({"bench": bench, "recompile": recompile, "train": train,
                    "latency": {"mape": 0.04}})
    assert t == {"32k_d0.25<=0.3x_cudnn": True, "32k_d0.5<=0.58x_cudnn": False,
                 "flex_no_recompiles_after_warmup": False, "flex_no_host_syncs_per_layer": True,
                 "triton_no_recompiles_after_warmup": True,
                 "triton_no_host_syncs_per_layer": True, "latency_mape<=5%": True,
                 "train_long_docs/sb_d0.5>=1.3x_dense": True,
                 "train_files/sb_d0.5>=1.1x_dense": False, "train_never_below_dense": False}
    assert gc.targets({}) == {}


def test_train_summary_skips_warmup_steps():
    gc = _script("gpu_check")
    recs = [dict(step=i + 1, loss=10 - i, tokens_per_s=1000.0 * (i + 1),
                 mean_density=0.5, density_per_stage=[0.5]) for i in range(gc.TRAIN_STEPS)]
    s = gc.train_summary(recs)
    steady = sorted(1000.0 * (i + 1) for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS))
    assert s["tokens_per_s"] == steady[len(steady) // 2] == s["median_step_tokens_per_s"]
    # with each step's tokens and seconds: all steady tokens over all steady seconds
    for i, r in enumerate(recs):
        r.update(tokens=100 * (i + 1), step_time_s=1.0 + (i % 2))
    s = gc.train_summary(recs)
    want = [(100 * (i + 1), 1.0 + (i % 2)) for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS)]
    assert s["tokens_per_s"] == sum(t for t, _ in want) / sum(x for _, x in want)
    assert s["step_s"] == {str(i + 1): 1.0 + (i % 2)
                           for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS)}
    assert s["losses"] == [10 - i for i in range(gc.TRAIN_STEPS)]
    assert s["mean_density"] == 0.5 and s["steps"] == gc.TRAIN_STEPS
    assert gc.train_summary([])["tokens_per_s"] is None


def test_every_call_names_its_device_commit_and_versions(tmp_path):
    """The e2e call runs no ``env`` step; its JSON still names the device and the versions."""
    gc = _script("gpu_check")
    doc = gc._write({"latency": {"ok": True}}, str(tmp_path))
    for key in ("commit", "torch", "triton", "cuda", "versions", "device"):
        assert key in doc, key
    gc._PROVENANCE["device"] = "NVIDIA H200"
    assert gc._write({"latency": {"ok": True}}, str(tmp_path))["device"] == "NVIDIA H200"
    got = gc._write({"env": {"ok": True, "device": "NVIDIA H100"}}, str(tmp_path))
    assert got["device"] == "NVIDIA H100"


def test_the_guide_states_each_steps_limit_as_the_script_has_it():
    import re
    gc = _script("gpu_check")
    text = (REPO / "docs/GPU.md").read_text()
    stated = {m.group(1): int(m.group(2))
              for m in re.finditer(r"^\| `(\w+)` \| .* \| (\d+) s \|$", text, re.M)}
    assert stated == gc.LIMIT_S


def test_paired_speedup_compares_the_same_steps():
    """Step k is the same global batch in every variant: the median of per-step ratios over the
    steps both runs timed."""
    gc = _script("gpu_check")
    base = {"step_s": {"4": 1.0, "5": 2.0, "6": 0.5, "7": 3.0}}
    run = {"step_s": {"4": 0.5, "5": 1.0, "6": 1.0, "8": 1.0}}
    assert gc.paired_speedup(base, run) == 2.0          # ratios 2, 2, 0.5 on steps 4-6
    assert gc.paired_speedup(base, {"step_s": {"9": 1.0}}) is None
    assert gc.paired_speedup({}, run) is None


def test_end_to_end_targets_count_against_the_faster_dense_baseline():
    """Issue 35: end to end is judged against dense attention with SAB packing where that run is
    faster than plain dense (the fairest dense baseline a user can have today)."""
    gc = _script("gpu_check")
    assert gc.TRAIN_VARIANTS["dense_sab"] == ["--sb-batching"]
    train = {"runs": {"long_docs/dense": {"tokens_per_s": 100.0},
                      "long_docs/dense_sab": {"tokens_per_s": 110.0, "speedup_vs_dense": 1.1},
                      "long_docs/sb_d0.5": {"tokens_per_s": 135.0, "speedup_vs_dense": 1.35,
                                            "speedup_vs_best_dense": 135.0 / 110.0}}}
    t = gc.targets({"train": train})
    assert t["train_long_docs/sb_d0.5>=1.3x_dense"] is False      # 1.23x the dense+SAB run
    assert t["train_never_below_dense"] is True


def test_sparse_runs_count_against_the_fastest_dense_run_whichever_its_kernel():
    """Dense + SAB through cuDNN SDPA (``--sb-dense-kernel sdpa``) joins plain dense and dense +
    SAB through the varlen call: a sparse run is compared with the fastest, step for step too."""
    gc = _script("gpu_check")
    assert gc.TRAIN_VARIANTS["dense_sab_sdpa"] == ["--sb-batching", "--sb-dense-kernel", "sdpa"]
    steps = {"4": 1.0, "5": 1.0}
    runs = {"long_docs/dense": {"tokens_per_s": 50.0, "step_s": {"4": 4.0, "5": 4.0}},
            "long_docs/dense_sab": {"tokens_per_s": 80.0, "step_s": {"4": 1.25, "5": 1.25}},
            "long_docs/dense_sab_sdpa": {"tokens_per_s": 100.0, "step_s": steps},
            "long_docs/sb_d0.5": {"tokens_per_s": 110.0, "step_s": {"4": 0.8, "5": 0.8}},
            "files/dense_sab": {"tokens_per_s": 70.0},
            "files/sb_d0.5": {"tokens_per_s": 77.0}}
    gc.compare_with_dense(runs, "long_docs")
    gc.compare_with_dense(runs, "files")
    sb = runs["long_docs/sb_d0.5"]
    assert sb["best_dense"] == "dense_sab_sdpa"
    assert sb["speedup_vs_best_dense"] == pytest.approx(1.1)
    assert sb["paired_speedup_vs_best_dense"] == pytest.approx(1.25)
    assert sb["speedup_vs_dense"] == pytest.approx(2.2)
    assert "speedup_vs_best_dense" not in runs["long_docs/dense_sab_sdpa"]
    files = runs["files/sb_d0.5"]           # no plain dense run: the best is dense + SAB
    assert files["best_dense"] == "dense_sab" and "speedup_vs_dense" not in files
    assert files["speedup_vs_best_dense"] == pytest.approx(1.1)
    assert gc.targets({"train": {"runs": runs}})["train_long_docs/sb_d0.5>=1.3x_dense"] is False


def test_steps_that_paid_a_triton_compile_are_reported_and_left_out_beside():
    """A sparse run's records say which steps compiled a Triton kernel: the summary keeps its
    rates and adds the same without those steps (run 3's forward spikes of 0.3-0.5 s)."""
    gc = _script("gpu_check")
    recs = [dict(step=n, tokens=1000, step_time_s=t, tokens_per_s=1000 / t, kernel_compiles=c,
                 kernel_compile_s=0.5 * c) for n, t, c in
            ((1, 3.0, 9), (2, 1.0, 1), (3, 1.0, 0), (4, 1.5, 1), (5, 1.0, 0), (6, 1.0, 0))]
    out = gc.train_summary(recs)
    assert out["compile_steps"] == {"1": 4.5, "2": 0.5, "4": 0.5}
    assert out["step_s_no_compile"] == {"5": 1.0, "6": 1.0}
    assert out["tokens_per_s"] == pytest.approx(3000 / 3.5)
    assert out["tokens_per_s_no_compile"] == pytest.approx(1000.0)
    dense = gc.train_summary([dict(r, kernel_compiles=None) for r in recs])
    assert "compile_steps" in dense and dense["compile_steps"] == {}
    plain = gc.train_summary([{k: v for k, v in r.items() if not k.startswith("kernel")}
                              for r in recs])
    assert "compile_steps" not in plain             # a dense run records none
    runs = {"x/dense_sab": {"tokens_per_s": 800.0, "step_s": {"4": 1.25, "5": 1.25, "6": 1.25}},
            "x/sb_d0.5": out}
    gc.compare_with_dense(runs, "x")
    assert out["speedup_vs_best_dense_no_compile"] == pytest.approx(1.25)
    assert out["paired_speedup_vs_best_dense_no_compile"] == pytest.approx(1.25)
    assert out["paired_speedup_vs_best_dense"] == pytest.approx(1.25)   # median of 0.83, 1.25 x2


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_host_and_gpu_ms_tells_the_hosts_cost_from_the_kernels():
    """A call that only sleeps on the host shows its time in ``host_ms`` and none on the GPU; a
    call that reads a device value waits for the sleep kernel and is counted ``held``."""
    import time

    import torch
    sys.path.insert(0, str(REPO / "scripts"))
    from studies.common import host_and_gpu_ms
    x = torch.ones(1, device="cuda")
    host = host_and_gpu_ms(lambda: (time.sleep(0.004), x.add_(1)), reps=3)
    assert host["host_ms"] >= 4.0 and host["gpu_ms"] < 4.0 and host["held"] == 0
    synced = host_and_gpu_ms(lambda: x.add_(1).item(), reps=3, sleep_ms=10.0)
    assert synced["held"] == 3 and synced["host_ms"] >= 9.0


def test_a_profiled_steps_trace_says_how_busy_the_gpu_was(tmp_path):
    """``gpu_trace.summarize_trace``: kernels summed, their union as the GPU's busy time
    (overlapping streams once) against the span from the first to the last, the recorded
    step's host time, the costliest kernels; a CPU trace has no kernel, a broken one says so."""
    import gzip
    import json
    sys.path.insert(0, str(REPO / "scripts"))
    from studies.gpu_trace import profile_flags, summarize_trace, trace_path
    events = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#2", "ts": 0, "dur": 10_000},
              {"ph": "X", "cat": "kernel", "name": "flash_bwd", "ts": 1_000, "dur": 3_000},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2_000, "dur": 1_000},  # overlaps
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 6_000, "dur": 1_000},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 8_000, "dur": 1_000},
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 9_500}]           # not a span
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = summarize_trace(str(path))
    assert got["kernels"] == 4 and got["host_step_ms"] == 10.0
    assert got["kernel_ms"] == 6.0 and got["gpu_busy_ms"] == 5.0 and got["gpu_span_ms"] == 8.0
    assert got["busy_fraction"] == 5.0 / 8.0
    assert got["top"][0] == {"name": "flash_bwd", "ms": 3.0, "count": 1}
    assert got["top"][1] == {"name": "gemm", "ms": 2.0, "count": 2}
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": events[:1]}))
    assert summarize_trace(str(cpu)) == {"kernels": 0, "host_step_ms": 10.0}
    assert "failed" in summarize_trace(str(tmp_path / "none.json.gz"))
    flags = profile_flags(str(tmp_path / "run"))
    assert flags[:2] == ["--profile", "--use-pytorch-profiler"]
    tb = flags[flags.index("--tensorboard-dir") + 1]       # Megatron writes beside it
    assert trace_path(str(tmp_path / "run")) == os.path.join(
        os.path.dirname(tb), "torch_profile", "rank-0.json.gz")
