#!/usr/bin/env python
"""Autotune the ``triton`` backend's launch settings on a GPU; print the entries to pin.

At each target shape it times the ``triton_launch.candidates`` that pass the sm_90a compile gate
(the default first): forward configs on the forward, backward configs on forward+backward, summed
over densities 0.25 and 0.5; the best pair is checked against the default's output and gradients
and never pinned otherwise. Rows go to ``<out>/autotune_triton.jsonl`` as measured, the summary
and the ``PINNED`` entries to ``<out>/autotune_triton.json``. Without CUDA it exits 0.

    python scripts/autotune_triton.py --out runs/autotune
    python scripts/autotune_triton.py --out runs/autotune --shapes 8/2/128 14/2/64 --deadline-s 420
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from studies.common import gpu_provenance, median_ms  # noqa: E402

FWD_FIELDS = ("fwd_block_m", "fwd_warps", "fwd_stages")
GATE_RESULTS = ("docs/results/compile_gate_sm90_triton36.json",
                "docs/results/compile_gate_sm90.json")


DEVICE = "cuda"


def cuda_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn``: CUDA events on the GPU, the wall clock with ``--device
    cpu`` (which only checks the script under TRITON_INTERPRET=1)."""
    return median_ms(fn, reps, warmup, cuda=DEVICE == "cuda")


class Case:
    """Inputs, selection and lists at one (shape, tokens, density), built once."""

    def __init__(self, nh, ng, hn, tokens, block, density, seed=0):
        from sparsebalance_megatron.attention import block_sparse_attention
        from sparsebalance_megatron.attention.block_lists import build_block_lists
        g = torch.Generator(device="cpu").manual_seed(seed)
        # bf16 on the GPU; float16 on the CPU check (the interpreter's tl.dot mishandles bf16)
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
        self.q, self.k, self.v = (torch.randn(tokens, h, hn, generator=g).to(DEVICE, dtype)
                                  for h in (nh, ng, ng))
        self.dout = torch.randn(tokens, nh, hn, generator=g).to(DEVICE, dtype)
        _, sel = block_sparse_attention(self.q, self.k, self.v, [0, tokens], density,
                                        block_size=block, backend="triton")
        self.lists, self.layout, self.scale = build_block_lists(sel), sel.layout, hn ** -0.5
        self.density_doc = (torch.tensor([float(density)], dtype=torch.float64,
                                         device=DEVICE), [float(density)])
        kept = int(self.lists.q_num.sum()) + ng * self.layout.num_blocks    # + diagonals
        self.kept_tiles = kept * (nh // ng)
        self.density = density

    def call(self, backward: bool):
        """The whole per-layer call (selection, lists, kernels; ``sparse_triton_select``) with
        the launch settings ``triton_launch`` gives (the pinned or default ones)."""
        from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
        x = [t.detach().requires_grad_(backward) for t in (self.q, self.k, self.v)]
        out, _ = triton_block_sparse(*x, self.layout, self.density_doc[0],
                                     density_host=self.density_doc[1], estimator="maxkey",
                                     softmax_scale=self.scale, sink_blocks=1, local_blocks=0,
                                     selection_mode="density", mass_threshold=0.9,
                                     min_density=0.125, max_density=1.0)
        if backward:
            torch.autograd.grad(out, x, self.dout)

    def select(self):
        """The selection and lists alone (no attention kernel): the per-call fixed cost."""
        from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
        from sparsebalance_megatron.attention import sparse_triton_select as sel
        real, sel.sparse_attention = sel.sparse_attention, lambda q, *a, **k: q
        try:
            with torch.no_grad():
                triton_block_sparse(self.q, self.k, self.v, self.layout, self.density_doc[0],
                                    density_host=self.density_doc[1], estimator="maxkey",
                                    softmax_scale=self.scale,
                                    sink_blocks=1, local_blocks=0, selection_mode="density",
                                    mass_threshold=0.9, min_density=0.125, max_density=1.0)
        finally:
            sel.sparse_attention = real

    def run(self, cfg, backward: bool):
        from sparsebalance_megatron.attention.sparse_triton import sparse_attention
        x = [t.detach().requires_grad_(backward) for t in (self.q, self.k, self.v)]
        out = sparse_attention(*x, self.lists, self.layout, self.scale, config=cfg)
        if not backward:
            return (out,)
        return (out,) + torch.autograd.grad(out, x, self.dout)


def _close(a, b) -> float:
    return max(float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))
               for x, y in zip(a, b))


