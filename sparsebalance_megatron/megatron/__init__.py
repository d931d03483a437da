"""The only adapter layer between SparseBalance and Megatron: everything here may import megatron.

cpu_compat (CPU shims), core_attention/spec (layer spec), model (model provider), data (packed
micro-batch iterator), runtime (DST hooks), comm (torch.distributed), trainer (the training loop).
Nothing is imported eagerly, so ``import sparsebalance_megatron`` never needs megatron.
"""
