"""The quality model DST plans by: a sample's held-out loss change against the density of each
depth group of the model's layers and the sample's length (``cost``, its shipped default
measured on SmolLM2-135M), the same on a pipeline's stages (``stages``), and the rule that
refreshes it from the network being trained (``refresh``). The latency model's counterpart:
the planner reads both. Pure numpy; must not import torch or megatron."""

from .cost import QualityCost, QualityCostError, load_quality_cost
from .stages import StageQuality

__all__ = ["QualityCost", "QualityCostError", "load_quality_cost", "StageQuality"]
