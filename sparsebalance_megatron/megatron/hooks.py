"""Entry points for a Megatron-LM checkout's ``pretrain_gpt.py`` (patches/megatron_lm_pretrain_gpt.patch).

The patch calls three functions, each thin and delegating to the adapter:

- ``extra_args_provider(base)``: our flags (``add_sparsebalance_args``) composed with whatever
  provider the script already passes (ModelOpt's, or None);
- ``install(args, model_cfg)``: launch checks, the SparseBalance layer spec in the named slot
  ``GPTModelConfig.transformer_layer_spec`` (``model.get_layer_spec``), and a post-wrap hook that
  sets ``config.finalize_model_grads_func`` (Megatron's ``train()`` keeps a preset one);
- ``wrap_forward_step(fn)``: before each micro-batch, ``config.timers`` becomes a tee that also
  records per-micro-batch intervals (``timing.MicrobatchTimers``); ``train()`` resets
  ``config.timers`` at start-up and around evaluation, so it is re-installed when needed.

No Megatron function is monkeypatched. In a Megatron-LM run, sparse attention runs at the static
density ``--sb-density``: DST and SAB need the read-ahead packed data path of
``examples/pretrain_gpt_sparsebalance.py`` and are reported as off in the log.
Only for ``sparsebalance_megatron.megatron``: imports megatron lazily, inside the functions.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from ..arguments import add_sparsebalance_args, config_from_args
from ..config import SparseBalanceConfig, flag_name
from .initialize import LaunchError
from .timing import MicrobatchTimers

log = logging.getLogger("sparsebalance")


class _State:
    """Per-process hook state (one training run per process, as in pretrain_gpt.py)."""

    sb: Optional[SparseBalanceConfig] = None
    timers: Optional[MicrobatchTimers] = None
    last_timings: Optional[dict] = None


_state = _State()


def extra_args_provider(base: Optional[Callable] = None) -> Callable:
    """Megatron ``extra_args_provider`` adding our flags after ``base``'s (if any)."""

    def provider(parser):
        if base is not None:
            parser = base(parser)
        return add_sparsebalance_args(parser)

    return provider


def model_layer_spec(args, sb: Optional[SparseBalanceConfig] = None):
    """The SparseBalance layer spec when sparse attention is on, else None (Megatron's default)."""
    sb = config_from_args(args) if sb is None else sb
    if not sb.sparse_attention_enabled:
        return None
    from .model import get_layer_spec

    return get_layer_spec(args, sb)


def _unsupported(args) -> list[str]:
    """Settings whose layer spec or core attention would silently replace ours."""
    out = []
    if getattr(args, "spec", None) is not None:
        out.append(f"--spec {args.spec} (a custom layer spec)")
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
    return out


def check(args, sb: SparseBalanceConfig) -> None:
    """Clear errors, before any model is built, for settings the sparse layer spec cannot serve."""
    if not sb.sparse_attention_enabled:
        return
    if args.seq_length is not None and args.seq_length < sb.block_size:
        raise LaunchError(
            f"--seq-length={args.seq_length} is smaller than {flag_name('block_size')}="
            f"{sb.block_size}: a sequence must hold at least one attention block")
    bad = _unsupported(args)
    if bad:
        raise LaunchError("sparse attention (--sparse-balance / --sb-sparse-attention / --sb-dst) "
                          "cannot be combined with: " + "; ".join(bad))


def install(args, model_cfg):
    """Put the SparseBalance layer spec and step hooks on Megatron's ``GPTModelConfig``."""
    sb = config_from_args(args)
    _state.sb = sb
    if not sb.sparse_attention_enabled:
        return model_cfg
    check(args, sb)
    model_cfg.transformer_layer_spec = model_layer_spec(args, sb)
    if _install_finalize not in model_cfg.post_wrap_hooks:
        model_cfg.post_wrap_hooks.append(_install_finalize)
    _state.timers = MicrobatchTimers()
    if getattr(args, "rank", 0) == 0:
        off = [name for name, on in (("DST", sb.dst_enabled), ("SAB", sb.batching_enabled)) if on]
        print(f"[sparsebalance] sparse attention on: density {sb.density}, block {sb.block_size}, "
              f"backend {sb.attention_backend}"
              + (f"; {' and '.join(off)} requested but not available in a Megatron-LM "
                 f"pretrain_gpt.py run (static density; use examples/pretrain_gpt_sparsebalance.py)"
                 if off else ""), flush=True)
    return model_cfg


def _install_finalize(model: list) -> list:
    """Post-wrap hook: record this step's per-micro-batch timings before Megatron's finalize."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    inner = config.finalize_model_grads_func or finalize_model_grads
    if getattr(inner, "_sparsebalance", False):
        return model

    def finalize_model_grads_sb(*a, **kw):
        timers = _state.timers
        if timers is not None:
            _state.last_timings = {"fwd_s": timers.durations_s("forward-compute"),
                                   "bwd_s": timers.durations_s("backward-compute")}
            timers.reset()
        return inner(*a, **kw)

    finalize_model_grads_sb._sparsebalance = True
    config.finalize_model_grads_func = finalize_model_grads_sb
    return model


def last_microbatch_timings() -> Optional[dict]:
    """Seconds per micro-batch of the last step on this rank: {'fwd_s': [...], 'bwd_s': [...]}."""
    return _state.last_timings


class _TeeInterval:
    def __init__(self, megatron_timer, ours):
        self._m, self._o = megatron_timer, ours

    def start(self, barrier: bool = False):
        self._o.start()
        self._m.start(barrier=barrier)

    def stop(self, barrier: bool = False):
        self._m.stop(barrier=barrier)
        self._o.stop()

    def __getattr__(self, name):
        return getattr(self._m, name)


class TeeTimers:
    """``config.timers`` feeding Megatron's ``Timers`` and our ``MicrobatchTimers`` together."""

    def __init__(self, megatron_timers, ours: MicrobatchTimers):
        self.megatron_timers, self.ours = megatron_timers, ours

    def __call__(self, name, log_level=None, barrier: bool = False):
        return _TeeInterval(self.megatron_timers(name, log_level), self.ours(name))

    def __getattr__(self, name):
        return getattr(self.megatron_timers, name)


def wrap_forward_step(forward_step: Callable) -> Callable:
    """Megatron ``forward_step_func`` that (re)installs the timer tee, then calls ``forward_step``."""
    if getattr(forward_step, "_sparsebalance", False):
        return forward_step

    @functools.wraps(forward_step)  # keeps the signature Megatron inspects
    def forward_step_sb(data_iterator, model, *a, **kw):
        if _state.timers is not None:
            from megatron.core.utils import get_model_config

            config = get_model_config(model)
            if config.timers is not None and not isinstance(config.timers, TeeTimers):
                config.timers = TeeTimers(config.timers, _state.timers)
        return forward_step(data_iterator, model, *a, **kw)

    forward_step_sb._sparsebalance = True
    return forward_step_sb
