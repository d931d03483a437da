"""scripts/gpu_check.py on CPU: how the attention benchmark's rows become the 32K target."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(backend, ratio, t=32768, d=0.25, sink=1, variant="default"):
    return dict(backend=backend, variant=variant, seq_len=t, density=d, sink_blocks=sink,
                ratio_vs_dense=ratio, select_vs_dense=ratio / 20)


def test_the_32k_target_goes_to_the_faster_backend():
    gc = _gpu_check()
    rows = [_row("flex", 0.66), _row("flash", 0.31), _row("flash", 0.1, t=8192),
            _row("flash", 0.05, sink=0), _row("flash", 0.2, d=0.125),
            _row("flex", 0.01, variant="tma"), dict(backend="flash", variant="x", failed="E")]
    got = gc.bench_summary(rows)
    assert got["ratio_backend"] == "flash" and got["ratio_32k_d025"] == 0.31
    assert got["ratio_32k_d025_by_backend"] == {"flex": 0.66, "flash": 0.31}
    assert got["select_vs_dense_32k"] == 0.31 / 20
    # where sparse beats dense, per backend and length (the tma variant and sink-0 rows aside)
    assert got["densities_faster_than_dense"] == {"flex": {"32768": [0.25]},
                                                  "flash": {"32768": [0.25, 0.125],
                                                            "8192": [0.25]}}
    t = gc.targets({"bench": got})
    assert t["ours_32k_d025_vs_dense<=0.4"] and not t["ours_32k_d025_vs_dense<=0.3_goal"]


def test_no_32k_row_gives_no_target():
    gc = _gpu_check()
    failed = [dict(backend="flash", variant="default", failed="RuntimeError: no flash")]
    assert gc.bench_summary(failed) == {}
    assert gc.bench_summary(failed + [_row("flex", 1.5, t=8192)]) == \
        {"densities_faster_than_dense": {"flex": {"8192": []}}}
    assert "ours_32k_d025_vs_dense<=0.4" not in gc.targets({"bench": {}})
    assert gc.bench_summary(failed + [_row("flex", 0.66)])["ratio_backend"] == "flex"


def test_flash_backend_has_its_own_recompile_targets():
    gc = _gpu_check()
    flex = {"recompiles_after_warmup": 0, "host_syncs_per_layer_path": 0}
    t = gc.targets({"recompile": dict(flex, flash={"recompiles_after_warmup": 3,
                                                   "host_syncs_per_layer_path": 0})})
    assert t == {"no_recompiles_after_warmup": True, "no_host_syncs_per_layer": True,
                 "flash_no_recompiles_after_warmup": False, "flash_no_host_syncs_per_layer": True}
    assert "flash_no_recompiles_after_warmup" not in gc.targets({"recompile": flex})
