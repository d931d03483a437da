"""The only adapter layer between SparseBalance and Megatron: everything here may import megatron.

hooks (the integration both entry points call around Megatron's ``pretrain()``), launch (checks
before any process group), spec/core_attention/budget (the layer spec and the typed slots the
budget travels through), data (packed micro-batch iterators), callback/reporting/state (the
per-step callback: SAB, DST, calibration, metrics, resume state), timing (per-micro-batch timers),
latency_setup/profile/profile_cli (latency tables), compat (CPU shims), comm (torch.distributed).
Nothing is imported eagerly, so ``import sparsebalance_megatron`` never needs megatron.
"""
