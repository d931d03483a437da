"""``--sb-microbatch-multiple auto``: whether a launch packs variable-length micro-batches.

Fixed-length micro-batches (every one ``--seq-length`` positions, padding filling what its
documents leave) are what Megatron's own data path runs and what the sparse kernels compile
for. With dense attention the fill is pure linear-layer time: Megatron's ``dp_balanced`` packer
sends micro-batches of their documents only, so SAB at fixed length loses to it where documents
are short (BENCHMARKS.md, "Against dense attention and Megatron's own packer"). 'auto' therefore
resolves, once per launch, to variable lengths where SAB packs for dense attention and nothing
needs fixed shapes, and to 0 (fixed) otherwise; the launch line says which and why. A number
given is kept as given (the launch checks judge it).

Variable where all hold: the plugin's data path, SAB packing, dense attention (Megatron's own
attention takes any THD length, as its packing scheduler feeds it) or a sparse backend that
takes any length (``LENGTH_FREE_BACKENDS``: fa4 and triton; flex compiles per length; 'auto'
on CUDA where one of them serves the model, ``auto_takes_any_length``: it then runs one, and
the start-up profile times only length-free kernels), no HybridModel (its Mamba
layers' packed path is not verified here), no CUDA graphs (they capture fixed shapes), and a latency
table that prices shorter micro-batches (the start-up profile is taken at several token totals;
a given table profiled at one total cannot tell token work from per-micro-batch costs). The
multiple is ``VARIABLE_MULTIPLE`` raised to what the document padding (2 x CP) and sequence
parallelism (TP x CP) need. A run replaying recorded plans (``--sb-replay-plans``) takes the
multiple they were packed at: a replay must pack what was recorded, and any other multiple is
refused by the replay's own launch check.

Reads parsed arguments only: imports nothing from megatron, no torch.distributed.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from ...config import SparseBalanceConfig, flag_name
from ...latency.sparse_call import LENGTH_FREE_BACKENDS

VARIABLE_MULTIPLE = 128
"""What 'auto' rounds a variable-length micro-batch up to (before the padding and sequence-
parallel constraints): one 128-token attention tile, a multiple of what FP8 GEMMs need (16);
the simulator's packer comparison runs at it."""


def _one_token_total(path: str) -> Optional[bool]:
    """Whether the latency table at ``path`` was profiled at one token total (None: unreadable;
    the table's own launch check names that)."""
    try:
        with open(path) as f:
            totals = (json.load(f).get("profile") or {}).get("token_totals") or []
    except (OSError, ValueError, AttributeError):
        return None
    return len(totals) == 1


def _recorded_multiple(path: str) -> Optional[int]:
    """The length multiple of the first step recorded in ``path`` (None: unreadable; the
    replay's own launch check names that)."""
    from .replay import RecordedPlans, ReplayError

    try:
        recorded = RecordedPlans.read(path)
    except ReplayError:
        return None
    return int(recorded.steps[min(recorded.steps)]["shape"].length_multiple)


def resolve_length_multiple(args, sb: SparseBalanceConfig, *, plugin_data: bool,
                            hybrid: bool = False) -> tuple[int, Optional[str]]:
    """(the micro-batches' length multiple, why 'auto' chose it; None when a number was
    given): the module docstring's rule."""
    given = sb.microbatch_multiple_value
    if given is not None:
        return given, None
    flag = f"{flag_name('microbatch_multiple')} auto"
    if not plugin_data:
        return 0, None                       # Megatron's data path: the flag sizes nothing
    recorded = _recorded_multiple(sb.replay_plans) if sb.replay_plans else None
    if recorded is not None:
        kind = f"multiples of {recorded} tokens" if recorded else "fixed --seq-length"
        return recorded, (f"{kind} micro-batches ({flag}: as the plans of "
                          f"{flag_name('replay_plans')} were packed)")
    fixed = None
    auto_free = length_free_backend(args, sb) if sb.sparse_attention_enabled \
        and sb.attention_backend == "auto" else None
    free_names = " or ".join(LENGTH_FREE_BACKENDS)
    if sb.sparse_attention_enabled and sb.attention_backend not in LENGTH_FREE_BACKENDS \
            and auto_free is None:
        fixed = (f"sparse attention through the {sb.attention_backend} backend (flex compiles "
                 f"a kernel per length and 'auto' may pick it where {free_names} cannot run; "
                 f"{flag_name('attention_backend')} {free_names} takes any length)")
    elif sb.packing_method != "sab":
        fixed = f"{sb.packing_method} packing (Megatron's fixed shapes)"
    elif hybrid:
        fixed = "a HybridModel"
    elif str(getattr(args, "cuda_graph_impl", "none") or "none") != "none" \
            or getattr(args, "enable_cuda_graph", False) \
            or getattr(args, "external_cuda_graph", False):
        fixed = "CUDA graphs (fixed shapes)"
    elif sb.latency_table and _one_token_total(sb.latency_table) is not False:
        fixed = (f"--sb-latency-table {sb.latency_table} profiled at one token total (it cannot "
                 f"price shorter micro-batches)")
    if fixed is not None:
        return 0, f"fixed --seq-length micro-batches ({flag}: {fixed})"
    k = math.lcm(VARIABLE_MULTIPLE, length_need(args, sb))
    what = (f"the {sb.attention_backend} kernel takes any length" if sb.sparse_attention_enabled
            else "SAB with dense attention pays no fill")
    if auto_free is not None:
        what = f"{flag_name('attention_backend')} auto runs the {auto_free} kernel, which " \
               f"takes any length"
    return k, (f"variable-length micro-batches, multiples of {k} tokens ({flag}: {what}; "
               f"{flag_name('microbatch_multiple')} 0 keeps --seq-length shapes)")


