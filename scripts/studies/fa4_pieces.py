"""FA4's fixed cost per call taken apart on the GPU: host time, and each kernel of a pass timed alone.

A line through fa4's pass times against kept tiles crosses zero tiles at 0.3-0.7 ms forward and
1.3-1.6 ms backward (issue 74). This probe says what that is made of, per shape, token count and
density, on one document (the backend's block layout, block 128):

- ``host``: each pass's host time with nothing awaited and its GPU time alone
  (``common.host_and_gpu_ms``): the forward through ``block_sparse_attention`` whole (selection,
  lists, pad, FA4, unpad), FA4's forward alone on the lists (``fa4_cute.forward_kernel``), its
  backward alone in both GQA forms (``backward_kernel``: accumulated in float32, and per query
  head);
- ``kernels``: one profiled forward + backward of the whole call (``torch.profiler``), its GPU
  events accounted by ``_gpu_trace.account``: FA4's forward and backward main kernels, its
  side passes apart (``bwd_preprocess``: delta and the dQ accumulator's zeroing; ``dq_convert``;
  ``dkv_convert`` and ``dkv_fill``: GQA's float32 dK/dV accumulators), our selection and lists,
  copies (pad / unpad), and ``other`` inside our ops (the per-head form's copies and sum).

``pieces_row`` turns one case's timings and account into the row the JSON holds: the side passes
summed per pass beside the main kernels, and the host's share (host time not covered by GPU
work). It is pure and tested on CPU; the measurement needs Hopper and flash-attn-4:

    python scripts/bench.py fa4_pieces --json docs/results/fa4_pieces_h200.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from . import _gpu_trace
from .common import gpu_provenance, host_and_gpu_ms, parser, write_result

SHAPES = ("8/2/128", "14/2/64")
DENSITIES = (1.0, 0.25)
TOKENS = 32768
REPS = 10
SIDE_PASSES = ("bwd_preprocess", "dq_convert", "dkv_convert", "dkv_fill", "other")


def pieces_row(host: dict, account: dict) -> dict:
    """One case's row from its host/GPU timings (``{name: host_and_gpu_ms(...)}``) and the
    ``_gpu_trace.account`` of one profiled forward + backward: milliseconds per piece, the
    backward's side passes summed (``bwd_side_ms``) beside its main kernel, and per timed call
    the host's lead (``host_ms - gpu_ms``: > 0, the GPU waits for the host)."""
    passes = account.get("attention_passes", {})
    ms = account.get("ms", {})
    row = {"fwd_kernel_ms": passes.get("fwd", 0.0), "bwd_kernel_ms": passes.get("bwd", 0.0),
           **{f"{p}_ms": passes.get(p, 0.0) for p in SIDE_PASSES},
           "bwd_side_ms": sum(passes.get(p, 0.0) for p in SIDE_PASSES),
           "selection_ms": ms.get("selection", 0.0), "copies_ms": ms.get("copies", 0.0),
           "attention_by_kernel": account.get("attention_by_kernel", {})}
    for name, t in host.items():
        if t:
            row[name] = dict(t, host_over_gpu_ms=t["host_ms"] - t["gpu_ms"])
    return row


def _trace_account(fn) -> dict:
    """``fn()`` once under the CUDA profiler; its GPU events accounted."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _gpu_trace.GPU_CATEGORIES]
    return _gpu_trace.account(gpu, events)


def measure(shape: str, tokens: int, density: float, reps: int) -> dict:
    """One case on the GPU (module docstring)."""
    import torch

    from sparsebalance_megatron.attention import block_sparse_attention, fa4_cute
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    from ._kernel_passes import parse_shape
    nh, ng, hn = parse_shape(shape)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, hn, generator=gen).to("cuda", torch.bfloat16)
               .requires_grad_(True) for h in (nh, ng, ng))
    g = torch.randn(tokens, nh, hn, generator=gen).to("cuda", torch.bfloat16)
    cu, scale = [0, tokens], hn ** -0.5
    kw = dict(block_size=128, backend="fa4", softmax_scale=scale, cache={})
    _, sel = block_sparse_attention(q, k, v, cu, density, **kw)
    lists = build_block_lists(sel)
    qp, kp, vp = (sel.layout.pad(x.detach()) for x in (q, k, v))
    out, lse = fa4_cute.forward_kernel(qp, kp, vp, lists.q_num, lists.q_idx, 128, scale)
    gp = sel.layout.pad(g)

    def bwd(per_head):
        return lambda: fa4_cute.backward_kernel(gp, qp, kp, vp, out, lse, lists.kv_num,
                                                lists.kv_idx, 128, scale, per_head=per_head)

    def whole():
        o, _ = block_sparse_attention(q, k, v, cu, density, **kw)
        torch.autograd.grad(o, (q, k, v), g)

    host = {"call_fwd": host_and_gpu_ms(lambda: block_sparse_attention(q, k, v, cu, density,
                                                                       **kw), reps),
            "fa4_fwd": host_and_gpu_ms(lambda: fa4_cute.forward_kernel(
                qp, kp, vp, lists.q_num, lists.q_idx, 128, scale), reps),
            "fa4_bwd": host_and_gpu_ms(bwd(False), reps),
            "fa4_bwd_per_head": host_and_gpu_ms(bwd(True), reps)}
    row = pieces_row(host, _trace_account(whole))
    return dict(shape=shape, tokens=tokens, density=density,
                kept_density=float(sel.density_kept.mean()), **row)


def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = parser(__doc__, "fa4_pieces")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="np/ng/hn shapes, comma-separated (default %(default)s)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="one document of this many tokens")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                   help="comma-separated (default %(default)s)")
    p.add_argument("--reps", type=int, default=REPS, help="timed calls per piece")
    args = p.parse_args(argv)
    from sparsebalance_megatron.attention.fa4_cute import fa4_missing
    why = fa4_missing("cuda")
    if why is not None:
        print(f"fa4_pieces: the fa4 backend cannot run here: {why}", file=sys.stderr)
        return 2
    rows = []
    for shape in args.shapes.split(","):
        for d in _floats(args.densities):
            rows.append(measure(shape, args.tokens, d, args.reps))
            r = rows[-1]
            print(f"{shape} d {d}: fwd {r['fwd_kernel_ms']:.3f} ms, bwd {r['bwd_kernel_ms']:.3f}"
                  f" + side {r['bwd_side_ms']:.3f} ms, selection {r['selection_ms']:.3f} ms, "
                  f"host fwd {r['call_fwd']['host_ms']:.3f} ms", flush=True)
    write_result(args.json, {"study": "fa4_pieces", "rows": rows, **gpu_provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
