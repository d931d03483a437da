"""The H100 compile gate: every Triton kernel compiled for sm_90a here, per kernel x launch config
(``attention/compile_gate.py``; docs/GPU.md). Exit status 1 when the gate fails."""

from __future__ import annotations

import time

from sparsebalance_megatron.attention import compile_gate as gate

from .common import parser, write_result

CACHE = ("docs/results/compile_gate_sm90.json", "docs/results/compile_gate_sm90_triton36.json")


def main(argv=None) -> int:
    ap = parser(__doc__, "compile_gate")
    ap.add_argument("--cache", nargs="*", default=list(CACHE),
                    help="gate JSON files whose results are reused where the key matches")
    ap.add_argument("--fresh", action="store_true", help="compile everything again")
    ap.add_argument("--jobs", type=int, default=0, help="compiles at once (0: CPU count)")
    args = ap.parse_args(argv)
    import triton
    t0 = time.time()
    items = gate.compiles()
    cache = {} if args.fresh else gate.load_cache(args.cache)
    rows = gate.run(items, cache, jobs=args.jobs)
    seconds = time.time() - t0
    fails = gate.failures(rows)
    print(f"triton {triton.__version__}, target sm_90a (GPUTarget cuda 90), bf16, "
          f"{len(rows)} compiles ({sum(not r['cached'] for r in rows)} compiled now, "
          f"{seconds:.0f} s)")
    strict = [r for r in rows if set(r["roles"]) & {"default", "pinned", "fixed"}]
    print("defaults, pinned entries and fixed-config kernels:")
    print(gate.table(strict))
    cands = [r for r in rows if r not in strict]
    refused = sum(r["verdict"] != "pass" for r in cands)
    print(f"\nautotune candidates ({len(cands)} more compiles; {refused} refused):")
    print(gate.table(cands))
    print(f"gate: {'PASS' if not fails else 'FAIL'}")
    for f in fails:
        print("  " + f)
    if args.json:
        write_result(args.json, {
            "device": "cpu (compiled for sm_90a, no GPU)", "triton": triton.__version__,
            "target": "cuda sm_90 (GPUTarget('cuda', 90, 32))", "dtype": "bfloat16",
            "targets": [f"{a}/{b}/{c}@{d}" for a, b, c, d in gate.TARGETS],
            "tokens": gate.TOKENS, "shared_limit_bytes": gate.SHARED_LIMIT,
            "seconds": round(seconds, 1), "compiled_now": sum(not r["cached"] for r in rows),
            "passed": not fails, "failures": fails, "rows": rows})
    return 1 if fails else 0
