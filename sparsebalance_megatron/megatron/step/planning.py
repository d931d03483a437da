"""The planning half of ``SparseBalanceCallback``: a step's documents, packing and budgets, built
before the step runs, and the ``--sb-plan-ahead`` thread that drafts the next one.

``StepPlanning`` is a base class of the callback, not a component of its own: its methods read the
callback's sampler, latency model, sensitivity tracker, replay, layout and capacity
(``step/callback.py`` sets them) and write the prepared step the callback's ``take_step`` reads. A step
is first a ``Draft`` (no collective: safe on the planner thread), then ``_commit`` makes it the
``PreparedStep`` (collective: rank 0's DST plan is broadcast as a fixed-size tensor,
``step/exchange.py``). Each packing is committed only where
predicted no slower than the static baseline (do no harm, ``step/choice.py``).
No torch.distributed outside ``comm``; megatron only through the callback.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...batching.plan import BatchPlan
from ...plan import BudgetPlan
from ..runtime import comm
from .checks import check_assignment
from .choice import wants_baseline_packing
from .plan_record import PlanShape


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


@dataclass
class Draft:
    """A step planned without collectives (``SparseBalanceCallback._draft``): every rank packs the
    same micro-batches; rank 0 also holds the DST plan the commit broadcasts."""

    iteration: int
    first_bin: int
    batch: BatchPlan
    units: object
    payload: Optional[tuple]       # rank 0 with DST: (densities, report); else None
    replayed: object = None        # --sb-replay-plans: the recorded densities (None: dense)
    cpu_s: float = 0.0             # CPU time the draft took (its thread's)
    basis: Optional[dict] = None   # plan-ahead: the plugin state it was planned from
    baseline: Optional[tuple] = None   # (batch, units) packed the baseline's way (stand-down)
    stand_down: Optional[dict] = None  # without DST: every rank's own packing choice


class Planner:
    """One background draft (``--sb-plan-ahead``): a daemon thread, its result or exception."""

    def __init__(self, fn, basis: dict):
        self.basis, self._out, self._err = basis, None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="sparsebalance-planner")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out = fn()
        except BaseException as e:           # re-raised on the training thread by result()
            self._err = e

    def result(self) -> Draft:
        self._thread.join()
        if self._err is not None:
            raise self._err
        self._out.basis = self.basis
        return self._out


class StepPlanning:
    """Packing, drafting and committing a step's plan (a base of ``SparseBalanceCallback``)."""

    def pack(self, segments, num_microbatches: int, method: Optional[str] = None) -> BatchPlan:
        """The step's micro-batches by --sb-packing (or ``method``): sequential (Megatron),
        token_balanced, SAB."""
        from ...batching.packing import (latency_sample_cost_fn, sab_plan, sequential_plan,
                                         token_balanced_plan)

        sb, kw = self.sb, dict(dp=self.dp, num_microbatches=num_microbatches,
                               max_tokens=self.capacity)
        method = method or sb.packing_method
        if method == "sab":
            plan = sab_plan(segments, cost_fn=latency_sample_cost_fn(self.latency, sb.density),
                            sensitivity=self.tracker, long_sample_policy=sb.long_sample_policy,
                            seed=sb.seed, **kw)
        elif method == "token_balanced":
            plan = token_balanced_plan(segments, long_sample_policy=sb.long_sample_policy,
                                       seed=sb.seed, **kw)
        else:
            plan = sequential_plan(segments, **kw)
        # variable-length micro-batches: the planner's units end where the packed tensors do
        return plan.with_length_multiple(sb.microbatch_multiple)

    def prepare_step(self, iteration: int, num_microbatches: int) -> None:
        """Documents, packing and budgets of ``iteration`` (collective: DST plan broadcast)."""
        t0 = time.perf_counter()
        draft = self._draft(iteration, num_microbatches)
        draft.basis = self._state_basis() if self.sb.plan_ahead else None
        self._commit(draft)
        self._overhead_s += time.perf_counter() - t0

    def _draft(self, iteration: int, num_microbatches: int) -> Draft:
        """The step's documents, packing, latency features and (rank 0) DST plan; reads the
        sampler, latency model and tracker, no collective (safe on the planner thread)."""
        t0 = time.thread_time()
        first_bin = self.sampler.bins
        segments = self.sampler.next_bins(self.dp * num_microbatches)
        replayed, payload, stand = None, None, None
        if self.replay is not None:            # the recorded packing and densities
            batch, replayed = self.replay.step(iteration, first_bin, segments, num_microbatches)
            options = [self._checked(segments, batch)]
        else:
            options = [self._packed(segments, num_microbatches)]
            if wants_baseline_packing(self.sb, self.latency):     # do no harm: SAB vs baseline
                options.append(self._packed(segments, num_microbatches, self.sb.stand_down))
            if self.sb.dst_enabled:
                if comm.rank() == 0:
                    densities, report, _ = self._choose(options, dst=True)
                    payload = (densities, report)
            elif len(options) > 1:
                stand = self._choose(options, dst=False)[2]
        return Draft(iteration, first_bin, *options[0], payload, replayed,
                      cpu_s=time.thread_time() - t0,
                      baseline=options[1] if len(options) > 1 else None, stand_down=stand)

    def _packed(self, segments, num_microbatches: int, method: Optional[str] = None) -> tuple:
        return self._checked(segments, self.pack(segments, num_microbatches, method))

    def _checked(self, segments, batch: BatchPlan) -> tuple:
        """(batch, its latency features), once the batch is checked to hold ``segments``."""
        check_assignment(segments, batch, self.capacity)
        return batch, self._units(batch)

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
        batch, units = draft.batch, draft.units
        if stand is not None and stand["packing_index"] == 1:    # SAB stood down
            batch, units = draft.baseline
        if plan is None and sb.sparse_attention_enabled:
            plan = BudgetPlan.static(draft.iteration, sb.density, self.dp,
                                     batch.num_microbatches, self.layout.num_stages)
        self._ready = PreparedStep(draft.iteration, draft.first_bin, batch, plan, report,
                                   units, stand)
        self._ready_basis = draft.basis
        if not self._layout_checked:
            self._layout_checked = True
            self._check_layout(batch, units)

    def _plan_shape(self, draft: Draft) -> PlanShape:
        """The size of the draft's plan record, known on every rank (``step/plan_record.py``)."""
        return PlanShape(self.dp, draft.batch.num_microbatches, self.layout.num_stages,
                         options=1 if draft.baseline is None else 2,
                         sensitivity=self.tracker is not None)

    def _planning_state(self) -> dict:
        """The state plans are made from: latency calibration and sensitivities."""
        return {"latency": self.latency.calibration_state() if self.latency else None,
                "sensitivity": self.tracker.state_dict() if self.tracker else None}

    def _state_basis(self) -> dict:
        """A copy of ``_planning_state`` that later steps do not change (plan-ahead)."""
        return copy.deepcopy(self._planning_state())

    def _plan_ahead(self) -> None:
        """--sb-plan-ahead: start drafting the step after the prepared one on the planner thread,
        from the current state (which nothing changes until ``end_step`` joins the draft)."""
        step = self._ready
        if not self.sb.plan_ahead or step is None or step.iteration + 1 >= self.args.train_iters:
            return
        m = self._num_microbatches_next(step)
        self._planner = Planner(lambda: self._draft(step.iteration + 1, m), self._state_basis())

    def _units(self, batch: BatchPlan):
        """The latency model's features of the step's packed micro-batches, built once per step
        and shared by DST, calibration and the layout check (None without a latency model)."""
        if self.latency is None:
            return None
        return self.latency.unit_features(batch.unit_csr(with_padding=True))

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

    def _choose(self, options: list, *, dst: bool):
        """(densities, DST report, stand-down record) of the step: DST on each packing option,
        under the do-no-harm rule (``step_choice.choose``)."""
        from .choice import choose, raise_headroom

        return choose(self.sb, self.latency, options, self.dp, tracker=self.tracker, dst=dst,
                      raise_headroom=raise_headroom(self.sb, self.latency, self.dp)
                      if dst else None, stage_layers=self.layout.attention_layers)
