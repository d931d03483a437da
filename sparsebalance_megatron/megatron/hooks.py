"""The one integration of SparseBalance into Megatron's ``pretrain()``, for every entry point.

``examples/pretrain_{gpt,hybrid}_sparsebalance.py`` and Megatron-LM's ``pretrain_gpt.py`` /
``pretrain_hybrid.py`` (with ``patches/``) run the same six calls around Megatron's own flow; the
loop is Megatron's::

    args = parse_and_validate_args(
        extra_args_provider=hooks.extra_args_provider(base, model="gpt"),
        args_defaults=hooks.args_defaults(defaults))
    model_cfg = gpt_config_from_args(args)        # or hybrid_config_from_args, model="hybrid"
    hooks.install(args, model_cfg)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg),
             hooks.datasets_provider(provider), ModelType.encoder_or_decoder,
             hooks.forward_step(forward_step), ...)
    hooks.finish()       # destroys the process groups once every rank is done

A script whose ``pretrain()`` builds the model through ``model_provider`` with a config container
that holds no model (Megatron-LM dev's ``pretrain_gpt.py``) calls ``model_cfg =
hooks.model_config(args, gpt_config_from_args)`` instead of the config and ``install`` lines and
passes it on: ``pretrain_cfg_container_from_args(args, model_cfg)``.

Why this is long: it is the one module Megatron's side calls, and each of the six calls above is
short glue over the rooms (launch, model, step, runtime); splitting it would give an entry point a
reader must assemble from several files, which is what a single integration module avoids. The
two parse-time calls (``extra_args_provider``, ``args_defaults``) live in ``hooks_flags`` and are
exported here: they run before anything else of the plugin and share nothing with the rest.
Every refusal, here and in the rooms, is said once per job (``runtime.refusal``).

What enters where:
- flags: ``extra_args_provider`` (our ``--sparse-balance``/``--sb-*`` after the script's own; on a
  machine without CUDA also the CPU defaults of ``launch.cpu_parser_defaults`` and the CPU shims);
  ``args_defaults`` and the parser the provider returns check the plugin's settings, and the
  launch conflicts Megatron's flags show (``launch.checks.flag_conflicts``), before Megatron
  validates and prints its flags or builds a tokenizer (``launch/preflight.py``);
- the attention: ``GPTModelConfig.transformer_layer_spec`` = Megatron's default spec with only
  ``core_attention`` swapped (``spec.layer_spec_builder``), the budget context in its params; a
  HybridModel's ``hybrid_stack_spec`` with its attention layers' slot swapped (``model/hybrid.py``);
  after the build, the post-wrap hook checks every budgeted layer is ours (``attention_check``);
- data (SAB): with the plugin's data path (DST or SAB on, or always for our entry) Megatron pulls
  our iterators through ``--dataloader-type external``; ``forward_step`` is ours (THD inputs);
- the step callback (DST, calibration, metrics): a post-wrap hook (``model_cfg.post_wrap_hooks``)
  builds ``callback.SparseBalanceCallback`` once the process groups and model exist and sets
  ``config.finalize_model_grads_func`` (Megatron's ``train()`` keeps a preset one);
- per-micro-batch timings: Megatron's global ``Timers`` becomes a ``TeeTimers`` (it is what
  ``train()`` puts in ``config.timers``, and ``evaluate()`` restores after evaluation);
- resume state: ``args.dataloader_save`` = ``--save``: Megatron's checkpoint calls our iterator's
  ``save_state`` and writes it into the iteration's folder (``step/state.py``); with the
  interleaved schedule, where that hook cannot take the chunks' iterators, the timers tee's
  ``save-checkpoint`` timer writes the same file at the start of each save.
- the watchdog (``runtime/watchdog.py``, with the plugin's data path): built by the post-wrap hook, ticked
  by every forward step, told of evaluation, checkpoint saves and loads, the optimizer step and
  data loading by Megatron's timers of them (``runtime/watchdog_megatron.py``), stopped by ``finish``; it
  names a hung, stopped or departed rank before the distributed timeout
  (``--sb-watchdog-seconds``), never while a rank saves a checkpoint.
With none of the plugin's switches on, ``install`` changes nothing: the run is stock Megatron.
"""

from __future__ import annotations

import atexit
import functools
import gc
import time
from typing import Callable, Optional

from ..arguments import config_from_args
from ..config import ConfigError, SparseBalanceConfig
from .hooks_flags import MODELS, args_defaults, extra_args_provider  # noqa: F401  (the hooks)
from .launch import compat
from .launch.checks import LaunchError, check_launch
from .launch.preflight import uses_plugin_data
from .runtime import comm
from .runtime.refusal import refusal, say_refusal

