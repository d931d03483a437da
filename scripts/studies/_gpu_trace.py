"""Where a training step's time goes on the GPU: Megatron's own PyTorch profiler on one step of a
``pretrain()`` run, and the accounting of the trace it writes.

``profile_flags(run_dir, step=2)`` are the flags that make ``pretrain()`` record step ``step``
with ``torch.profiler`` (``--profile --use-pytorch-profiler``; Megatron writes the Chrome trace to
``<tensorboard-dir>/../torch_profile/rank-0.json.gz``: ``trace_path``). The profiler waits
``step - 1`` steps and warms up on one; the trace is written at the start of the next step,
whose time it adds to. Step 2 (the default) is a warm-up step; a steady step (``step`` past the
warm-ups) costs the step after it the export, so a run's rates should leave that step out.

``summarize_trace(path)`` reads a whole trace (a probe's: ``fa4_pieces``' passes): the GPU's
kernels (and copies and fills) summed, the time the GPU was busy (their union: streams that
overlap count once) against the span from the first to the last, the recorded step's host time
(``ProfilerStep#``), the kernels that took the most time, and the ``account`` below. A busy
fraction well under 1 means the GPU waited for the host: a faster kernel does not make such a
step faster.

``summarize_step(path, step=None)`` is the same for one ``ProfilerStep#`` (the last one by
default): the GPU events launched inside it. ``account(gpu_events, cpu_ranges)`` splits kernel
time into what the issue's table names:

- ``attention``: attention kernels per pass (``fwd``, ``bwd``, and the side passes apart:
  ``bwd_preprocess`` (FA4's/flash's ``delta = rowsum(dO * O)`` and dQ-accumulator zeroing,
  triton's ``bwd_pre_kernel``), ``dq_convert`` (the float32 dQ accumulator cast),
  ``dkv_convert`` (GQA's float32 dK/dV accumulators cast), ``dkv_fill`` (their zero fills),
  ``bwd_convert`` (triton's one cast pass), ``other`` (anything else inside our attention
  ops: copies of ``bwd_per_head``, the sum over a group's heads), and by implementation
  (``cudnn``, ``fa4``, ``triton``, ``flex``, ``flash``, ``efficient``);
- ``selection``: the selection and block lists (our Triton kernels by name, and every kernel
  launched inside the ``sparsebalance::selection`` range the attention opens);
- ``copies``: memcpy / memset and copy or fill kernels elsewhere;
- ``non_attention``: every other kernel;
- ``gpu_idle_ms``: the span the GPU spent waiting (span minus the busy union), the
  ``busy_fraction``, and the longest gaps with the CPU op that launched the kernel after each.

A kernel is tied to its launch by the profiler's ``correlation`` (runtime / driver launch
events), and the launch to the CPU ops and annotations open on its thread at that moment.
``step_bound(non_attention_ms, cudnn_attention_ms, density)`` is a step's bound (its
non-attention time plus ``d`` x cuDNN's attention time), the one body of it: the train step's
headline bound per steady step (``_train_report.step_bounds``) calls it, and so does its
cross-check on the profiled step (``_train_report.profiled_bounds``), whose inputs
``dense_split`` takes from a dense run's profiled step and ``bound_record`` states beside the
measured step. Pure Python; reads a file, imports neither torch nor megatron.
"""

from __future__ import annotations

import gzip
import json
import os
import re

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
RANGE_CATEGORIES = ("cpu_op", "user_annotation")
SELECTION_RANGE = "sparsebalance::selection"
TOP = 8
GAPS = 5

