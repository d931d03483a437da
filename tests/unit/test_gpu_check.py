"""The GPU acceptance check's logic on CPU: the kernel table's crossover and target summary
(scripts/bench_attention_gpu.py), and how gpu_check turns step results into targets."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / f"scripts/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(backend, tokens, ours, dense=10.0, d=0.25, shape="14/2/64", case="single",
         routing="none", varlen=None):
    return dict(case=case, shape=shape, tokens=tokens, backend=backend, density=d,
                routing=routing, ours_ms=ours, dense_ms=dense, ratio_vs_dense=ours / dense,
                dense_varlen_ms=varlen or dense, ratio_vs_varlen=ours / (varlen or dense))


def test_crossover_is_where_ours_stays_faster():
    kt = _script("bench_attention_gpu")
    rows = [_row("triton", 4096, 12), _row("triton", 8192, 9), _row("triton", 16384, 11),
            _row("triton", 32768, 4), _row("triton", 65536, 3),
            _row("flex", 32768, 30), _row("triton", 32768, 1, d=0.5, shape="32/8/128")]
    # 8K was faster but 16K was not: the crossover is the shortest length from which every
    # longer measured length is faster too
    assert kt.crossover_of(rows, "triton", "14/2/64", 0.25) == 32768
    assert kt.crossover_of(rows, "flex", "14/2/64", 0.25) is None      # never: all dense
    assert kt.crossover_of(rows, "triton", "32/8/128", 0.5) == 32768
    assert kt.crossover_of(rows, "triton", "14/2/64", 0.125) is None   # not measured


def test_summary_checks_the_issue_targets():
    kt = _script("bench_attention_gpu")
    rows = [_row("flex", 32768, 6.6), _row("triton", 32768, 3.2),
            _row("triton", 32768, 5.5, d=0.5),
            _row("triton", 32768, 10.1, case="file#0", routing="crossover"),
            _row("triton", 32768, 10.5, case="file#1", routing="crossover"),
            _row("fa4", 32768, 9.0, case="file#0", routing="crossover"),
            _row("flex", 32768, 50, case="file#0", routing="none")]   # unrouted: not judged
    s = kt.summarize(rows, {"triton|14/2/64|0.25": 32768})
    assert s["32k_d0.25"]["backend"] == "triton" and s["32k_d0.25"]["met"]
    assert not s["32k_d0.25"]["goal_0.3_met"]                            # 0.32 > 0.3
    assert s["32k_d0.5"]["ratio"] == pytest.approx(0.55) and s["32k_d0.5"]["met"]
    assert s["packed_worst_vs_varlen"] == {"triton": pytest.approx(1.05), "fa4": 0.9}
    assert s["packed_never_slower_met"] == {"triton": False, "fa4": True}
    assert s["crossover_tokens"] == {"triton|14/2/64|0.25": 32768}


def test_shape_argument_is_checked():
    kt = _script("bench_attention_gpu")
    assert kt.parse_shape("14/2/64") == (14, 2, 64)
    for bad in ("14/3/64", "14-2-64", "0/1/64"):
        with pytest.raises(ValueError, match=bad):
            kt.parse_shape(bad)


def test_targets_from_every_step():
    gc = _script("gpu_check")
    bench = {"summary": {"32k_d0.25": {"met": True, "goal_0.3_met": False},
                         "32k_d0.5": {"met": False},
                         "packed_never_slower_met": {"triton": True, "flex": False}}}
    recompile = {"ok": True, "flex": {"recompiles_after_warmup": 2,
                                      "host_syncs_per_layer_path": 0},
                 "triton": {"recompiles_after_warmup": 0, "host_syncs_per_layer_path": 0}}
    train = {"runs": {"long_docs/sb_d0.5": {"speedup_vs_dense": 1.35},
                      "files/sb_d0.5": {"speedup_vs_dense": 1.05},
                      "files/sb_d0.25": {"speedup_vs_dense": 0.98}}}
    t = gc.targets({"bench": bench, "recompile": recompile, "train": train,
                    "latency": {"mape": 0.04}})
    assert t == {"ours_32k_d0.25_vs_dense<=0.35": True, "ours_32k_d0.5_vs_dense<=0.6": False,
                 "ours_32k_d0.25_vs_dense<=0.3_goal": False,
                 "packed_routed<=1.02x_varlen(any backend)": True,
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
    assert s["tokens_per_s"] == steady[len(steady) // 2]
    assert s["losses"] == [10 - i for i in range(gc.TRAIN_STEPS)]
    assert s["mean_density"] == 0.5 and s["steps"] == gc.TRAIN_STEPS
    assert gc.train_summary([])["tokens_per_s"] is None