def measure(cases, cfg, backward, reps, ref=None):
    """Summed ms over the cases (and the worst relative difference to ``ref``'s results)."""
    total, worst = 0.0, 0.0
    for i, case in enumerate(cases):
        res = case.run(cfg, backward)
        if ref is not None:
            worst = max(worst, _close(res, ref[i]))
        total += cuda_ms(lambda: case.run(cfg, backward), reps)
    return total, worst


def tune_shape(shape, args, out_rows, deadline):
    from sparsebalance_megatron.attention import work_model
    from sparsebalance_megatron.attention.triton_launch import candidates, default_config
    nh, ng, hn = shape
    rep, block = nh // ng, args.block
    key = (hn, block, rep)
    base = default_config(hn, block, rep)
    sweep, gate = candidates(hn, block, rep)[1:args.max_configs], None
    if args.gate:
        sweep, gate = gate_candidates((nh, ng, hn, block), sweep, args.gate_jobs)
    cases = [Case(nh, ng, hn, args.tokens, block, d) for d in args.densities]
    ref = {b: [c.run(base, b) for c in cases] for b in (False, True)}
    flops = sum(work_model.attention_flops(c.kept_tiles, 1, block, hn)["total"]
                for c in cases)

    def row(kind, cfg, backward):
        r = dict(shape=f"{nh}/{ng}/{hn}", block=block, tokens=args.tokens, kind=kind,
                 densities=list(args.densities), config=asdict(cfg),
                 timed="fwd+bwd" if backward else "fwd")
        try:
            ms, err = measure(cases, cfg, backward, args.reps, ref[backward])
            r.update(ms=round(ms, 4), max_rel_diff=err, ok=err < args.max_rel_diff)
            if backward:
                r["tflops"] = round(flops / ms / 1e9, 1)
        except Exception as e:      # a config that does not compile or run: dropped
            r.update(ok=False, failed=f"{type(e).__name__}: {str(e)[:300]}")
        out_rows.append(r)
        with open(os.path.join(args.out, "autotune_triton.jsonl"), "a") as fh:
            fh.write(json.dumps(r) + "\n")
        print(f"{r['shape']:>9} {kind:>8} {r.get('ms', float('nan')):9.3f} ms  "
              f"{'ok' if r['ok'] else 'DROPPED'}  {asdict(cfg)}", flush=True)
        return r

    default_fwd = row("default", base, False)
    default_bwd = row("default", base, True)
    fwd_rows, bwd_rows = [default_fwd], [default_bwd]
    for cfg in sweep:
        if time.time() > deadline:
            print(f"deadline reached: {shape} sweep cut", flush=True)
            break
        fwd_only = all(getattr(cfg, f) == getattr(base, f) for f in asdict(cfg)
                       if f not in FWD_FIELDS)
        if fwd_only:
            fwd_rows.append(row("fwd", cfg, False))
        else:
            bwd_rows.append(row("bwd", cfg, True))
    best_f = min((r for r in fwd_rows if r["ok"]), key=lambda r: r["ms"])
    best_b = min((r for r in bwd_rows if r["ok"]), key=lambda r: r["ms"])
    best = replace(base, **{f: best_b["config"][f] for f in asdict(base) if f not in FWD_FIELDS},
                   **{f: best_f["config"][f] for f in FWD_FIELDS})
    final = row("best", best, True)
    if not final["ok"] or final["ms"] >= default_bwd["ms"]:
        best, final = base, default_bwd
    # the whole per-layer call with the best settings pinned, and its selection alone
    from sparsebalance_megatron.attention import triton_launch
    old = triton_launch.PINNED.get(key)
    triton_launch.PINNED[key] = best
    try:
        per_call = {f"d{c.density}": dict(call_ms=round(cuda_ms(lambda: c.call(True),
                                                                 args.reps), 4),
                                          selection_ms=round(cuda_ms(c.select, args.reps), 4))
                    for c in cases}
    finally:
        if old is None:
            triton_launch.PINNED.pop(key)
        else:
            triton_launch.PINNED[key] = old
    print(f"per-layer call (fwd+bwd, with selection) and selection alone: {per_call}",
          flush=True)
    return key, best, dict(default_ms=default_bwd["ms"], best_ms=final["ms"],
                           speedup=round(default_bwd["ms"] / final["ms"], 3),
                           tflops=final.get("tflops"), per_call=per_call, gate=gate)