# (implementation, pass) of an attention kernel by its name, first match wins
_ATTENTION = [
    (re.compile(r"cudnn_generated_fort_native_sdpa.*fprop"), ("cudnn", "fwd")),
    (re.compile(r"cudnn_generated_fort_native_sdpa.*bprop"), ("cudnn", "bwd")),
    (re.compile(r"FlashAttentionForward"), ("fa4", "fwd")),
    (re.compile(r"FlashAttentionBackwardPreprocess"), ("fa4", "bwd_preprocess")),
    (re.compile(r"FlashAttentionBackwardPostprocess"), ("fa4", "convert")),
    (re.compile(r"FlashAttentionBackward"), ("fa4", "bwd")),
    (re.compile(r"^(fwd_kernel)$"), ("triton", "fwd")),
    (re.compile(r"^(dkv_kernel|dq_kernel)$"), ("triton", "bwd")),
    (re.compile(r"^bwd_pre_kernel$"), ("triton", "bwd_preprocess")),
    (re.compile(r"^bwd_post_kernel$"), ("triton", "bwd_convert")),
    (re.compile(r"flex_attention_backward"), ("flex", "bwd")),
    (re.compile(r"flex_attention"), ("flex", "fwd")),
    (re.compile(r"flash_bwd_dot_do_o|FlashAttnBwdPreprocess"), ("flash", "bwd_preprocess")),
    (re.compile(r"flash_bwd_convert_dq|FlashAttnBwdPostprocessConvertdQ"),
     ("flash", "dq_convert")),
    (re.compile(r"flash_bwd|FlashAttnBwd"), ("flash", "bwd")),
    (re.compile(r"flash_fwd|FlashAttnFwd|pytorch_flash"), ("flash", "fwd")),
    (re.compile(r"fmha_cutlassF"), ("efficient", "fwd")),
    (re.compile(r"fmha_cutlassB"), ("efficient", "bwd")),
]
SELECTION_KERNELS = ("_block_sums_kernel", "_maxkey_kernel", "_shares_kernel", "_lists_kernel")
_COPY_OR_FILL = ("FillFunctor", "fill_kernel", "copy_kernel", "direct_copy", "CatArrayBatchedCopy",
                 "index_copy", "indexFuncLargeIndex", "indexFuncSmallIndex",
                 "indexSelectLargeIndex", "indexSelectSmallIndex", "Memcpy", "Memset")
_OUR_ATTENTION_OPS = ("sparsebalance::fa4_block_sparse", "sparsebalance::sparse_attn")


def profile_flags(run_dir: str, step: int = 2) -> list:
    """``pretrain()`` flags that record its step ``step`` (>= 2) with the PyTorch profiler, the
    trace under ``run_dir`` (``trace_path(run_dir)``)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 2:
        raise ValueError(f"step={step!r}: expected an integer >= 2 (the profiler warms up on "
                         f"the step before)")
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(step),
            "--profile-step-end", str(step + 1), "--tensorboard-dir",
            os.path.join(run_dir, "tb"), "--tensorboard-log-interval", "1000"]


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


def attention_kind(name: str):
    """(implementation, pass) of an attention kernel's name, or None."""
    for pattern, kind in _ATTENTION:
        if pattern.search(name):
            return kind
    return None


def _stacks(events: list, launches: list) -> list:
    """For each launch (a dict with ``ts``, ``pid``, ``tid``): the names of the CPU ops and
    annotations open on its thread at its start, outermost first (they nest on a thread)."""
    by_thread: dict = {}
    for e in events:
        if e.get("cat") in RANGE_CATEGORIES and e.get("ph") == "X" and "dur" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = [()] * len(launches)
    order = sorted(range(len(launches)), key=lambda i: launches[i]["ts"])
    for key, ranges in by_thread.items():
        ranges.sort(key=lambda e: (e["ts"], -e["dur"]))
        mine = [i for i in order if (launches[i].get("pid"), launches[i].get("tid")) == key]
        stack, r = [], 0
        for i in mine:
            ts = launches[i]["ts"]
            while r < len(ranges) and ranges[r]["ts"] <= ts:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ranges[r]["ts"]:
                    stack.pop()
                stack.append(ranges[r])
                r += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            out[i] = tuple(str(e.get("name", "")) for e in stack
                           if e["ts"] <= ts <= e["ts"] + e["dur"])
    return out


