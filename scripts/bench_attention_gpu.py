#!/usr/bin/env python
"""GPU attention benchmark: our FlexAttention path vs dense cuDNN / flash SDPA, forward+backward.

One document of ``t`` tokens (8K and 32K), bf16, 8 query / 2 KV heads, head dim 128 (the shape
of ``bench_attention.py``'s GPU rows). Dense baselines: ``F.scaled_dot_product_attention`` with
``is_causal=True`` pinned to the cuDNN and to the flash backend (GQA expanded before timing, so
the baselines pay for no copy); ``dense_ms`` is the faster of the two. Ours: the whole
``block_sparse_attention`` call (selection, BlockMask, compiled flex, pad/unpad) with the
micro-batch's ``cache`` shared between repetitions, as the layers of one micro-batch share it;
``--backends flex flash`` also times flex's FlashAttention-4 kernel (backend ``flash``),
``--backends triton`` the plugin's own Triton kernel (``sparse_triton``; the flex tuning variants
do not apply to it). ``select_ms`` is the selection alone (pooled queries, maxkey scores, top-k),
``mask_ms`` the BlockMask construction (triton: the block lists), ``kernel_ms`` the kernel's
forward+backward on a fixed selection.
Times are CUDA-event medians after warm-up (the first call compiles; Dynamo is reset between
lengths so each length gets its own static graph).

    python scripts/bench_attention_gpu.py --json docs/results/attention_gpu_h100.json
    python scripts/bench_attention_gpu.py --backends flex flash --json runs/attention_flash.json
    python scripts/bench_attention_gpu.py --backends flex triton --json runs/attention_triton.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

DENSITIES = (1.0, 0.5, 0.25, 0.125)


def cuda_ms(fn, reps: int = 10, warmup: int = 3) -> float:
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


def _dense_rows(t, q, kk, vv, g, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    qd = q.detach().transpose(0, 1)[None].contiguous().requires_grad_(True)   # [1, np, t, hn]
    kd, vd = (x.detach().transpose(0, 1)[None].contiguous().requires_grad_(True)
              for x in (kk, vv))
    gd = g.transpose(0, 1)[None].contiguous()
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def dense(be=be):
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            o.backward(gd)
        try:
            out[name] = cuda_ms(dense, reps)
        except RuntimeError as e:  # a backend that refuses this shape/GPU
            out[name] = None
            print(f"  dense {name} unavailable at t={t}: {str(e)[:120]}", file=sys.stderr)
    return out


def bench(seq_lens, nh=8, ng=2, hn=128, block_size=128, reps=10, densities=DENSITIES,
          backend="flex"):
    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    from sparsebalance_megatron.attention.flex import (FLEX_KERNELS, build_block_mask,
                                                       flex_attention_padded)
    from sparsebalance_megatron.attention.sparse_triton import triton_attention_padded
    from sparsebalance_megatron.attention.selection import (query_block_sums_padded,
                                                            select_from_shares,
                                                            shares_from_block_sums)
    rows = []
    dev = torch.device("cuda")
    for t in seq_lens:
        torch._dynamo.reset()
        gen = torch.Generator(device="cpu").manual_seed(t)
        q, k, v = (torch.randn(t, h, hn, generator=gen).to(dev, torch.bfloat16)
                   .requires_grad_(True) for h in (nh, ng, ng))
        g = torch.randn(t, nh, hn, generator=gen).to(dev, torch.bfloat16)
        kk, vv = (x.repeat_interleave(nh // ng, 1) for x in (k, v))
        dense = _dense_rows(t, q, kk, vv, g, reps)
        dense_ms = min([x for x in dense.values() if x is not None] or [float("nan")])
        cache = {}
        scale = hn ** -0.5
        # the last run: density 0.25 without the sink block (the dK/dV kernel walks a sink
        # block's whole column of query blocks in one program: how much does that tail cost?)
        extra = [(0.25, 0)] if 0.25 in densities else []
        for d, sink in [(d, 1) for d in densities] + extra:
            def ours(d=d, sink=sink):
                out, _ = block_sparse_attention(q, k, v, [0, t], d, block_size=block_size,
                                                backend=backend, cache=cache, sink_blocks=sink)
                out.backward(g)

            ms = cuda_ms(ours, reps)
            _, sel = block_sparse_attention(q.detach(), k.detach(), v.detach(), [0, t], d,
                                            block_size=block_size, backend=backend, cache=cache,
                                            sink_blocks=sink)
            lay = sel.layout
            dd, dh = lay.memo[("density", float(d))]

            def select():
                with torch.no_grad():
                    qp, kp = lay.pad(q.detach()), lay.pad(k.detach())
                    qsum = query_block_sums_padded(qp, lay, ng)
                    keys = kp[:lay.num_blocks * block_size].permute(1, 0, 2)
                    sh = shares_from_block_sums(qsum, keys, lay, "maxkey", scale)
                    select_from_shares(sh, lay, dd, density_host=dh, sink_blocks=sink)

            qp, kp, vp = (lay.pad(x.detach()).requires_grad_(True) for x in (q, k, v))
            gp = lay.pad(g)

            def kernel():
                if backend == "triton":
                    triton_attention_padded(qp, kp, vp, sel, scale).backward(gp)
                else:
                    flex_attention_padded(qp, kp, vp, sel, scale,
                                          kernel=FLEX_KERNELS[backend]).backward(gp)

            def lists():
                return build_block_lists(sel) if backend == "triton" else build_block_mask(sel)

            row = dict(backend=backend, seq_len=t, density=d, sink_blocks=sink, block_size=block_size, ours_ms=ms,
                       dense_ms=dense_ms, dense_cudnn_ms=dense["cudnn"],
                       dense_flash_ms=dense["flash"], ratio_vs_dense=ms / dense_ms,
                       select_ms=cuda_ms(select, reps), mask_ms=cuda_ms(lists, reps),
                       kernel_ms=cuda_ms(kernel, reps),
                       density_kept=float(sel.density_kept[0]),
                       padded_blocks=lay.padded_blocks, num_blocks=lay.num_blocks)
            row["select_vs_dense"] = row["select_ms"] / dense_ms
            rows.append(row)
            print(f"  {backend} t={t} d={d} sink={sink}: ours {ms:.2f} ms, dense {dense_ms:.2f} ms "
                  f"({ms / dense_ms:.3f}x)", file=sys.stderr)
    return rows


def print_table(rows, device):
    print(f"device: {device}; torch {torch.__version__}")
    print("| backend/variant | seq_len | density | sink | ours ms | SDPA cuDNN ms | SDPA flash ms "
          "| ours / dense "
          "| select ms | select / dense | mask ms | kernel ms | kept |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda x: "-" if x is None else f"{x:.2f}"     # noqa: E731
    for r in rows:
        if "failed" in r:
            print(f"| {r['backend']}/{r['variant']} failed: {r['failed'][:120]} |")
            continue
        print(f"| {r['backend']}/{r['variant']} | {r['seq_len']} | {r['density']} | {r['sink_blocks']} | "
              f"{f(r['ours_ms'])} | "
              f"{f(r['dense_cudnn_ms'])} | {f(r['dense_flash_ms'])} | "
              f"{r['ratio_vs_dense']:.3f} | {f(r['select_ms'])} | {r['select_vs_dense']:.3f} "
              f"| {f(r['mask_ms'])} | {f(r['kernel_ms'])} | {r['density_kept']:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="also run with flex tuning JSON {\"kernel_options\": {...}, "
                         "\"mode\": \"max-autotune-no-cudagraphs\", \"split_blocks\": 0, "
                         "\"dynamic_lists\": false} (repeatable; split_blocks 0: no sink "
                         "split; dynamic_lists false: static list widths); the "
                         "default configuration runs first as 'default'")
    ap.add_argument("--backends", nargs="+", choices=("flex", "flash", "triton"),
                    default=["flex"],
                    help="our kernels: 'flex' (flex's Triton kernel), 'flash' (flex's "
                         "FlashAttention-4 kernel; needs flash-attn-4) and/or 'triton' (the "
                         "plugin's own Triton kernel)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs CUDA (the CPU benchmark is scripts/bench_attention.py)",
              file=sys.stderr)
        return 2
    from sparsebalance_megatron.attention.flex import SPLIT_BLOCKS, set_flex_tuning
    variants = [("default", {})]
    for v in args.variant:
        name, _, spec = v.partition("=")
        try:
            cfg = json.loads(spec)
        except json.JSONDecodeError as e:
            ap.error(f"--variant {v!r}: expected NAME=JSON ({e})")
        keys = {"kernel_options", "mode", "split_blocks", "dynamic_lists"}
        if not isinstance(cfg, dict) or set(cfg) - keys:
            ap.error(f"--variant {v!r}: expected keys {', '.join(sorted(keys))}")
        variants.append((name, cfg))
    rows = []
    for backend, (name, cfg) in itertools.product(args.backends, variants):
        if backend == "triton" and name != "default":
            continue                     # the flex tuning variants do not apply to it
        set_flex_tuning(cfg.get("kernel_options"), cfg.get("mode"),
                        cfg.get("split_blocks", SPLIT_BLOCKS), cfg.get("dynamic_lists", True))
        try:
            got = bench(args.seq_lens, block_size=args.block_size, reps=args.reps,
                        densities=args.densities, backend=backend)
        except Exception as e:   # noqa: BLE001 - a configuration or kernel that does not compile
            print(f"{backend}/{name}: failed: {type(e).__name__}: {str(e)[:300]}",
                  file=sys.stderr)
            got = [dict(backend=backend, failed=f"{type(e).__name__}: {str(e)[:300]}")]
        for r in got:
            r.setdefault("variant", name)
            r["tuning"] = cfg
        rows += got
    set_flex_tuning()
    device = torch.cuda.get_device_name()
    print_table(rows, device)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device, "torch": torch.__version__, "dtype": "bfloat16",
                       "heads": [8, 2, 128], "command": " ".join(sys.argv),
                       "results": rows}, fh, indent=1)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
