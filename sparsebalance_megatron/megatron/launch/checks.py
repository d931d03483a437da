"""Launch checks and CPU defaults: what cannot work is refused before any process group starts.

``check_launch(args, sb, plugin_data=...)`` runs on Megatron's parsed and validated arguments in
``hooks.install`` (before ``pretrain()`` initialises torch.distributed) and raises a
``LaunchError`` whose one line names the flag, its value and what to do; the entry points turn it
into ``SystemExit("error: ...")``, so the user reads one line, not a chained traceback.
``flag_conflicts`` is the part the flags alone decide: the parser the hooks hand Megatron runs it
as soon as it has parsed them (``preflight.check_after_parse``), so those mistakes are named
before Megatron validates and prints its arguments or builds a tokenizer; ``check_launch`` runs
it again on the validated arguments (a flag Megatron derives, a hand-wired launch).

``cpu_parser_defaults(parser)``: on a machine without CUDA, Megatron's defaults that need a GPU
(NCCL, transformer-engine, fused kernels, apex's persistent layer norm and fused weight-gradient
accumulation, the distributed optimizer) are replaced as *defaults*, so a flag given on the command
line still wins, and is then refused here by name when it cannot run on the CPU.
Imports nothing from megatron at module level; no torch.distributed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from ...attention.fa4_cute import FA4_BLOCK, fa4_missing
from ...attention.flex import flash_kernel_missing
from ...config import CP_COMM_TYPES, SparseBalanceConfig, flag_name
from ...latency.layout import ATTENTION, HYBRID_SYMBOLS, MLP, LayoutError, PipelineLayout
from ..errors import LaunchError  # noqa: F401  (re-exported: callers import it from here)
from .data_checks import data_conflicts, packer_conflicts, quality_conflicts
from .lengths import LENGTH_FREE_BACKENDS, length_need
from .preflight import attention_dropout_conflicts, config_problems, dense_kernel_conflicts


# dest -> value on a CPU-only machine (Megatron's flag in the comment)
CPU_DEFAULTS = {
    "distributed_backend": "gloo",             # --distributed-backend
    "transformer_impl": "local",               # --transformer-impl
    "gradient_accumulation_fusion": False,     # --no-gradient-accumulation-fusion
    "no_persist_layer_norm": True,             # --no-persist-layer-norm
    "masked_softmax_fusion": False,            # --no-masked-softmax-fusion
    "bias_gelu_fusion": False,                 # --no-bias-gelu-fusion
    "bias_swiglu_fusion": False,               # --no-bias-swiglu-fusion
    "bias_dropout_fusion": False,              # --no-bias-dropout-fusion
    "apply_rope_fusion": False,                # --no-rope-fusion
}


def cpu_parser_defaults(parser) -> list[str]:
    """Set ``CPU_DEFAULTS`` on Megatron's parser when CUDA is absent; returns what was set."""
    if torch.cuda.is_available():
        return []
    known = {a.dest for a in parser._actions}
    values = {k: v for k, v in CPU_DEFAULTS.items() if k in known}
    parser.set_defaults(**values)
    return [f"{k}={v}" for k, v in values.items()]


def have_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _sparse_attention_conflicts(args, hybrid: Optional[bool] = False) -> list[str]:
    """Settings whose layer spec or core attention would silently replace ours (a HybridModel's
    ``--spec`` is a stack spec: the swap goes inside it, ``model/hybrid.py``; ``hybrid`` None:
    the model kind is not known yet, ``--spec`` waits for ``check_launch``)."""
    out = []
    if getattr(args, "spec", None) is not None and hybrid is False:
        spec = args.spec if isinstance(args.spec, str) else " ".join(args.spec)
        out.append(f"--spec {spec} (a custom layer spec)")
    if getattr(args, "num_experts", None):
        out.append(f"--num-experts {args.num_experts} (MoE block spec)")
    if getattr(args, "multi_latent_attention", False):
        out.append("--multi-latent-attention")
    if getattr(args, "experimental_attention_variant", None) is not None:
        out.append(f"--experimental-attention-variant {args.experimental_attention_variant}")
    if getattr(args, "heterogeneous_layers_config_path", None) is not None:
        out.append("--heterogeneous-layers-config-path")
    if str(getattr(args, "attention_backend", "")).endswith("local"):
        out.append("--attention-backend local (the builder swaps in DotProductAttention)")
    if getattr(args, "modelopt_enabled", False):
        out.append("ModelOpt (its own layer spec)")
    if getattr(args, "window_size", None) is not None:
        out.append(f"--window-size {args.window_size} (use --sb-local-blocks)")
    return out


