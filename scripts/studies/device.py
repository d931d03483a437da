"""What gpu_check's steps run on the device (``scripts/gpu_check.py``; docs/GPU.md): the calls'
latency tables priced from committed measurements (``priced_table``), the train step's
``pretrain()`` runs (``step_train``) and the kernel-side steps. Pure Python; torch, megatron and
the package are imported inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import gpu_trace
from .common import ROOT
from .full_depth import SEQUENCES, memory_plan
from .gpu_trace import (LAYERS, SHAPE, compare_with_dense, cudnn_measured, cudnn_priced,
                        profiled_bounds, step_bounds, train_summary)

# ---- the device calls' latency tables -----------------------------------------------------------

KERNEL_TABLES = {"fa4": "kernel_table_h200_run5_fa4_flash.json",
                 "triton": "kernel_table_h200_run5_triton_flex.json"}
MODEL_SHAPE = "14/2/64"                 # Qwen2.5-0.5B's query / KV heads x head dim


def kernel_table_path(backend: str) -> str:
    if backend not in KERNEL_TABLES:
        raise ValueError(f"backend {backend!r}: expected one of {sorted(KERNEL_TABLES)} (the "
                         f"kernels run 5 timed at {MODEL_SHAPE})")
    return os.path.join(ROOT, "docs", "results", KERNEL_TABLES[backend])


def length_free_backend() -> str:
    """What ``--sb-attention-backend auto`` runs at variable lengths here: fa4 where it can
    run, else triton (``latency.sparse_call.LENGTH_FREE_BACKENDS``' order; the launch's rule,
    ``megatron/launch/lengths.py``)."""
    from sparsebalance_megatron.attention.api import backend_missing
    return "fa4" if backend_missing("fa4", "cuda") is None else "triton"


def h200_profile(rows: list):
    """``DeviceProfile`` of the H200 with cuDNN's kernel as the kernel table timed it (one 32K
    document at the model's heads: seconds per causal tile, its call cost the H100's)."""
    from sparsebalance_megatron.latency.analytic import DeviceProfile

    dense = next(r for r in rows if r.get("kind") == "dense" and r["case"] == "single"
                 and r["shape"] == MODEL_SHAPE and r.get("dense_cudnn_ms"))
    nb = -(-int(dense["tokens"]) // 128)
    nh, _, hd = (int(v) for v in MODEL_SHAPE.split("/"))
    return DeviceProfile(name="NVIDIA H200 (analytic GEMMs; cuDNN and the sparse call measured, "
                              "run 5)", dense_tile_s=dense["dense_cudnn_ms"] * 1e-3 /
                         (nb * (nb + 1) / 2), dense_reference_heads_dim=nh * hd,
                         hbm_bytes_per_s=4.8e12)


def priced_table(backend: str, *, layers: int = 24, pp: int = 1, seq_length: int = 32768,
                 kernel_table: str | None = None) -> dict:
    """The analytic table of Qwen2.5-0.5B with ``layers`` layers in ``pp`` stages at
    ``seq_length`` tokens per micro-batch, block 128, its attention priced by the kernel
    table (default: run 5's of ``backend``)."""
    from sparsebalance_megatron.latency import ModelShape, analytic_table
    from sparsebalance_megatron.latency.sparse_call import fit_price, price_rows

    path = kernel_table or kernel_table_path(backend)
    rows = json.load(open(path))["rows"]
    price = fit_price(price_rows(rows, MODEL_SHAPE), backend, os.path.relpath(path, ROOT),
                      shape=MODEL_SHAPE)
    table = analytic_table(ModelShape(num_layers=layers, seq_length=seq_length, pp=pp),
                           h200_profile(rows), pp=pp, block_size=128, sparse_price=price,
                           transformer_impl="local")
    table["notes"] = (f"made by scripts/studies/device.priced_table({backend!r}, "
                      f"layers={layers}, pp={pp}, seq_length={seq_length}) from "
                      f"{os.path.relpath(path, ROOT)}; " + table["notes"])
    return table


# ---- the train step ------------------------------------------------------------------------------

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
# the steady step Megatron's PyTorch profiler records (``gpu_trace``; the rates count steps
# past ``TRAIN_WARMUP``, 3) in the runs of ``TRAIN_PROFILED``: where a steady step's time goes,
# dense and sparse, at 32K and 64K (issue 74; 64K has no measured cuDNN run)
PROFILE_STEP = 6
TRAIN_PROFILED = {(d, v) for d, v in TRAIN_RUNS if d in ("long_docs", "long_docs_64k")
                  and v in ("dense_sab_sdpa", "dense_sab", "sb_d0.5", "sb_d0.25")}
# seconds a profiled run adds, estimated: the profiler on the warm-up and the recorded step and
# the trace's export at the start of the next (its summary runs beside the next run)
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


def run_table(work, data_name, backend, given):
    """The latency table a run of ``data_name`` plans with: ``given`` (``--latency-table``), else
    this model's table at its micro-batch priced by run 5's kernel table of ``backend``
    (``auto``: fa4 where it can run here, else triton), written into ``work``."""
    if given:
        return given
    from sparsebalance_megatron.latency.table import write_table

    if backend == "auto":
        backend = length_free_backend()
    path = os.path.join(work, f"latency_{backend}_{seq_of(data_name)}.json")
    if not os.path.exists(path):
        write_table(priced_table(backend, layers=LAYERS, seq_length=seq_of(data_name)), path)
    return path


def te_available(env):
    code = "import transformer_engine.pytorch"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def profile_summary(prof_dir):
    """The summary of a profiled run's step ``PROFILE_STEP`` (``gpu_trace.summarize_step``), or
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
    bound (``gpu_trace``); the profiled runs' summaries and the cross-check of the bound.
    ``table``: ``--latency-table`` or None; ``memory_gib``: the device's (None: read here, and
    on a machine without CUDA no data set is held back)."""
    py = sys.executable
    impl = (["--transformer-impl", "transformer_engine"] if te_available(env) else
            ["--transformer-impl", "local", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-rope-fusion"])
    t0 = time.time()
    res = {"ok": True, "transformer_impl": impl[1], "backend": backend, "runs": {},
           "layers": LAYERS}
    data, info = data_sets(out_dir)
    res.update(info)
    if memory_gib is None:
        import torch
        if torch.cuda.is_available():
            memory_gib = torch.cuda.get_device_properties(0).total_memory / float(1 << 30)
    plans = {d: memory_plan(seq_of(d), memory_gib) if memory_gib else {"flags": [], "fits": True}
             for d in data}
    res["memory"] = {d: p for d, p in plans.items() if "why" in p}
    summaries, pool = {}, ThreadPoolExecutor(max_workers=1)   # beside the next run
    for data_name, variant in train_order(data):
        name = f"{data_name}/{variant}"
        left = limit - (time.time() - t0)
        skipped = (f"memory: {plans[data_name]['why']}" if not plans[data_name]["fits"]
                   else "out of time" if left < 30 else None)
        if skipped:
            res["runs"][name] = {"ok": False, "skipped": skipped}
            res["ok"] = res["ok"] and (data_name, variant) not in TARGET_RUNS
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
    if tile_costs:
        res["dense_tile_us"] = tile_costs
    priced = tile_costs if tile_costs and "failed" not in tile_costs else None
    for data_name in data:
        compare_with_dense(res["runs"], data_name)
        cudnn_measured(res["runs"], data_name)
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
    heads = "/".join(shape[shape.index(flag) + 1] for flag in (
        "--num-attention-heads", "--num-query-groups", "--kv-channels"))     # 'np/ng/hn'
    out = {}
    for n in seq_lens:
        case = Case("single", [n], heads)
        rows = dense_passes(case, reps)
        pairs = case.causal_tiles() / case.nh
        out[str(n)] = {k: 1000 * (rows[k]["fwd_ms"] + rows[k]["bwd_ms"]) / pairs
                       for k in ("cudnn", "varlen") if "fwd_ms" in rows.get(k, {})}
        out[str(n)]["block"] = BLOCK
        del case
        torch.cuda.empty_cache()
    return out


# ---- the kernel-side steps -----------------------------------------------------------------------

_run = run_logged           # the kernel-side steps' runner (a test replaces it)


GPU_PATH_MODULES = tuple(f"sparsebalance_megatron.attention.{m}" for m in (
    "dense", "flex", "sparse_triton", "block_lists", "maxkey_triton", "fa4_cute"))


def step_env(out_dir):
    """Versions, the device, what imports, and the torch signatures every GPU path calls
    (``attention/torch_compat.py``); not ok when a GPU path cannot import or a signature lacks
    a keyword. Runs on CPU too (``make device-stack``)."""
    import importlib

    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["sm_count"], info["capability"] = p.multi_processor_count, f"{p.major}.{p.minor}"
    for mod in ("triton", "megatron.core", "transformer_engine", "flash_attn",
                "flash_attn.cute"):
        try:
            m = __import__(mod, fromlist=["_"])
            info[mod] = getattr(m, "__version__", "importable")
        except Exception as e:   # noqa: BLE001 - any import failure means "not usable"
            info[mod] = f"not importable: {type(e).__name__}"
    broken = {}
    for mod in GPU_PATH_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:   # noqa: BLE001 - recorded, the step fails
            broken[mod] = f"{type(e).__name__}: {str(e)[:200]}"
    from sparsebalance_megatron.attention import torch_compat
    from sparsebalance_megatron.attention.api import auto_backend, backend_missing
    from sparsebalance_megatron.attention.flex import flash_kernel_missing
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    info.update(gpu_path_import_failures=broken,
                signature_problems=torch_compat.signature_problems(),
                varlen_gqa=torch_compat.varlen_gqa_mode()[0],
                auto_backend=auto_backend(dev)[0],
                backends={b: backend_missing(b, dev) or "can run"
                          for b in ("triton", "flex", "flash", "fa4")},
                flash_backend=flash_kernel_missing("cuda") or "available")
    info["ok"] = not broken and not info["signature_problems"]
    return info


def rows_of(jsonl):
    """The rows a bench run wrote as it went (a cut run's too); a torn last line is dropped."""
    rows = []
    if os.path.exists(jsonl):
        for line in open(jsonl):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def step_bench(py, out_dir, work, limit, env, backends, lengths=None):
    """The kernel table: rows to ``out_dir`` as measured, a deadline 10 s under ``limit``; the
    summary from the rows that finished, even when the run was cut.
    ``lengths``: the single documents' token counts (None: the table's default, 32K)."""
    if not backends:
        return {"ok": False, "rows": 0, "skipped": "no sparse backend can run here"}
    rows, res = run_rows(py, "attention_gpu", os.path.join(out_dir, "kernel_rows.jsonl"),
                         os.path.join(work, "kernel_table.json"),
                         os.path.join(work, "kernel.log"), limit, env,
                         ["--backends", *backends,
                          *(["--lengths", *map(str, lengths)] if lengths else [])])
    res["failed_rows"] = [f"{r.get('backend', 'dense')} {r.get('case', 'check')} "
                          f"d={r.get('density', 1)}: {r['failed'][:160]}"
                          for r in rows if "failed" in r][:8]
    res["failed_checks"] = [f"{r['backend']} {r['variant']} {r['shape']}" for r in rows
                            if r.get("kind") == "check" and not r["ok"]]
    from .kernels import summarize     # (imports torch: inside the step)
    res["summary"] = summarize(rows)
    return res


def run_rows(py, study, jsonl, path, log, limit, env, extra=()):
    """``scripts/bench.py study``: its rows to ``jsonl`` as measured, its JSON to ``path`` (both
    removed first: never stale rows), a deadline 10 s under ``limit``. Returns (the rows, even
    of a cut run; the step's ``ok``, ``rc``, ``seconds``, ``rows`` and a failed run's tail)."""
    for f in (jsonl, path):
        if os.path.exists(f):
            os.remove(f)
    rc, sec, tail = _run([py, "scripts/bench.py", study, "--jsonl", jsonl, "--json", path,
                          "--deadline-s", str(max(10, limit - 10)), *extra], log, limit, env)
    rows = rows_of(jsonl)
    res = {"ok": rc == 0 and bool(rows), "rc": rc, "seconds": sec, "rows": len(rows)}
    if rc != 0:
        res["tail"] = tail[-1500:]
    return rows, res


def step_recompile(backend="flex"):
    """Child process: training-shaped calls through ``backend``; graphs and host syncs."""
    import warnings

    import torch
    from torch._dynamo.utils import counters

    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.megatron.launch.profile_grid import default_mixes
    t, bs, nh, ng, hn = 16384, 128, 14, 2, 64
    mixes = default_mixes(t, 24, seed=0, block_size=bs)
    mixes = [m + [t - sum(m)] if sum(m) < t else m for m in mixes]   # every batch holds t tokens
    densities = [0.125 + 0.875 * ((i * 0.618) % 1.0) for i in range(len(mixes))]
    gen = torch.Generator().manual_seed(0)
    kw = dict(block_size=bs, backend=backend, sink_blocks=1, local_blocks=1)

    def call(q, k, v, g, cu, d, cache, grad=True):
        with torch.set_grad_enabled(grad):
            out, sel = block_sparse_attention(q, k, v, cu, d, cache=cache, **kw)
            if grad:
                out.backward(g)
        return sel

    rows, warmup = [], 2
    for i, (mix, d) in enumerate(zip(mixes[:warmup + 20], densities)):
        q, k, v = (torch.randn(t, h, hn, generator=gen).to("cuda", torch.bfloat16)
                   .requires_grad_(True) for h in (nh, ng, ng))
        g = torch.randn(t, nh, hn, generator=gen).to("cuda", torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(mix).cumsum(0).tolist()], device="cuda",
                          dtype=torch.int32)
        cache = {}
        sel = call(q, k, v, g, cu, d, cache)                             # setup layer
        if i < warmup:
            call(q, k, v, g, cu, d, cache, grad=False)
        graphs_before = counters["stats"]["unique_graphs"]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(2):
                    call(q, k, v, g, cu, d, cache)
                call(q, k, v, g, cu, d, cache, grad=False)            # recompute pass
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [c for c in caught if "synchroniz" in str(c.message)]
        rows.append(dict(docs=len(mix), density=d, kept=float(sel.density_kept.mean()),
                         padded_blocks=sel.layout.padded_blocks,
                         num_blocks=sel.layout.num_blocks,
                         new_graphs=counters["stats"]["unique_graphs"] - graphs_before,
                         host_syncs=len(syncs),
                         sync_sites=[f"{c.filename}:{c.lineno}: {str(c.message)[:160]}"
                                     for c in syncs[:3]]))
    after = rows[warmup:]
    return {"backend": backend, "calls_after_warmup": len(after), "warmup_calls": warmup,
            "graphs_total": counters["stats"]["unique_graphs"],
            "recompiles_after_warmup": sum(r["new_graphs"] for r in after),
            "host_syncs_per_layer_path": sum(r["host_syncs"] for r in after),
            "host_syncs_during_warmup": sum(r["host_syncs"] for r in rows[:warmup]),
            "rows": rows}


def step_pieces(py, out_dir, work, limit, env):
    """Where one sparse call's time goes (``scripts/bench.py fa4_pieces`` at its defaults): rows
    to ``out_dir`` as measured, the JSON to ``work``, a deadline 10 s under ``limit``."""
    rows, res = run_rows(py, "fa4_pieces", os.path.join(out_dir, "pieces_rows.jsonl"),
                         os.path.join(work, "fa4_pieces.json"), os.path.join(work, "pieces.log"),
                         limit, env)
    res["failed_rows"] = [f"{r['backend']} {r['what']} {r['shape']} d={r['density']}: "
                          f"{r['failed'][:160]}" for r in rows if "failed" in r][:8]
    return res
