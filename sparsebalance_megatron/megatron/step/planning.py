"""The planning half of ``SparseBalanceCallback``: a step's documents, packing and budgets, built
before the step runs, and the planner that drafts the next one while a step trains.

``StepPlanning`` is a base class of the callback, not a component of its own: its methods read the
callback's sampler, latency model, sensitivity tracker, replay, layout and capacity
(``step/callback.py`` sets them) and write the prepared step the callback's ``take_step`` reads. A step
is first a ``Draft`` (``step/drafting.py``: no collective, the same function in-line, on the planner
thread or in the planner process, ``step/ahead.py``), then ``_commit`` makes it the
``PreparedStep`` (collective: rank 0's DST plan is broadcast as a fixed-size tensor,
``step/exchange.py``). Each packing is committed only where
predicted no slower than the static baseline (do no harm, ``step/choice.py``).
No torch.distributed outside ``comm``; megatron only through the callback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...batching.plan import BatchPlan
from ...plan import BudgetPlan
from ..runtime import comm
from .plan_record import PlanShape
from .ahead import Planner, PlannerProcess
from .drafting import Draft, Drafter  # noqa: F401  (Draft: the planners' result type)


@dataclass
class LaggedBasis:
    """A plan-ahead draft's basis without a copy of the tracker (``StepPlanning._lagged_basis``):
    the latency calibration as it was, and how many tracker updates the draft saw."""

    latency: Optional[dict]
    mark: int


@dataclass
class PreparedStep:
    """One step's data and budgets, built before the step runs."""

    iteration: int                 # Megatron's 0-based iteration (args.curr_iteration)
    first_bin: int                 # Megatron's consumed samples before the step
    batch: BatchPlan               # [dp][m] micro-batches of segments, padding known
    plan: Optional[BudgetPlan]     # None: dense run
    report: Optional[dict]         # DST's report (None: static plan)
    units: object = None           # the latency model's UnitFeatures of the batch (padded)
    stand_down: Optional[dict] = None  # do-no-harm record (step_choice.choose); None: no choice


