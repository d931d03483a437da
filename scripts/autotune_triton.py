#!/usr/bin/env python
"""Autotune the ``triton`` backend's launch settings on a GPU; print the entries to pin.

One device step: at the target shape (8 query / 2 KV heads, head dim 128, block 128, one 32K
document, bf16, fwd+bwd) it sweeps ``triton_launch.candidates`` (the default first): forward
tiles x warps x stages timed on the forward, backward tiles x warps x stages x ``kv_chunk``
timed on forward+backward, each summed over the densities (0.25 and 0.5: the targets'). The
best forward and the best backward are combined, timed against the default, and checked
against the default's output and gradients (a config that computes something else, or fails
to compile, is dropped, never pinned). Every row is appended to ``<out>/autotune_triton.jsonl``
as it is measured, so a run cut by its deadline still leaves its rows; the summary JSON
(``<out>/autotune_triton.json``) holds the command, commit, versions, device, the table and
``pinned``: the ``triton_launch.PINNED`` entries to paste (``paste``: as Python).

Without CUDA it prints why and exits 0 (nothing to tune here).

    python scripts/autotune_triton.py --out runs/autotune
    python scripts/autotune_triton.py --out runs/autotune --shapes 8/2/128 14/2/64 --deadline-s 420
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

FWD_FIELDS = ("fwd_block_m", "fwd_warps", "fwd_stages")


def _provenance(argv):
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    info = {"command": " ".join(["python", "scripts/autotune_triton.py"] + list(argv)),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def cuda_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class Case:
    """Inputs, selection and lists at one (shape, tokens, density), built once."""

    def __init__(self, nh, ng, hn, tokens, block, density, seed=0):
        from sparsebalance_megatron.attention import block_sparse_attention
        from sparsebalance_megatron.attention.block_lists import build_block_lists
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.q, self.k, self.v = (torch.randn(tokens, h, hn, generator=g).to("cuda",
                                                                             torch.bfloat16)
                                  for h in (nh, ng, ng))
        self.dout = torch.randn(tokens, nh, hn, generator=g).to("cuda", torch.bfloat16)
        _, sel = block_sparse_attention(self.q, self.k, self.v, [0, tokens], density,
                                        block_size=block, backend="triton")
        self.lists, self.layout, self.scale = build_block_lists(sel), sel.layout, hn ** -0.5
        kept = int(self.lists.q_num.sum()) + ng * self.layout.num_blocks    # + diagonals
        self.kept_tiles = kept * (nh // ng)
        self.density = density

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
    cases = [Case(nh, ng, hn, args.tokens, block, d) for d in args.densities]
    base = default_config(hn, block, rep)
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
    for cfg in candidates(hn, block, rep)[1:]:
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
    return key, best, dict(default_ms=default_bwd["ms"], best_ms=final["ms"],
                           speedup=round(default_bwd["ms"] / final["ms"], 3),
                           tflops=final.get("tflops"))


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
    info = _provenance(argv)
    if not torch.cuda.is_available():
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
    doc = dict(info, dtype="bfloat16", block_size=args.block, tokens=args.tokens,
               densities=args.densities, seconds=round(time.time() - t0, 1), summary=summary,
               pinned=pinned, paste=paste, results=rows)
    with open(os.path.join(args.out, "autotune_triton.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"device: {info['device']}; triton {info['triton']}; torch {info['torch']}")
    print("| (hn, block, rep) | default fwd+bwd ms | best ms | speedup | TFLOP/s |")
    print("|---|---|---|---|---|")
    for k, s in summary.items():
        print(f"| {k} | {s['default_ms']:.3f} | {s['best_ms']:.3f} | {s['speedup']} | "
              f"{s['tflops']} |")
    print("paste into sparsebalance_megatron/attention/triton_launch.py PINNED:\n" + paste)
    return 0


if __name__ == "__main__":
    sys.exit(main())
