"""The start-up compile of the fused selection's Triton kernels (``attention/triton_warmup.py``):
the widths it compiles for a run (a pure function), that it compiles exactly the kernels real
calls launch (cache keys compared on CPU against a stand-in sm_90 driver, nothing compiled),
a no-op off CUDA, and its call path under ``TRITON_INTERPRET=1``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsebalance_megatron.attention.triton_warmup import (SelectionShape, selection_compiles,
                                                            selection_widths, warm_selection)

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_widths_are_every_power_of_two_pair_up_to_the_longest_document():
    """(KP, WP) with KP <= WP <= next_pow2(blocks of the longest micro-batch - 1)."""
    w = selection_widths(32768, 128)                      # 256 blocks: WP up to 256
    assert len(w) == 45 and max(wp for _, wp in w) == 256 and (256, 256) in w
    assert all(kp <= wp and kp & (kp - 1) == 0 and wp & (wp - 1) == 0 for kp, wp in w)
    assert len(selection_widths(65536, 128)) == 55 == len(selection_widths(32768, 64))
    assert selection_widths(32769, 128)[-1] == (256, 256)    # 257 blocks: 256 less one
    assert selection_widths(32897, 128)[-1] == (512, 512)    # 258 blocks
    assert selection_widths(128, 128) == [(1, 1)] == selection_widths(256, 128)
    assert selection_widths(384, 128) == [(1, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match="max_tokens=0"):
        selection_widths(0, 128)


def test_compiles_of_a_run_are_the_widths_and_one_of_each_other_kernel():
    shape = SelectionShape(14, 2, 64, 128, 32768)
    names = [fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
             for fn, *_ in selection_compiles(shape)]
    assert names[:3] == ["_block_sums_kernel", "_maxkey_kernel", "_shares_kernel"]
    assert names[3:] == ["_lists_kernel"] * 45
    pooled = SelectionShape(14, 2, 64, 128, 32768, estimator="pooled", lists="generic")
    items = selection_compiles(pooled)
    names = [fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__ for fn, *_ in items]
    assert names == ["_block_sums_kernel"] * 2 + ["_lists_kernel"] * 45   # q's and k's sums
    assert {c["SELECT"] for *_, c in items[2:]} == {False}
    with pytest.raises(ValueError, match="lists='both'"):
        selection_compiles(SelectionShape(14, 2, 64, 128, 32768, lists="both"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs it")
def test_warm_up_is_a_no_op_off_cuda():
    assert warm_selection(SelectionShape(14, 2, 64, 128, 32768), "cpu") is None


def check_warm_up_runs_in_the_interpreter():
    """(In the interpreter worker.) The call path runs for a small width set: 128 tokens at
    block 16, 8 blocks, 10 widths."""
    got = warm_selection(SelectionShape(4, 2, 16, 16, 128, dtype=torch.float32), "cpu")
    assert got is not None and got["compiles"] == 3 + 10 and got["widths"] == 10, got
    assert got["parallel"] is False and got["seconds"] >= 0.0


def test_warm_up_call_path_runs_in_the_interpreter(interp):
    interp("check_warm_up_runs_in_the_interpreter")


def test_the_run_shape_follows_megatrons_flags():
    """This rank's heads after TP and CP, the dtype, --seq-length, the estimator and which list
    kernel runs; nothing for another backend or a head dim the fused selection's tiles refuse;
    and nothing compiled (no line) off CUDA."""
    from argparse import Namespace

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.selection_warmup import selection_shape, warm_up
    args = Namespace(bf16=True, fp16=False, kv_channels=64, tensor_model_parallel_size=2,
                     context_parallel_size=1, num_attention_heads=28, num_query_groups=4,
                     group_query_attention=True, seq_length=65536)
    sb = SparseBalanceConfig(block_size=128)
    got = selection_shape(args, sb, "fa4")
    assert got == SelectionShape(14, 2, 64, 128, 65536, torch.bfloat16, sb.estimator,
                                 sb.sink_blocks, sb.local_blocks, "fused")
    cp = Namespace(**dict(vars(args), num_attention_heads=32, context_parallel_size=2))
    assert (selection_shape(cp, sb, "triton").num_heads, selection_shape(cp, sb, "triton")
            .num_groups, selection_shape(cp, sb, "triton").lists) == (8, 1, "fused")
    cp4 = selection_shape(Namespace(**dict(vars(cp), context_parallel_size=4)), sb, "triton")
    assert (cp4.num_heads, cp4.num_groups, cp4.lists) == (4, 1, "generic")   # 2 groups, 4 ranks
    mass = SparseBalanceConfig(block_size=128, selection_mode="mass")
    assert selection_shape(args, mass, "triton").lists == "generic"
    assert selection_shape(args, sb, "flex") is None
    assert selection_shape(Namespace(**dict(vars(args), kv_channels=80)), sb, "fa4") is None
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert warm_up(args, sb, "fa4", "cpu") is None


def test_the_warm_up_line_says_what_it_compiled_and_a_failure_does_not_stop_the_run(
        monkeypatch):
    from argparse import Namespace

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model import selection_warmup as sw
    args = Namespace(bf16=True, fp16=False, kv_channels=64, tensor_model_parallel_size=1,
                     context_parallel_size=1, num_attention_heads=14, num_query_groups=2,
                     group_query_attention=True, seq_length=32768)
    sb = SparseBalanceConfig(block_size=128)
    monkeypatch.setattr(sw, "warm_selection", lambda shape, dev: dict(
        compiles=48, widths=45, seconds=3.25, parallel=True))
    assert sw.warm_up(args, sb, "fa4", "cuda") == (
        "Triton selection warm-up (fa4): 48 kernels, 45 list widths up to 32768 tokens at "
        "block 128, in 3.2 s (parallel)")

    def broken(shape, dev):
        raise RuntimeError("ptxas died")
    monkeypatch.setattr(sw, "warm_selection", broken)
    line = sw.warm_up(args, sb, "triton", "cuda")
    assert "warm-up failed (RuntimeError: ptxas died)" in line and "compile in the steps" in line


# --- the warm-up compiles what real calls launch ------------------------------------------------

def _key_check(out_path):
    """(In a fresh process, no interpreter.) With a stand-in sm_90 driver (no GPU, no libcuda),
    every selection kernel's compile is intercepted at its cache key and skipped: first the
    warm-up's, then those of real ``triton_block_sparse`` calls over random micro-batches
    (varied longest documents, densities, block counts and k strides). Writes both key sets."""
    import numpy as np

    from sparsebalance_megatron.attention import (block_lists, maxkey_triton,
                                                  sparse_triton_select as sel)
    from sparsebalance_megatron.attention.api import _density
    from sparsebalance_megatron.attention.blocks import build_layout
    from sparsebalance_megatron.attention.compile_gate_worker import _install_target_driver
    _install_target_driver()
    kernels = {"block_sums": sel._block_sums_kernel, "maxkey": maxkey_triton._maxkey_kernel,
               "shares": sel._shares_kernel, "lists": block_lists._lists_kernel}
    keys = {p: {k: set() for k in kernels} for p in ("warm", "real", "warm_mass", "real_mass")}
    phase = ["warm"]
    for name, fn in kernels.items():
        def skip(key, *args, _name=name, **kw):
            keys[phase[0]][_name].add(str(key))
            return None                              # run() returns without a launch
        fn._do_compile = skip
    nh, ng, hn, bs, tokens = 14, 2, 64, 128, 4096
    for phase[0], lists in (("warm", "fused"), ("warm_mass", "generic")):
        shape = SelectionShape(nh, ng, hn, bs, tokens, dtype=torch.bfloat16, lists=lists)
        for fn, args, constexprs in selection_compiles(shape):
            fn.warmup(*args, grid=(1,), **constexprs)
    sel.sparse_attention = lambda q, k, v, lists, layout, scale: q      # no attention kernel
    rng = np.random.default_rng(0)
    rep = nh // ng
    for n in range(50):
        phase[0] = "real" if n < 40 else "real_mass"      # mass mode: the generic lists
        t = int(rng.integers(1, tokens // 128 + 1)) * 128
        cuts = sorted(set(rng.integers(1, t, size=int(rng.integers(0, 6))).tolist()))
        cu = [0] + cuts + [t]
        layout = build_layout(cu, t, bs, torch.device("cpu"), fixed_length=False)
        density, host = _density(layout, float(rng.uniform(0.02, 1.0)))
        if n % 2:           # k as Megatron's fused QKV hands it over: a strided view
            qkv = torch.randn(t, ng, (rep + 2) * hn, dtype=torch.bfloat16)
            k = qkv[:, :, rep * hn:(rep + 1) * hn]
        else:
            k = torch.randn(t, ng, hn, dtype=torch.bfloat16)
        q = torch.randn(t, nh, hn, dtype=torch.bfloat16)
        sel.triton_block_sparse(q, k, k, layout, density, density_host=host,
                                estimator="maxkey", softmax_scale=0.125, sink_blocks=1,
                                local_blocks=0, mass_threshold=0.9,
                                selection_mode="density" if n < 40 else "mass",
                                min_density=0.0, max_density=1.0)
    import triton
    with open(out_path, "w") as fh:
        json.dump({"triton": triton.__version__,
                   **{p: {k: sorted(v) for k, v in d.items()} for p, d in keys.items()}}, fh)


def test_the_warm_up_compiles_every_kernel_real_calls_launch(tmp_path):
    """Every cache key the selection kernels meet over 40 random micro-batches of up to 4K
    tokens (documents of 1 to 32 blocks, densities 0.02-1, block counts divisible by 16 or
    not, k contiguous or strided) is one the warm-up compiled: no compile is left for a
    training step. The real calls meet several list widths, and one key of each other kernel;
    10 more in ``mass`` mode meet the generic list kernel's, which ``lists="generic"`` warms."""
    out = tmp_path / "keys.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(     # this process's triton first
        p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
    env.pop("TRITON_INTERPRET", None)
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('t', {str(__file__)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"m._key_check({str(out)!r})")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=str(REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    keys = json.loads(out.read_text())
    import triton
    assert keys["triton"] == triton.__version__         # the triton of this process
    for mode in ("", "_mass"):
        warm, real = keys["warm" + mode], keys["real" + mode]
        for name in ("block_sums", "maxkey", "shares", "lists"):
            missing = set(real[name]) - set(warm[name])
            assert not missing, (mode, name, len(missing), len(real[name]))
    assert len(keys["real_mass"]["lists"]) >= 3 and not keys["real_mass"]["shares"]
    warm, real = keys["warm"], keys["real"]
    assert len(warm["lists"]) == len(selection_widths(4096, 128)) == 21
    assert len(real["lists"]) >= 8
    assert [len(real[k]) for k in ("block_sums", "maxkey", "shares")] == [1, 1, 1]
