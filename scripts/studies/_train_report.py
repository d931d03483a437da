"""The train step's runs compared (``scripts/gpu_check.py --steps train``): each run's rates
from its per-step metrics (``train_summary``), and each sparse run of a data set against its
dense runs: the fastest of them (``compare_with_dense``), dense + SAB measured through cuDNN
(``cudnn_measured``) and dense + SAB re-priced at cuDNN's kernel per tile (``cudnn_priced``),
step for step where both ran the same global batch (``paired_speedup``).

Every run's steps beside their bound (``_gpu_trace.step_bound``, the one body of it: the step's
non-attention time plus d x cuDNN's attention time, the distance to it being the plugin's
overhead), from two inputs:

- ``step_bounds``, **the e2e JSON's headline bound** (``bound_s``, ``vs_bound``: the issue-74
  target "within 5% of its bound"): every steady step of every run, its non-attention time
  dense + SAB's through the varlen call less its attention priced per tile, cuDNN's attention
  the same tiles at cuDNN's price;
- ``profiled_bounds``, **the cross-check** (``profiled_bound``): the one profiled step of each
  profiled run, from the kernels its trace holds (``_gpu_trace.dense_split``,
  ``bound_record``).

Pure Python; imports neither torch nor megatron.
"""

from __future__ import annotations

from ._gpu_trace import bound_record, dense_split, step_bound

# Qwen2.5-0.5B at full depth (24 layers; issue 74: the reduced 8-layer model's LM head hid the
# attention, 33-38% of its cuDNN-priced dense step), its heads, widths, vocabulary and RoPE
SHAPE = ["--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
         "--num-attention-heads", "14", "--num-query-groups", "2", "--kv-channels", "64",
         "--seq-length", "32768"]
TRAIN_WARMUP = 3     # steps every rate leaves out (compiles, allocator growth, the profiled step)


def runs_of(runs: dict, data_name: str) -> dict:
    """{variant: run} of one data set, from the train step's ``{"data/variant": run}``."""
    head = f"{data_name}/"
    return {k[len(head):]: r for k, r in runs.items() if k.startswith(head)}


def train_summary(records, left_out=()):
    """Per run, after the warm-up steps: tokens/s as all their tokens over all their seconds
    (each step's global batch holds different documents, so one step's tokens/s swings with its
    padding: the H200 run of 2026-11-26 read 35-101K tokens/s in one run), the median step's
    tokens/s beside it, and each step's seconds (``step_s``, for the paired comparison of
    ``paired_speedup``); the losses of every step; the last step's work-weighted mean density
    and per-stage densities. Records without ``tokens``/``step_time_s`` give the median.
    ``left_out``: step numbers no rate counts (a profiled run's step after the profiled one,
    which pays the trace's export), named in ``left_out_steps`` with their seconds."""
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
    """Dense + SAB through the varlen call (``dense_sab``) re-priced as cuDNN's kernel would run
    it: each steady step less ``layers x dense work x (varlen - cuDNN) us per tile`` (the tile
    costs of the longest length measured at most the micro-batch's), then every sparse run of
    ``data_name`` against it (``vs_cudnn_priced``: all steady steps; ``_no_compile``: without
    the steps that compiled a Triton kernel; ``paired_vs_cudnn_priced``: the median step ratio).
    The dense run gets ``cudnn_priced_tokens_per_s``; the measured cuDNN run
    (``cudnn_measured``) ``vs_cudnn_priced``, its tokens/s over the priced rate: the check of
    the one against the other (below 1 by its padding and by steps that built a cuDNN graph)."""
    base = runs.get(f"{data_name}/dense_sab", {})
    work, secs, toks = (base.get(k) or {} for k in ("step_dense_work", "step_s", "step_tokens"))
    tiles = _tile_seconds(tile_us, data_name)
    if not (work and secs and toks and tiles):
        return
    per_tile = tiles[0] - tiles[1]
    layers = layers or int(SHAPE[SHAPE.index("--num-layers") + 1])
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
    seq = 65536 if data_name.endswith("_64k") else 131072 if data_name.endswith("_128k") \
        else 32768
    fit = [c for n, c in sorted(costs) if n <= seq] or [min(costs)[1]]
    return fit[-1]["varlen"] / 1e6, fit[-1]["cudnn"] / 1e6


def step_bounds(runs, data_name, tile_us, layers=None):
    """The e2e JSON's headline bound (module docstring): each run of ``data_name`` beside its
    bound step by step (``step_bound``): a step's non-attention seconds are dense + SAB's
    through the varlen call (``dense_sab``, the same global batch) less its attention
    (``layers`` x the step's causal tiles x varlen's seconds per tile), cuDNN's attention the
    same tiles at cuDNN's; ``d`` is the step's kept density (``step_density``; 1 for a dense
    run). Each run gets ``bound_s`` per step, ``vs_bound`` (its seconds over the bound's over
    the steps both have: 1.0 is at the bound) and ``nonattention_s``; nothing where dense + SAB
    or the tile costs were not measured. A step the bound refuses (non-attention priced below
    zero, no kept density) is named in ``bound_refused`` instead."""
    base = runs.get(f"{data_name}/dense_sab", {})
    work, secs = base.get("step_dense_work") or {}, base.get("step_s") or {}
    per_tile = _tile_seconds(tile_us or {}, data_name)
    if not (work and secs and per_tile):
        return
    layers = layers or int(SHAPE[SHAPE.index("--num-layers") + 1])
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
    """The cross-check of ``step_bounds`` (module docstring) on the profiled step ``step``, the
    same global batch in every run: each profiled run of ``data_name`` (``gpu_profile``, the
    trace's ``_gpu_trace.summarize_step``) gets ``profiled_bound`` (``bound_record``: the bound
    beside the step's host time in its trace, ``measured_ms``, and ``over_bound``), with the
    step's seconds in the metrics beside (``metrics_step_s``) and where each input came from.
    Non-attention: dense + SAB's profiled step through the varlen call less its attention
    kernels (``dense_split``: its other kernels, copies and GPU idle). cuDNN's attention: the
    measured cuDNN run's attention kernels in its profiled step (``dense_sab_sdpa``: a long
    document alone in its call, at 32K), else dense + SAB's attention kernels priced at cuDNN's
    seconds per tile over varlen's (64K: no measured cuDNN run; the trace's kernels count a
    recomputed forward too). Nothing where dense + SAB's step was not profiled."""
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
    (``dense_sab_sdpa``, its calls at padded lengths from a bounded set): ``vs_cudnn_dense``
    (all steady steps), ``vs_cudnn_dense_no_compile`` (without the steps that compiled a
    Triton kernel), ``paired_vs_cudnn_dense`` (the median step ratio). The cuDNN run gets
    ``cudnn_graph_steps``: its steady steps over 1.25x the median of its step-for-step ratio
    to the varlen run (the same global batch: where torch most likely built a cuDNN graph for
    a new padded shape), and ``tokens_per_s_no_graph`` without them."""
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
