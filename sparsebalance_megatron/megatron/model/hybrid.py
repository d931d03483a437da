"""SparseBalance in Megatron's HybridModel (``pretrain_hybrid.py``): the stack spec it builds.

``HybridModelBuilder`` reads ``HybridModelConfig.hybrid_stack_spec`` (a ``HybridStack``
``ModuleSpec``), never ``transformer_layer_spec``; ``hybrid_stack_spec_for(model_cfg, core)`` is
the spec ``hooks.install`` puts there:

- the base: ``--spec``'s (``hybrid_config_from_args`` already put it in the config, e.g. the
  migration guide's ``megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec``); else,
  on ``--transformer-impl local`` (the CPU default), ``get_hybrid_stack_local_spec``; else
  Megatron's own default ``hybrid_stack_spec`` (transformer-engine);
- ``core`` (``SparseCoreAttention``'s spec, or the dense THD attention on the local path) goes into
  the attention layers' slot only (``spec.swap_hybrid_core_attention``); every other layer kind
  stays as Megatron builds it.

Megatron's hybrid specs are transformer-engine modules (stand-in mocks where it is missing) and
``HybridStack`` builds a ``TENorm`` final norm, so there is no CPU spec upstream.
``get_hybrid_stack_local_spec`` is one of plain megatron-core modules: the attention layer
(``*``) is Megatron's local GPT layer without its MLP half, the MLP layer (``-``) is the MLP half
as an ``MLPLayer``, both with the GPT layer's checkpoint key map (keys as transformer-engine's
fused norms name them), and ``LocalHybridStack`` builds its final norm from the same norm module.

Layer kinds served: ``*`` and ``-``; the launch refuses the others (``launch/checks.py``).
``install_attention_spec(model_cfg, core)`` (``hooks.install``) puts ``core`` where either model's
builder reads it; it lives here, not in ``model/spec.py``, because it needs both (``model/spec.py`` must not
import this module, which imports it).
Must not touch torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from ..errors import LaunchError
from .spec import have_transformer_engine, layer_spec_builder, swap_hybrid_core_attention

TE_MODULE = "megatron.core.extensions.transformer_engine"


def is_hybrid_config(model_cfg) -> bool:
    """True for Megatron's ``HybridModelConfig`` (``pretrain_hybrid.py``'s model)."""
    try:
        from megatron.training.models.hybrid import HybridModelConfig
    except ImportError:   # a megatron-core without HybridModel
        return False
    return isinstance(model_cfg, HybridModelConfig)


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is ``final_norm`` (a plain module spec or class, the
    layers' own norm) instead of the transformer-engine ``TENorm`` upstream hard-codes."""

    def __init__(self, config, submodules: HybridStackSubmodules, *args, final_norm=None,
                 post_layer_norm: bool = True, **kwargs):
        if final_norm is None:
            raise ValueError("LocalHybridStack needs final_norm (a norm module or spec)")
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(final_norm, config=self.config,
                                           hidden_size=self.config.hidden_size,
                                           eps=self.config.layernorm_epsilon)