def _classify(e: dict, stack: tuple, after_bwd: bool):
    """(category, implementation or None, pass or None) of one GPU event."""
    name = str(e.get("name", ""))
    kind = attention_kind(name) if e.get("cat") == "kernel" else None
    if kind is not None:
        impl, step = kind
        if step == "convert":            # FA4's postprocess: dQ first, then GQA's dK and dV
            step = "dkv_convert" if after_bwd else "dq_convert"
        return "attention", impl, step
    if name in SELECTION_KERNELS or SELECTION_RANGE in stack:
        return "selection", None, None
    ours = next((s for s in stack if s.startswith(_OUR_ATTENTION_OPS)), None)
    fill = "Fill" in name or e.get("cat") == "gpu_memset"
    if ours is not None:
        impl = "fa4" if "fa4" in ours else "triton"
        if ours.endswith("_bwd") and fill:
            return "attention", impl, "dkv_fill"
        return "attention", impl, "other"
    if e.get("cat") in ("gpu_memcpy", "gpu_memset") or any(s in name for s in _COPY_OR_FILL):
        return "copies", None, None
    return "non_attention", None, None


def account(gpu: list, events: list) -> dict:
    """The accounting of GPU events ``gpu`` (module docstring) with the trace's ``events`` for
    their launches; milliseconds, summed over the events (overlapping streams count twice)."""
    launch = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = e
    gpu = sorted(gpu, key=lambda e: e["ts"])
    launches = [launch.get(e.get("args", {}).get("correlation"), {"ts": e["ts"]}) for e in gpu]
    stacks = _stacks(events, launches)
    ms = {"non_attention": 0.0, "attention": 0.0, "selection": 0.0, "copies": 0.0}
    passes, impls = {}, {}
    after_bwd = {}                       # stream -> a FA4 backward ran since its last forward
    for e, stack in zip(gpu, stacks):
        stream = e.get("args", {}).get("stream")
        cat, impl, step = _classify(e, stack, after_bwd.get(stream, False))
        dur = e["dur"] / 1e3
        ms[cat] += dur
        if cat == "attention":
            passes[step] = passes.get(step, 0.0) + dur
            impls[impl] = impls.get(impl, 0.0) + dur
            if impl == "fa4" and step in ("bwd", "dq_convert", "dkv_convert"):
                after_bwd[stream] = step != "bwd"
            elif impl == "fa4" and step in ("fwd", "bwd_preprocess"):
                after_bwd[stream] = False
    return {"ms": ms, "attention_passes": passes, "attention_by_kernel": impls}


def _load(path: str):
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            return json.load(f).get("traceEvents", []), None
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"[:300]


def _spans(events):
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _timeline(gpu: list, events: list) -> dict:
    """Busy time, span, idle, the busy fraction and the longest gaps of ``gpu`` events."""
    first = min(e["ts"] for e in gpu)
    last = max(e["ts"] + e["dur"] for e in gpu)
    busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    gaps, end = [], None
    ordered = sorted(gpu, key=lambda e: e["ts"])
    for e in ordered:
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, e))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    gaps.sort(key=lambda g: -g[0])
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    top_gaps = []
    if gaps:
        picked = gaps[:GAPS]
        stacks = _stacks(events, [launch.get(e.get("args", {}).get("correlation"),
                                             {"ts": e["ts"]}) for _, e in picked])
        top_gaps = [{"ms": g / 1e3, "next": str(e.get("name", "?"))[:80],
                     "launched_in": next((s for s in reversed(stack)
                                          if not s.startswith("ProfilerStep#")), None)}
                    for (g, e), stack in zip(picked, stacks)]
    return {"gpu_busy_ms": busy / 1e3, "gpu_span_ms": (last - first) / 1e3,
            "gpu_idle_ms": (last - first - busy) / 1e3,
            "busy_fraction": busy / (last - first) if last > first else None,
            "gaps": top_gaps}