def gate_candidates(target, configs, jobs):
    """The candidates that pass the sm_90a compile gate (``compile_gate.judge_configs``: one
    process per compile, the committed results reused where their key matches), and what the
    gate said: the device never times a config that spills or cannot launch."""
    from sparsebalance_megatron.attention import compile_gate
    t0 = time.time()
    cache = compile_gate.load_cache(os.path.join(ROOT, p) for p in GATE_RESULTS)
    passed, dropped, rows = compile_gate.judge_configs(target, configs, cache, jobs)
    for cfg, why in dropped.items():
        print(f"gate: dropped {asdict(cfg)}: {why}", flush=True)
    info = dict(candidates=len(configs), passed=len(passed), compiled_now=sum(
        not r["cached"] for r in rows), seconds=round(time.time() - t0, 1),
        dropped=[dict(config=asdict(c), why=w) for c, w in dropped.items()])
    print(f"gate: {len(passed)} of {len(configs)} candidates pass ({info['compiled_now']} "
          f"compiled now, {info['seconds']} s)", flush=True)
    return passed, info


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON(L) results")
    ap.add_argument("--shapes", nargs="+", default=["8/2/128"], metavar="NP/NG/HN")
    ap.add_argument("--tokens", type=int, default=32768, help="one document of this length")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="stop sweeping after this many seconds (the rows so far are kept)")
    ap.add_argument("--max-configs", type=int, default=1000,
                    help="sweep at most this many candidates per shape (the default first)")
    ap.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                    help="sweep only the candidates that pass the sm_90a compile gate "
                         "(attention/compile_gate.py; compiled here, one process each, where "
                         "the committed results do not match)")
    ap.add_argument("--gate-jobs", type=int, default=0,
                    help="gate compiles at once (0: the CPU count)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: check the script itself under TRITON_INTERPRET=1 (tiny shapes; "
                         "the times mean nothing)")
    ap.add_argument("--max-rel-diff", type=float, default=2e-2,
                    help="a config whose output/gradients differ more from the default's "
                         "(relative norm) is dropped")
    args = ap.parse_args(argv)
    shapes = []
    for text in args.shapes:
        try:
            nh, ng, hn = (int(x) for x in text.split("/"))
        except ValueError:
            ap.error(f"--shapes {text!r}: expected NP/NG/HN, e.g. 8/2/128")
        if nh % ng:
            ap.error(f"--shapes {text!r}: query heads must be a multiple of KV heads")
        shapes.append((nh, ng, hn))
    os.makedirs(args.out, exist_ok=True)
    info = gpu_provenance()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("autotune_triton: skipped, no CUDA device (it times the kernels on a GPU)")
        with open(os.path.join(args.out, "autotune_triton.json"), "w") as fh:
            json.dump(dict(info, skipped="no CUDA device"), fh, indent=1)
        return 0
    t0 = time.time()
    deadline = t0 + args.deadline_s
    rows, pinned, summary = [], {}, {}
    for shape in shapes:
        key, best, summ = tune_shape(shape, args, rows, deadline)
        pinned[str(key)] = asdict(best)
        summary[str(key)] = summ
    paste = "\n".join(f"    {k}: LaunchConfig(" + ", ".join(f"{f}={v}" for f, v in c.items())
                      + "),  # " + f"{info['device']}, triton {info['triton']}, torch "
                      f"{info['torch']}, commit {str(info['commit'])[:10]}"
                      for k, c in pinned.items())
    doc = dict(info, dtype="bfloat16" if DEVICE == "cuda" else "float16 (CPU check)",
               block_size=args.block, tokens=args.tokens,
               densities=args.densities, seconds=round(time.time() - t0, 1), summary=summary,
               pinned=pinned, paste=paste, results=rows)
    with open(os.path.join(args.out, "autotune_triton.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"device: {info['device']}; triton {info['triton']}; torch {info['torch']}")
    print("| (hn, block, rep) | default fwd+bwd ms | best ms | speedup | TFLOP/s | "
          "per call: whole / selection ms |")
    print("|---|---|---|---|---|---|")
    for k, s in summary.items():
        calls = "; ".join(f"{d}: {c['call_ms']:.3f} / {c['selection_ms']:.3f}"
                          for d, c in s["per_call"].items())
        print(f"| {k} | {s['default_ms']:.3f} | {s['best_ms']:.3f} | {s['speedup']} | "
              f"{s['tflops']} | {calls} |")
    print("paste into sparsebalance_megatron/attention/triton_launch.py PINNED:\n" + paste)
    return 0


if __name__ == "__main__":
    sys.exit(main())