def length_need(args, sb: SparseBalanceConfig) -> int:
    """What every packed micro-batch's length must be a multiple of: the document padding
    (2 x CP) and, with sequence parallelism, TP x CP (each CP rank's share splits over TP)."""
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    need = sb.pad_multiple(cp)
    if getattr(args, "sequence_parallel", False) and tp > 1:
        need = math.lcm(need, tp * cp)
    return need


def length_free_backend(args, sb: SparseBalanceConfig) -> Optional[str]:
    """The first of ``LENGTH_FREE_BACKENDS`` that serves the model's head dim, dtype and block
    size on this machine's CUDA device (None off CUDA or where none does)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from ...attention.api import backend_missing

    heads = getattr(args, "num_attention_heads", None)
    head_dim = getattr(args, "kv_channels", None) or (
        args.hidden_size // heads if heads and getattr(args, "hidden_size", None) else None)
    dtype = (torch.bfloat16 if getattr(args, "bf16", False)
             else torch.float16 if getattr(args, "fp16", False) else torch.float32)
    return next((b for b in LENGTH_FREE_BACKENDS
                 if backend_missing(b, "cuda", dtype=dtype, head_dim=head_dim,
                                    block_size=sb.block_size) is None), None)


def auto_takes_any_length(args, sb: SparseBalanceConfig) -> bool:
    """Whether ``--sb-attention-backend auto`` runs a length-free kernel in this launch: on CUDA
    where one of them serves the model (``length_free_backend``). 'auto' then runs it and packs
    variable-length micro-batches (``apply_length_multiple`` registers it; the start-up profile
    times every length-free one and keeps the fastest); the fastest kernel on one document may
    be flex, but its fixed shapes cost the padding (the H200's two runs of 2026-11-26: 0.52x
    dense + SAB at fixed length, 1.04x variable). Off CUDA, or where none can run, 'auto' keeps
    fixed shapes and its measured pick."""
    return length_free_backend(args, sb) is not None


def apply_length_multiple(args, sb: SparseBalanceConfig, *, plugin_data: bool,
                          hybrid: bool = False) -> tuple[SparseBalanceConfig, Optional[str]]:
    """Resolve 'auto' into ``args`` (every later ``config_from_args`` reads the number, the
    planner process and the profiler's command line included) and return the config built
    from it, with the launch line's note (None when a number was given)."""
    from ...arguments import config_from_args
    from ...config import dest_name

    k, why = resolve_length_multiple(args, sb, plugin_data=plugin_data, hybrid=hybrid)
    if sb.microbatch_multiple_value is None:
        setattr(args, dest_name("microbatch_multiple"), str(k))
        sb = config_from_args(args)
    free = length_free_backend(args, sb) if k and sb.sparse_attention_enabled \
        and sb.attention_backend == "auto" else None
    if free is not None:
        from ...attention.api import set_auto_backend    # variable lengths: a length-free one
        set_auto_backend(free, f"{flag_name('microbatch_multiple')} {k}: variable-length "
                         f"micro-batches take a length-free kernel")
    return sb, why
