#!/usr/bin/env python
"""Pretrain a megatron-core GPT with SparseBalance, in Megatron's own ``pretrain()``.

    torchrun --nproc_per_node=2 examples/pretrain_gpt_sparsebalance.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 \
        --lr 3e-4 --train-iters 30 --sparse-balance --sb-density 0.5

Megatron's own flags work as usual; ``--sparse-balance`` and the ``--sb-*`` flags are ours. The
flow is Megatron-LM's ``pretrain_gpt.py`` with the plugin's six calls (``hooks``); the data path
is always the plugin's (packed documents; ``--data-path`` or the built-in corpus). On a machine
without CUDA it runs on the CPU (gloo) by itself.
The ``__main__`` guard matters: Megatron's checkpoint writer spawns a process that re-imports it.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from sparsebalance_megatron.megatron import hooks

if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=hooks.extra_args_provider(packed_data=True, model="gpt"),
        args_defaults=hooks.args_defaults(packed_data=True))
    model_cfg = gpt_config_from_args(args)
    hooks.install(args, model_cfg, packed_data=True)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg),
             hooks.datasets_provider(), ModelType.encoder_or_decoder, hooks.forward_step())
    hooks.finish()
