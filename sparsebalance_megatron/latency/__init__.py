"""Latency model of one micro-batch on one pipeline stage: work features, fit, calibration,
JSON tables (profiled or analytic). Pure numpy; must not import megatron (the profiler CLI in
``profile_cli`` imports it lazily inside ``main``)."""

from .analytic import DeviceProfile, analytic_table
from .context_parallel import ContextParallelCost
from .features import FEATURES, UnitFeatures
from .layout import LayoutError, PipelineLayout, candidate_layouts
from .model import LatencyModel, UnitTerms
from .shape import ModelShape
from .table import (LatencyTableError, LatencyTableMismatch, read_table, stage_kinds_for,
                    validate_table, write_table)
from .work import attention_work, selection_work

__all__ = ["ContextParallelCost", "DeviceProfile", "ModelShape", "analytic_table", "FEATURES", "UnitFeatures",
           "LatencyModel", "UnitTerms", "LayoutError", "PipelineLayout", "candidate_layouts", "LatencyTableError", "LatencyTableMismatch",
           "read_table", "stage_kinds_for", "validate_table", "write_table", "attention_work",
           "selection_work"]