def get_hybrid_stack_local_spec(config) -> ModuleSpec:
    """A ``HybridStack`` spec of megatron-core's local modules (no transformer-engine) for
    ``config`` (a ``TransformerConfig``): attention (``*``) and MLP (``-``) layers cut from
    Megatron's local GPT layer spec with the config's norm and QK-norm settings; the other layer
    kinds are left empty (``IdentityOp``), which the launch refuses."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                             TransformerLayerSubmodules)

    gpt = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                   normalization=config.normalization,
                                   qk_l2_norm=config.qk_l2_norm).submodules
    keys = gpt.sharded_state_dict_keys_map
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda,
        sharded_state_dict_keys_map={k: v for k, v in keys.items() if k == "input_layernorm."}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda,
        sharded_state_dict_keys_map={k: v for k, v in keys.items()
                                     if k == "pre_mlp_layernorm."}))
    return ModuleSpec(module=LocalHybridStack, params={"final_norm": gpt.input_layernorm},
                      submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))


def transformer_engine_parts(stack_spec) -> list[str]:
    """Names of the transformer-engine modules (or the stand-ins Megatron binds when it is
    missing) that building ``stack_spec``'s attention and MLP layers and final norm needs."""
    found: list[str] = []

    def visit(x, depth=0):
        if depth > 20 or x is None:
            return
        if type(x).__module__.startswith("unittest.mock"):
            found.append(f"a stand-in for a missing transformer-engine module ({type(x).__name__})")
        elif isinstance(x, type) and x.__module__.startswith(TE_MODULE):
            found.append(x.__name__)
        elif isinstance(x, ModuleSpec):
            visit(x.module, depth + 1)
            visit(x.submodules, depth + 1)
            for v in (x.params or {}).values():
                visit(v, depth + 1)
        elif isinstance(x, functools.partial):
            visit(x.func, depth + 1)
            for v in x.keywords.values():
                visit(v, depth + 1)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name), depth + 1)

    sub = getattr(stack_spec, "submodules", None)
    for slot in ("attention_layer", "mlp_layer"):
        visit(getattr(sub, slot, None))
    module = getattr(stack_spec, "module", None)
    if isinstance(module, type) and issubclass(module, HybridStack) \
            and not issubclass(module, LocalHybridStack):
        found.append("HybridStack's final norm (TENorm)")
    return sorted(set(found))


def hybrid_stack_spec_for(model_cfg, core=None, *, spec_flag: Optional[str] = None
                          ) -> ModuleSpec:
    """The stack spec the run builds (see the module docstring); ``core`` None keeps the base's
    core attention. ``LaunchError`` (one line) when the spec cannot be built here: no attention
    slot, or transformer-engine modules without transformer-engine. ``spec_flag``: the ``--spec``
    value, for the message."""
    impl = model_cfg.transformer.transformer_impl
    if impl == "inference_optimized":
        raise LaunchError("cannot launch: --transformer-impl inference_optimized with "
                          "SparseBalance (an inference stack spec; train with local or "
                          "transformer_engine)")
    base = model_cfg.hybrid_stack_spec
    where = f"--spec {spec_flag}" if spec_flag else "Megatron's default hybrid_stack_spec"
    if base is None:
        if impl == "local":
            base, where = get_hybrid_stack_local_spec(model_cfg.transformer), "local"
        else:
            from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
            base = hybrid_stack_spec
    if not have_transformer_engine():
        te = transformer_engine_parts(base)
        if te:
            raise LaunchError(
                f"cannot launch: {where} is built of transformer-engine modules ("
                f"{', '.join(te)}) and transformer-engine is not installed: "
                + ("drop --spec (with --transformer-impl local the plugin builds its local "
                   "hybrid stack spec)" if spec_flag else
                   "pip install 'transformer-engine[pytorch]' or use --transformer-impl local"))
    if core is None:
        return base
    try:
        return swap_hybrid_core_attention(base, core, what=f"the hybrid stack spec ({where})")
    except ValueError as e:
        raise LaunchError(f"cannot launch: {e}") from None


def install_attention_spec(model_cfg, core, *, spec_flag=None) -> None:
    """Put ``core`` (None: the base spec's own) where ``model_cfg``'s builder reads it: a
    ``GPTModelConfig``'s ``transformer_layer_spec`` (``layer_spec_builder``), a
    ``HybridModelConfig``'s ``hybrid_stack_spec`` (its builder never reads the former;
    ``hybrid_stack_spec_for``, which also picks the base, the local one on CPU).
    ``spec_flag``: Megatron's ``--spec`` value, for messages."""
    if is_hybrid_config(model_cfg):
        if spec_flag is not None and not isinstance(spec_flag, str):
            spec_flag = " ".join(spec_flag)
        model_cfg.hybrid_stack_spec = hybrid_stack_spec_for(model_cfg, core,
                                                            spec_flag=spec_flag or None)
    elif core is not None:
        model_cfg.transformer_layer_spec = layer_spec_builder(core)
