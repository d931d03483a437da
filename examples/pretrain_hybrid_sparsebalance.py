#!/usr/bin/env python
"""Pretrain a megatron-core HybridModel with SparseBalance, in Megatron's own ``pretrain()``.

    torchrun --nproc_per_node=2 examples/pretrain_hybrid_sparsebalance.py \
        --hybrid-layer-pattern '*-*-' --hidden-size 128 --num-attention-heads 4 \
        --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope \
        --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --train-iters 30 \
        --sparse-balance --sb-density 0.5

The HybridModel counterpart of ``pretrain_gpt_sparsebalance.py`` (Megatron-LM's
``pretrain_hybrid.py`` with the plugin's six calls, ``hooks``): ``--hybrid-layer-pattern`` gives
the layers (``*`` attention, ``-`` MLP; ``|`` between pipeline stages), only the attention layers
get the sparse attention and its budgets. On a machine without CUDA the plugin builds its local
hybrid stack spec (no transformer-engine) and runs on the CPU (gloo) by itself; the migration
guide's ``--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec`` is taken as
the base spec where transformer-engine is installed.
The ``__main__`` guard matters: Megatron's checkpoint writer spawns a process that re-imports it.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import (hybrid_config_from_args,
                                              pretrain_cfg_container_from_args)
from megatron.training.arguments import parse_and_validate_args

from sparsebalance_megatron.megatron import hooks

if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=hooks.extra_args_provider(packed_data=True, model="hybrid"),
        args_defaults=hooks.args_defaults(packed_data=True))
    model_cfg = hybrid_config_from_args(args)
    hooks.install(args, model_cfg, packed_data=True)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg),
             hooks.datasets_provider(), ModelType.encoder_or_decoder, hooks.forward_step())
    hooks.finish()