class _Integration:
    """What ``install`` set up in this process (one training run per process)."""

    sb: Optional[SparseBalanceConfig] = None
    plugin_data: bool = False
    data = None
    budget = None
    callback = None
    timers = None
    watchdog = None
    model_built = False   # the post-wrap hook ran: pretrain() built the model install() changed
    warmed = False        # the selection's Triton kernels were compiled (once per process)


_run = _Integration()


# --- model, data, callback ----------------------------------------------------------------------

def install(args, model_cfg, *, packed_data: Optional[bool] = None):
    """Checks, layer spec, data and step hooks on Megatron's ``GPTModelConfig``; returns it.

    ``packed_data``: True for an entry whose only data path is the plugin's (ours); None for a
    script with its own data path (Megatron-LM's ``pretrain_gpt.py``): the plugin's is used when
    DST or SAB needs it. Bad settings end the process with one ``error:`` line.
    """
    try:
        return _install(args, model_cfg, packed_data)
    except (ConfigError, LaunchError, ValueError, OSError) as e:
        raise refusal(f"error: {e}") from None


def model_config(args, build: Callable, *, packed_data: Optional[bool] = None):
    """The model config for ``pretrain_cfg_container_from_args(args, model_cfg)`` in a script
    whose ``pretrain()`` builds the model through ``model_provider`` (Megatron-LM dev's
    ``pretrain_gpt.py``). With the plugin's switches on: ``build(args)``
    (``gpt_config_from_args``) after ``install``: ``pretrain()`` builds a container's model
    whenever it has one and then never calls ``model_provider``, so the plugin's spec and hooks
    are the ones built. With them off: the launch checks alone, and None (the script's
    ``model_provider`` builds the model, as upstream)."""
    try:
        sb = config_from_args(args)
    except ConfigError as e:
        raise refusal(f"error: {e}") from None
    if not (sb.sparse_attention_enabled or uses_plugin_data(sb, packed_data)):
        return install(args, None, packed_data=packed_data)
    return install(args, build(args), packed_data=packed_data)


def _install(args, model_cfg, packed_data):
    from .launch.lengths import apply_length_multiple
    from .model.budget import BudgetContext
    from .model.hybrid import install_attention_spec, is_hybrid_config
    from .model.spec import sparse_core_attention_spec

    sb = config_from_args(args)
    plugin_data = uses_plugin_data(sb, packed_data)
    hybrid = is_hybrid_config(model_cfg)
    # --sb-microbatch-multiple auto -> a number, in args, before anything reads it
    sb, lengths_note = apply_length_multiple(args, sb, plugin_data=plugin_data, hybrid=hybrid)
    check_launch(args, sb, plugin_data=plugin_data, hybrid=hybrid)
    if plugin_data:
        from .launch.latency_setup import check_given_table
        check_given_table(args, sb)       # the validated model's sizes (padded vocabulary, ...)
    _run.sb, _run.plugin_data, _run.model_built, _run.warmed = sb, plugin_data, False, False
    if not (sb.sparse_attention_enabled or plugin_data):
        return model_cfg
    compat.skip_prebuilt_helpers_compile()
    _run.budget = BudgetContext.for_config(sb)
    core = None
    if sb.sparse_attention_enabled:
        core = sparse_core_attention_spec(sb, _run.budget)
    elif args.transformer_impl == "local":            # local DotProductAttention: no THD
        from .model.spec import dense_core_attention_spec
        core = dense_core_attention_spec(sb)
    install_attention_spec(model_cfg, core, spec_flag=args.spec)
    if plugin_data:
        from .step.data import check_vocab, load_data, megatron_text_tokenizer

        _run.data = load_data(args, sb, text_tokenizer=megatron_text_tokenizer(args))
        check_vocab(_run.data, int(args.padded_vocab_size or model_cfg.vocab_size))
        args.dataloader_type = "external"            # Megatron pulls our iterators
        args.dataloader_save = args.save             # our save_state -> the iteration's folder
        if _interleaved(args):
            # megatron-core's maybe_save_dataloader_state (0.19, 0.20) takes one iterator and
            # train() hands it the list of the model chunks' iterators: it would fail at the
            # first save. The post-wrap hook writes the same file at each save instead.
            args.dataloader_save = None
        # Packed micro-batches hold different numbers of real tokens: normalise per token.
        args.calculate_per_token_loss = True
        model_cfg.calculate_per_token_loss = True
        if sb.length_multiple or sb.varies_microbatch_count:
            # Variable-length micro-batches: Megatron's pipeline stages exchange each tensor's
            # shape before sending it (its dataloader-set flag; validate_args clears it).
            args.variable_seq_lengths = True
            model_cfg.variable_seq_lengths = True
    if _on_model_built not in model_cfg.post_wrap_hooks:
        model_cfg.post_wrap_hooks.append(_on_model_built)
    parts = [f"sparse attention: density {sb.density}, block {sb.block_size}, backend "
             f"{sb.attention_backend}" if sb.sparse_attention_enabled else
             "dense attention (no sparse call; SAB packs by the dense kernel's predicted time)"
             if sb.batching_enabled else "dense attention"]
    if not sb.sparse_attention_enabled and core is not None:
        parts[0] += f", dense kernel {sb.dense_kernel} (--sb-dense-kernel; CUDA bf16/fp16)"
    if hybrid:
        p = args.hybrid_layer_pattern
        parts[0] += f" in the {p.count('*')} attention layers of HybridModel {p!r}"
    if plugin_data:
        parts.append(f"data: {_run.data.corpus.name} ({len(_run.data.corpus)} documents, "
                     f"tokenizer {_run.data.tokenizer}), packing {sb.packing_method}")
        if lengths_note:
            parts.append(lengths_note)
    parts.append("DST on" if sb.dst_enabled else "DST off")
    comm.say("; ".join(parts))
    return model_cfg


