"""Where a training step's time goes on the GPU (Megatron's PyTorch profiler on one step of a
``pretrain()`` run), and the train step's comparisons that read it. Pure Python.

``summarize_trace`` / ``summarize_step`` account the GPU's events (``account``: attention per
pass and implementation, ``selection``, ``copies``, ``non_attention``) with the busy time and
gaps; ``step_bound`` is the one body of a step's bound (non-attention + d x cuDNN's attention),
which ``step_bounds`` and ``profiled_bounds`` call.
"""

from __future__ import annotations

import gzip
import json
import os
import re

from .full_depth import SEQUENCES

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
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):          # what each span adds past the union so far
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total


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
    kind = next((k for p, k in _ATTENTION if p.search(name)), None) \
        if e.get("cat") == "kernel" else None
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


def _launches(events: list, gpu: list) -> list:
    """Each of the ``gpu`` events' launch among ``events`` (its CUDA runtime or driver call),
    else ``{"ts": its own start}``."""
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    return [launch.get(e.get("args", {}).get("correlation"), {"ts": e["ts"]}) for e in gpu]


def _profiler_steps(spans: list) -> list:
    return [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("cat") != "gpu_user_annotation"]


def account(gpu: list, events: list) -> dict:
    """The accounting of GPU events ``gpu`` (module docstring) with the trace's ``events`` for
    their launches; milliseconds, summed over the events (overlapping streams count twice)."""
    gpu = sorted(gpu, key=lambda e: e["ts"])
    stacks = _stacks(events, _launches(events, gpu))
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
    for e in sorted(gpu, key=lambda e: e["ts"]):
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, e))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    gaps.sort(key=lambda g: -g[0])
    top_gaps = []
    if gaps:
        picked = gaps[:GAPS]
        stacks = _stacks(events, _launches(events, [e for _, e in picked]))
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
    steps = _profiler_steps(spans)
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
    steps = sorted(_profiler_steps(spans), key=lambda e: e["ts"])
    if step is not None:
        steps = [e for e in steps if e["name"] == f"ProfilerStep#{step}"]
    if not steps:
        return {"failed": f"no ProfilerStep#{'' if step is None else step} in {path}"}
    s = steps[-1]
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    gpu = [e for e, at in zip(gpu, _launches(spans, gpu)) if t0 <= at["ts"] <= t1]
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


# ---- the train step's runs compared ------------------------------------------------------------

# Qwen2.5-0.5B at full depth (24 layers: fewer let the LM head hide the attention), its heads,
# widths, vocabulary and RoPE
SHAPE = ["--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
         "--num-attention-heads", "14", "--num-query-groups", "2", "--kv-channels", "64",
         "--seq-length", "32768"]
LAYERS = int(SHAPE[SHAPE.index("--num-layers") + 1])
TRAIN_WARMUP = 3     # steps every rate leaves out (compiles, allocator growth, the profiled step)


def runs_of(runs: dict, data_name: str) -> dict:
    """{variant: run} of one data set, from the train step's ``{"data/variant": run}``."""
    head = f"{data_name}/"
    return {k[len(head):]: r for k, r in runs.items() if k.startswith(head)}


