"""The run's latency model: ``--sb-latency-table``, else a table profiled now on this device.

Rank 0 profiles (the profiler CLI in a subprocess, a quick grid for this run's model shape,
progress on the console) into the cache when no table is given and none is cached; the other
ranks wait for it under ``--sb-profile-timeout-minutes``, not the job's distributed timeout, and
load the same table (``startup_profile.shared_table``). The profile is saved as it is measured
and resumed by a retry. Any problem with the table (malformed, measured
on another device/model/version) stops the run before step 1 with the loader's message.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from ...config import SparseBalanceConfig
from ..runtime import comm
from ..runtime.refusal import refusal

def table_expectation(args, sb: SparseBalanceConfig) -> dict:
    """What a latency table must have been measured on to be used by this run: device,
    versions, model shape, execution (``args.tensor_model_parallel_size``,
    ``args.transformer_impl``, ``args.recompute_granularity``) and attention. The pipeline is not
    compared: any table with the run's stage kinds (and a middle stage, for a layout other than
    its own) predicts the run's layout (``LatencyModel.with_layout``)."""
    from ...latency.shape import ModelShape

    shape = ModelShape.from_megatron_args(args)
    return dict(_run_expectation(sb), model=shape.as_table_model(),
                execution=shape.as_table_execution())


def flag_expectation(args, sb: SparseBalanceConfig) -> dict:
    """``table_expectation`` from Megatron's flags as parsed, before its ``validate_args`` and
    tokenizer: the model fields that flags give as they are (layers, hidden size, heads, tokens
    per micro-batch, SwiGLU). Derived sizes (padded vocabulary, FFN and KV defaults, query
    groups) and the execution section are compared by ``check_given_table`` at install."""
    model = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
             "num_attention_heads": args.num_attention_heads,
             "seq_length": None if args.seq_length is None
             else args.seq_length * (args.micro_batch_size or 1),
             "swiglu": bool(getattr(args, "swiglu", False))}
    return dict(_run_expectation(sb), model={k: v for k, v in model.items() if v is not None})


def _run_expectation(sb: SparseBalanceConfig) -> dict:
    import megatron.core
    import torch

    from ... import __version__
    from .profile import device_name

    return {
        "device": device_name(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "sparsebalance_megatron": __version__,
        "attention": {"block_size": sb.block_size, "sink_blocks": sb.sink_blocks,
                      "local_blocks": sb.local_blocks},
    }


def uses_latency_table(sb: SparseBalanceConfig) -> bool:
    """DST and SAB plan with a latency model (the callback loads it)."""
    return sb.dst_enabled or sb.batching_enabled


def check_given_table(args, sb: SparseBalanceConfig) -> None:
    """``LaunchError`` naming --sb-latency-table when the given table cannot serve this run
    (unreadable, measured on another device, model, execution or version without
    --sb-latency-table-force, or missing the stages of the run's pipeline layout). For
    ``hooks.install``: Megatron's args validated, no process group yet."""
    import warnings

    from ...latency.layout import LayoutError
    from ...latency.model import LatencyModel
    from ...latency.table import LatencyTableError
    from ..errors import LaunchError

    if not (sb.latency_table and uses_latency_table(sb)):
        return
    try:
        with warnings.catch_warnings():    # said once, when the callback loads it
            warnings.simplefilter("ignore")
            model = LatencyModel.load(sb.latency_table, expect=table_expectation(args, sb),
                                      force=sb.latency_table_force)
        model_for_run(model, args)
    except (LatencyTableError, OSError) as e:
        raise LaunchError(f"--sb-latency-table: {e}") from None
    except LayoutError as e:
        raise LaunchError(f"--sb-latency-table {sb.latency_table}: {e}") from None


def profile_command(args, sb: SparseBalanceConfig, out: str) -> list[str]:
    from ...latency.shape import ModelShape

    cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--out", out, *ModelShape.from_megatron_args(args).cli_flags(),
           "--sb-block-size", sb.block_size, "--sb-sink-blocks", sb.sink_blocks,
           "--sb-local-blocks", sb.local_blocks, "--sb-attention-backend", sb.attention_backend]
    if sb.length_multiple:   # a grid of several token totals, as the run's micro-batches
        cmd += ["--sb-microbatch-multiple", sb.length_multiple]
    return [str(c) for c in cmd]


def cached_table_path(args, sb: SparseBalanceConfig, expect: dict) -> str:
    from ...data.sources import default_cache_dir

    key = "_".join(f"{k}{int(v) if isinstance(v, bool) else v}"
                   for k, v in sorted(expect["model"].items()))
    key += (f"_pp{args.pipeline_model_parallel_size}_b{sb.block_size}s{sb.sink_blocks}"
            f"l{sb.local_blocks}_v{expect['sparsebalance_megatron']}"  # upgrade: re-profile
            f"_mc{expect['megatron_core']}_t{expect['torch']}"
            "_mid"    # measured with a middle stage (any layout); older caches lack one
            "_dx"     # with the dense/sparse crossover (on CUDA); older caches lack one
            + (f"_mm{sb.length_multiple}" if sb.length_multiple else ""))
    key += "_" + "_".join(f"{v}" for _, v in sorted(expect.get("execution", {}).items()))
    key = "".join(c if c.isalnum() or c in "._-" else "-" for c in key)
    return os.path.join(sb.data_cache_dir or default_cache_dir(), "latency", key + ".json")


