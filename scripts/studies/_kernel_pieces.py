"""Where one attention call's time goes on the GPU (``scripts/bench_attention_gpu.py
--pieces``): each pass of a kernel alone or of the whole call (selection, lists, kernel) run
under torch's profiler, its GPU kernels summed by name per call, beside the pass's wall time.
For FlashAttention-4 this names its own side passes (the backward's preprocess, the float32 dQ
accumulator's fill and conversion, GQA's dK/dV accumulation and conversion) and ours (the
selection, the lists and their transpose, copies and fills) with their milliseconds: the parts
of the fixed cost per call (issue 74, item 3).

Imports torch; runs where the table runs (a CUDA device).
"""

from __future__ import annotations

import sys
import time

import torch

from ._kernel_passes import Case, Lists, call_fn, kernel_fn

TOP = 12


def _kernels(prof, calls: int) -> dict:
    """{gpu_ms, kernels, top: [{name, ms, count}]} per call of a profile of ``calls`` calls."""
    rows = []
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0.0) / 1e3
        if ms > 0:
            rows.append({"name": e.key[:120], "ms": ms / calls, "count": e.count / calls})
    rows.sort(key=lambda r: -r["ms"])
    return {"gpu_ms": sum(r["ms"] for r in rows), "kernels": sum(r["count"] for r in rows),
            "top": rows[:TOP]}


def pieces(fn, inputs, g, reps: int = 3) -> dict:
    """{fwd, bwd: {wall_ms, gpu_ms, kernels, top}} of ``out = fn(*inputs)``: ``reps`` calls of
    each pass under the profiler after a warm-up, the kernels per call by name and the pass's
    synchronised wall time per call."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    y = fn(*inputs)
    torch.autograd.grad(y, inputs, g, retain_graph=True)
    out = {}
    for p, run in (("fwd", lambda: fn(*inputs)),
                   ("bwd", lambda: torch.autograd.grad(y, inputs, g, retain_graph=True))):
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            sync()
            wall = (time.perf_counter() - t0) * 1e3 / reps
        out[p] = {"wall_ms": wall, **_kernels(prof, reps)}
    return out


def run_pieces(args, backends, log, clock, table) -> bool:
    """Rows of kind ``pieces``: per backend, shape and density, one document of the first
    length, the kernel alone (each variant) and the whole call, each pass's kernels by name
    (``pieces``). False when cut by the clock. ``table``: ``bench_attention_gpu`` (its
    ``variants``, ``KERNEL_BACKENDS`` and row base)."""
    for backend in backends:
        for shape in args.shapes:
            case = Case("single", [sorted(args.lengths)[-1]], shape)
            for d in args.densities:
                lists = Lists(case, d) if backend == "fa4" else None
                # FA4's kernel in each form; any other backend's call alone (its selection
                # and lists: triton's are those FA4's call runs)
                fns = [(v, lambda cfg=cfg: kernel_fn(backend, lists, case, cfg))
                       for v, cfg in (table.variants(backend, case)
                                      if lists and backend == "fa4" else [])]
                fns.append(("call", lambda: call_fn(backend, case, d)))
                for what, make in fns:
                    if not clock.can_start():
                        return False
                    row = dict(kind="pieces", **table.Table.base(case), backend=backend, what=what,
                               density=d)
                    try:
                        row.update(clock.timed(lambda: pieces(
                            make(), [case.q, case.k, case.v], case.g, args.reps)))
                    except Exception as e:  # noqa: BLE001 - a failed profile is a row
                        row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  pieces {backend} {what} {shape} d={d}: "
                          + (row.get("failed") or " | ".join(
                              f"{p} {row[p]['gpu_ms']:.2f} ms GPU in {row[p]['kernels']} "
                              f"kernels, {row[p]['wall_ms']:.2f} ms wall" for p in ("fwd", "bwd")
                              if p in row)), file=sys.stderr)
                    log.add(row)
            del case
    return True