def train_summary(records, left_out=()):
    """Per run, after the warm-up steps: tokens/s as all their tokens over all their seconds (one
    step's tokens/s swings with its padding), the median step's beside it, each step's seconds
    (``step_s``, for ``paired_speedup``), every step's loss, the last step's densities; the rates
    without the steps that compiled a Triton kernel beside them. ``left_out``: step numbers no
    rate counts (named in ``left_out_steps``)."""
    steady = [r for r in records if r.get("step", 0) > TRAIN_WARMUP and r.get("tokens_per_s")
              and r.get("step") not in left_out]
    median = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2] if steady else None
    timed = steady and all(r.get("tokens") and r.get("step_time_s") for r in steady)
    out = {"steps": len(records), "losses": [r.get("loss") for r in records],
           "tokens_per_s": (sum(r["tokens"] for r in steady)
                            / sum(r["step_time_s"] for r in steady)) if timed else median,
           "median_step_tokens_per_s": median,
           "step_s": {str(r["step"]): r["step_time_s"] for r in steady
                      if r.get("step_time_s")},
           "step_tokens": {str(r["step"]): r["tokens"] for r in steady if r.get("tokens")},
           # causal (query block, key block) pairs of the step's documents (``dense_work``):
           # what ``cudnn_priced`` re-prices the dense attention by
           "step_dense_work": {str(r["step"]): sum(map(sum, r["dense_work"])) for r in steady
                               if r.get("dense_work")},
           # the work-weighted density each step kept (``step_bounds``' d)
           "step_density": {str(r["step"]): r["mean_density"] for r in steady
                            if r.get("mean_density") is not None},
           "mean_density": records[-1].get("mean_density") if records else None,
           "density_per_stage": records[-1].get("density_per_stage") if records else None}
    if left_out:
        out["left_out_steps"] = {str(r["step"]): r.get("step_time_s") for r in records
                                 if r.get("step") in left_out}
    # steps that paid a Triton compile (``kernel_compiles``, sparse runs): a long run amortises
    # them, ten steps do not, so the rates without them go beside the others
    compiled = {str(r["step"]): r.get("kernel_compile_s") for r in records
                if r.get("kernel_compiles")}
    if any("kernel_compiles" in r for r in records):
        clean = [r for r in steady if str(r["step"]) not in compiled]
        out.update(compile_steps=compiled, step_s_no_compile={
            k: v for k, v in out["step_s"].items() if k not in compiled},
            tokens_per_s_no_compile=(sum(r["tokens"] for r in clean)
                                     / sum(r["step_time_s"] for r in clean))
            if timed and clean else None)
    return out


def cudnn_priced(runs, data_name, tile_us, layers=None):
    """Dense + SAB through the varlen call re-priced as cuDNN's kernel would run it (each steady
    step less ``layers x dense work x (varlen - cuDNN) us per tile``), then every sparse run of
    ``data_name`` against it (``vs_cudnn_priced``, ``_no_compile``, ``paired_vs_cudnn_priced``).
    The measured cuDNN run gets ``vs_cudnn_priced``: the check of the one against the other."""
    base = runs.get(f"{data_name}/dense_sab", {})
    work, secs, toks = (base.get(k) or {} for k in ("step_dense_work", "step_s", "step_tokens"))
    tiles = _tile_seconds(tile_us, data_name)
    if not (work and secs and toks and tiles):
        return
    per_tile = tiles[0] - tiles[1]
    layers = layers or LAYERS
    priced = {k: secs[k] - layers * work[k] * per_tile for k in secs if k in work and k in toks}
    if not priced:
        return
    rate = sum(toks[k] for k in priced) / sum(priced.values())
    base["cudnn_priced_tokens_per_s"] = rate
    measured = runs.get(f"{data_name}/dense_sab_sdpa", {})
    if measured.get("tokens_per_s"):
        measured["vs_cudnn_priced"] = measured["tokens_per_s"] / rate
    for variant, run in runs_of(runs, data_name).items():
        if variant.startswith("dense") or not run.get("step_s"):
            continue
        mine = {k: v for k, v in run["step_s"].items() if k in priced}
        clean = {k: v for k, v in (run.get("step_s_no_compile") or mine).items() if k in priced}
        if not mine:
            continue

        def ratio(steps):
            return (sum(run["step_tokens"][k] for k in steps) / sum(steps.values())) / rate \
                if steps and run.get("step_tokens") else None

        run.update(vs_cudnn_priced=ratio(mine), vs_cudnn_priced_no_compile=ratio(clean),
                   paired_vs_cudnn_priced=paired_speedup({"step_s": priced}, run))