def _hybrid_conflicts(args, sb: SparseBalanceConfig, hybrid: bool,
                      plugin_data: bool) -> list[str]:
    """HybridModel: the layer kinds served are attention (``*``) and MLP (``-``); a GPT run
    must not carry a hybrid pattern (the plan would budget layers the GPT does not have). The
    deprecated ``--hybrid-override-pattern`` counts as the pattern (Megatron's validation moves
    it there)."""
    pattern = getattr(args, "hybrid_layer_pattern", None) or \
        getattr(args, "hybrid_override_pattern", None)
    if not (sb.sparse_attention_enabled or plugin_data):
        return []   # the plugin is off: the run is stock Megatron, whatever its layers
    if not hybrid:
        return [] if pattern is None else [
            f"--hybrid-layer-pattern {pattern!r} with a GPT model (pretrain_gpt builds GPT "
            f"layers; use pretrain_hybrid.py or examples/pretrain_hybrid_sparsebalance.py)"]
    if pattern is None:
        return ["a HybridModel without --hybrid-layer-pattern (the plugin plans from the "
                "pattern; the deprecated ratios are not supported)"]
    main = str(pattern).split("/")[0]
    out = []
    bad = sorted(set(main) - {ATTENTION, MLP, "|"} & set(HYBRID_SYMBOLS))
    if bad:
        kinds = ", ".join(f"'{c}' ({HYBRID_SYMBOLS[c]})" for c in bad)
        out.append(f"--hybrid-layer-pattern {pattern!r}: layer kind(s) {kinds} not supported "
                   f"with SparseBalance (supported: '{ATTENTION}' attention, '{MLP}' MLP)")
    if sb.sparse_attention_enabled and ATTENTION not in main:
        out.append(f"--hybrid-layer-pattern {pattern!r} has no attention layer "
                   f"('{ATTENTION}') for the sparse attention")
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp > 1:
        out.append(f"--context-parallel-size {cp} with a HybridModel (verified with GPT "
                   f"only so far)")
    if plugin_data and sb.varies_microbatch_count:
        out.append(f"{flag_name('stand_down')} dp_balanced with a HybridModel (verified at fixed "
                   f"lengths only: use sequential or token_balanced)")
    return out


def _gpu_kernel(sb: SparseBalanceConfig) -> str:
    """The GPU kernel backend the sparse attention would run ('flex', 'flash', 'triton', 'fa4',
    or what ``auto`` resolves to on CUDA), or '' when it runs the torch or reference path."""
    if not sb.sparse_attention_enabled:
        return ""
    if sb.attention_backend in ("flex", "flash", "triton", "fa4"):
        return sb.attention_backend
    if sb.attention_backend == "auto" and torch.cuda.is_available():
        from ...attention.api import resolve_backend
        return resolve_backend("auto", "cuda")          # one rule: api.auto_backend
    return ""


def _flex(sb: SparseBalanceConfig) -> str:
    """``_gpu_kernel`` when it is a FlexAttention backend (compiled per shape), else ''."""
    kernel = _gpu_kernel(sb)
    return kernel if kernel in ("flex", "flash") else ""


