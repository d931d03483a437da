"""Layer specs with SparseBalance attention: megatron's own GPT specs, ``core_attention`` swapped.

``get_sparsebalance_layer_spec(sb_config, transformer_impl="local", **kwargs)`` builds megatron's
``get_gpt_layer_local_spec(**kwargs)`` (or ``get_gpt_layer_with_transformer_engine_spec`` for
``transformer_impl="transformer_engine"``, which needs transformer-engine installed) and replaces
only ``submodules.self_attention.submodules.core_attention`` with a ``ModuleSpec`` of
``SparseCoreAttention`` whose ``params`` carry ``sb_config``. Everything else (QKV projection,
RoPE, norms, MLP) stays megatron's. transformer-engine is probed, never required.
Must not touch torch.distributed.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import SparseBalanceConfig
from .core_attention import SparseCoreAttention

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


def sparse_core_attention_spec(sb_config: SparseBalanceConfig) -> ModuleSpec:
    """The core-attention builder: ``ModuleSpec(SparseCoreAttention, params={"sb_config": ...})``."""
    if not isinstance(sb_config, SparseBalanceConfig):
        raise ValueError(f"sb_config={sb_config!r}: expected a SparseBalanceConfig")
    return ModuleSpec(module=SparseCoreAttention, params={"sb_config": sb_config})


def get_sparsebalance_layer_spec(sb_config: SparseBalanceConfig,
                                 transformer_impl: str = "local", **kwargs) -> ModuleSpec:
    """Megatron's GPT layer spec (``kwargs`` go to it) with SparseBalance core attention."""
    core = sparse_core_attention_spec(sb_config)
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
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if getattr(attention.submodules, "core_attention", None) is None:
        raise ValueError(f"the {transformer_impl} spec has no self_attention.core_attention slot "
                         f"(multi-latent attention is not supported)")
    attention.submodules.core_attention = core
    return spec
