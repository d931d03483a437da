"""Pipeline x data-parallel step simulator (pure numpy; no torch, no megatron)."""

from .pipeline import StepSimulation, pipeline_makespan_s, simulate_1f1b, stage_order

__all__ = ["StepSimulation", "pipeline_makespan_s", "simulate_1f1b", "stage_order"]
