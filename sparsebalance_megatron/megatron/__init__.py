"""The only adapter layer between SparseBalance and Megatron: everything here may import megatron.

hooks (the integration every entry point calls around Megatron's ``pretrain()``), launch (checks
before any process group), spec/core_attention/budget (the layer spec and the typed slots the
budget travels through), hybrid (HybridModel's stack spec), attention_check (after the build:
every budgeted layer runs our attention), data (packed micro-batch iterators),
callback/reporting/state (the per-step callback: SAB, DST, calibration, metrics, resume state),
timing (per-micro-batch timers),
latency_setup/profile/profile_cli (latency tables), compat (CPU shims), comm (torch.distributed).
Nothing is imported eagerly, so ``import sparsebalance_megatron`` never needs megatron.
"""
