"""The H100 compile gate: every Triton kernel of the ``triton`` backend compiled for sm_90a on a
machine without a GPU, in every launch configuration the device can be asked to run, and judged.

``compiles()`` lists the compiles at the target shapes (``TARGETS``: 8 query / 2 KV heads at
head dim 128 and 14 / 2 at 64, block 128; 8 / 2 / 128 at block 64; bf16, one 32K-token
document): the forward and the dK/dV/dQ kernel in the default config, every ``PINNED`` entry
and every autotune candidate of ``triton_launch`` (configs that differ only in arguments the
kernel does not specialise on, such as ``kv_chunk``, share one compile), and the selection,
list, ``bwd_pre`` and ``bwd_post`` kernels as ``sparse_triton_select``, ``maxkey_triton``,
``block_lists`` and ``sparse_triton`` launch them. ``run()`` compiles each in a process of its
own (``compile_gate_worker``: the kernel's own JIT binding, 16-byte-aligned stand-ins, target
``GPUTarget("cuda", 90, 32)``), reusing results whose key (the hash of the kernel's source file,
the compile's arguments, the triton version and the worker's source) is in a cache.
``problems()`` says what is wrong with a result, ``verdict()`` whether that fails the gate:

- a default or pinned config (and every fixed-config kernel) fails on any problem: a spill
  (stack bytes, STL/LDL), more than ``SHARED_LIMIT`` bytes of shared memory (227 KB: it
  compiles and cannot launch on an H100), or a GEMM of the forward or dK/dV/dQ main loop off
  wgmma (any HMMA, or no HGMMA), except a pinned config whose HMMA ``triton_launch.HMMA_KEPT``
  justifies with a device measurement (a default never: it runs where nothing was measured);
- an autotune candidate fails when it cannot launch or does not compile, and when it spills
  unless ``triton_launch.SPILL_KEPT`` states why it stays; HMMA is reported, not refused;
- a fixed-config kernel (selection, lists, ``bwd_pre``/``bwd_post``) is judged as a default,
  but a spill ``SPILL_KEPT`` states a reason for is reported, not refused.

Pure python here (torch and triton only inside ``specs()`` and the worker); must not import
megatron. ``scripts/bench.py compile_gate`` prints the table and writes the JSON;
``tests/unit/test_compile_gate.py`` runs the gate in ``make test``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

TARGETS: Tuple[Tuple[int, int, int, int], ...] = ((8, 2, 128, 128), (14, 2, 64, 128),
                                                  (8, 2, 128, 64))
"""(query heads, KV heads, head dim, block size) the device runs (DESIGN 3a's targets)."""
TOKENS = 32768
"""Tokens of the one document whose sizes fill the specialised integer arguments."""
SHARED_LIMIT = 227 * 1024
"""Shared memory an H100 thread block may use (bytes)."""
WGMMA_KERNELS = ("fwd_kernel", "dkv_kernel", "dq_kernel")
"""Kernels whose list loop is GEMMs that must run on wgmma (HGMMA) at the target shapes."""
_PKG = "sparsebalance_megatron.attention"
WORKER = f"{_PKG}.compile_gate_worker"


@dataclass(frozen=True)
class Compile:
    """One compile: a kernel with its launch arguments' kinds and values at one target."""

    kernel: str                  # "module:function"
    target: str                  # "8/2/128@128": np/ng/hn@block
    args: Tuple[Tuple[str, object], ...]
    constexprs: Tuple[Tuple[str, object], ...]
    num_warps: int = 4
    num_stages: int = 3
    roles: Tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        return self.kernel.split(":")[1]

    def spec(self) -> dict:
        """What the worker compiles (roles left out: they do not change the cubin)."""
        return dict(kernel=self.kernel, args=[list(a) for a in self.args],
                    constexprs=dict(self.constexprs), num_warps=self.num_warps,
                    num_stages=self.num_stages)

    def label(self) -> str:
        """The tiles, warps and stages, as the table shows them."""
        c = dict(self.constexprs)
        tiles = "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N") if k in c)
        return f"{tiles + ' ' if tiles else ''}w{self.num_warps} s{self.num_stages}"


def _t(dtype: str):
    return ("t", dtype)