def _profile(args, sb: SparseBalanceConfig, path: str) -> None:
    """Rank 0: run the profiler CLI (``startup_profile.run_profiler``); its progress goes to
    this console."""
    from .startup_profile import run_profiler

    os.makedirs(os.path.dirname(path), exist_ok=True)
    wait = (f"; the other ranks wait for it up to {sb.profile_timeout_minutes:g} min "
            f"(--sb-profile-timeout-minutes)" if comm.world_size() > 1 else "")
    comm.say(f"no --sb-latency-table: profiling this model on this device (quick grid) -> "
             f"{path}{wait}")
    t0 = time.perf_counter()
    # The profiler must import the megatron this run imports (a Megatron-LM checkout's, say).
    import megatron.core
    env = dict(os.environ)   # megatron is a namespace package: locate it through megatron.core
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        megatron.core.__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run_profiler(profile_command(args, sb, path), path, env=env)
    comm.say(f"latency table profiled in {time.perf_counter() - t0:.1f} s")


def load_latency_model(args, sb: SparseBalanceConfig):
    """The run's ``LatencyModel`` (collective: every rank calls it)."""
    from ...latency.model import LatencyModel
    from ...latency.table import LatencyTableError

    expect = table_expectation(args, sb)
    path = sb.latency_table
    if path is None:
        path = cached_table_path(args, sb, expect)
        from .startup_profile import shared_table
        shared_table(path, lambda: _profile(args, sb, path),
                     timeout_minutes=sb.profile_timeout_minutes)
    try:
        model = LatencyModel.load(path, expect=expect, force=sb.latency_table_force,
                                  calibration_ema=sb.calibration_ema)
    except (LatencyTableError, OSError) as e:
        raise refusal(f"error: --sb-latency-table: {e}") from None
    if sb.length_multiple and model._folded_tokens():
        from ...config import flag_name
        comm.say(f"warning: --sb-latency-table {path} was profiled at one token total "
                 f"({model._folded_tokens()}): it cannot tell token work from per-micro-batch "
                 f"costs, so its times of shorter (variable-length) micro-batches are guesses; "
                 f"profile with {flag_name('microbatch_multiple')} "
                 f"{sb.length_multiple} (several token totals)")
    if sb.sparse_attention_enabled:
        model = model.with_routing(sb.routing_threshold(model.dense_below_tokens))
        note = routing_note(model, sb, *run_kernels(args, sb, model.table))
        if note:
            comm.say(note)
    else:   # SAB with dense attention: every document through the dense kernel, priced so
        model = model.all_dense()
    from ...latency.layout import LayoutError
    try:
        return model_for_run(model, args)
    except LayoutError as e:
        raise refusal(f"error: --sb-latency-table {path}: {e}") from None


def table_backend(table: dict, sb: SparseBalanceConfig):
    """The kernel ``--sb-attention-backend auto`` runs with this latency table: on CUDA the one
    its profile measured fastest here (``crossover.fastest_backend``, recorded as the table's
    attention backend), if it can run; None (``resolve_backend``'s default) otherwise, and for
    any explicit backend."""
    import torch

    from ...attention.api import backend_missing

    chosen = (table.get("attention") or {}).get("backend")
    if sb.attention_backend != "auto" or not torch.cuda.is_available() \
            or chosen in (None, "auto", "torch", "reference"):
        return None
    if backend_missing(chosen, "cuda") is not None:
        return None
    from ...attention.api import set_auto_backend
    set_auto_backend(chosen, "the latency table's profile")     # every later 'auto' runs it
    return chosen


def run_kernels(args, sb: SparseBalanceConfig, table: Optional[dict] = None) -> tuple[str, str]:
    """(sparse, dense) kernel this run's attention resolves to (its device and dtype; with
    ``table``, ``auto`` as ``table_backend`` picks it)."""
    import torch

    from ...attention import resolve_backend
    from ...attention.dense import resolve_dense_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else \
        torch.float16 if getattr(args, "fp16", False) else torch.float32
    backend = (table_backend(table, sb) if table else None) or sb.attention_backend
    return resolve_backend(backend, dev), resolve_dense_kernel(sb.dense_kernel, dev, dtype)


def routing_note(model, sb: SparseBalanceConfig, sparse_kernel: str, dense_kernel: str) -> str:
    """The console line on routing: the threshold the run uses and where it comes from, with a
    warning when the table's crossover was measured for other kernels (the run's resolve to
    ``sparse_kernel`` and ``dense_kernel``) or another base density."""
    n, rec = model.dense_below_tokens, model.table.get("dense_crossover") or {}
    if not n:
        return ""
    if sb.dense_below_tokens_value is not None:
        return f"routing: documents under {n} tokens run dense (--sb-dense-below-tokens)"
    line = (f"routing: documents under {n} tokens run dense (the latency table's crossover, "
            f"measured with {rec.get('sparse_kernel', '?')} vs {rec.get('dense_kernel', '?')} "
            f"at density {rec.get('density', '?')})")
    want = {"sparse_kernel": sparse_kernel, "dense_kernel": dense_kernel, "density": sb.density}
    off = [f"{k} {rec[k]!r} (this run: {v!r})" for k, v in want.items()
           if k in rec and rec[k] != v and rec.get("source") != "analytic"]
    if off:
        line += ("; warning: measured for another " + ", ".join(off) + ": profile again, or "
                 "set --sb-dense-below-tokens")
    return line


def model_for_run(model, args):
    """The table's model adapted to the run: its pipeline layout (``with_layout``) and, with
    ``--context-parallel-size`` > 1, one CP rank's time under the a2a scheme
    (``with_context_parallel``, per TP rank's heads). The table itself stays a CP=1 one (the
    profiler measures one process); the CP terms are derived from it, with the interconnect's
    assumed bandwidth, and online calibration absorbs what they miss. Every rank builds the
    same model from the same table and args, and plans are made on rank 0 and broadcast."""
    from ...latency.layout import PipelineLayout

    model = model.with_layout(PipelineLayout.from_megatron_args(args))
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp == 1:
        return model
    return model.with_context_parallel(
        cp, tensor_model_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1))