def _tile_seconds(tile_us, data_name):
    """(varlen, cuDNN) seconds per causal tile of one layer at the data set's micro-batch (the
    longest length timed at most it), or None where none was timed."""
    costs = [(int(n), c) for n, c in tile_us.items() if "cudnn" in c and "varlen" in c]
    if not costs:
        return None
    seq = SEQUENCES.get(data_name, 32768)
    fit = [c for n, c in sorted(costs) if n <= seq] or [min(costs)[1]]
    return fit[-1]["varlen"] / 1e6, fit[-1]["cudnn"] / 1e6


def step_bounds(runs, data_name, tile_us, layers=None):
    """The e2e JSON's headline bound: each run of ``data_name`` beside its bound step by step
    (``step_bound``): non-attention seconds are dense + SAB's (``dense_sab``, the same global
    batch) less its attention (``layers`` x the step's causal tiles x varlen's seconds per tile),
    cuDNN's attention the same tiles at cuDNN's; ``d`` the step's kept density (1 for a dense
    run). Each run gets ``bound_s``, ``vs_bound`` and ``nonattention_s``; a refused step goes to
    ``bound_refused``."""
    base = runs.get(f"{data_name}/dense_sab", {})
    work, secs = base.get("step_dense_work") or {}, base.get("step_s") or {}
    per_tile = _tile_seconds(tile_us or {}, data_name)
    if not (work and secs and per_tile):
        return
    layers = layers or LAYERS
    varlen, cudnn = per_tile
    rest = {k: secs[k] - layers * work[k] * varlen for k in secs if k in work}
    for variant, run in runs_of(runs, data_name).items():
        mine = run.get("step_s") or {}
        dens = run.get("step_density") or {}
        dense = variant.startswith("dense")
        bound, refused = {}, {}
        for k in mine:
            if k not in rest or not (dense or k in dens):
                continue
            try:          # step_bound takes milliseconds
                bound[k] = step_bound(1e3 * rest[k], 1e3 * layers * work[k] * cudnn,
                                      1.0 if dense else dens[k]) / 1e3
            except ValueError as e:
                refused[k] = str(e)
        if refused:
            run["bound_refused"] = refused
        if not bound:
            continue
        run.update(bound_s=bound, nonattention_s={k: rest[k] for k in bound},
                   vs_bound=sum(mine[k] for k in bound) / sum(bound.values()))


def profiled_bounds(runs, data_name, tile_us, step: int):
    """The cross-check of ``step_bounds`` on the profiled step ``step`` (the same global batch in
    every run): each profiled run of ``data_name`` gets ``profiled_bound`` (``bound_record`` beside
    the step's host time in its trace). Non-attention: dense + SAB's profiled step less its
    attention kernels (``dense_split``); cuDNN's attention: the measured cuDNN run's kernels
    (``dense_sab_sdpa``), else dense + SAB's priced at cuDNN's over varlen's seconds per tile."""
    base = runs.get(f"{data_name}/dense_sab", {}).get("gpu_profile") or {}
    split = dense_split(base)
    if split is None:
        return
    non_attention, varlen_ms = split
    cudnn = dense_split(runs.get(f"{data_name}/dense_sab_sdpa", {}).get("gpu_profile") or {})
    tiles = _tile_seconds(tile_us or {}, data_name)
    if cudnn is not None:
        attention, source = cudnn[1], "measured: dense_sab_sdpa's attention kernels"
    elif tiles:
        attention = varlen_ms * tiles[1] / tiles[0]
        source = "priced: dense_sab's attention kernels x cuDNN's / varlen's seconds per tile"
    else:
        return
    for variant, run in runs_of(runs, data_name).items():
        prof = run.get("gpu_profile") or {}
        if not prof.get("host_step_ms"):
            continue
        dense = variant.startswith("dense")
        d = 1.0 if dense else (run.get("step_density") or {}).get(str(step))
        try:
            rec = bound_record(non_attention, attention, d, prof["host_step_ms"])
        except ValueError as e:
            run["profiled_bound"] = {"refused": str(e)}
            continue
        run["profiled_bound"] = dict(
            rec, step=step, metrics_step_s=(run.get("step_s") or {}).get(str(step)),
            non_attention_from="dense_sab's profiled step less its attention kernels",
            cudnn_attention_from=source)


