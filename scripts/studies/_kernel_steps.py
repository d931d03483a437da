"""gpu_check's kernel-side steps (``scripts/gpu_check.py``): ``env`` (versions, imports, the torch
signatures every GPU path calls), ``bench`` / ``smoke`` (the kernel table,
``scripts/bench.py attention_gpu``, its rows as measured), ``pieces`` (one call's kernels from a
profiler trace, host and GPU apart: ``fa4_pieces``), ``autotune`` and the ``recompile`` child
(graphs and host syncs of training-shaped calls).

Each returns the step's record for ``gpu_check.json``; torch and the package are imported inside.
"""

from __future__ import annotations

import json
import os

from ._train_step import run_logged as _run
from .common import ROOT

GPU_PATH_MODULES = ("sparsebalance_megatron.attention.dense", "sparsebalance_megatron.attention.flex",
                    "sparsebalance_megatron.attention.sparse_triton",
                    "sparsebalance_megatron.attention.block_lists",
                    "sparsebalance_megatron.attention.maxkey_triton",
                    "sparsebalance_megatron.attention.fa4_cute")
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


def step_bench(py, out_dir, work, limit, env, backends, smoke=False, lengths=None):
    """The kernel table (or the smoke rows): rows to ``out_dir`` as measured, a deadline 10 s
    under ``limit``; the summary from the rows that finished, even when the run was cut.
    ``lengths``: the single documents' token counts (None: the table's default, 32K)."""
    name = "smoke" if smoke else "kernel"
    if not backends:
        return {"ok": False, "rows": 0, "skipped": "no sparse backend can run here"}
    jsonl = os.path.join(out_dir, f"{name}_rows.jsonl")
    path = os.path.join(work, f"{name}_table.json")
    for f in (jsonl, path):
        if os.path.exists(f):
            os.remove(f)     # never stale rows
    cmd = [py, "scripts/bench.py", "attention_gpu", "--jsonl", jsonl, "--json", path,
           "--deadline-s", str(max(10, limit - 10)), "--backends", *backends,
           *(["--lengths", *map(str, lengths)] if lengths and not smoke else [])]
    smoke_args = ["--cases", "single", "--shapes", "8/2/128", "--densities", "0.25",
                  "--no-check", "--reps", "3"]
    rc, sec, tail = _run(cmd + (smoke_args if smoke else []),
                         os.path.join(work, f"{name}.log"), limit, env)
    rows = rows_of(jsonl)
    res = {"ok": rc == 0 and bool(rows), "rc": rc, "seconds": sec, "rows": len(rows),
           "failed_rows": [f"{r.get('backend', 'dense')} {r.get('case', 'check')} "
                           f"d={r.get('density', 1)}: {r['failed'][:160]}"
                           for r in rows if "failed" in r][:8]}
    res["failed_checks"] = [f"{r['backend']} {r['variant']} {r['shape']}" for r in rows
                            if r.get("kind") == "check" and not r["ok"]]
    if smoke:
        res["ms"] = {r["backend"]: r.get("ours_ms") for r in rows if r.get("kind") == "call"}
        res["dense_ms"] = next((r["dense_ms"] for r in rows if r.get("kind") == "dense"), None)
    else:
        from .kernels import summarize     # (imports torch: inside the step)

        res["summary"] = summarize(rows)
        res["rows_dense_files"] = sorted({r["dense_varlen_ms"] for r in rows
                                          if r.get("kind") == "dense"
                                          and r["case"].startswith("file#")
                                          and r["shape"] == "14/2/64"   # the train step's shape
                                          and r["dense_varlen_ms"]})
    if rc != 0:
        res["tail"] = tail[-1500:]
    return res


def step_autotune(py, work, limit, env):
    """The Triton kernel's autotune (scripts/autotune_triton.py, written for issue 35), into
    ``work/autotune``; reported missing when this checkout has no such script."""
    script = os.path.join(ROOT, "scripts", "autotune_triton.py")
    if not os.path.exists(script):
        return {"ok": False, "missing": "scripts/autotune_triton.py is not in this checkout"}
    rc, sec, tail = _run([py, script, "--out", os.path.join(work, "autotune"),
                          "--deadline-s", str(max(10, limit - 20))],
                         os.path.join(work, "autotune.log"), limit, env)
    res = {"ok": rc == 0, "rc": rc, "seconds": sec}
    if rc != 0:
        res["tail"] = tail[-1500:]
    return res


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
    """Where one sparse call's time goes (``scripts/bench.py fa4_pieces``, its defaults): fa4's
    kernel in both GQA backward forms and its whole call, then triton's call, at 8/2 x 128 and
    14/2 x 64, densities 0.25 and 1, one 32K document; each pass's host and GPU time apart and
    its kernels from a profiler trace. Rows to ``out_dir`` as measured, the JSON to ``work``,
    a deadline 10 s under ``limit``."""
    jsonl = os.path.join(out_dir, "pieces_rows.jsonl")
    path = os.path.join(work, "fa4_pieces.json")
    for f in (jsonl, path):
        if os.path.exists(f):
            os.remove(f)     # never stale rows
    rc, sec, tail = _run([py, "scripts/bench.py", "fa4_pieces", "--jsonl", jsonl, "--json", path,
                          "--deadline-s", str(max(10, limit - 10))],
                         os.path.join(work, "pieces.log"), limit, env)
    rows = rows_of(jsonl)
    res = {"ok": rc == 0 and bool(rows), "rc": rc, "seconds": sec, "rows": len(rows),
           "failed_rows": [f"{r['backend']} {r['what']} {r['shape']} d={r['density']}: "
                           f"{r['failed'][:160]}" for r in rows if "failed" in r][:8]}
    if rc != 0:
        res["tail"] = tail[-1500:]
    return res