def _interleaved(args) -> bool:
    from ..latency.layout import PipelineLayout

    return PipelineLayout.from_megatron_args(args).vp > 1


def _on_model_built(model: list) -> list:
    """Post-wrap hook (process groups and the model exist): the check that every layer the plan
    budgets runs our attention, then the step callback, the finalize hook and the timers tee;
    last, once the backend 'auto' runs is known (the callback's latency table sets it), the
    fused selection's Triton kernels compiled for every width the run can meet
    (``model/selection_warmup.py``), so that no training step pays a compile."""
    model = _build_runtime(model)
    if _run.sb is not None and _run.sb.sparse_attention_enabled and not _run.warmed:
        from ..attention.api import resolve_backend
        from .launch.compat import device
        from .model.selection_warmup import warm_up

        _run.warmed = True
        dev = device()
        line = warm_up(_megatron_args(), _run.sb, resolve_backend(
            _run.budget.attention_backend or _run.sb.attention_backend, dev), dev)
        if line:
            comm.say(line)
    return model


def _build_runtime(model: list) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    _run.model_built = True
    if _run.plugin_data:
        _check_one_packer(get_model_config(model[0]))
    if _run.sb is not None and _run.sb.sparse_attention_enabled:
        from .model.attention_check import check_sparse_attention
        try:
            check_sparse_attention(model, _megatron_args(), ps.get_pipeline_model_parallel_rank())
        except LaunchError as e:
            raise refusal(f"error: {e}") from None
    if not _run.plugin_data or _run.callback is not None:
        return model
    from .launch.compat import device
    from .step.callback import SparseBalanceCallback
    from .step.timing import MicrobatchTimers, install_timers_tee

    args = _megatron_args()
    if ps.get_context_parallel_rank() != 0:
        # CP ranks of a DP rank hold the same state and Megatron names its file by the DP rank
        # alone: only CP rank 0 writes it (the others would write the same file at once).
        args.dataloader_save = None
    _run.callback = SparseBalanceCallback(args, _run.sb, _run.budget, _run.data, device=device())
    if _run.sb.quality_refresh_interval:     # the quality model follows the network
        try:
            _run.callback.start_quality_probe(model, _forward_step)
        except LaunchError as e:             # no held-out documents: before any step
            raise refusal(f"error: {e}") from None
    from .step import microbatches
    if _run.sb.varies_microbatch_count:      # dp_balanced's own count reaches the schedule
        microbatches.install(_run.callback)
    from .model.backend_fallback import stand_in_for_faults
    line = stand_in_for_faults(_run.budget, _run.sb.fault_specs, comm.rank())
    if line:                                            # --sb-fault ...-fails (tests)
        comm.say(line)
    from .runtime.watchdog_megatron import start_for_megatron, watch_megatron_phases
    _run.watchdog = start_for_megatron(args, _run.sb)   # watches from the first micro-batch
    _run.callback.watchdog = _run.watchdog              # a wait for the planner is a phase
    _run.timers = _run.callback.timers = MicrobatchTimers()
    install_timers_tee(_run.timers)
    if args.save and _interleaved(args) and ps.get_pipeline_model_parallel_rank() == 0 and \
            ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
        # the ranks Megatron's data loader hook writes on, one file per DP rank (step/state.py)
        from megatron.training import global_vars

        from .step.state import save_at_checkpoints
        save_at_checkpoints(global_vars._GLOBAL_TIMERS, _run.callback)
    watch_megatron_phases(_run.watchdog)   # evaluation, checkpoints, optimizer, data: progress
    config = get_model_config(model[0])
    inner = config.finalize_model_grads_func or finalize_model_grads
    if not getattr(inner, "_sparsebalance", False):
        config.finalize_model_grads_func = _run.callback.finalize_model_grads(inner)
    return model


