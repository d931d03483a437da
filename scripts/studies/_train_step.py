"""gpu_check's train step: Megatron ``pretrain()`` runs of the full-depth Qwen2.5-0.5B (24
layers, ``_train_report.SHAPE``) on the corpus's documents of 16K+ tokens, and their
comparisons (``_train_report``).

The runs, in ``TRAIN_RUNS``' order (what the issue-74 targets count first; the budget cuts the
rest): dense + SAB through torch's varlen call (``dense_sab``: the base every comparison
re-prices and every bound's non-attention time comes from) and ``--sparse-balance`` at d0 0.25
and 0.5 in 32K micro-batches, the same dense + SAB and d0 0.25 in 64K ones, dense + SAB
through cuDNN SDPA at 32K (``dense_sab_sdpa``, a long document alone in its call: the measured
baseline), then d0 0.5 at 64K, the 128K data set, whole files and Megatron's plain dense.
A data set runs without activation recomputation where its estimated peak fits the device,
with Megatron's full recomputation where only that fits, and not at all otherwise
(``full_depth.memory_plan``, the device's memory read here: on the H200 32K plain, 64K
recomputed, 128K not run); every run of a data set has the same flags. The runs plan with
``--latency-table`` or, without one, a table of this model priced by run 5's kernel table of
the backend ``auto`` runs (``_device_tables``).

The 32K and 64K runs of dense + SAB (both kernels) and of d0 0.5 and 0.25 (``TRAIN_PROFILED``)
record their steady step ``PROFILE_STEP`` with Megatron's PyTorch profiler; the step's trace is
summarised (``_gpu_trace.summarize_step``: non-attention, attention per pass with FA4's side
passes, selection and lists, copies and fills, GPU idle, the busy fraction, the longest host
gaps) while the next run trains, into the run's ``gpu_profile``, and the trace removed. Its
export adds seconds to the step after, which no rate counts (``left_out_steps``). Each run's
steps beside their bound: ``bound_s`` / ``vs_bound`` per steady step (the headline), and the
profiled step's ``profiled_bound`` (the cross-check; ``_train_report``).

Pure Python; imports megatron and torch only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import _gpu_trace as gpu_trace
from ._train_report import (SHAPE, compare_with_dense, cudnn_measured, cudnn_priced,
                            profiled_bounds, step_bounds, train_summary)
from .common import ROOT
from .full_depth import SEQUENCES, memory_plan

LONG_DOC_TOKENS = 16384     # the end-to-end data set of long documents: 16K tokens or more
# dense_sab: dense attention with SAB packing (--sb-batching alone), through torch's varlen call;
# dense_sab_sdpa: the same through cuDNN SDPA over the documents grouped by length (each long
# document its own call, as a Transformer Engine user's THD cuDNN call computes it: the
# long-document set has 1-2 per micro-batch); every sparse run counts against the fastest dense
# run of its data
TRAIN_VARIANTS = {"dense": [], "dense_sab_sdpa": ["--sb-batching", "--sb-dense-kernel", "sdpa"],
                  "dense_sab": ["--sb-batching"],
                  "sb_d0.5": ["--sparse-balance", "--sb-density", "0.5"],
                  "sb_d0.25": ["--sparse-balance", "--sb-density", "0.25"]}
TRAIN_RUNS = (("long_docs", "dense_sab"), ("long_docs", "sb_d0.25"), ("long_docs", "sb_d0.5"),
              ("long_docs_64k", "dense_sab"), ("long_docs_64k", "sb_d0.25"),
              ("long_docs", "dense_sab_sdpa"), ("long_docs_64k", "sb_d0.5"),
              ("long_docs_128k", "dense_sab"), ("long_docs_128k", "sb_d0.25"),
              ("files", "dense_sab"), ("files", "sb_d0.5"),
              ("long_docs", "dense"), ("files", "dense"))
# the comparisons the targets count: a step fails when one of them is cut short or does not
# fit (the others inform only)
TARGET_RUNS = TRAIN_RUNS[:6]
TRAIN_STEPS = 10
# the steady step Megatron's PyTorch profiler records (``_gpu_trace``; the rates count steps
# past ``TRAIN_WARMUP``, 3) in the runs of ``TRAIN_PROFILED``: where a steady step's time goes,
# dense and sparse, at 32K and 64K (issue 74; 64K has no measured cuDNN run)
PROFILE_STEP = 6
TRAIN_PROFILED = {(d, v) for d, v in TRAIN_RUNS if d in ("long_docs", "long_docs_64k")
                  and v in ("dense_sab_sdpa", "dense_sab", "sb_d0.5", "sb_d0.25")}
# seconds a profiled run adds, estimated: the profiler on the warm-up and the recorded step and
# the trace's export (gzip) at the start of the next, about 50K events of a full-depth step (50K
# CPU events took 12 s to export on this repository's loaded 2-core machine). The summary runs
# beside the next run. The train step's budget counts it (tests/unit/test_gpu_train_step.py)
PROFILE_S = 5


def run_logged(cmd, log_path, limit_s, env=None):
    """Run ``cmd``; stdout+stderr to ``log_path``. Returns (rc, seconds, tail of the log)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=limit_s, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log_path) as log:
        tail = log.read()[-3000:]
    return rc, time.time() - t0, tail