class StepPlanning:
    """Packing, drafting and committing a step's plan (a base of ``SparseBalanceCallback``)."""

    def drafter(self) -> Drafter:
        """What this rank's drafts read (built once, after the callback set its parts)."""
        if self._drafter is None:
            self._drafter = Drafter(self.sb, self.latency, self.tracker, dp=self.dp,
                                    capacity=self.capacity,
                                    attention_layers=self.layout.attention_layers,
                                    replay=self.replay)
        return self._drafter

    def pack(self, segments, num_microbatches: int, method: Optional[str] = None) -> BatchPlan:
        """The step's micro-batches by --sb-packing (or ``method``): sequential (Megatron),
        token_balanced, SAB."""
        return self.drafter().pack(segments, num_microbatches, method)

    def prepare_step(self, iteration: int, num_microbatches: int) -> None:
        """Documents, packing and budgets of ``iteration`` (collective: DST plan broadcast)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        draft = self._draft(iteration, num_microbatches)
        draft.basis = self._state_basis() if self.sb.plan_ahead else None
        self._commit(draft)
        self._overhead_s += time.perf_counter() - t0
        self._own_s += time.thread_time() - c0

    def _draft(self, iteration: int, num_microbatches: int) -> Draft:
        """The step's documents (the sampler's next bins), packing, latency features and
        (rank 0) DST plan; no collective (safe on the planner thread)."""
        first_bin = self.sampler.bins
        segments = self.sampler.next_bins(self.dp * num_microbatches)
        return self.drafter().draft(iteration, first_bin, segments, num_microbatches,
                                    with_dst=comm.rank() == 0)

    def _commit(self, draft: Draft) -> None:
        """The draft becomes the prepared step (collective: rank 0's DST plan is broadcast)."""
        plan, report, sb, stand = None, None, self.sb, draft.stand_down
        if self.replay is not None and sb.sparse_attention_enabled:   # every rank read it
            plan = BudgetPlan(draft.iteration, draft.replayed)
        elif sb.dst_enabled:
            densities, report = self.exchange.broadcast_plan(draft.payload,
                                                             self._plan_shape(draft))
            plan = BudgetPlan(draft.iteration, np.asarray(densities))
            stand = report.get("stand_down")
        # SAB's packing, or the baseline's where SAB stood down
        batch, units = draft.packing(1 if stand is not None and stand["packing_index"] == 1
                                     else 0)
        if plan is None and sb.sparse_attention_enabled:
            plan = BudgetPlan.static(draft.iteration, sb.density, self.dp,
                                     batch.num_microbatches, self.layout.num_stages)
        self._ready = PreparedStep(draft.iteration, draft.first_bin, batch, plan, report,
                                   units, stand)
        self._advance_basis(draft.basis)
        self._ready_basis = draft.basis
        if not self._layout_checked:
            self._layout_checked = True
            self._check_layout(batch, units)

    def _plan_shape(self, draft: Draft) -> PlanShape:
        """The size of the draft's plan record, known on every rank (``step/plan_record.py``)."""
        return PlanShape(self.dp, draft.num_microbatches, self.layout.num_stages,
                         options=draft.options, sensitivity=self.tracker is not None,
                         ranks=self.layout.pp)

    def _planning_state(self) -> dict:
        """The state plans are made from: latency calibration and sensitivities."""
        return {"latency": self.latency.calibration_state() if self.latency else None,
                "sensitivity": self.tracker.state_dict() if self.tracker else None}

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
                           self._updates)

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
                    else self._basis_tracker.state_dict()}
        return basis

    def _plan_ahead(self) -> None:
        """--sb-planner process/thread: start drafting the step after the prepared one, from
        the current state (which nothing changes until ``end_step`` joins the draft)."""
        step = self._ready
        if not self.sb.plan_ahead or step is None or step.iteration + 1 >= self.args.train_iters:
            return
        m, it = self._num_microbatches_next(step), step.iteration + 1
        basis = self._lagged_basis()
        if self.sb.planner == "thread":
            self._planner = Planner(lambda: self._draft(it, m), basis)
            return
        self.start_planner()
        first_bin = self.sampler.bins
        segments = self.sampler.next_bins(self.dp * m)
        self._planner = self._process.submit(
            it, first_bin, segments, m, with_dst=comm.rank() == 0,
            latency_state=basis.latency, tracker_sync=self._tracker_sync(), basis=basis)

    def start_planner(self) -> None:
        """--sb-planner process: start this rank's planner process (once; it reads its copy of
        the Drafter and imports while the first step is prepared, before training starts)."""
        if self.sb.planner == "process" and self._process is None:
            self._process = PlannerProcess(self.drafter())
            self._tracker_synced = False

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

    def close_planner(self) -> None:
        """End the planner process, if one runs (its exit also ends it)."""
        if self._process is not None:
            self._process.close()
            self._process = None

    def _units(self, batch: BatchPlan):
        """The latency model's features of the step's packed micro-batches (None without a
        latency model)."""
        return self.drafter().units(batch)

    def _check_layout(self, batch: BatchPlan, units) -> None:
        """Once, on rank 0: warn when the run's pipeline layout is predicted well slower (static,
        at d0, this step's data) than another split Megatron's flags allow."""
        if comm.rank() != 0 or self.latency is None or self.layout.pp < 2 \
                or self.layout.pattern is not None:   # the search splits GPT layers only
            return
        from ...experiments.layout_search import LAYOUT_GAP_WARN, layout_gap
        from ...latency.layout import LayoutError
        try:
            gap, best = layout_gap(self.latency, units, self.dp,
                                   batch.num_microbatches, self.layout, self.sb.density)
        except LayoutError:
            return   # a table that knows only its own layout: nothing to compare
        if gap > LAYOUT_GAP_WARN:
            comm.say(f"warning: the pipeline layout {self.layout.describe()} is predicted "
                     f"{gap:.2f}x slower (static, d0, this step's data) than "
                     f"{best.describe()} ({' '.join(best.megatron_flags())}); see "
                     f"sparsebalance-layout")