def _context_parallel_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """Context parallelism: the sparse attention's all-to-all scheme on the plugin's packed data;
    what it does not serve, one line each."""
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    out = []
    seq = getattr(args, "seq_length", None)
    multiple = sb.pad_multiple(cp)
    if sb.seq_pad_multiple and not plugin_data:
        out.append(f"{flag_name('seq_pad_multiple')} {sb.seq_pad_multiple} on Megatron's data "
                   f"path (it pads the plugin's packed documents)")
    if sb.seq_pad_multiple and cp > 1 and sb.seq_pad_multiple % (2 * cp):
        out.append(f"{flag_name('seq_pad_multiple')} {sb.seq_pad_multiple} with "
                   f"--context-parallel-size {cp}: expected a multiple of 2 x {cp} (every "
                   f"sequence splits into 2 x CP chunks)")
    elif seq is not None and seq % multiple:
        out.append(f"--seq-length {seq}: expected a multiple of {multiple} (documents are padded "
                   f"to multiples of {multiple}" + (f", 2 x --context-parallel-size {cp})"
                                                    if cp > 1 else ")"))
    if sb.seq_pad_multiple > 1 and _gpu_kernel(sb) and cp == 1:
        out.append(f"{flag_name('seq_pad_multiple')} {sb.seq_pad_multiple} with the "
                   f"{_gpu_kernel(sb)} attention backend (padded documents are verified with the "
                   f"torch backend only so far: add {flag_name('attention_backend')} torch)")
    if cp == 1:
        return out
    where = f"--context-parallel-size {cp}"
    kinds = getattr(args, "cp_comm_type", None) or ["p2p"]
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = sorted({k for k in kinds if k not in CP_COMM_TYPES})
    if bad:
        out.append(f"--cp-comm-type {' '.join(bad)} with {where}: the sparse attention "
                   f"implements only {', '.join(CP_COMM_TYPES)} (all-to-all: sequence gathered, "
                   f"heads scattered); p2p, all_gather, a2a+p2p and hierarchical CP are not "
                   f"supported: pass --cp-comm-type a2a")
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        out.append(f"--hierarchical-context-parallel-sizes with {where} (a2a+p2p is not "
                   f"supported; use --cp-comm-type a2a)")
    if getattr(args, "hybrid_context_parallel", False):
        out.append(f"--hybrid-context-parallel (dynamic CP group sizes per micro-batch are not "
                   f"supported; use a fixed --context-parallel-size with --cp-comm-type a2a)")
    if not plugin_data:
        out.append(f"{where} on Megatron's data path (the plugin's packed data path splits "
                   f"micro-batches for CP: use examples/pretrain_gpt_sparsebalance.py, or "
                   f"--sb-batching / --sparse-balance)")
    if _gpu_kernel(sb):
        out.append(f"{where} with the {_gpu_kernel(sb)} attention backend (CP is verified with "
                   f"the torch backend only so far: add {flag_name('attention_backend')} torch)")
    if getattr(args, "transformer_impl", "local") != "local":
        out.append(f"{where} with --transformer-impl {args.transformer_impl} (CP is verified "
                   f"with --transformer-impl local only so far)")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    heads = getattr(args, "num_attention_heads", None)
    if heads:
        groups = getattr(args, "num_query_groups", None) \
            if getattr(args, "group_query_attention", False) else None
        nh, ng = heads // tp, max((groups or heads) // tp, 1)
        if nh % cp:
            out.append(f"{where}: {nh} attention heads per tensor-parallel rank do not split "
                       f"over {cp} CP ranks (the a2a scheme gives each num_heads / cp)")
        if ng % cp and cp % ng:
            out.append(f"{where}: {ng} query groups per tensor-parallel rank and {cp} CP ranks "
                       f"(expected one to divide the other: whole KV groups, or replicas)")
    return out


def _microbatch_length_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """``--sb-microbatch-multiple K``: what variable-length micro-batches need; at fixed length
    also ``--sb-stand-down dp_balanced``, whose micro-batches hold their documents only."""
    k = sb.length_multiple
    if not k and not (plugin_data and sb.varies_microbatch_count):
        return []
    flag = f"{flag_name('microbatch_multiple')} {k}" if k else \
        f"{flag_name('stand_down')} dp_balanced (micro-batches of their documents only)"
    if not plugin_data:
        return [f"{flag} on Megatron's data path (it sizes the plugin's packed micro-batches)"]
    out = []
    if sb.varies_microbatch_count and sb.replay_plans:
        out.append(f"{flag_name('stand_down')} dp_balanced with {flag_name('replay_plans')} (a "
                   f"replay packs the recorded micro-batch count of every step)")
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    need = length_need(args, sb)
    if k % need:
        out.append(f"{flag}: expected a multiple of {need} (documents are padded to multiples "
                   f"of {sb.pad_multiple(cp)}; each of {cp} CP ranks' share must split over "
                   f"{tp if getattr(args, 'sequence_parallel', False) else 1} sequence-"
                   f"parallel ranks)")
    kernel = _gpu_kernel(sb)
    if kernel and kernel not in LENGTH_FREE_BACKENDS:   # the one list 'auto' packs by too
        out.append(f"{flag} with the {kernel} attention backend (each micro-batch length "
                   f"would compile its own kernel: add {flag_name('attention_backend')} "
                   f"{' or '.join(LENGTH_FREE_BACKENDS)} on a GPU, whose kernels take any "
                   f"length, or torch)")
    if str(getattr(args, "cuda_graph_impl", "none") or "none") != "none" \
            or getattr(args, "enable_cuda_graph", False) \
            or getattr(args, "external_cuda_graph", False):
        out.append(f"{flag} with CUDA graphs (they capture fixed shapes)")
    return out