def long_docs_prefix(out_dir, min_tokens=LONG_DOC_TOKENS):
    """A Megatron indexed data set (Qwen tokens) of the built-in corpus's documents of
    ``min_tokens`` tokens or more; returns its prefix."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from sparsebalance_megatron.data import load_corpus
    corpus = load_corpus(tokenizer="qwen")
    prefix = os.path.join(out_dir, f"long_docs_{min_tokens}")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    kept = 0
    for i, n in enumerate(corpus.lengths):
        if n >= min_tokens:
            builder.add_document(torch.from_numpy(np.asarray(corpus.tokens(i), np.int32)), [n])
            kept += 1
    builder.finalize(prefix + ".idx")
    if not kept:
        raise ValueError(f"the built-in corpus has no document of {min_tokens}+ tokens")
    return prefix, kept


def seq_of(data_name: str) -> int:
    return SEQUENCES.get(data_name, 32768)


def train_cmd(py, impl, metrics, table, variant_flags, data_flags, backend):
    sparse = ([*variant_flags, "--sb-block-size", "128", "--sb-attention-backend", backend,
               *(["--sb-latency-table", table, "--sb-latency-table-force"]
                 if os.path.exists(table) else [])] if variant_flags else [])
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "examples/pretrain_gpt_sparsebalance.py", *SHAPE,
            "--group-query-attention", "--max-position-embeddings", "32768",
            "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
            "--disable-bias-linear", "--add-qkv-bias", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", str(TRAIN_STEPS), "--lr", "3e-4", "--min-lr", "3e-5",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
            "--bf16", "--log-interval", "1", "--eval-iters", "0",
            "--distributed-backend", "nccl", *impl, "--sb-tokenizer", "qwen",
            "--sb-metrics-file", metrics, *data_flags, *sparse]


def train_order(data):
    """(data set, variant) of ``TRAIN_RUNS`` whose data set is in ``data``, in order."""
    return [(d, v) for d, v in TRAIN_RUNS if d in data]


def data_sets(out_dir):
    """{name: data flags} of the long documents at 32K, 64K and 128K tokens per micro-batch and
    of whole files (the built-in corpus), and {"long_docs": count} or the failure."""
    info = {}
    try:
        prefix, n_long = long_docs_prefix(out_dir)
        info["long_docs"] = n_long
        data = {name: ["--data-path", prefix] + ([] if seq == 32768 else [
            "--seq-length", str(seq), "--max-position-embeddings", str(seq)])
            for name, seq in SEQUENCES.items()}
    except Exception as e:  # noqa: BLE001 - the whole-file runs still go ahead
        data = {}
        info["long_docs_failed"] = f"{type(e).__name__}: {e}"
    data["files"] = []
    return data, info


def device_gib():
    """The device's memory in GiB, or None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / float(1 << 30)


def run_table(work, data_name, backend, given):
    """The latency table a run of ``data_name`` plans with: ``given`` (``--latency-table``), else
    this model's table at its micro-batch priced by run 5's kernel table of ``backend``
    (``auto``: fa4 where it can run here, else triton), written into ``work``."""
    if given:
        return given
    from sparsebalance_megatron.latency.table import write_table

    from ._device_tables import length_free_backend, priced_table
    if backend == "auto":
        backend = length_free_backend()
    path = os.path.join(work, f"latency_{backend}_{seq_of(data_name)}.json")
    if not os.path.exists(path):
        layers = int(SHAPE[SHAPE.index("--num-layers") + 1])
        write_table(priced_table(backend, layers=layers, seq_length=seq_of(data_name)), path)
    return path


