"""Layer specs with SparseBalance attention: Megatron's own GPT specs, ``core_attention`` swapped.

Training builds the model with Megatron's ``GPTModelBuilder``; ``layer_spec_builder(core)`` is the
callable put in ``GPTModelConfig.transformer_layer_spec``. It calls the function Megatron's builder
itself calls when no spec is given (``megatron.training.models.gpt.default_layer_spec(config,
vp_stage)``: transformer-engine or local, with every keyword upstream passes, ``qk_l2_norm``,
``use_te_op_fuser`` and the rest) and replaces only
``submodules.self_attention.submodules.core_attention``. So every flag upstream honours still works.

HybridModel (``pretrain_hybrid.py``): the slot sits one level deeper, in the stack spec's
attention layer (``submodules.attention_layer.submodules.self_attention.submodules.
core_attention``); ``swap_hybrid_core_attention`` swaps it there and nowhere else (which stack
spec a run builds: ``model/hybrid.py``).

``get_sparsebalance_layer_spec(sb_config, transformer_impl, **kwargs)`` builds a spec directly from
``get_gpt_layer_local_spec(**kwargs)`` / ``get_gpt_layer_with_transformer_engine_spec(**kwargs)``
for models built outside ``pretrain()`` (the profiler, conversion, tests).
transformer-engine is probed, never required. Must not touch torch.distributed.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from ...config import SparseBalanceConfig
from .budget import BudgetContext
from .core_attention import SparseCoreAttention

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


def sparse_core_attention_spec(sb_config: SparseBalanceConfig,
                               budget: Optional[BudgetContext] = None) -> ModuleSpec:
    """``ModuleSpec(SparseCoreAttention, params={"sb_config": ..., "budget": ...})``."""
    if not isinstance(sb_config, SparseBalanceConfig):
        raise ValueError(f"sb_config={sb_config!r}: expected a SparseBalanceConfig")
    if budget is None:
        budget = BudgetContext.for_config(sb_config)
    return ModuleSpec(module=SparseCoreAttention, params={"sb_config": sb_config,
                                                          "budget": budget})


def dense_core_attention_spec(sb_config: SparseBalanceConfig) -> ModuleSpec:
    """``ModuleSpec(DenseVarlenCoreAttention, params={"dense_kernel": ...})``: the dense runs'
    core attention on the local spec, through ``--sb-dense-kernel`` (varlen or cuDNN SDPA)."""
    if not isinstance(sb_config, SparseBalanceConfig):
        raise ValueError(f"sb_config={sb_config!r}: expected a SparseBalanceConfig")
    from .dense_attention import DenseVarlenCoreAttention

    return ModuleSpec(module=DenseVarlenCoreAttention,
                      params={"dense_kernel": sb_config.dense_kernel})


def swap_core_attention(spec: ModuleSpec, core, what: str = "the layer spec") -> ModuleSpec:
    """A copy of ``spec`` whose ``self_attention.core_attention`` is ``core``; nothing else changes."""
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is None:
        raise ValueError(f"{what} ({type(spec).__name__}) has no "
                         f"submodules.self_attention.submodules.core_attention slot: only "
                         f"layers with Megatron's SelfAttention (transformer-engine or local) "
                         f"can take sparse attention")
    spec = copy.deepcopy(spec)   # the budget context survives: BudgetContext.__deepcopy__
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def swap_hybrid_core_attention(stack_spec: ModuleSpec, core,
                               what: str = "the hybrid stack spec") -> ModuleSpec:
    """A copy of a ``HybridStack`` spec whose attention layers (``*``) have ``core`` as core
    attention; the other layer kinds are shared with ``stack_spec``, unchanged."""
    sub = getattr(stack_spec, "submodules", None)
    layer = getattr(sub, "attention_layer", None)
    if not isinstance(layer, ModuleSpec):
        raise ValueError(f"{what} ({type(stack_spec).__name__}) has no submodules."
                         f"attention_layer layer spec: expected a HybridStack ModuleSpec")
    attention = getattr(layer.submodules, "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is None:
        raise ValueError(f"{what}'s attention_layer has no submodules.self_attention."
                         f"submodules.core_attention slot")
    # copies along the path to the slot only: the rest stays shared (Megatron's TE specs hold
    # stand-in mocks where transformer-engine is missing, which cannot be deep-copied)
    attention = copy.copy(attention)
    attention.submodules = copy.copy(attention.submodules)
    attention.submodules.core_attention = core
    layer = copy.copy(layer)
    layer.submodules = copy.copy(layer.submodules)
    layer.submodules.self_attention = attention
    out = copy.copy(stack_spec)
    out.submodules = copy.copy(sub)
    out.submodules.attention_layer = layer
    return out


def layer_spec_builder(core) -> Callable:
    """``GPTModelConfig.transformer_layer_spec`` callable: Megatron's default spec for
    ``(config, vp_stage)``, with ``core`` (a module class or ``ModuleSpec``) as core attention."""

    def sparsebalance_layer_spec(config, vp_stage=None) -> ModuleSpec:
        from megatron.training.models.gpt import default_layer_spec

        return swap_core_attention(default_layer_spec(config, vp_stage), core,
                                   what=f"Megatron's {config.transformer_impl} layer spec")

    return sparsebalance_layer_spec


def get_sparsebalance_layer_spec(sb_config: SparseBalanceConfig, transformer_impl: str = "local",
                                 budget: Optional[BudgetContext] = None, **kwargs) -> ModuleSpec:
    """Megatron's GPT layer spec (``kwargs`` go to it) with SparseBalance core attention."""
    core = sparse_core_attention_spec(sb_config, budget)
    if transformer_impl == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec(**kwargs)
    elif transformer_impl == "transformer_engine":
        if not have_transformer_engine():
            raise ImportError("get_sparsebalance_layer_spec(transformer_impl='transformer_engine') "
                              "needs transformer-engine: pip install 'transformer-engine[pytorch]' "
                              "(or use transformer_impl='local')")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        spec = get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        raise ValueError(f"transformer_impl={transformer_impl!r}: expected one of "
                         f"{', '.join(TRANSFORMER_IMPLS)}")
    return swap_core_attention(spec, core, what=f"the {transformer_impl} spec")
