#!/usr/bin/env python
"""Train a megatron-core GPT with SparseBalance. Launch with torchrun, e.g.

    torchrun --nproc_per_node=2 examples/pretrain_gpt_sparsebalance.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 \
        --lr 3e-4 --train-iters 30 --sparse-balance --sb-density 0.5

Megatron's own flags work as usual; ``--sparse-balance`` and the ``--sb-*`` flags are ours.
The ``__main__`` guard matters: Megatron's checkpoint writer spawns a process that re-imports it.
"""

from sparsebalance_megatron.megatron.trainer import main

if __name__ == "__main__":
    main()