def te_available(env):
    code = "import transformer_engine.pytorch"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def profile_summary(prof_dir):
    """The summary of a profiled run's step ``PROFILE_STEP`` (``_gpu_trace.summarize_step``), or
    why there is none; the trace removed after."""
    try:
        return gpu_trace.summarize_step(gpu_trace.trace_path(prof_dir), step=PROFILE_STEP)
    except Exception as e:  # noqa: BLE001 - a trace that cannot be read costs its summary only
        return {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        shutil.rmtree(prof_dir, ignore_errors=True)


def step_train(out_dir, table, limit, env, backend, tile_costs=None, memory_gib=None):
    """The runs of ``TRAIN_RUNS`` while time lasts (module docstring); with ``tile_costs``
    (``dense_tile_costs``) dense + SAB re-priced at cuDNN's kernel and every run beside its
    bound (``_train_report``); the profiled runs' summaries and the cross-check of the bound.
    ``table``: ``--latency-table`` or None; ``memory_gib``: the device's (None: read here, and
    on a machine without CUDA no data set is held back)."""
    py = sys.executable
    impl = (["--transformer-impl", "transformer_engine"] if te_available(env) else
            ["--transformer-impl", "local", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-rope-fusion"])
    t0 = time.time()
    res = {"ok": True, "transformer_impl": impl[1], "backend": backend, "runs": {},
           "layers": int(SHAPE[SHAPE.index("--num-layers") + 1])}
    data, info = data_sets(out_dir)
    res.update(info)
    gib = memory_gib if memory_gib is not None else device_gib()
    plans = {d: memory_plan(seq_of(d), gib) if gib else {"flags": [], "fits": True}
             for d in data}
    res["memory"] = {d: p for d, p in plans.items() if "why" in p}
    summaries, pool = {}, ThreadPoolExecutor(max_workers=1)   # beside the next run
    for data_name, variant in train_order(data):
        name = f"{data_name}/{variant}"
        counts = (data_name, variant) in TARGET_RUNS
        if not plans[data_name]["fits"]:
            res["runs"][name] = {"ok": False, "skipped": f"memory: {plans[data_name]['why']}"}
            res["ok"] = res["ok"] and not counts
            continue
        left = limit - (time.time() - t0)
        if left < 30:
            res["runs"][name] = {"ok": False, "skipped": "out of time"}
            res["ok"] = res["ok"] and not counts
            continue
        metrics = os.path.join(out_dir, f"train_{data_name}_{variant}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        data_flags = [*data[data_name], *plans[data_name]["flags"]]
        prof_dir = os.path.join(out_dir, f"profile_{data_name}_{variant}")
        profiled = (data_name, variant) in TRAIN_PROFILED
        if profiled:
            shutil.rmtree(prof_dir, ignore_errors=True)
            data_flags = [*data_flags, *gpu_trace.profile_flags(prof_dir, step=PROFILE_STEP)]
        flags = TRAIN_VARIANTS[variant]
        plan_table = run_table(out_dir, data_name, backend, table) if flags else ""
        rc, sec, tail = run_logged(train_cmd(py, impl, metrics, plan_table, flags, data_flags,
                                             backend),
                                   os.path.join(out_dir, f"train_{data_name}_{variant}.log"),
                                   left, env)
        records = ([json.loads(x) for x in open(metrics) if x.strip()]
                   if os.path.exists(metrics) else [])
        run = {"ok": rc == 0, "rc": rc, "seconds": sec,
               **train_summary(records, left_out=(PROFILE_STEP + 1,) if profiled else ())}
        if plans[data_name]["flags"]:
            run["recompute"] = "full"
        if profiled:
            summaries[name] = pool.submit(profile_summary, prof_dir)
        if rc != 0:
            run["tail"] = tail[-2000:]
            res["ok"] = False
        res["runs"][name] = run
    for name, job in summaries.items():
        res["runs"][name]["gpu_profile"] = job.result()
    pool.shutdown()
    for data_name in data:
        compare_with_dense(res["runs"], data_name)
        cudnn_measured(res["runs"], data_name)
    if tile_costs:
        res["dense_tile_us"] = tile_costs
    priced = tile_costs if tile_costs and "failed" not in tile_costs else None
    for data_name in data:
        if priced:
            cudnn_priced(res["runs"], data_name, priced, res["layers"])
            step_bounds(res["runs"], data_name, priced, res["layers"])
        profiled_bounds(res["runs"], data_name, priced, PROFILE_STEP)
    res["seconds"] = time.time() - t0
    return res


def dense_tile_costs(shape=SHAPE, seq_lens=(32768, 65536), reps=10):
    """Microseconds per causal (query block, key block) pair of one layer's attention, fwd+bwd,
    for torch's varlen call and for cuDNN's kernel alone (contiguous inputs, the kernel table's
    reference), on one document of each length at the train step's heads: what a Transformer
    Engine user's cuDNN THD call costs a tile, without torch's cuDNN graph built per new
    document length. {} where no CUDA."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from .kernels import BLOCK, Case, dense_passes
    nh = int(shape[shape.index("--num-attention-heads") + 1])
    ng = int(shape[shape.index("--num-query-groups") + 1])
    hn = int(shape[shape.index("--kv-channels") + 1])
    out = {}
    for n in seq_lens:
        case = Case("single", [n], f"{nh}/{ng}/{hn}")
        rows = dense_passes(case, reps)
        pairs = case.causal_tiles() / nh
        out[str(n)] = {k: 1000 * (rows[k]["fwd_ms"] + rows[k]["bwd_ms"]) / pairs
                       for k in ("cudnn", "varlen") if "fwd_ms" in rows.get(k, {})}
        out[str(n)]["block"] = BLOCK
        del case
        torch.cuda.empty_cache()
    return out


__all__ = ["PROFILE_S", "PROFILE_STEP", "TRAIN_PROFILED", "TRAIN_RUNS", "TRAIN_STEPS",
           "TRAIN_VARIANTS", "dense_tile_costs", "long_docs_prefix", "profile_summary",
           "run_logged", "step_train", "train_cmd", "train_order"]
