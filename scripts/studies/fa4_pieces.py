"""Where one sparse call's time goes on the GPU, kernel by kernel: FA4's fixed cost per call
taken apart (issue 74, item 3; docs/GPU.md), host and GPU apart. The sums are tested on CPU;
the measurement needs CUDA (``gpu_check.py --steps pieces``)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from . import gpu_trace
from .common import gpu_provenance, parser, write_result

SHAPES = ("8/2/128", "14/2/64")
DENSITIES = (0.25, 1.0)
BACKENDS = ("fa4", "triton")
TOKENS = 32768
REPS = 5
SIDE_PASSES = ("bwd_preprocess", "dq_convert", "dkv_convert", "dkv_fill", "other")


def pieces_row(host: dict, account: dict) -> dict:
    """One row's pieces from its host/GPU timings (``{name: {host_ms, gpu_ms, held}}``, per
    pass) and the ``gpu_trace.account`` of one forward + backward: milliseconds per piece, the
    backward's side passes summed (``bwd_side_ms``) beside its main kernel, and per timed pass
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


def per_call(summary: dict, calls: int) -> dict:
    """A trace's summary (``gpu_trace.summarize_trace``) of ``calls`` calls, per call: kernel
    counts and milliseconds divided, the busy fraction as it is."""
    if calls < 1:
        raise ValueError(f"calls={calls}: expected at least one profiled call")
    acc = summary.get("account") or {}
    out = {"kernels": summary.get("kernels", 0) / calls,
           "kernel_ms": summary.get("kernel_ms", 0.0) / calls,
           "busy_fraction": summary.get("busy_fraction"),
           **{k: {n: v / calls for n, v in acc.get(k, {}).items()}
              for k in ("ms", "attention_passes", "attention_by_kernel")},
           "top": [dict(t, ms=t["ms"] / calls, count=t["count"] / calls)
                   for t in summary.get("top", [])]}
    if "failed" in summary:
        out["failed"] = summary["failed"]
    return out


def summed(accounts) -> dict:
    """The per-call accounts of a call's passes (``per_call``) summed into one."""
    out: dict = {"ms": {}, "attention_passes": {}, "attention_by_kernel": {}}
    for acc in accounts:
        for k, total in out.items():
            for n, v in acc.get(k, {}).items():
                total[n] = total.get(n, 0.0) + v
    return out


def traced(run, calls: int) -> dict:
    """``run()`` ``calls`` times under torch's profiler (CPU, and CUDA where there is one) after
    one call outside it, per call (``per_call``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU]
                 + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            run()
        sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        return per_call(gpu_trace.summarize_trace(path), calls)


def pass_kernels(fn, inputs, g, calls: int) -> dict:
    """{fwd, bwd: ``traced``} of ``out = fn(*inputs)``: the forward with autograd recording, the
    backward replayed from one retained graph."""
    import torch
    y = fn(*inputs)
    return {"fwd": traced(lambda: fn(*inputs), calls),
            "bwd": traced(lambda: torch.autograd.grad(y, inputs, g, retain_graph=True), calls)}


def timed_pieces(fn, case, reps: int) -> dict:
    """One row's measurement of ``fn`` on ``case`` (module docstring)."""
    from .kernels import pass_times
    inputs = [case.q, case.k, case.v]
    times = pass_times(fn, inputs, case.g, reps)
    kernels = pass_kernels(fn, inputs, case.g, reps)
    host = {p: {k: times[f"{p}_{k}"] for k in ("host_ms", "gpu_ms", "held")
                if f"{p}_{k}" in times} for p in ("fwd", "bwd")}
    return dict(times, **pieces_row(host, summed(kernels.values())), kernels=kernels)


def measure(backend: str, shape: str, tokens: int, densities, reps: int, clock, log) -> bool:
    """``backend``'s rows at ``shape`` (module docstring); False once the clock stops new rows."""
    from .kernels import Case, Lists, call_fn, kernel_fn
    case = Case("single", [tokens], shape)
    for d in densities:
        lists = Lists(case, d) if backend == "fa4" else None
        forms = () if lists is None else (False, True) if case.nh > case.ng else (False,)
        jobs = [(f"kernel {'per head' if f else 'accumulated'}",
                 lambda f=f: kernel_fn("fa4", lists, case, {"bwd_per_head": f})) for f in forms]
        jobs.append(("call", lambda: call_fn(backend, case, d)))
        for what, make in jobs:
            if not clock.can_start():
                return False
            row = dict(kind="pieces", backend=backend, what=what, shape=shape, tokens=tokens,
                       density=d)
            if lists is not None:
                row.update(tiles=lists.tiles, kept_fraction=lists.kept_fraction)
            try:
                row.update(clock.timed(lambda: timed_pieces(make(), case, reps)))
            except Exception as e:  # noqa: BLE001 - a piece that fails here is a row
                row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {backend} {what} {shape} d={d}: " + (row.get("failed") or (
                f"fwd {row['fwd_ms']:.2f} ms (host {row.get('fwd', {}).get('host_ms', 0):.2f},"
                f" GPU {row.get('fwd', {}).get('gpu_ms', 0):.2f}), bwd {row['bwd_ms']:.2f} ms; "
                f"kernels fwd {row['fwd_kernel_ms']:.2f}, bwd {row['bwd_kernel_ms']:.2f} + "
                f"side {row['bwd_side_ms']:.2f}, selection {row['selection_ms']:.2f}, copies "
                f"{row['copies_ms']:.2f} ms")), file=sys.stderr, flush=True)
            log.add(row)
    return True


def main(argv=None) -> int:
    p = parser(__doc__, "fa4_pieces")
    from .kernels import Clock, RowLog, add_row_args, usable_backends
    add_row_args(p)
    args = p.parse_args(argv)
    usable, skipped = usable_backends(BACKENDS)
    for b, why in skipped.items():
        print(f"fa4_pieces: the {b} backend cannot run here: {why}", file=sys.stderr)
    if not usable:
        return 2
    t0, clock, log = time.time(), Clock(args.deadline_s), RowLog(args.jsonl)
    finished = all(measure(b, s, TOKENS, DENSITIES, REPS, clock, log)
                   for b in usable for s in SHAPES)
    write_result(args.json, {"study": "fa4_pieces", "tokens": TOKENS, "reps": REPS,
                             "seconds": time.time() - t0, "cut_by_deadline": not finished,
                             "rows": log.rows, **gpu_provenance()})
    return 1 if any("failed" in r for r in log.rows) else 0
