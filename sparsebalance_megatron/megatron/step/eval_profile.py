"""``--sb-eval-density trained``: Megatron's evaluation reads the network at the densities DST
trained it at.

Every planned step's record holds each (virtual) pipeline stage's work-weighted mean density
(``density_per_stage``). ``TrainedProfile`` keeps their mean over the run's steps per decoder
layer (a layer: its stage's), and gives evaluation, which runs outside any step plan
(``BudgetContext.layer_densities``), that profile scaled by the one factor that makes the
model's kept attention work uniform ``--sb-density``'s (``latency.work.scaled_to_work``). Kept
work is what the selection keeps of the documents trained on so far: every step adds the kept
block pairs of its documents at each density of ``GRID`` (``report_sums.rank_parts``'
``kept_curve``, summed over the DP group), so a profile that moves density between layers is
charged the sink, local and diagonal blocks each query block keeps whatever its density (the
training study's reading, QUALITY.md, scales the same way on its held-out documents). Kept per
layer in the checkpoint, so a resume on another pipeline layout keeps it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...latency.layout import ATTENTION, PipelineLayout
from ...latency.work import scaled_to_work


class TrainedProfile:
    """The mean planned density of every decoder layer over the steps ``add`` was given, and
    the kept work of their documents against density."""

    GRID = np.arange(1, 101) / 100.0     # densities the kept work is counted at (interpolated)

    def __init__(self, layout: PipelineLayout, density: float):
        self.stage_of_layer = np.asarray(layout.layer_stages(), dtype=np.int64)
        self.num_stages = layout.num_stages
        pattern = layout.pattern or ATTENTION * layout.num_layers
        # Megatron's 1-based global numbers of the layers the sparse attention budgets
        self.attention = [n + 1 for n, c in enumerate(pattern) if c == ATTENTION]
        self.density = float(density)
        self.sums, self.curve = np.zeros(layout.num_layers), np.zeros(self.GRID.size)
        self.steps = 0
        self._layers: Optional[dict] = None     # layer_densities, made once a change

    @classmethod
    def of(cls, layout: PipelineLayout, sb) -> Optional["TrainedProfile"]:
        """The run's profile: None unless ``--sb-eval-density trained`` (with DST)."""
        return cls(layout, sb.density) if sb.eval_density == "trained" and sb.dst_enabled \
            else None

    def add(self, density_per_stage, kept_curve=None) -> Optional[list]:
        """One planned step's ``density_per_stage`` (None: the step had no plan) and the kept
        pairs of its documents at ``GRID`` (None: not counted); returns ``stage_densities``
        after it (the record's ``eval_density_per_stage``)."""
        if density_per_stage is None:
            return self.stage_densities()
        d = np.asarray(density_per_stage, dtype=np.float64)
        if d.shape != (self.num_stages,):
            raise ValueError(f"density_per_stage {list(d)}: expected {self.num_stages} "
                             f"stages' densities")
        self.sums += d[self.stage_of_layer]
        self.steps += 1
        if kept_curve is not None:
            self.curve += np.asarray(kept_curve, dtype=np.float64)
        self._layers = self._scaled()
        return self.stage_densities()

    def work(self, density: float) -> float:
        """A layer's kept work at ``density`` on the documents so far (before any: the
        density itself, planned work)."""
        return float(np.interp(density, self.GRID, self.curve)) if self.curve[-1] > 0 \
            else density

    def layer_densities(self) -> Optional[dict]:
        """{layer number: density} of every attention layer, the profile at uniform d0's kept
        work; None before any planned step (evaluation at uniform d0)."""
        return None if self._layers is None else dict(self._layers)

    def _scaled(self) -> Optional[dict]:
        """``layer_densities`` from the sums: the bisection over the profile's distinct
        densities, each weighted by its layers (a stage's layers share one)."""
        if not self.steps:
            return None
        profile = (self.sums / self.steps)[np.asarray(self.attention) - 1]
        values, inverse, counts = np.unique(profile, return_inverse=True, return_counts=True)
        scaled = scaled_to_work(values.tolist(), self.work, self.density,
                                weights=counts.tolist())
        return dict(zip(self.attention, np.asarray(scaled)[inverse].tolist()))

    def stage_densities(self) -> Optional[list]:
        """``layer_densities`` per stage (the mean of its attention layers'; None for a stage
        without one): the record's ``eval_density_per_stage``."""
        if self._layers is None:
            return None
        out = [[] for _ in range(self.num_stages)]
        for n, d in self._layers.items():
            out[self.stage_of_layer[n - 1]].append(d)
        return [round(sum(v) / len(v), 4) if v else None for v in out]

    def describe(self) -> str:
        """The run summary's line."""
        stages = "/".join(f"{d:.4f}" for d in self.stage_densities() if d is not None)
        return (f"evaluation reads the trained profile: stage densities {stages} (DST's mean "
                f"over {self.steps} steps, at uniform {self.density:g}'s kept work; "
                f"--sb-eval-density trained)")

    def state_dict(self) -> dict:
        return {"layer_sums": self.sums.tolist(), "steps": self.steps,
                "kept_curve": self.curve.tolist()}

    def load_state_dict(self, state: Optional[dict]) -> Optional[str]:
        """Restore a checkpoint's profile; a note (str) where it cannot be kept."""
        self.sums, self.curve, self.steps = np.zeros(self.sums.size), np.zeros(self.GRID.size), 0
        self._layers = None
        if not state:                  # a checkpoint without one: from this run's steps
            return None
        sums = state.get("layer_sums") or []
        if len(sums) != self.sums.size:
            return (f"--sb-eval-density trained: the checkpoint's profile covers {len(sums)} "
                    f"decoder layers, this model has {self.sums.size}: it starts afresh")
        self.sums, self.steps = np.asarray(sums, dtype=np.float64), int(state["steps"])
        self.curve = np.asarray(state["kept_curve"], dtype=np.float64)
        self._layers = self._scaled()
        return None