def _layout_problems(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """The pipeline layout the plan reads (from Megatron's validated sizes: a HybridModel's layer
    count comes from its pattern)."""
    # a HybridModel's pattern matters only when the plugin plans (stock runs keep Mamba, MTP...)
    plans = sb.sparse_attention_enabled or plugin_data
    try:
        if getattr(args, "num_layers", None) is not None and \
                (plans or getattr(args, "hybrid_layer_pattern", None) is None):
            PipelineLayout.from_megatron_args(args)
    except LayoutError as e:
        return [f"the pipeline layout: {e}"]
    return []


def _triton_conflicts(args, sb: SparseBalanceConfig, cuda: bool) -> list[str]:
    """``--sb-attention-backend triton``: what its kernels cannot run (``sparse_triton.why_not``
    at launch: the device, the head dim, the block size)."""
    flag = f"{flag_name('attention_backend')} triton"
    out = []
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        out.append(f"{flag}: the Triton kernels need CUDA (use torch or auto on this machine)")
    hn = getattr(args, "kv_channels", None)
    if hn is not None and not (16 <= hn <= 256 and hn & (hn - 1) == 0):
        out.append(f"{flag} with head dim {hn} (--kv-channels): expected a power of two in "
                   f"16..256 (use flex or torch)")
    if sb.block_size < 16:
        out.append(f"{flag} with {flag_name('block_size')} {sb.block_size}: expected >= 16 "
                   f"(the kernels' smallest tile)")
    return out


def _device_conflicts(args, sb: SparseBalanceConfig, validated: bool = True) -> list[str]:
    """``validated`` False (the flags as parsed): leave out what Megatron's validation may still
    change (the distributed optimizer, sequence parallelism at TP 1, the RoPE fusion without
    RoPE); ``check_launch`` judges those."""
    out = []
    cuda = torch.cuda.is_available()
    impl = getattr(args, "transformer_impl", "local")
    if impl == "transformer_engine" and not have_module("transformer_engine"):
        out.append("--transformer-impl transformer_engine: transformer-engine is not installed "
                   "(pip install 'transformer-engine[pytorch]', or --transformer-impl local)")
    if sb.sparse_attention_enabled and sb.attention_backend == "flex" and not cuda:
        out.append(f"{flag_name('attention_backend')} flex: FlexAttention needs CUDA "
                   f"(use torch or auto on this machine)")
    if sb.sparse_attention_enabled and sb.attention_backend == "triton":
        out += _triton_conflicts(args, sb, cuda)
    if sb.sparse_attention_enabled and sb.attention_backend == "flash":
        why = flash_kernel_missing(torch.device("cuda") if cuda else torch.device("cpu"))
        if why is not None:
            out.append(f"{flag_name('attention_backend')} flash: {why} (use flex, torch or "
                       f"auto on this machine)")
    if sb.sparse_attention_enabled and sb.attention_backend == "fa4":
        why = fa4_missing(torch.device("cuda") if cuda else torch.device("cpu"))
        if why is not None:
            out.append(f"{flag_name('attention_backend')} fa4: {why} (use flex, torch or "
                       f"auto on this machine)")
        if sb.block_size != FA4_BLOCK:
            out.append(f"{flag_name('attention_backend')} fa4 with {flag_name('block_size')} "
                       f"{sb.block_size}: expected {FA4_BLOCK} (FA4's Hopper tiles)")
    if not cuda:
        if validated and getattr(args, "use_distributed_optimizer", False):
            out.append("--use-distributed-optimizer on CPU (Megatron's distributed optimizer "
                       "asserts CUDA tensors; leave it to GPU runs)")
        if getattr(args, "distributed_backend", "gloo") == "nccl":
            out.append("--distributed-backend nccl on CPU (use gloo)")
        if getattr(args, "fp8", None):
            out.append(f"--fp8-format {args.fp8} on CPU")
    elif impl == "local":
        have_apex = have_module("apex")
        if getattr(args, "gradient_accumulation_fusion", False) and not have_apex:
            out.append("--transformer-impl local with gradient accumulation fusion: it needs "
                       "NVIDIA apex; add --no-gradient-accumulation-fusion")
        if not getattr(args, "no_persist_layer_norm", True) and not have_apex:
            out.append("--transformer-impl local with the persistent layer norm: it needs NVIDIA "
                       "apex; add --no-persist-layer-norm")
        if validated and getattr(args, "sequence_parallel", False):
            out.append("--sequence-parallel with --transformer-impl local (the local torch norm "
                       "does not support it; use transformer-engine)")
        if validated and getattr(args, "apply_rope_fusion", False) and \
                not have_module("transformer_engine"):
            out.append("the fused RoPE kernel (Megatron's default) needs transformer-engine; "
                       "add --no-rope-fusion")
    return out


def flag_conflicts(args, sb: SparseBalanceConfig, *, plugin_data: bool,
                   hybrid: Optional[bool], validated: bool = False) -> list[str]:
    """Every setting of this launch that cannot work and that Megatron's flags show, one entry
    each (``hybrid``: the model is a HybridModel; None: not known, its checks wait for
    ``check_launch``). ``validated`` False: the flags as parsed, before Megatron's validation;
    only what it does not change is judged then (it may still derive a setting the checks miss,
    never undo one they refuse: ``check_launch`` judges the rest)."""
    bad = _device_conflicts(args, sb, validated)
    if hybrid is not None:
        bad += _hybrid_conflicts(args, sb, hybrid, plugin_data)
    bad += _context_parallel_conflicts(args, sb, plugin_data)
    bad += _microbatch_length_conflicts(args, sb, plugin_data)
    bad += packer_conflicts(args, sb, plugin_data) + quality_conflicts(args, sb, plugin_data)
    if plugin_data:
        if getattr(args, "iterations_to_skip", None):
            bad.append(f"--iterations-to-skip {args.iterations_to_skip} with the plugin's data "
                       f"iterator")
        bad += data_conflicts(args)
    if sb.sparse_attention_enabled:
        seq = getattr(args, "seq_length", None)
        if seq is not None and seq < sb.block_size:
            bad.append(f"--seq-length {seq} is smaller than {flag_name('block_size')} "
                       f"{sb.block_size}: a micro-batch must hold at least one attention block")
        bad += [f"{c} with sparse attention (--sparse-balance / --sb-sparse-attention / --sb-dst)"
                for c in _sparse_attention_conflicts(args, hybrid)]
        if not plugin_data and getattr(args, "reset_attention_mask", False):
            bad.append("--reset-attention-mask with sparse attention on Megatron's data path: the "
                       "sparse attention takes document boundaries from packed cu_seqlens; use "
                       "--dataloader-inter-document-masking (or the plugin's data path, "
                       "--sb-batching / --sparse-balance, which packs documents apart)")
    if sb.dst_enabled and sb.selection_mode == "mass":
        bad.append(f"{flag_name('selection_mode')} mass with DST (--sparse-balance / --sb-dst): "
                   f"mass mode picks its own density per query block and would ignore the plan; "
                   f"use {flag_name('selection_mode')} density")
    return bad + _straggler_problems(args, sb)


def _straggler_problems(args, sb: SparseBalanceConfig) -> list[str]:
    bad = []
    if sb.straggler_stage >= 0 and sb.straggler_rank < 0:
        bad.append(f"{flag_name('straggler_stage')} {sb.straggler_stage}: needs "
                   f"{flag_name('straggler_rank')} (the data-parallel rank whose stage is slow)")
    if sb.straggler_rank >= 0:
        world = int(os.environ.get("WORLD_SIZE", getattr(args, "world_size", 1) or 1))
        per_dp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
            getattr(args, "context_parallel_size", 1)
        dp = max(world // max(per_dp, 1), 1)
        if sb.straggler_rank >= dp:
            bad.append(f"{flag_name('straggler_rank')} {sb.straggler_rank}: this launch has "
                       f"{dp} data-parallel rank(s) (0..{dp - 1})")
        pp = args.pipeline_model_parallel_size
        if sb.straggler_stage >= pp:
            bad.append(f"{flag_name('straggler_stage')} {sb.straggler_stage}: this launch has "
                       f"{pp} pipeline rank(s) (0..{pp - 1})")
    return bad


def check_launch(args, sb: SparseBalanceConfig, *, plugin_data: bool,
                 hybrid: bool = False) -> None:
    """``LaunchError`` listing every setting of this launch that cannot work (``hybrid``: the
    model is a HybridModel, ``pretrain_hybrid.py``)."""
    bad = flag_conflicts(args, sb, plugin_data=plugin_data, hybrid=hybrid, validated=True)
    bad += _layout_problems(args, sb, plugin_data)
    bad += config_problems(sb)   # the files the flags name (checked at parse too)
    bad += attention_dropout_conflicts(args, sb, plugin_data)
    bad += dense_kernel_conflicts(args, sb, plugin_data)
    if bad:
        raise LaunchError("cannot launch: " + "; ".join(bad))
