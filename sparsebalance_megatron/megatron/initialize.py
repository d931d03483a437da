"""Argument parsing and process start-up for the SparseBalance training entry.

Megatron's own parser (``megatron.training.arguments.parse_args``) plus our flags, our checks
before any model is built, then torch.distributed + megatron-core model parallelism. On a machine
without CUDA the CPU-only settings are applied (gloo, local transformer impl, no fusions) and the
CPU shims are activated.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from datetime import timedelta

import torch

from ..arguments import add_sparsebalance_args, config_from_args
from ..config import ConfigError, SparseBalanceConfig
from . import comm, cpu_compat

log = logging.getLogger("sparsebalance")


class LaunchError(ValueError):
    """A launch setting that cannot work; raised before any model is built."""


def _cpu_settings(args) -> list[str]:
    """Settings megatron-core needs on a machine without CUDA (see MEGATRON_CPU notes)."""
    changed = []
    for name, value in (("distributed_backend", "gloo"), ("transformer_impl", "local"),
                        ("gradient_accumulation_fusion", False), ("no_persist_layer_norm", True),
                        ("apply_rope_fusion", False), ("masked_softmax_fusion", False),
                        ("bias_swiglu_fusion", False), ("bias_gelu_fusion", False),
                        ("bias_dropout_fusion", False), ("use_distributed_optimizer", False)):
        if hasattr(args, name) and getattr(args, name) != value:
            setattr(args, name, value)
            changed.append(f"{name}={value}")
    return changed


def check_launch(args, sb: SparseBalanceConfig) -> None:
    """Clear errors for launch settings that cannot work, before anything is built."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise LaunchError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}: launch a multiple of {tp * pp} "
            f"processes (torchrun --nproc_per_node) or change the parallel sizes")
    if args.seq_length is None or args.seq_length < 1:
        raise LaunchError(f"--seq-length={args.seq_length}: expected a positive integer")
    if sb.sparse_attention_enabled and args.seq_length < sb.block_size:
        raise LaunchError(
            f"--seq-length={args.seq_length} is smaller than --sb-block-size={sb.block_size}: "
            f"a micro-batch must hold at least one attention block")
    if args.micro_batch_size != 1:
        raise LaunchError(
            f"--micro-batch-size={args.micro_batch_size}: packed (THD) micro-batches hold whole "
            f"documents in one row of --seq-length tokens; use --micro-batch-size 1 and raise "
            f"--seq-length or --global-batch-size instead")
    if args.num_layers % pp != 0:
        raise LaunchError(f"--num-layers={args.num_layers} is not divisible by "
                          f"--pipeline-model-parallel-size={pp}")


def _extra_args(parser):
    """Our flags; also escapes stray '%' in Megatron's help texts (megatron-core 0.19.2 has one
    in --moe-paged-stash-buffer-size-factor-cuda that makes ``--help`` crash)."""
    for action in parser._actions:
        if action.help:
            action.help = re.sub(r"%%|%\(\w+\)[a-z]|%",
                                 lambda m: m.group(0) if len(m.group(0)) > 1 else "%%",
                                 action.help)
    return add_sparsebalance_args(parser)


def parse_and_validate(argv=None, defaults: dict | None = None):
    """Parse Megatron's and our flags; returns (megatron args, SparseBalanceConfig)."""
    from megatron.training.arguments import parse_args, validate_args

    cpu_compat.activate_cpu_shims()  # no-op with CUDA; validate_args already queries the device
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    args = parse_args(extra_args_provider=_extra_args)
    try:
        sb = config_from_args(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    try:
        check_launch(args, sb)
    except LaunchError as e:
        raise SystemExit(f"error: {e}")
    if not torch.cuda.is_available():
        changed = _cpu_settings(args)
        if changed and args.rank == 0:
            print(f"[sparsebalance] no CUDA: running on CPU with {', '.join(changed)}", flush=True)
    # Packed micro-batches carry a different number of real tokens each: normalise per token.
    args.calculate_per_token_loss = True
    for k, v in (defaults or {}).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    # validate_args prints every argument on rank 0; keep that out of the training log.
    with contextlib.redirect_stdout(io.StringIO()) as dump:
        validate_args(args, defaults or {})
    args._sb_args_dump = dump.getvalue()
    return args, sb


def initialize_distributed(args) -> None:
    """torch.distributed + megatron-core model parallel groups + RNG, on CUDA or CPU (gloo)."""
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.activate_cpu_shims()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    comm.init_process_group(args.distributed_backend, args.world_size, args.rank,
                            timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size)
    # Megatron's seeding: one seed per pipeline stage, tensor-parallel offsets in the tracker.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[sparsebalance %(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        force=True)
