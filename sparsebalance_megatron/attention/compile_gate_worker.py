"""One compile of one Triton kernel for the H100 (sm_90a) on a machine without a GPU: the child
process of ``compile_gate``.

``python -m sparsebalance_megatron.attention.compile_gate_worker '<spec JSON>'`` compiles the
kernel the spec names the way a launch compiles it, then prints one JSON line with what the
cubin holds. A launch goes through the kernel's own JIT binding: its arguments are bound and
specialised (a pointer 16-byte aligned gets ``tt.divisibility``; an integer divisible by 16
too, one equal to 1 becomes a constant; ``do_not_specialize`` arguments are left alone), then
``triton.compile`` runs for the current device's target. Here the binding is the same
(``JITFunction.warmup`` with 16-byte-aligned CPU stand-in tensors of the launch's dtypes and
the launch's integer values), and the "current device" is a stand-in driver that names
``GPUTarget("cuda", 90, 32)`` and launches nothing. One compile per process: the review that
motivated this gate saw repeated compiles of one kernel in one process give a type error once
and double the shared memory once.

What is read back (``cuobjdump`` of the triton wheel, ``triton/backends/nvidia/bin``):
``-res-usage`` registers, stack (the spill stack), local and static shared bytes per thread or
block; ``-sass`` the opcode counts (``OPCODES``: STL/LDL spill traffic, HGMMA wgmma vs HMMA
mma.sync, REDG/RED/ATOMG/ATOM atomics, UTMALDG/LDGSTS tile loads); ``metadata.shared`` the
dynamic shared memory a launch asks for. Imports torch (stand-in tensors) and triton; must not
depend on the Megatron adapter or on Megatron itself.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict

OPCODES = ("HGMMA", "HMMA", "STL", "LDL", "REDG", "RED", "ATOMG", "ATOM", "UTMALDG", "LDGSTS")
"""SASS opcodes counted (base names: ``HGMMA.64x128x16.F32.BF16`` counts as HGMMA)."""

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _install_target_driver():
    """Make the sm_90a target the active one without touching CUDA (no device, no libcuda)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class H100Target(CudaDriver):
        def __init__(self):          # CudaDriver's own loads libcuda: nothing to load here
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(H100Target())


def _arg(a):
    """A spec argument -> the value the launch passes: a 16-byte-aligned CPU tensor of the
    dtype (``["t", "bfloat16"]``), an int or a float."""
    import torch
    kind, value = a
    if kind == "t":
        x = torch.empty(64, dtype=getattr(torch, value))
        assert x.data_ptr() % 16 == 0
        return x
    return int(value) if kind == "i" else float(value)


def parse_res_usage(text: str, kernel: str) -> Dict[str, int]:
    """``cuobjdump -res-usage`` -> {regs, stack, static_shared, local} of ``kernel``."""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if line.strip().startswith("Function") and line.strip().rstrip(":").endswith(kernel):
            m = _RES.search(lines[n + 1])
            if m:
                regs, stack, shared, local = (int(x) for x in m.groups())
                return dict(regs=regs, stack=stack, static_shared=shared, local=local)
    raise ValueError(f"cuobjdump -res-usage: no resource line for {kernel!r} in:\n{text[:2000]}")


def count_opcodes(sass: str) -> Dict[str, int]:
    """Counts of ``OPCODES`` in ``cuobjdump -sass`` output (every instruction line once)."""
    counts = dict.fromkeys(OPCODES, 0)
    for m in _OP.finditer(sass):
        if m.group(1) in counts:
            counts[m.group(1)] += 1
    return counts


def compile_spec(spec: dict) -> dict:
    """Compile ``spec`` (``compile_gate.Compile.spec()``) for sm_90a -> the cubin's figures."""
    import triton
    _install_target_driver()
    module, name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    args = [_arg(a) for a in spec["args"]]
    ck = fn.warmup(*args, grid=(1,), num_warps=spec["num_warps"],
                   num_stages=spec["num_stages"], **spec["constexprs"])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(ck.asm["cubin"])
        tool = os.path.join(bin_dir, "cuobjdump")
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    out = dict(parse_res_usage(res, ck.metadata.name), shared=int(ck.metadata.shared),
               **count_opcodes(sass))
    out["target"] = f"{ck.metadata.target.backend}:{ck.metadata.target.arch}"
    out["triton"] = triton.__version__
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    try:
        out = dict(ok=True, **compile_spec(spec))
    except Exception as e:   # a config that does not compile is a result, named as such
        out = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
    print("@@GATE " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
