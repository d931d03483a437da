"""Triton compiles counted per step (``megatron/step/compile_watch.py``): a kernel compiled for
a new constexpr is counted once, a launch that reuses it is not, hooks set before are still
called, and ``take`` clears the count. A tiny kernel compiled for sm_90a through its JIT
binding (``warmup``, the compile gate's stand-in driver: no GPU), in a process of its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def add_one(X, N: tl.constexpr):
    x = tl.arange(0, N)
    tl.store(X + x, tl.load(X + x) + 1)
'''

CHECK = r'''
import torch
from triton import knobs
from sparsebalance_megatron.attention.compile_gate_worker import _install_target_driver
from sparsebalance_megatron.megatron.step.compile_watch import CompileWatch
from tiny_kernel import add_one

_install_target_driver()
seen = []
knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
w = CompileWatch()
assert w.install() and w.available
x = torch.empty(64)
add_one.warmup(x, grid=(1,), N=8)
add_one.warmup(x, grid=(1,), N=8)       # the same specialisation: no compile
n, s = w.take()
assert n == 1 and s > 0, (n, s)
add_one.warmup(x, grid=(1,), N=16)      # a new constexpr: a new compile
assert w.take()[0] == 1 and w.take() == (0, 0.0)
assert seen == ["add_one", "add_one"], seen     # the hook set before still runs
w.uninstall()
add_one.warmup(x, grid=(1,), N=32)
assert w.take() == (0, 0.0) and len(seen) == 3
print("OK")
'''


def test_compiles_are_counted_once_per_specialisation(tmp_path):
    (tmp_path / "tiny_kernel.py").write_text(KERNEL)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         env=env, timeout=300, cwd=str(ROOT))
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
