"""Where a training step's time goes on the GPU: Megatron's own PyTorch profiler on one
warm-up step of a ``pretrain()`` run, and a summary of the trace it writes.

``profile_flags(run_dir)`` are the flags that make ``pretrain()`` record one step with
``torch.profiler`` (``--profile --use-pytorch-profiler``; Megatron writes the Chrome trace to
``<tensorboard-dir>/../torch_profile/rank-0.json.gz``). The recorded step is the second
(``ProfilerStep#2``: the profiler waits one step and warms up on one), and the trace is written
at the start of the third, whose time it adds to (0.2 s for a tiny CPU run): both are warm-up
steps the train step's rates leave out. The TensorBoard writer, where it exists, logs only
every 1,000 steps.

``summarize_trace(path)`` reads the trace: the GPU's kernels (and copies and fills) summed, the
time the GPU was busy (their union: streams that overlap count once) against the span from the
first to the last, the recorded step's host time (``ProfilerStep#``), and the kernels that took
the most time. A busy fraction well under 1 means the GPU waited for the host: a step bound by
Python and launches rather than by its kernels, where a faster kernel does not make the step
faster (issue 61: at 32K, ``--sparse-balance`` ran about as fast at d0 0.25 as at 0.5).

Pure Python; reads a file, imports neither torch nor megatron.
"""

from __future__ import annotations

import gzip
import json
import os

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 8


def profile_flags(run_dir: str) -> list:
    """``pretrain()`` flags that record its second step with the PyTorch profiler, the trace
    under ``run_dir`` (``trace_path(run_dir)``)."""
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
            "--profile-step-end", "3", "--tensorboard-dir", os.path.join(run_dir, "tb"),
            "--tensorboard-log-interval", "1000"]


def trace_path(run_dir: str) -> str:
    """Where Megatron writes rank 0's trace for ``profile_flags(run_dir)``."""
    return os.path.join(run_dir, "torch_profile", "rank-0.json.gz")


def _union_us(spans: list) -> float:
    """Length of the union of [start, end) spans."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize_trace(path: str) -> dict:
    """The summary of one Chrome trace (module docstring); ``{"kernels": 0}`` where it holds no
    GPU event (a CPU run), ``{"failed": why}`` where it cannot be read."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
    except (OSError, ValueError) as e:
        return {"failed": f"{type(e).__name__}: {e}"[:300]}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    steps = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    out = {"kernels": len(gpu),
           "host_step_ms": max((e["dur"] for e in steps), default=0.0) / 1e3 or None}
    if not gpu:
        return out
    first = min(e["ts"] for e in gpu)
    last = max(e["ts"] + e["dur"] for e in gpu)
    busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    by_name: dict = {}
    for e in gpu:
        t = by_name.setdefault(str(e.get("name", "?"))[:100], [0.0, 0])
        t[0] += e["dur"]
        t[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    out.update(kernel_ms=sum(e["dur"] for e in gpu) / 1e3, gpu_busy_ms=busy / 1e3,
               gpu_span_ms=(last - first) / 1e3,
               busy_fraction=busy / (last - first) if last > first else None,
               top=[{"name": n, "ms": t / 1e3, "count": c} for n, (t, c) in top])
    return out


__all__ = ["profile_flags", "summarize_trace", "trace_path"]
