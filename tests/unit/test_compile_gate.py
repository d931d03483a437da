"""The H100 compile gate in the normal suite (``attention/compile_gate.py``): every Triton
kernel of the ``triton`` backend, compiled for sm_90a on this CPU machine in every launch config
the device can be asked to run, passes: no spill, <= 227 KB of shared memory and every
main-loop GEMM on wgmma for the defaults, pinned entries and fixed-config kernels; every
autotune candidate can launch.

Results are reused where their key (the hash of the kernel's source file, the compile's spec,
the triton version, the worker's source) matches the committed gate JSON (``docs/results/
compile_gate_sm90*.json``, written by ``scripts/bench.py compile_gate``) or this machine's
cache (``~/.cache/sparsebalance_megatron/compile_gate.json``); the rest is compiled, one
process per compile. One real config (the forward default at 8/2/128, block 128) is always
compiled again and must equal its committed result, so the cache cannot go stale unnoticed.
"""

import ast
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

from sparsebalance_megatron.attention import compile_gate as gate  # noqa: E402
from sparsebalance_megatron.attention.compile_gate_worker import (  # noqa: E402
    count_opcodes, parse_res_usage)

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [ROOT / "docs/results/compile_gate_sm90.json",
             ROOT / "docs/results/compile_gate_sm90_triton36.json"]
LOCAL = Path(os.environ.get("SB_COMPILE_GATE_CACHE",
                            Path.home() / ".cache/sparsebalance_megatron/compile_gate.json"))
FIGURES = ("regs", "stack", "shared", "static_shared", "local", "HGMMA", "HMMA", "STL", "LDL",
           "REDG", "RED", "ATOMG", "ATOM", "UTMALDG", "LDGSTS")


def _anchor(items):
    return next(c for c in items if c.name == "fwd_kernel" and c.target == "8/2/128@128"
                and "default" in c.roles)


def test_every_kernel_compiles_clean_for_the_h100():
    items = gate.compiles()
    committed = gate.load_cache(str(p) for p in COMMITTED)
    cache = dict(committed)
    cache.update(gate.load_cache([str(LOCAL)]))
    anchor = _anchor(items)
    rows = gate.run(items, cache, fresh=[anchor])
    new = [r for r in rows if not r["cached"] and r["result"].get("ok")]
    if new:     # this machine's cache: a second run reuses what this one compiled
        LOCAL.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(LOCAL.read_text()).get("rows", []) if LOCAL.exists() else []
        keep = {r["key"]: r for r in old}
        keep.update({r["key"]: dict(key=r["key"], result=r["result"]) for r in new})
        LOCAL.write_text(json.dumps({"rows": list(keep.values())}))
    row = next(r for r in rows if r["kernel"] == "fwd_kernel" and r["spec"] == anchor.spec())
    assert row["result"].get("ok"), row["result"]
    if row["key"] in committed:       # the cache agrees with a compile made now
        fresh = {f: row["result"][f] for f in FIGURES}
        assert fresh == {f: committed[row["key"]][f] for f in FIGURES}, \
            "the committed gate results are stale: run python scripts/bench.py compile_gate " \
            "--fresh --json docs/results/compile_gate_sm90.json"
    fails = gate.failures(rows)
    assert not fails, "\n".join(fails)
    # the gate saw every kernel, and the configs it judged are the ones the device runs
    names = {r["kernel"] for r in rows}
    assert names == _jit_kernels(), names ^ _jit_kernels()
    for hn, bs in ((128, 128), (64, 128), (128, 64)):
        assert any(r["kernel"] == "dkv_kernel" and "default" in r["roles"]
                   and r["target"].endswith(f"/{hn}@{bs}") for r in rows)