def _check_one_packer(config) -> None:
    """The config ``train_step`` reads: a packing scheduler set on it (a hand-wired config, past
    the flag checks) would repack the plugin's micro-batches (``data_checks.packer_conflicts``)."""
    scheduler = getattr(config, "sequence_packing_scheduler", None)
    if scheduler is not None:
        raise refusal(f"error: cannot launch: the model config's sequence_packing_scheduler "
                         f"{scheduler!r} with the plugin's packing: two packers, Megatron's would "
                         f"repack the micro-batches the plugin packed; leave it None (SAB packs) "
                         f"or drop the plugin's packing")


def _megatron_args():
    from megatron.training.global_vars import get_args

    return get_args()


def datasets_provider(megatron_provider: Optional[Callable] = None) -> Callable:
    """Megatron's ``train_valid_test_datasets_provider``: ours with the plugin's data path (it
    returns the train/valid/test iterators for ``--dataloader-type external``), else
    ``megatron_provider``, checked first (when Megatron calls it, after building the model)
    that the model is the one ``install`` changed, or that ``install`` need not have run."""
    if not _run.plugin_data:
        if megatron_provider is None:
            raise RuntimeError("hooks.datasets_provider(None) needs the plugin's data path: call "
                               "hooks.install(args, model_cfg, packed_data=True) first")
        if _run.sb is not None and not _run.sb.sparse_attention_enabled:
            return megatron_provider

        @functools.wraps(megatron_provider)       # keeps is_distributed and the like
        def checked(*args, **kwargs):
            try:
                _check_installed() if _run.sb is None else _check_model_built()
            except LaunchError as e:
                raise say_refusal(f"error: {e}") from None
            return megatron_provider(*args, **kwargs)

        return checked

    def provider(train_val_test_num_samples, vp_stage=None):
        try:
            return _datasets(vp_stage)
        except LaunchError as e:   # a resume without the plugin's state: the callback made
            # every rank raise the same one; said once
            raise say_refusal(f"error: {e}") from None

    provider.is_distributed = True   # every rank builds its own (identical) iterators
    return provider


def _check_installed() -> None:
    """``install`` (or ``model_config``) never ran in this process: with the plugin's switches
    on, none of it would act (a ``model_provider`` holding the plugin's spec is not called when
    the container has a model), and the run would be stock Megatron under the plugin's flags."""
    try:
        sb = config_from_args(_megatron_args())
    except ConfigError:
        return           # the parser named bad values already; nothing of the plugin is on
    if sb.sparse_attention_enabled or uses_plugin_data(sb, None):
        raise LaunchError("the plugin's switches are on (--sparse-balance / --sb-sparse-attention "
                          "/ --sb-dst / --sb-batching) but hooks.install never ran: pretrain() "
                          "builds Megatron's attention and nothing of the plugin acts; call "
                          "hooks.install(args, model_cfg) (or model_cfg = hooks.model_config(args, "
                          "gpt_config_from_args)) and pass that model_cfg to pretrain: "
                          "pretrain(pretrain_cfg_container_from_args(args, model_cfg), ...)")


def _check_model_built() -> None:
    """Megatron builds the model before the datasets: by then the post-wrap hook that
    ``install`` added to ``model_cfg`` must have run. A config built again after ``install``
    (``gpt_config_from_args(args)`` a second time), or a container without it (``pretrain()``
    then calls ``model_provider``), carries neither the sparse attention nor the hook: training
    it would run Megatron's attention, and the plugin's data path has no callback (a bare
    ``AttributeError`` on ``None``)."""
    if _run.model_built:
        return
    raise LaunchError("pretrain() built the model from a config that hooks.install(args, "
                      "model_cfg) did not change (a config made again after install, e.g. a "
                      "second gpt_config_from_args(args), or a container without it, so that "
                      "model_provider built the model): it has Megatron's attention and none "
                      "of the plugin's hooks; pass pretrain the model_cfg given to install: "
                      "pretrain(pretrain_cfg_container_from_args(args, model_cfg), ...)")