def cudnn_measured(runs, data_name):
    """Every sparse run of ``data_name`` against the measured dense + SAB run through cuDNN
    (``vs_cudnn_dense``, ``_no_compile``, ``paired_vs_cudnn_dense``). The cuDNN run gets
    ``cudnn_graph_steps`` (steps over 1.25x the median ratio to the varlen run: where torch most
    likely built a graph) and ``tokens_per_s_no_graph`` without them."""
    base = runs.get(f"{data_name}/dense_sab_sdpa", {})
    rate = base.get("tokens_per_s")
    if not rate:
        return
    secs, toks = base.get("step_s") or {}, base.get("step_tokens") or {}
    varlen = runs.get(f"{data_name}/dense_sab", {}).get("step_s") or {}
    ratio = {k: secs[k] / varlen[k] for k in secs.keys() & varlen.keys() if varlen[k] > 0}
    if ratio and toks:
        med = sorted(ratio.values())[len(ratio) // 2]
        base["cudnn_graph_steps"] = {k: secs[k] for k, r in ratio.items() if r > 1.25 * med}
        kept = [k for k in secs if k not in base["cudnn_graph_steps"] and k in toks]
        base["tokens_per_s_no_graph"] = (sum(toks[k] for k in kept)
                                         / sum(secs[k] for k in kept)) if kept else None
    for variant, run in runs_of(runs, data_name).items():
        if variant.startswith("dense") or not run.get("tokens_per_s"):
            continue
        clean = run.get("tokens_per_s_no_compile")
        run.update(vs_cudnn_dense=run["tokens_per_s"] / rate,
                   vs_cudnn_dense_no_compile=clean / rate if clean else None,
                   paired_vs_cudnn_dense=paired_speedup(base, run))


def compare_with_dense(runs, data_name):
    """Each run of ``data_name`` against plain dense (``speedup_vs_dense``) and each sparse run
    against the fastest dense run of the data set, whichever kernel and packing it had
    (``speedup_vs_best_dense``, ``paired_speedup_vs_best_dense``, ``best_dense``)."""
    mine = runs_of(runs, data_name)
    dense = mine.get("dense", {}).get("tokens_per_s")
    timed = [v for v in mine if v.startswith("dense") and mine[v].get("tokens_per_s")]
    best = max(timed, key=lambda v: mine[v]["tokens_per_s"]) if timed else None
    for variant, run in mine.items():
        if dense and run.get("tokens_per_s"):
            run["speedup_vs_dense"] = run["tokens_per_s"] / dense
        if best and run.get("tokens_per_s") and not variant.startswith("dense"):
            run["best_dense"] = best
            run["speedup_vs_best_dense"] = run["tokens_per_s"] / mine[best]["tokens_per_s"]
            run["paired_speedup_vs_best_dense"] = paired_speedup(mine[best], run)
            if run.get("tokens_per_s_no_compile"):
                run["speedup_vs_best_dense_no_compile"] = (run["tokens_per_s_no_compile"]
                                                           / mine[best]["tokens_per_s"])
                run["paired_speedup_vs_best_dense_no_compile"] = paired_speedup(
                    mine[best], {"step_s": run["step_s_no_compile"]})


def paired_speedup(base, run):
    """The median over the steady steps both runs timed of base seconds / run seconds: the same
    step number is the same global batch in every variant (one seed, one data order), so each
    ratio compares like with like; None without common steps."""
    a, b = base.get("step_s") or {}, run.get("step_s") or {}
    ratios = sorted(a[k] / b[k] for k in a.keys() & b.keys() if b[k] > 0)
    return ratios[len(ratios) // 2] if ratios else None