def _kernel_specs(nh: int, ng: int, hn: int, bs: int) -> List[Compile]:
    """The fixed-config kernels at one target, with the arguments their launch sites pass."""
    from . import block_lists, maxkey_triton, sparse_triton
    rep, nb, t = nh // ng, TOKENS // bs, TOKENS
    tgt = f"{nh}/{ng}/{hn}@{bs}"
    bf, f32, i32, i64 = _t("bfloat16"), _t("float32"), _t("int32"), _t("int64")
    k = 1 + -(-nb // 2)                               # kept slots at density 0.5, 1 sink
    kp = 1 << max(0, (k - 2).bit_length())
    wq, wk = max(k - 1, 1), max(nb - 1, 1)
    mod = f"{_PKG}.sparse_triton_kernels"
    out = [
        Compile(f"{mod}:bwd_pre_kernel", tgt, (bf, bf, f32, f32, f32, f32, i32, i32, ("i", nb)),
                (("NP", nh), ("NG", ng), ("HN", hn), ("BS", bs), ("PADDED", False))),
        Compile(f"{mod}:bwd_post_kernel", tgt, (f32, f32, f32, bf, bf, bf, ("i", t * nh * hn),
                                               ("i", t * ng * hn)),
                (("BLOCK", sparse_triton._POST_BLOCK),)),
        Compile(f"{_PKG}.sparse_triton_select:_block_sums_kernel", tgt, (bf, i32, i32, f32),
                (("H", nh), ("HN", hn), ("BS", bs))),
        Compile(f"{_PKG}.sparse_triton_select:_shares_kernel", tgt,
                (f32, i32, f32, f32, ("i", nb), ("i", nb * rep * nb), ("i", rep * nb),
                 ("i", nb), ("i", 1), ("i", 0)),
                (("REP", rep), ("RP", max(2, 1 << max(0, (rep - 1).bit_length()))),
                 ("BLOCK_J", 64))),
        Compile(f"{_PKG}.maxkey_triton:_maxkey_kernel", tgt,
                (f32, bf, i32, i32, i32, f32, ("i", nb * rep), ("i", rep), ("i", nb),
                 ("f", 0.1), ("i", rep * hn), ("i", nh * hn), ("i", hn), ("i", hn),
                 ("i", ng * hn), ("i", nb * rep * nb), ("i", nb)),
                (("HN", hn), ("BS", bs), ("BLOCK_R", maxkey_triton._BLOCK_R), ("IEEE", False))),
        Compile(f"{_PKG}.block_lists:_lists_kernel", tgt,
                (i64, i64, i32, i32, i32, i32, i32, i32, i64, f32, f32, ("i", nb * k), ("i", k),
                 ("i", nb), ("i", wq), ("i", wk), ("i", k)),
                (("KP", kp), ("WP", 1 << max(0, (max(wq, wk) - 1).bit_length())),
                 ("BLOCK", block_lists.scan_block(kp, 8)),
                 ("SELECT", True))),
    ]
    return [Compile(c.kernel, c.target, c.args, c.constexprs, c.num_warps, c.num_stages,
                    ("fixed",)) for c in out]


def _attention(nh, ng, hn, bs, cfg, role) -> List[Compile]:
    """The forward and backward compiles of one ``LaunchConfig`` (as ``sparse_triton`` launches
    them): dK/dV/dQ in one pass, or the split's dK/dV and dQ kernels."""
    rep, nb = nh // ng, TOKENS // bs
    tgt = f"{nh}/{ng}/{hn}@{bs}"
    bf, f32, i32 = _t("bfloat16"), _t("float32"), _t("int32")
    mod = f"{_PKG}.sparse_triton_kernels"
    shape = (("NP", nh), ("NG", ng), ("REP", rep), ("HN", hn), ("BS", bs))
    fwd = Compile(f"{mod}:fwd_kernel", tgt,
                  (bf, bf, bf, bf, f32, i32, i32, i32, i32, ("i", nb), ("i", 7), ("f", 0.1)),
                  shape + (("BLOCK_M", cfg.fwd_block_m), ("PREC", "tf32"), ("PADDED", False)),
                  cfg.fwd_warps, cfg.fwd_stages, (role,))
    dkv = Compile(f"{mod}:dkv_kernel", tgt,
                  (bf, bf, bf, bf, f32, f32, f32, f32, f32, i32, i32, i32, i32, ("i", nb),
                   ("i", nb - 1), ("i", 16), ("f", 0.1), ("f", 0.1)),
                  shape + (("BLOCK_N", cfg.bwd_block_n), ("BLOCK_M", cfg.bwd_block_m),
                           ("PREC", "tf32"), ("ONE_PASS", not cfg.dq_block_m)),
                  cfg.bwd_warps, cfg.bwd_stages, (role,))
    if not cfg.dq_block_m:
        return [fwd, dkv]
    dq = Compile(f"{mod}:dq_kernel", tgt,
                 (bf, bf, bf, bf, f32, f32, f32, i32, i32, i32, i32, ("i", nb), ("i", 7),
                  ("f", 0.1), ("f", 0.1)),
                 shape + (("BLOCK_M", cfg.dq_block_m), ("PREC", "tf32"), ("PADDED", False)),
                 cfg.bwd_warps, cfg.bwd_stages, (role,))
    return [fwd, dkv, dq]


def compiles(targets: Iterable[Tuple[int, int, int, int]] = TARGETS) -> List[Compile]:
    """Every compile of the gate, each once, with every role (default, pinned, candidate n,
    fixed) that needs it."""
    from .triton_launch import PINNED, candidates, default_config
    merged: Dict[Compile, Tuple[str, ...]] = {}
    for nh, ng, hn, bs in targets:
        key = (hn, bs, nh // ng)
        items = _kernel_specs(nh, ng, hn, bs)
        items += _attention(nh, ng, hn, bs, default_config(*key), "default")
        if key in PINNED:
            items += _attention(nh, ng, hn, bs, PINNED[key], "pinned")
        for n, cfg in enumerate(candidates(*key)):
            items += _attention(nh, ng, hn, bs, cfg, f"candidate {n}")
        for c in items:
            merged[c] = merged.get(c, ()) + tuple(r for r in c.roles
                                                  if r not in merged.get(c, ()))
    return [Compile(c.kernel, c.target, c.args, c.constexprs, c.num_warps, c.num_stages, r)
            for c, r in merged.items()]


def _file_hash(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def key(c: Compile) -> str:
    """Cache key: the source file that defines the kernel (its code, constants and
    specialisation rules), the compile's spec, the triton version and the worker's source.
    Read from the files, not the imported kernels (an interpreted kernel has no JIT hash)."""
    import importlib.util
    from importlib import metadata
    module = c.kernel.split(":")[0]
    here = os.path.dirname(os.path.abspath(__file__))
    text = json.dumps([_file_hash(importlib.util.find_spec(module).origin), c.spec(),
                       metadata.version("triton"),
                       _file_hash(os.path.join(here, "compile_gate_worker.py"))],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def compile_one(c: Compile, env: Optional[dict] = None, timeout_s: int = 300) -> dict:
    """Compile ``c`` in a fresh process (a fresh triton cache: a real compile) -> the worker's
    result (``ok``, registers, stack, shared, opcode counts; or ``error``)."""
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="sb_gate_") as cache:
        run_env = dict(os.environ if env is None else env, TRITON_CACHE_DIR=cache)
        run_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (run_env.get("PYTHONPATH", ""), root) if p)
        run_env.pop("TRITON_INTERPRET", None)
        p = subprocess.run([sys.executable, "-m", WORKER, json.dumps(c.spec())],
                           capture_output=True, text=True, env=run_env, timeout=timeout_s)
    for line in p.stdout.splitlines():
        if line.startswith("@@GATE "):
            return json.loads(line[len("@@GATE "):])
    return dict(ok=False, error=f"worker exit {p.returncode}: {(p.stderr or p.stdout)[-800:]}")


def run(items: List[Compile], cache: Optional[Dict[str, dict]] = None, jobs: int = 0,
        fresh: Iterable[Compile] = ()) -> List[dict]:
    """One row per compile: its spec, roles, key, result (cached where the key matches, else
    compiled; always compiled for ``fresh``), ``problems`` and ``verdict``; ``cached`` says
    which. ``jobs``: processes at once (0: the CPU count)."""
    cache = cache or {}
    keys = [key(c) for c in items]
    fresh = set(fresh)
    todo = [n for n, (c, k) in enumerate(zip(items, keys)) if c in fresh or k not in cache]
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        done = dict(zip(todo, pool.map(lambda n: compile_one(items[n]), todo)))
    rows = []
    for n, (c, k) in enumerate(zip(items, keys)):
        res = done[n] if n in done else cache[k]
        row = dict(kernel=c.name, target=c.target, config=c.label(), roles=list(c.roles),
                   spec=c.spec(), key=k, cached=n not in done, result=res)
        row["problems"] = problems(c.name, res)
        row["verdict"] = verdict(c, row["problems"])
        rows.append(row)
    return rows


def problems(kernel: str, res: dict) -> List[str]:
    """What is wrong with one compile's result, in words (empty: nothing)."""
    if not res.get("ok"):
        return [f"does not compile: {res.get('error', '?')}"]
    out = []
    shared = res["shared"] + res["static_shared"]
    if shared > SHARED_LIMIT:
        out.append(f"needs {shared / 1024:.0f} KB of shared memory: > 227 KB, cannot launch")
    if res["stack"] or res["STL"] or res["LDL"]:
        out.append(f"spills: {res['stack']} B stack, {res['STL']} STL, {res['LDL']} LDL")
    if kernel in WGMMA_KERNELS and (res["HMMA"] or not res["HGMMA"]):
        out.append(f"GEMMs off wgmma: {res['HMMA']} HMMA, {res['HGMMA']} HGMMA")
    return out


def verdict(c: Compile, found: List[str]) -> str:
    """``pass`` or ``fail: <why>`` (module docstring: the rules per role)."""
    from .triton_launch import HMMA_KEPT, SPILL_KEPT
    strict = any(r in ("default", "pinned") for r in c.roles)
    if "default" not in c.roles and (c.target, c.name, c.label()) in HMMA_KEPT:
        found = [p for p in found if not p.startswith("GEMMs off wgmma")]   # measured faster
    if "fixed" in c.roles:      # a fixed-config kernel's spill stays only with a stated reason
        found = [p for p in found if not (p.startswith("spills") and (
            c.target, c.name, c.label()) in SPILL_KEPT)]
        strict = True
    bad = []
    for p in found:
        if strict or p.startswith(("does not compile", "needs")):
            bad.append(p)
        elif p.startswith("spills") and (c.target, c.name, c.label()) not in SPILL_KEPT:
            bad.append(p + " (a candidate: drop it or state in SPILL_KEPT why it stays)")
    return "pass" if not bad else "fail: " + "; ".join(bad)


def load_cache(paths: Iterable[str]) -> Dict[str, dict]:
    """key -> result from gate JSON files (``write_result``'s ``rows``) that exist."""
    out = {}
    for path in paths:
        if os.path.exists(path):
            with open(path) as fh:
                for row in json.load(fh).get("rows", []):
                    out[row["key"]] = row["result"]
    return out


def table(rows: List[dict]) -> str:
    """The gate's rows as a markdown table."""
    head = ("| target | kernel | config | roles | regs | spill B | STL/LDL | HGMMA/HMMA | "
            "atomics | UTMALDG/LDGSTS | shared KB | verdict |\n|" + "---|" * 12)
    lines = [head]
    for r in rows:
        s = r["result"]
        roles = ", ".join(r["roles"]) if len(r["roles"]) <= 2 else \
            f"{r['roles'][0]} +{len(r['roles']) - 1}"
        if not s.get("ok"):
            lines.append(f"| {r['target']} | {r['kernel']} | {r['config']} | {roles} |"
                         + " - |" * 7 + f" {r['verdict']} |")
            continue
        atom = s["REDG"] + s["RED"] + s["ATOMG"] + s["ATOM"]
        lines.append(f"| {r['target']} | {r['kernel']} | {r['config']} | {roles} | {s['regs']} "
                     f"| {s['stack']} | {s['STL']}/{s['LDL']} | {s['HGMMA']}/{s['HMMA']} | "
                     f"{atom} | {s['UTMALDG']}/{s['LDGSTS']} | "
                     f"{(s['shared'] + s['static_shared']) / 1024:.0f} | {r['verdict']} |")
    return "\n".join(lines)


def failures(rows: List[dict]) -> List[str]:
    return [f"{r['target']} {r['kernel']} {r['config']} ({', '.join(r['roles'])}): "
            f"{r['verdict']}" for r in rows if r["verdict"] != "pass"]


__all__ = ["Compile", "SHARED_LIMIT", "TARGETS", "compile_one", "compiles", "failures",
           "key", "load_cache", "problems", "run", "table", "verdict"]