def _datasets(vp_stage):
    """The plugin's train, valid and test iterators (every rank builds its own)."""
    from .step.data import plugin_datasets

    _check_model_built()
    return plugin_datasets(_run.callback, _run.data, _run.sb, _megatron_args(), vp_stage)


def finish() -> None:
    """After ``pretrain()`` has returned on every rank: a barrier, then the process groups are
    destroyed (PyTorch's documented shutdown; Megatron's ``pretrain()`` leaves them up). Left to
    interpreter finalization, gloo's worker threads can abort a finished rank ("terminate called
    without an active exception", pytorch#190489; seen here in about one of ten PP x CP runs on
    CPU). Only for a normal end: after an error the other ranks would not reach the barrier.
    The watchdog watches that barrier (a rank that hangs after its final save is named) and
    stops before the groups go (its records live on the default group's store)."""
    if _run.watchdog is not None:
        comm.barrier()
        _run.watchdog.stop()
    comm.destroy_process_groups()
    # The interpreter's exit then collects every object torch and Megatron leave (half a
    # million in a tiny CPU run: 2-4 s of CPU per rank, after the job's work is done); frozen,
    # they are left to the OS, as Python leaves objects alive at exit anyway (no __del__
    # guarantee). Registered here, it runs before the earlier-registered exit handlers.
    atexit.register(gc.freeze)


def forward_step(megatron_forward_step: Optional[Callable] = None) -> Callable:
    """Megatron's ``forward_step_func``: ours with the plugin's data path, else the script's."""
    if not _run.plugin_data:
        if megatron_forward_step is None:
            raise RuntimeError("hooks.forward_step(None) needs the plugin's data path")
        return megatron_forward_step
    return _forward_step


def _forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One packed micro-batch through this pipeline stage."""
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    mb = next(data_iterator)
    timers("batch-generator").stop()
    sb, cb = _run.sb, _run.callback
    psp = mb["packed_seq_params"]
    if _run.watchdog is not None:   # a progress point (training or evaluation micro-batch)
        step, index = getattr(psp, "sb_step", None), getattr(psp, "sb_microbatch", None)
        _run.watchdog.tick(step, "evaluation" if step is None or index is None else
                           f"forward step, iteration {step + 1}, micro-batch {index}")
    if sb.fault is not None:
        for spec in sb.fault_specs:
            _inject_fault(spec, mb["packed_seq_params"])
    t0 = time.perf_counter()
    output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"],
                   loss_mask=mb["loss_mask"], packed_seq_params=mb["packed_seq_params"])
    if sb.straggler_rank == cb.dp_rank and sb.straggler_slowdown > 1.0 and \
            sb.timing_source == "measured" and sb.straggler_stage in (-1, cb.pp_rank):
        # Benchmarks (--sb-straggler-*): forward + backward (about 3x the forward) take
        # straggler_slowdown times longer on this rank (with --sb-timing-source model the
        # slowdown is modelled instead).
        time.sleep(3.0 * (sb.straggler_slowdown - 1.0) * (time.perf_counter() - t0))
    from .model.loss import loss_func   # pretrain_gpt's, mirrored flag by flag (loss.py)

    return output, functools.partial(loss_func, mb["loss_mask"], mb["packed_seq_params"], cb,
                                     _megatron_args())


def _inject_fault(spec, psp) -> None:
    """--sb-fault RANK:STEP:KIND (tests of fail-fast): at the first micro-batch of iteration STEP
    on global rank RANK, raise, hang (stop answering, as a stuck device would), die, or leave
    (``os._exit(0)``, a rank that ends before the others)."""
    import os
    import signal

    rank, step, kind = spec
    if kind.startswith("planner-") or kind.endswith("-fails") or comm.rank() != rank \
            or psp.sb_step != step - 1 or psp.sb_microbatch != 0:
        return     # (the planner's faults: step/planning.py; the kernels': backend_fallback)
    print(f"[sparsebalance] --sb-fault: injecting '{kind}' on rank {rank} at iteration {step}",
          flush=True)
    if kind == "raise":
        raise RuntimeError(f"--sb-fault: injected failure on rank {rank} at iteration {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "exit":
        os._exit(0)
    while True:   # hang
        time.sleep(3600)