def _jit_kernels():
    """Names of every function of the package decorated as a Triton kernel and launched as one:
    a jit function another jit function of its module calls (``_query_tile``) is a device
    function, compiled inside its callers."""
    out = set()
    for path in (ROOT / "sparsebalance_megatron").rglob("*.py"):
        jit = [node for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef)
               and any(ast.unparse(d).startswith(("triton.jit", "_kernel"))
                       for d in node.decorator_list)]
        called = {c.func.id for fn in jit for c in ast.walk(fn)
                  if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        out.update(fn.name for fn in jit if fn.name not in called)
    return out


def _result(**kw):
    base = dict(ok=True, regs=200, stack=0, shared=100 * 1024, static_shared=1024, local=0,
                **dict.fromkeys(("HGMMA", "HMMA", "STL", "LDL", "REDG", "RED", "ATOMG", "ATOM",
                                 "UTMALDG", "LDGSTS"), 0))
    base["HGMMA"] = 32
    base.update(kw)
    return base


def test_the_rules_fail_what_they_must(monkeypatch):
    """Spill, shared memory past 227 KB and HMMA in a main loop fail a default; a candidate
    fails only when it cannot launch, or spills without a stated reason."""
    items = gate.compiles(targets=[(8, 2, 128, 128)])
    default = next(c for c in items if c.name == "dkv_kernel" and "default" in c.roles)
    cand = next(c for c in items if c.name == "dkv_kernel"
                and not {"default", "pinned"} & set(c.roles))
    spill = _result(stack=64, STL=3, LDL=5)
    big = _result(shared=257 * 1024)
    hmma = _result(HMMA=32, HGMMA=20)
    assert gate.problems("dkv_kernel", _result()) == []
    for res, word in ((spill, "spills: 64 B"), (big, "258 KB"), (hmma, "32 HMMA")):
        found = gate.problems("dkv_kernel", res)
        assert len(found) == 1 and word in found[0], found
        assert gate.verdict(default, found).startswith("fail")
    assert gate.verdict(cand, gate.problems("dkv_kernel", hmma)) == "pass"
    assert gate.verdict(cand, gate.problems("dkv_kernel", big)).startswith("fail")
    assert "SPILL_KEPT" in gate.verdict(cand, gate.problems("dkv_kernel", spill))
    assert gate.problems("_maxkey_kernel", hmma) == []      # one GEMM, no list loop
    # a fixed-config kernel's spill passes only with a reason in SPILL_KEPT (none has one now)
    from sparsebalance_megatron.attention import triton_launch
    lists = next(c for c in items if "fixed" in c.roles and c.name == "_lists_kernel")
    assert gate.verdict(lists, gate.problems(lists.name, spill)).startswith("fail")
    monkeypatch.setitem(triton_launch.SPILL_KEPT, (lists.target, lists.name, lists.label()),
                        "a stated reason")
    assert gate.verdict(lists, gate.problems(lists.name, spill)) == "pass"
    assert gate.verdict(lists, gate.problems(lists.name, big)).startswith("fail")
    assert gate.problems("fwd_kernel", _result(HGMMA=0)) != []
    assert gate.problems("fwd_kernel", dict(ok=False, error="boom"))[0].startswith(
        "does not compile")


def test_a_pinned_hmma_config_stays_only_with_the_device_measurement(monkeypatch):
    """A pinned backward whose dQ GEMM runs on mma.sync passes the gate only while
    ``HMMA_KEPT`` names the device measurement that chose it; every ``HMMA_KEPT`` entry is a
    pinned compile (no stale reason), and HMMA in a default still fails."""
    from sparsebalance_megatron.attention import triton_launch
    items = gate.compiles(targets=list(gate.TARGETS))
    pinned = {(c.target, c.name, c.label()): c for c in items if "pinned" in c.roles}
    assert set(triton_launch.HMMA_KEPT) <= set(pinned)
    hmma = gate.problems("dkv_kernel", _result(HMMA=32, HGMMA=20))
    dkv = next(k for k in pinned if k[1] == "dkv_kernel")   # a reason for the rule's sake
    if dkv not in triton_launch.HMMA_KEPT:
        monkeypatch.setitem(triton_launch.HMMA_KEPT, dkv, "a device measurement")
    for key in list(triton_launch.HMMA_KEPT):
        c = pinned[key]
        assert gate.verdict(c, hmma) == "pass"
        assert gate.verdict(c, gate.problems("dkv_kernel", _result(stack=64, STL=1)))\
            .startswith("fail")                       # the reason excuses HMMA, nothing else
        monkeypatch.delitem(triton_launch.HMMA_KEPT, key)
        assert gate.verdict(c, hmma).startswith("fail")
    default = next(c for c in items if c.name == "dkv_kernel" and "default" in c.roles)
    monkeypatch.setitem(triton_launch.HMMA_KEPT, (default.target, default.name,
                                                  default.label()), "a stated reason")
    assert gate.verdict(default, hmma).startswith("fail")


def test_cuobjdump_parsing():
    res = ("\nResource usage:\n Common:\n  GLOBAL:11\n Function fwd_kernel:\n"
           "  REG:229 STACK:8 SHARED:1024 LOCAL:4 CONSTANT[0]:632 TEXTURE:0\n")
    assert parse_res_usage(res, "fwd_kernel") == dict(regs=229, stack=8, static_shared=1024,
                                                      local=4)
    sass = ("        /*0a30*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
            "        /*0a40*/              @!P0 STL [R1+0x4], R3 ;\n"
            "        /*0a50*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU [R2.64], R5 ;\n"
            "        /*0a60*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n")
    c = count_opcodes(sass)
    assert (c["HGMMA"], c["STL"], c["REDG"], c["HMMA"], c["LDL"]) == (1, 1, 1, 1, 0)
