"""Sparsity-aware batching (SAB): pack a global batch's samples into micro-batches and DP ranks
by predicted latency and sparsity sensitivity; plus the sequential and token-balanced baselines and
Megatron's own packer (``dp_balanced``).

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from .dp_balanced import dp_balanced_groups, dp_balanced_plan
from .packing import latency_sample_cost_fn, sab_plan, sequential_plan, token_balanced_plan
from .plan import (LONG_SAMPLE_POLICIES, BatchingError, BatchPlan, LongSampleError, Segment,
                   split_long)
from .sensitivity import (SensitivityTracker, length_bucket, prior_sensitivity,
                          unit_sensitivity)

__all__ = ["dp_balanced_groups", "dp_balanced_plan", "latency_sample_cost_fn",
           "sab_plan", "sequential_plan", "token_balanced_plan", "LONG_SAMPLE_POLICIES",
           "BatchingError", "BatchPlan", "LongSampleError", "Segment", "split_long",
           "SensitivityTracker", "length_bucket", "prior_sensitivity", "unit_sensitivity"]
