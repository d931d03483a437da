"""Model provider: a megatron-core GPTModel per pipeline stage, with the SparseBalance layer spec.

Sparse attention on: ``get_sparsebalance_layer_spec`` (only ``core_attention`` swapped).
Sparse attention off: the stock spec (transformer-engine's when ``--transformer-impl
transformer_engine``, else the local one with a THD-capable dense core attention, because the local
``DotProductAttention`` refuses packed documents).
"""

from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from ..config import SparseBalanceConfig

log = logging.getLogger(__name__)


def get_dense_layer_spec(args):
    """The stock Megatron spec for a dense run (packed documents supported)."""
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    from .dense_attention import DenseVarlenCoreAttention

    spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                                  normalization=args.normalization))
    spec.submodules.self_attention.submodules.core_attention = DenseVarlenCoreAttention
    return spec


def get_layer_spec(args, sb_config: SparseBalanceConfig):
    if sb_config.sparse_attention_enabled:
        from .spec import get_sparsebalance_layer_spec

        return get_sparsebalance_layer_spec(
            sb_config, transformer_impl=args.transformer_impl,
            qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return get_dense_layer_spec(args)


def make_model_provider(args, sb_config: SparseBalanceConfig):
    """A ``model_provider(pre_process, post_process, config, ...)`` for megatron.training.get_model."""

    def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None,
                       vp_stage=None, **unused):
        from megatron.training.argument_utils import core_transformer_config_from_args

        if config is None:
            config = core_transformer_config_from_args(args)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_layer_spec(args, sb_config),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    return model_provider
