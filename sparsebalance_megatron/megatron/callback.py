"""``SparseBalanceCallback``: SAB and DST as a named per-step callback inside Megatron's ``train()``.

Megatron's loop runs unchanged; the callback is reached through its hooks only:

- ``train_iterator(chunk)`` (from the datasets provider, on every rank before training; once per
  model chunk with the interleaved schedule): for the first chunk the data position from
  ``args.consumed_train_samples``, the plugin state saved in the checkpoint of a resumed run, and
  the first step prepared; every chunk gets its own cursor over the same prepared steps.
- ``step_for_chunk()`` (a data iterator's first ``next`` of a step): the first chunk to read
  makes the prepared step current and installs its plan in the ``BudgetContext`` the attention
  reads (each chunk's layers are their own virtual stage of the plan).
- ``finalize_model_grads`` (``config.finalize_model_grads_func``, once per step on every rank
  after the last backward): this rank's per-micro-batch timings (``config.timers`` tee), then
  Megatron's finalize, then ``end_step``: gather timings and attention statistics, check that
  every rank used the plan, calibrate the latency model, refine sensitivities, report metrics,
  and prepare the next step: its documents (bins = Megatron's samples), SAB packing, and the DST
  plan (rank 0 plans, broadcasts; every rank holds identical budgets), each committed only where
  predicted no slower than the static baseline (do no harm, ``step_choice.py``).
- ``record_loss`` (the loss function), ``state_dict`` (Megatron's ``--dataloader-save`` hook).

With ``--sb-replay-plans`` a step's packing and densities are another run's recorded ones
(``replay.py``) instead of SAB's and DST's; the resume state is ``state.py``'s.

With ``--sb-plan-ahead`` the next step's draft (documents, packing, latency features, rank 0's
DST plan: no collective) is made by a background thread while the step trains, from the state
after the previous step; ``end_step`` joins it before it updates that state, and only the plan's
broadcast stays on the critical path. So a step's plan always uses the state after the step
before the previous one, and a checkpoint also holds that older state (``ahead_basis``): a
resumed run re-plans its first step from it and repeats the uninterrupted run.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..batching.plan import BatchPlan
from ..config import SparseBalanceConfig
from ..plan import BudgetPlan
from . import comm
from .budget import BudgetContext
from .step_choice import wants_baseline_packing

STATE_VERSION = 1


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
class _Draft:
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


class _Planner:
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

    def result(self) -> _Draft:
        self._thread.join()
        if self._err is not None:
            raise self._err
        self._out.basis = self.basis
        return self._out


class SparseBalanceCallback:
    """Owns the latency model, sensitivity tracker, packer and per-step plans of this rank."""

    def __init__(self, args, sb: SparseBalanceConfig, budget: BudgetContext, data, *, device):
        from megatron.core import parallel_state as ps

        from .reporting import StepReporter

        self.args, self.sb, self.budget, self.data, self.device = args, sb, budget, data, device
        self.corpus = data.corpus
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp, self.pp_rank = args.pipeline_model_parallel_size, \
            ps.get_pipeline_model_parallel_rank()
        self.capacity = args.seq_length * args.micro_batch_size
        # How micro-batches are built (data.microbatch_inputs): CP ranks of a DP rank read the
        # same micro-batches, each its share of the tokens; lengths fixed or variable.
        cp = ps.get_context_parallel_world_size()
        self.mb_args = dict(pad_multiple=sb.pad_multiple(cp), cp_size=cp,
                            cp_rank=ps.get_context_parallel_rank(),
                            length_multiple=sb.microbatch_multiple)
        self.latency = self.tracker = None
        if sb.dst_enabled or sb.batching_enabled:
            from .latency_setup import load_latency_model, table_backend
            self.latency = load_latency_model(args, sb)
            budget.set_backend(table_backend(self.latency.table, sb))   # auto: measured pick
        # routing: the latency table's crossover (or --sb-dense-below-tokens), known only now
        routing = self.latency.dense_below_tokens if self.latency is not None \
            else sb.routing_threshold(None)
        budget.set_routing(routing)
        if sb.batching_enabled:
            from ..batching.sensitivity import SensitivityTracker
            self.tracker = SensitivityTracker(signal=sb.sensitivity_signal)
        from ..latency.layout import PipelineLayout
        self.layout = PipelineLayout.from_megatron_args(args)   # launch.py checked it
        from .replay import plan_replay
        self.replay = plan_replay(sb, dp=self.dp, max_tokens=self.capacity,
                                  pad_multiple=self.mb_args["pad_multiple"],
                                  stages=self.layout.num_stages)   # None: plan here
        self.vp = self.layout.vp
        # A rank with several model chunks finds each layer's virtual stage by its number.
        self.layer_stages = self.layout.layer_stages() if self.vp > 1 else None
        self.reporter = StepReporter(args, sb, dp=self.dp, layout=self.layout,
                                     doc_positions=np.asarray(self.corpus.lengths,
                                                              dtype=np.int64) + 1,
                                     dense_below_tokens=routing,
                                     pad_multiple=self.mb_args["pad_multiple"])
        self.timers = None                      # hooks installs the MicrobatchTimers
        self.sampler = None
        self.steps_done = 0                     # steps this process ran (the first is warm-up)
        self._ready: Optional[PreparedStep] = None
        self._current: Optional[PreparedStep] = None
        self._chunks_read: set = set()          # model chunks that read the current step
        self._fwd_order: list = []              # (micro-batch, chunk) of every forward, in order
        self._finalized: Optional[int] = None
        self._losses: list = []
        self._doc_losses: list = []             # (doc ids, loss sums, tokens) per micro-batch
        self._overhead_s = 0.0
        self._layout_checked = False
        self._planner: Optional[_Planner] = None   # --sb-plan-ahead: the next step's draft
        self._ready_basis: Optional[dict] = None   # the state the prepared step was planned from
        self._ahead_s = 0.0                        # CPU seconds of the last background draft

    # --- Megatron hooks ----------------------------------------------------------------------
    def train_iterator(self, chunk: int = 0):
        """The train data iterator of model chunk ``chunk`` (all ranks; collective for the first
        chunk: the first plan is broadcast)."""
        from .data import TrainIterator

        if chunk:
            if self.sampler is None:
                raise RuntimeError(f"train_iterator(chunk={chunk}) before chunk 0's: Megatron "
                                   f"builds the iterators of the model chunks in order")
            return TrainIterator(self, self.device, chunk=chunk)
        args = self.args
        self.sampler = self.data.sampler("train", capacity=self.capacity, seed=self.sb.seed,
                                         long_sample_policy=self.sb.long_sample_policy,
                                         pad_multiple=self.mb_args["pad_multiple"])
        self.sampler.skip_bins(int(args.consumed_train_samples))
        state, ahead = None, False
        if args.iteration > 0 and args.load:
            from .launch import LaunchError
            from .state import restore_saved_state
            try:
                state, ahead = restore_saved_state(self)
                err = None
            except LaunchError as e:
                err = str(e)
            # Every rank refuses alike, before any other collective (the hooks say it once,
            # from rank 0), even where only some ranks could not read their state.
            errors = [e for e in comm.all_gather_object(err) if e]
            if errors:
                raise LaunchError(errors[0])
        if args.iteration < args.train_iters:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            self.prepare_step(args.iteration, get_num_microbatches())
            if ahead:
                self.load_state_dict(state)      # validated above as part of the same file
            self._plan_ahead()
        return TrainIterator(self, self.device)

    def finalize_model_grads(self, inner):
        """Megatron's ``finalize_model_grads_func``, with the step's end around it."""
        def finalize_model_grads(*a, **kw):
            timings = self.timers.step_timings() if self.timers is not None else {}
            out = inner(*a, **kw)
            iteration = self.args.curr_iteration
            if self._finalized != iteration:   # a rerun of the step (rerun state machine): once
                self._finalized = iteration
                self.end_step(iteration, timings)
            return out
        finalize_model_grads._sparsebalance = True
        return finalize_model_grads

    def record_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """The loss function's per-micro-batch (sum, tokens), last stage, training only."""
        if torch.is_grad_enabled():
            self._losses.append((loss_sum.detach(), num_tokens.detach()))

    @property
    def signal(self) -> Optional[str]:
        """The sensitivity signal this run measures: 'loss', 'recall', or None (no SAB)."""
        return self.tracker.signal if self.tracker is not None else None

    def record_doc_losses(self, doc_ids, loss_sums: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each document's (loss sum, loss tokens) in one micro-batch, last stage, training only
        (read at the end of the step, with the other statistics)."""
        if torch.is_grad_enabled():
            self._doc_losses.append((tuple(doc_ids), loss_sums.detach(), tokens.detach()))

    # --- before a step -----------------------------------------------------------------------
    def pack(self, segments, num_microbatches: int, method: Optional[str] = None) -> BatchPlan:
        """The step's micro-batches by --sb-packing (or ``method``): sequential (Megatron),
        token_balanced, SAB."""
        from ..batching.packing import (latency_sample_cost_fn, sab_plan, sequential_plan,
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

    def _draft(self, iteration: int, num_microbatches: int) -> _Draft:
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
        return _Draft(iteration, first_bin, *options[0], payload, replayed,
                      cpu_s=time.thread_time() - t0,
                      baseline=options[1] if len(options) > 1 else None, stand_down=stand)

    def _packed(self, segments, num_microbatches: int, method: Optional[str] = None) -> tuple:
        return self._checked(segments, self.pack(segments, num_microbatches, method))

    def _checked(self, segments, batch: BatchPlan) -> tuple:
        """(batch, its latency features), once the batch is checked to hold ``segments``."""
        _check_assignment(segments, batch, self.capacity)
        return batch, self._units(batch)

    def _commit(self, draft: _Draft) -> None:
        """The draft becomes the prepared step (collective: rank 0's DST plan is broadcast)."""
        plan, report, sb, stand = None, None, self.sb, draft.stand_down
        if self.replay is not None and sb.sparse_attention_enabled:   # every rank read it
            plan = BudgetPlan(draft.iteration, draft.replayed)
        elif sb.dst_enabled:
            densities, report = comm.broadcast_object(draft.payload, src=0)
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
        self._planner = _Planner(lambda: self._draft(step.iteration + 1, m), self._state_basis())

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
        from ..experiments.layout_search import LAYOUT_GAP_WARN, layout_gap
        from ..latency.layout import LayoutError
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
        from .step_choice import choose, raise_headroom

        return choose(self.sb, self.latency, options, self.dp, tracker=self.tracker, dst=dst,
                      raise_headroom=raise_headroom(self.sb, self.latency, self.dp)
                      if dst else None, stage_layers=self.layout.attention_layers)

    def step_for_chunk(self, chunk: int) -> PreparedStep:
        """The step the data iterator of model chunk ``chunk`` reads next: the current one if
        another chunk took it already, else the prepared one (``take_step``)."""
        if self._current is not None and chunk not in self._chunks_read:
            self._chunks_read.add(chunk)
            return self._current
        step = self.take_step()
        self._chunks_read = {chunk}
        return step

    def note_forward(self, microbatch: int, chunk: int) -> None:
        """A training forward of (micro-batch, model chunk) begins (Megatron's schedule order);
        maps the step's timer intervals to plan units."""
        self._fwd_order.append((int(microbatch), int(chunk)))

    def take_step(self) -> PreparedStep:
        """The prepared step becomes current (the data iterator's first read of a step)."""
        step, args = self._ready, self.args
        if step is None:
            raise RuntimeError("the data iterator was read past the prepared step: every step "
                               "must run its forward/backward through Megatron's train_step")
        if step.iteration != args.curr_iteration or step.first_bin != args.consumed_train_samples:
            raise RuntimeError(
                f"data out of step: prepared iteration {step.iteration} at sample "
                f"{step.first_bin}, Megatron is at iteration {args.curr_iteration}, sample "
                f"{args.consumed_train_samples}")
        self._ready, self._current = None, step
        self.budget.set_plan(step.plan, dp_rank=self.dp_rank, stage=self.pp_rank,
                             layer_stages=self.layer_stages)
        self._losses, self._fwd_order, self._doc_losses = [], [], []
        return step

    # --- after a step ------------------------------------------------------------------------
    def end_step(self, iteration: int, timings: dict) -> None:
        """Gather, check, calibrate, report; then prepare the next step (collective)."""
        t0 = time.perf_counter()
        step = self._current
        if step is None:
            raise RuntimeError(f"iteration {iteration} finished without reading the plugin's "
                               f"data iterator")
        loss = (torch.stack([x[0].float() for x in self._losses]).sum().item(),
                torch.stack([x[1].float() for x in self._losses]).sum().item()) \
            if self._losses else (0.0, 0.0)
        records = self.budget.pop_stats()
        stats = _doc_recalls(records) if self.signal == "recall" else {}
        mine = dict(dp=self.dp_rank, pp=self.pp_rank, fwd_s=timings.get("fwd_s", []),
                    bwd_s=timings.get("bwd_s", []), step_s=timings.get("step_s"), stats=stats,
                    served=self.budget.pop_served(),
                    used=_min_kept(records, self.budget.stage_of),
                    units=unit_order(self._fwd_order, self.layout, self.pp_rank),
                    fingerprint=_fingerprint(step.batch), loss=loss,
                    doc_loss=self._pop_doc_losses())
        gathered = comm.all_gather_object(mine)
        if len({g["fingerprint"] for g in gathered}) != 1:
            raise RuntimeError(f"iteration {iteration}: ranks packed different micro-batches "
                               f"(the sampler/packer must be deterministic on every rank)")
        if step.plan is not None:
            check_budgets(step.plan, gathered, check_used=self.sb.selection_mode == "density")
        if self.sb.timing_source == "model" and self.latency is not None and step.plan is not None:
            measured = self._modelled_busy(step)
            warm = True                        # a modelled time has no warm-up in it
        else:
            measured = _measured_busy(gathered, self.dp, self.pp,
                                      step.batch.num_microbatches * self.vp)
            # The first step of a process pays for warm-up (allocations, lazy init): no sample.
            warm = self.steps_done > 0
        # The next step's draft read the state this step is about to change: join it first.
        draft, self._planner = (self._planner.result() if self._planner is not None
                                else None), None
        calib = {}
        if self.latency is not None and step.plan is not None and warm:
            calib = self._calibrate(step, measured)
        self.steps_done += 1
        if self.tracker is not None:
            self._update_sensitivity(step, gathered)
        self._current, self._chunks_read = None, set()
        args = self.args
        if draft is not None:
            self._ahead_s = draft.cpu_s
            self._commit(draft)
            self._plan_ahead()
        elif iteration + 1 < args.train_iters:
            self.prepare_step(iteration + 1, self._num_microbatches_next(step))
        self._overhead_s += time.perf_counter() - t0
        self.reporter.report(iteration + 1, step, gathered, measured, calib,
                             overhead_s=self._overhead_s,
                             planned_ahead_s=self._ahead_s if self.sb.plan_ahead else None)
        self._overhead_s = 0.0

    def _num_microbatches_next(self, step: PreparedStep) -> int:
        """Micro-batches of the next step by Megatron's batch-size rules (its calculator at the
        consumed samples the next step will start from)."""
        from megatron.core import num_microbatches_calculator as nmc

        consumed = step.first_bin + self.dp * step.batch.num_microbatches
        args = self.args
        if args.step_batch_size_schedule is None:
            return nmc.get_num_microbatches()
        calc = nmc.StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size=args.micro_batch_size, data_parallel_size=self.dp,
            decrease_batch_size_if_needed=args.decrease_batch_size_if_needed, rank=-1,
            schedule=args.step_batch_size_schedule, seq_length=args.seq_length)
        calc.update(consumed, consistency_check=False)
        return calc.get()

    def _predicted_busy(self, step: PreparedStep) -> np.ndarray:
        """[dp, pp] uncorrected predicted fwd+bwd seconds of the step's units under its plan
        (a pipeline rank's model chunks together)."""
        units = step.units if step.units is not None else self._units(step.batch)
        return self.latency.busy_s(units, step.plan.densities)

    def _modelled_busy(self, step: PreparedStep) -> np.ndarray:
        """--sb-timing-source model: the prediction, --sb-straggler-slowdown times on the
        straggler rank (its --sb-straggler-stage alone if given); a deterministic stand-in for
        Megatron's timers."""
        busy = self._predicted_busy(step)
        if 0 <= self.sb.straggler_rank < self.dp:
            stages = slice(None) if self.sb.straggler_stage < 0 else self.sb.straggler_stage
            busy[self.sb.straggler_rank, stages] *= self.sb.straggler_slowdown
        return busy

    def _calibrate(self, step: PreparedStep, measured: np.ndarray) -> dict:
        """Per DP rank: measured fwd+bwd over its stages vs the uncorrected prediction; with
        PP, each pipeline rank's share of it too (one slow GPU of a pipeline)."""
        predicted = self._predicted_busy(step)
        corrected = predicted * self.latency.correction_grid(*predicted.shape)
        for r in range(self.dp):
            ok = np.isfinite(measured[r]).all()  # missing/NaN: keep the previous factor
            self.latency.calibrate(r, predicted[r] if ok else None, measured[r] if ok else None)
            self.latency.calibrate_stages(r, predicted[r], measured[r])
        busy = measured.sum(axis=1)
        err = np.abs(corrected.sum(axis=1) - busy) / np.maximum(busy, 1e-12)
        return {"predicted_busy_s": corrected.sum(axis=1).tolist(),
                "latency_error": float(np.nanmean(err)) if np.isfinite(err).any() else None,
                "calibration": [self.latency.correction(r) for r in range(self.dp)],
                "stage_calibration": self.latency.correction_grid(*predicted.shape).tolist()}

    def _pop_doc_losses(self) -> dict:
        """{doc_id: [loss sum, tokens]} of this rank's step (a document split over micro-batches
        summed), moved to the host in one transfer."""
        parts, self._doc_losses = self._doc_losses, []
        if not parts:
            return {}
        ids = [d for docs, _, _ in parts for d in docs]
        sums = torch.cat([torch.stack([s.float(), n.float()], dim=1) for _, s, n in parts])
        return _sum_by_doc((d, s_, n) for d, (s_, n) in zip(ids, sums.cpu().tolist()))

    def _update_sensitivity(self, step: PreparedStep, gathered) -> None:
        values: dict[int, float] = {}
        if self.signal == "loss":
            ranks = sorted(gathered, key=lambda g: (g["dp"], g["pp"]))
            sums = _sum_by_doc((d, s_, n) for g in ranks
                               for d, (s_, n) in sorted(g["doc_loss"].items()))
            values = {d: s_ / n for d, (s_, n) in sums.items() if n > 0}
        else:
            recalls: dict[int, list] = {}
            for g in sorted(gathered, key=lambda g: (g["dp"], g["pp"])):
                for doc_id, vals in sorted(g["stats"].items()):
                    recalls.setdefault(int(doc_id), []).extend(vals)
            values = {d: float(np.mean(v)) for d, v in recalls.items()}
        if not values:
            return
        lengths = {d: e - s for d, s, e in step.batch.segments()}
        ids = sorted(i for i in values if i in lengths)
        self.tracker.update(ids, [lengths[i] for i in ids], [values[i] for i in ids])

    # --- checkpoint state (inside Megatron's iter_* folder, via --dataloader-save) -----------
    def state_dict(self) -> dict:
        """Everything a resume restores, as plain Python types (``state.plain_state``: the one
        place that converts numpy/torch numbers and refuses what ``weights_only`` cannot read)."""
        from .state import plain_state

        out = {"version": STATE_VERSION, "iteration": int(self.args.curr_iteration) + 1,
               **self._planning_state(), "timing_source": self.sb.timing_source,
               "stand_down": self.reporter.stood.state_dict()}
        if self._ready_basis is not None:        # plan-ahead: what the next step was planned from
            out["ahead_basis"] = self._ready_basis
        return plain_state(out)

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            return
        if self.latency is not None and state.get("latency") is not None:
            self.latency.load_calibration_state(state["latency"])
        if self.tracker is not None and state.get("sensitivity") is not None:
            self.tracker.load_state_dict(state["sensitivity"])
        self.reporter.stood.load_state_dict(state.get("stand_down"))   # cumulative counts


def _check_assignment(segments, batch: BatchPlan, capacity: int) -> None:
    """The packer used every segment of the step exactly once and respected the capacity."""
    used = sorted(batch.segments())
    if used != sorted(tuple(s) for s in segments):
        raise RuntimeError("packer dropped or duplicated segments of the global batch")
    for r, rank in enumerate(batch.micro_batches):
        for j, mb in enumerate(rank):
            n = sum(e - s for _, s, e in mb)
            if n > capacity:
                raise RuntimeError(f"packer put {n} tokens in micro-batch ({r}, {j}), "
                                   f"capacity {capacity}")


def _fingerprint(batch: BatchPlan) -> int:
    return hash(tuple(tuple(tuple(mb) for mb in rank) for rank in batch.micro_batches))


def unit_order(fwd_order: list, layout, pp_rank: int) -> list:
    """The plan unit (micro-batch, virtual stage) of each of a pipeline rank's forward timer
    intervals, in order. Backward intervals follow the same micro-batches with the model chunks
    reversed (Megatron's interleaved schedule runs chunk ``vp - 1 - c`` where the forward ran
    ``c``; with one chunk both orders are the forward's)."""
    return [(mb, layout.stage_of(pp_rank, chunk)) for mb, chunk in fwd_order]


def _measured_busy(gathered, dp: int, pp: int, m: int) -> np.ndarray:
    """[dp, pp] measured fwd+bwd seconds of every rank's ``m`` timed forwards and backwards
    (micro-batches x model chunks; NaN: missing); the slowest of the TP and CP ranks that share
    a (dp, pp) place (they wait for each other in their collectives)."""
    measured = np.full((dp, pp), np.nan)
    for g in gathered:
        if len(g["fwd_s"]) == m and len(g["bwd_s"]) == m:
            t = float(np.sum(g["fwd_s"]) + np.sum(g["bwd_s"]))
            prev = measured[g["dp"], g["pp"]]
            measured[g["dp"], g["pp"]] = t if not np.isfinite(prev) else max(prev, t)
    return measured


USED_TOLERANCE = 1e-3   # kept blocks are counted in whole blocks; a float rounding slack


def check_budgets(plan: BudgetPlan, gathered, *, check_used: bool = True) -> None:
    """Every rank (all TP ranks of a micro-batch included) asked for exactly the plan's density,
    and its attention kept at least that share of every sequence's causal blocks (density
    selection keeps ceil(density x available) of them: fewer means the plan was ignored)."""
    bad = []
    for g in gathered:
        for (mb, stage), d in (g["served"] or {}).items():
            want = plan.density(g["dp"], mb, stage)
            if d != want:
                bad.append(f"(dp {g['dp']}, stage {stage}, micro-batch {mb}): {d} != {want}")
        for (mb, stage), kept in (g.get("used") or {}).items() if check_used else ():
            want = plan.density(g["dp"], mb, stage)
            if kept < want - USED_TOLERANCE:
                bad.append(f"(dp {g['dp']}, stage {stage}, micro-batch {mb}): kept {kept:.4f} "
                           f"of the blocks, plan {want}")
    if bad:
        raise RuntimeError("attention budgets differ from the broadcast plan: " + "; ".join(bad[:5]))


def _min_kept(records: list, stage_of) -> dict:
    """{(micro-batch, stage): the smallest kept density of any of its sequences in any layer};
    ``stage_of(layer_number)`` is the plan stage of a layer."""
    out: dict = {}
    for mb, _, layer, kept, _ in records:
        if mb is not None and kept:
            key = (mb, stage_of(layer))
            out[key] = min(out.get(key, 1.0), min(kept))
    return out


def _sum_by_doc(triples) -> dict:
    """{doc_id: [loss sum, tokens]} summed over (doc_id, loss sum, tokens) triples, in their
    order (a document split over micro-batches or ranks counts once, whole)."""
    out: dict[int, list] = {}
    for doc_id, s_, n in triples:
        acc = out.setdefault(int(doc_id), [0.0, 0.0])
        acc[0] += s_
        acc[1] += n
    return out


def _doc_recalls(stats: list) -> dict:
    """{doc_id: [recall per layer]} from the attention statistics of this rank's step."""
    out: dict[int, list] = {}
    for _, doc_ids, _, _, recall in stats:
        for doc_id, r in zip(doc_ids, recall):  # the trailing padding sequences have no doc id
            if np.isfinite(r):
                out.setdefault(int(doc_id), []).append(float(r))
    return out