def _top(gpu):
    by_name: dict = {}
    for e in gpu:
        t = by_name.setdefault(str(e.get("name", "?"))[:100], [0.0, 0])
        t[0] += e["dur"]
        t[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [{"name": n, "ms": t / 1e3, "count": c} for n, (t, c) in top]


def summarize_trace(path: str) -> dict:
    """The summary of one Chrome trace (module docstring); ``{"kernels": 0}`` where it holds no
    GPU event (a CPU run), ``{"failed": why}`` where it cannot be read."""
    events, why = _load(path)
    if events is None:
        return {"failed": why}
    spans = _spans(events)
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    steps = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    out = {"kernels": len(gpu),
           "host_step_ms": max((e["dur"] for e in steps), default=0.0) / 1e3 or None}
    if not gpu:
        return out
    timeline = _timeline(gpu, events)
    out.update(kernel_ms=sum(e["dur"] for e in gpu) / 1e3,
               **{k: timeline[k] for k in ("gpu_busy_ms", "gpu_span_ms", "busy_fraction")},
               top=_top(gpu), account=account(gpu, events))
    return out


def summarize_step(path: str, step: int = None) -> dict:
    """The accounting of one ``ProfilerStep#<step>`` (the last recorded one by default): the GPU
    events whose launch lies inside it (module docstring). ``{"failed": why}`` where the trace
    cannot be read or holds no such step; ``kernels: 0`` where it holds no GPU event."""
    events, why = _load(path)
    if events is None:
        return {"failed": why}
    spans = _spans(events)
    steps = sorted((e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    if step is not None:
        steps = [e for e in steps if e["name"] == f"ProfilerStep#{step}"]
    if not steps:
        return {"failed": f"no ProfilerStep#{'' if step is None else step} in {path}"}
    s = steps[-1]
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    launch = {e["args"]["correlation"]: e["ts"] for e in spans
              if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES
           and t0 <= launch.get(e.get("args", {}).get("correlation"), e["ts"]) <= t1]
    out = {"step": s["name"], "host_step_ms": s["dur"] / 1e3, "kernels": len(gpu)}
    if not gpu:
        return out
    out.update(kernel_ms=sum(e["dur"] for e in gpu) / 1e3, **_timeline(gpu, events),
               top=_top(gpu), **account(gpu, events))
    return out


def step_bound(non_attention_ms: float, cudnn_attention_ms: float, density: float) -> float:
    """A step's bound: its non-attention time plus ``density`` x cuDNN's attention time (the
    sparse step if its kept tiles ran at cuDNN's speed and cost nothing else)."""
    for name, x in (("non_attention_ms", non_attention_ms),
                    ("cudnn_attention_ms", cudnn_attention_ms)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0:
            raise ValueError(f"{name}={x!r}: expected a number >= 0 (milliseconds)")
    if isinstance(density, bool) or not isinstance(density, (int, float)) \
            or not 0 < density <= 1:
        raise ValueError(f"density={density!r}: expected a number in (0, 1]")
    return non_attention_ms + density * cudnn_attention_ms


def dense_split(dense_step: dict):
    """(non-attention ms, attention ms) of a dense run's profiled step (``summarize_step``): its
    attention kernels, and the rest of its host step time (the other kernels, copies and the
    GPU's idle); None where the trace held no accounted GPU event."""
    if "ms" not in dense_step:
        return None
    attn = dense_step["ms"]["attention"]
    return max(dense_step["host_step_ms"] - attn, 0.0), attn


def bound_record(non_attention_ms: float, cudnn_attention_ms: float, density: float,
                 measured_ms: float) -> dict:
    """The e2e JSON's cross-check bound beside a measured step (``step_bound``; ``density``: the
    kept density, 1 for a dense step), and ``over_bound = measured / bound - 1``: the distance
    that is our overhead."""
    bound = step_bound(non_attention_ms, cudnn_attention_ms, density)
    return {"bound_ms": bound, "measured_ms": measured_ms, "density": density,
            "non_attention_ms": non_attention_ms, "cudnn_attention_ms": cudnn_attention_ms,
            "over_bound": measured_ms / bound - 1 if bound > 0 else None}


__all__ = ["account", "attention_kind", "bound_record", "dense_split", "profile_flags",
           "step_bound", "summarize_step", "summarize_trace", "trace_path"]
