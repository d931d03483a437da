"""What a step's plan is made from, and what a plan-ahead draft read (a base of
``StepPlanning``, so of ``SparseBalanceCallback``): the latency calibration and the sensitivity
tracker's state, the basis a checkpoint saves with the prepared step (``ahead_basis``), and the
tracker's updates the planner process's copy and the basis's copy follow. Its methods read the
callback's ``latency``, ``tracker`` and planner process (``step/planning.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LaggedBasis:
    """A plan-ahead draft's basis without a copy of the tracker (``StepPlanning._lagged_basis``):
    the latency calibration as it was, how many tracker updates the draft saw, and the quality
    model's refreshed scales it planned by."""

    latency: Optional[dict]
    mark: int
    quality_scales: Optional[list] = None


class PlanBasis:
    """The plan's basis and the tracker's followers (a base of ``StepPlanning``)."""

    def _planning_state(self) -> dict:
        """The state plans are made from: latency calibration, sensitivities and the quality
        model's refreshed scales (``step/quality_probe.py``; None: the launch-time model)."""
        return {"latency": self.latency.calibration_state() if self.latency else None,
                "sensitivity": self.tracker.state_dict() if self.tracker else None,
                "quality_scales": self._quality_scales()}

    def _quality_scales(self) -> Optional[list]:
        """The scales the rank's drafts plan by now (a list: the checkpoint's plain type)."""
        scales = None if self._drafter is None else self._drafter.quality_scales
        return None if scales is None else list(scales)

    def _state_basis(self) -> dict:
        """``_planning_state`` as it is now, unchanged by later steps: its containers are built
        fresh by ``calibration_state`` / ``state_dict`` and hold only numbers and strings, so no
        deep copy is needed."""
        return self._planning_state()

    def _lagged_basis(self) -> "LaggedBasis":
        """The state a draft starting now is planned from, without copying the tracker: its
        latency calibration, and the number of tracker updates so far. A copy of the tracker
        follows the live one up to the prepared step's basis (``_commit``), read only when a
        checkpoint is saved (``ahead_basis``)."""
        if self.tracker is not None and self._basis_tracker is None:
            self._basis_tracker = type(self.tracker)(ema=self.tracker.ema,
                                                     signal=self.tracker.signal)
            self._basis_tracker.load_state_dict(self.tracker.state_dict())
            self._basis_log, self._basis_mark = [], self._updates
        return LaggedBasis(self.latency.calibration_state() if self.latency else None,
                           self._updates, self._quality_scales())

    def _advance_basis(self, basis) -> None:
        """The tracker's copy brought to ``basis`` (a ``LaggedBasis`` being committed)."""
        if not isinstance(basis, LaggedBasis) or self._basis_tracker is None:
            return
        n = basis.mark - self._basis_mark
        if n < 0:
            raise RuntimeError(f"plan-ahead basis at update {basis.mark} is older than the "
                               f"tracker copy's ({self._basis_mark})")
        for update in self._basis_log[:n]:
            self._basis_tracker.update(*update)
        del self._basis_log[:n]
        self._basis_mark = basis.mark

    def ahead_basis(self) -> Optional[dict]:
        """The state the prepared step was planned from, as saved (``ahead_basis``), or None."""
        basis = self._ready_basis
        if isinstance(basis, LaggedBasis):
            return {"latency": basis.latency,
                    "sensitivity": None if self._basis_tracker is None
                    else self._basis_tracker.state_dict(), "quality_scales": basis.quality_scales}
        return basis

    def _tracker_sync(self):
        """What brings the planner process's tracker to this one's: its whole state after a
        load (or at the start), else the updates since the last draft, in order."""
        if self.tracker is None:
            return None
        log, self._tracker_log = self._tracker_log, []
        if not self._tracker_synced:
            self._tracker_synced = True
            return ("reset", self.tracker.state_dict())
        return ("updates", log)

    def _track(self, ids, lengths, values) -> None:
        """Update the sensitivity tracker with a step's measurements (and log them for the
        planner process's copy and the plan-ahead basis's)."""
        self.tracker.update(ids, lengths, values)
        self._updates += 1
        if self._process is not None:
            self._tracker_log.append((ids, lengths, values))
        if self._basis_tracker is not None:
            self._basis_log.append((ids, lengths, values))

    def _tracker_loaded(self) -> None:
        """The tracker's state was replaced (a resume): the next draft sends it whole, and the
        basis's copy starts again from it."""
        self._tracker_synced, self._tracker_log = False, []
        self._basis_tracker, self._basis_log = None, []
