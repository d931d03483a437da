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
  Megatron's finalize, then ``end_step``: check this rank's attention against the plan, gather
  every rank's timings, losses and sensitivity sums (``step/exchange.py``: a fixed-size record
  per (DP rank, stage) cell, over the TP x CP, pipeline and DP groups), stop every rank alike if
  one ignored the plan or packed differently, calibrate the latency model, refine sensitivities,
  every ``--sb-quality-refresh-interval`` iterations refresh the quality model DST plans by
  (``step/quality_probe.py``: forward-only passes, collective), report metrics,
  and prepare the next step: its documents (bins = Megatron's samples), SAB packing, and the DST
  plan (every rank plans its own units, agreed over the DP group; every rank holds identical
  budgets), each committed only where
  predicted no slower than the static baseline (do no harm, ``step/choice.py``).
- ``record_loss`` (the loss function), ``state_dict`` (Megatron's ``--dataloader-save`` hook; with
  model chunks, the start of Megatron's checkpoint save: ``state.save_at_checkpoints``).

Before a step (its documents, packing and plan, and the plan-ahead thread): ``step/planning.py``;
the checks and sums over every rank's record at a step's end: ``step/checks.py``.

With ``--sb-replay-plans`` a step's packing and densities are another run's recorded ones
(``launch/replay.py``) instead of SAB's and DST's; the resume state is ``step/state.py``'s.

By default (``--sb-planner process``; ``thread`` alike, ``step/ahead.py``) the next step's draft
(documents, packing, latency features: no collective) is made while the step trains, by the
rank's planner process, from the state after the previous step, and its DST agreed with the other
DP ranks on the planner's reader thread as soon as it is back; ``end_step`` joins it before it
updates that state.
So a step's plan always uses the state after the step before the previous one, and a checkpoint
also holds that older state (``ahead_basis``): a resumed run re-plans its first step from it and
repeats the uninterrupted run. ``--sb-planner inline`` plans after the step, on its critical
path, from the state the step left.

Why this is long: it is the one object Megatron's hooks reach in a step, and ``end_step`` reads in
order what the step's gather brought (checks, calibration, sensitivities, the planner's draft, an
attention kernel's fallback, the report); its parts live in the room's modules (planning, checks,
record, reporting, state, fallback_sync), what is left here is their order.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from ...config import SparseBalanceConfig
from ..model.budget import BudgetContext
from ..runtime import comm
from .checks import (budget_error, budget_violations, doc_lengths, fingerprint, min_kept,
                     recall_sums, sum_by_doc, unit_order)
from .planner_worker import warm_up_kernels
from .exchange import ExchangeGroups, StepExchange
from .planning import PlannerFailures, PreparedStep, StepPlanning
from .fallback_sync import follow, reported
from .record import RankReport, StepSummary, step_record_shape
from .relayout import layout_record
from .microbatches import megatron_count, own_length_multiple
from .state import STATE_VERSION, plain_state


class SparseBalanceCallback(StepPlanning):
    """Owns the latency model, sensitivity tracker, packer and per-step plans of this rank."""

    def __init__(self, args, sb: SparseBalanceConfig, budget: BudgetContext, data, *, device):
        from megatron.core import parallel_state as ps

        from .reporting import StepReporter

        self.args, self.sb, self.budget, self.data, self.device = args, sb, budget, data, device
        self.corpus = data.corpus
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.pp, self.pp_rank = args.pipeline_model_parallel_size, \
            ps.get_pipeline_model_parallel_rank()
        self.capacity = args.seq_length * args.micro_batch_size
        # the per-step gather and reductions, over Megatron's TP x CP, PP and DP groups
        self.exchange = StepExchange(ExchangeGroups.from_megatron())
        if self.exchange.sizes[1:] != (self.pp, self.dp):
            raise RuntimeError(f"Megatron's pipeline and data-parallel groups have "
                               f"{self.exchange.sizes[1:]} ranks, expected (pp, dp) = "
                               f"{(self.pp, self.dp)}")
        # How micro-batches are built (data.microbatch_inputs): a DP rank's CP ranks split them
        cp = ps.get_context_parallel_world_size()
        self.mb_args = dict(pad_multiple=sb.pad_multiple(cp), cp_size=cp,
                            cp_rank=ps.get_context_parallel_rank(),
                            length_multiple=sb.length_multiple)
        # a micro-batch of its documents only (dp_balanced's at fixed length) still splits
        # over the CP ranks and, with sequence parallelism, the TP ranks
        self.own_length_multiple = own_length_multiple(args, sb)
        self.latency = self.tracker = None
        if sb.dst_enabled or sb.batching_enabled:
            from ..launch.latency_setup import load_latency_model, table_backend
            self.latency = load_latency_model(args, sb)
            budget.set_backend(table_backend(self.latency.table, sb))   # auto: measured pick
        # routing: the latency table's crossover (or --sb-dense-below-tokens), known only now
        routing = self.latency.dense_below_tokens if self.latency is not None \
            else sb.routing_threshold(None)
        budget.set_routing(routing)
        if sb.batching_enabled:
            from ...batching.sensitivity import SensitivityTracker
            self.tracker = SensitivityTracker(signal=sb.sensitivity_signal)
        from ...latency.layout import PipelineLayout
        self.layout = PipelineLayout.from_megatron_args(args)   # launch/checks.py checked it
        from ..launch.replay import plan_replay
        self.replay = plan_replay(sb, dp=self.dp, max_tokens=self.capacity,
                                  pad_multiple=self.mb_args["pad_multiple"],
                                  stages=self.layout.num_stages)   # None: plan here
        self.vp = self.layout.vp
        # A rank with several model chunks finds each layer's virtual stage by its number.
        self.layer_stages = self.layout.layer_stages() if self.vp > 1 else None
        self.reporter = StepReporter(args, sb, dp=self.dp, dp_rank=self.dp_rank,
                                     layout=self.layout,
                                     doc_positions=np.asarray(self.corpus.lengths,
                                                              dtype=np.int64) + 1,
                                     dense_below_tokens=routing,
                                     pad_multiple=self.mb_args["pad_multiple"])
        self.timers = self.sampler = None       # hooks installs the timers, train_iterator it
        self.steps_done = 0                     # steps this process ran (the first is warm-up)
        self._ready: Optional[PreparedStep] = None
        self._current: Optional[PreparedStep] = None
        self._chunks_read: set = set()          # model chunks that read the current step
        self._fwd_order: list = []              # (micro-batch, chunk) of every forward, in order
        self._finalized: Optional[int] = None
        self._losses: list = []
        self._doc_losses: list = []             # (doc ids, loss sums, tokens) per micro-batch
        self._overhead_s = 0.0                  # the plugin's wall seconds in this step ...
        self._own_s = 0.0                       # ... of which its own work (thread CPU)
        self._layout_checked = False
        self._planner = None                       # plan-ahead: the next step's pending draft
        self._ready_basis: Optional[dict] = None   # the state the prepared step was planned from
        self._ahead_s = 0.0                        # CPU seconds of the last background draft
        self._drafter = None                       # what drafts read (StepPlanning.drafter)
        self._process = None                       # --sb-planner process: its PlannerProcess
        self._tracker_log: list = []               # tracker updates the process has not seen
        self._tracker_synced = False               # the process's tracker is this one's
        self._failures = PlannerFailures()         # its deaths and stalls
        self.watchdog = None                       # hooks: the rank's watchdog (a wait's phase)
        self._updates = 0                          # tracker updates so far
        self._basis_tracker = None                 # the tracker as of the prepared step's basis
        self._basis_log: list = []                 # updates since then
        self._basis_mark = 0                       # updates the copy has
        self.quality_probe = None                  # --sb-quality-refresh-interval (hooks)

    def start_quality_probe(self, model: list, forward_step) -> None:
        """--sb-quality-refresh-interval: the refresh's measurer (``step/quality_probe.py``) of
        ``model`` (Megatron's chunks) through the run's ``forward_step``, its held-out
        micro-batches (--sb-quality-refresh-microbatches) built now (a valid split without
        documents is refused before training)."""
        from .data import held_out_batch
        from .quality_probe import QualityProbe

        mbs, lengths = held_out_batch(self.data, self.sb, capacity=self.capacity, dp=self.dp,
                                      dp_rank=self.dp_rank, device=self.device,
                                      mb_args=self.mb_args)
        self.quality_probe = QualityProbe(self.sb, self.args, model=model,
                                          forward_step=forward_step, budget=self.budget,
                                          exchange=self.exchange, held_out=mbs, lengths=lengths,
                                          pp_rank=self.pp_rank)

    # --- Megatron hooks ----------------------------------------------------------------------
    def train_iterator(self, chunk: int = 0):
        """The train data iterator of model chunk ``chunk`` (all ranks; collective for the first
        chunk: the first plan's DST is agreed over the DP group)."""
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
            from ..errors import LaunchError
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
            # numba's kernels, before the first step and before the planner process starts (a
            # first run compiles them here once; the planner then loads numba's disk cache)
            warm_up_kernels()
            if args.iteration + 1 < args.train_iters:
                self.start_planner()         # starts while the first step is prepared
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

    def step_for_chunk(self, chunk: int) -> PreparedStep:
        """The step the data iterator of model chunk ``chunk`` reads next: the current one if
        another chunk took it already, else the prepared one (``take_step``)."""
        if self._current is not None and chunk not in self._chunks_read:
            self._chunks_read.add(chunk)
            return self._current
        step = self.take_step()
        self._chunks_read = {chunk}
        return step

    def microbatches_at(self, consumed_samples: int) -> Optional[int]:
        """Micro-batches per DP rank of the committed packing of the step that starts at
        ``consumed_samples`` (what Megatron's schedule runs: ``step/microbatches.py``), None
        where no such step is prepared or running."""
        for step in (self._current, self._ready):
            if step is not None and step.first_bin == consumed_samples:
                return step.batch.num_microbatches
        return None

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
        t0, c0 = time.perf_counter(), time.thread_time()
        step = self._current
        if step is None:
            raise RuntimeError(f"iteration {iteration} finished without reading the plugin's "
                               f"data iterator")
        ran = len(self._fwd_order) // max(len(self._chunks_read), 1)
        if ran != step.batch.num_microbatches:
            raise RuntimeError(f"iteration {iteration}: Megatron's schedule ran {ran} "
                               f"micro-batches, the committed packing ({step.batch.method}) has "
                               f"{step.batch.num_microbatches} per DP rank (the step's count "
                               f"reaches the schedule through Megatron's micro-batch "
                               f"calculator, step/microbatches.py)")
        loss = (torch.stack([x[0].float() for x in self._losses]).sum().item(),
                torch.stack([x[1].float() for x in self._losses]).sum().item()) \
            if self._losses else (0.0, 0.0)
        shape, slots = step_record_shape(step.batch, self.vp, signal=self.signal is not None,
                                         per_interval=bool(self.sb.metrics_file))
        summary = self.exchange.gather(self._report(step, timings, loss), shape,
                                       slots[step.row] if slots else ())
        if not summary.fingerprints_agree:
            raise RuntimeError(f"iteration {iteration}: ranks packed different micro-batches "
                               f"(the sampler/packer must be deterministic on every rank)")
        if summary.violations:
            raise budget_error(summary.examples)
        if self.sb.timing_source == "model" and self.latency is not None and step.plan is not None:
            measured = self._modelled_busy(step)
            warm = True                        # a modelled time has no warm-up in it
        else:
            measured = summary.busy_s             # [1, pp]: its own pipeline's
            # The first step of a process pays for warm-up (allocations, lazy init): no sample.
            warm = self.steps_done > 0
        # The next step's draft read the state this step is about to change: join it first.
        draft = self.join_ahead()
        self.reporter.fallback = follow(self, summary.backend, iteration) or self.reporter.fallback
        calib = {}
        if self.latency is not None and step.plan is not None and warm:
            calib = self._calibrate(step, measured)
        self.steps_done += 1
        if self.tracker is not None:
            self._update_sensitivity(step, summary)
        self._current, self._chunks_read = None, set()
        refreshed = None          # the drafts from here on plan by the refreshed quality model
        if self.quality_probe is not None and self.quality_probe.due(iteration):
            refreshed = self.quality_probe.refresh(iteration)
            self.drafter().quality_scales = self.quality_probe.scales
        args = self.args
        if draft is not None:
            self._ahead_s = draft.cpu_s
            self._commit(draft)
            self._plan_ahead()
        elif iteration + 1 < args.train_iters:
            self.prepare_step(iteration + 1, self._num_microbatches_next(step))
        self._overhead_s += time.perf_counter() - t0
        self._own_s += time.thread_time() - c0
        t1, c1 = time.perf_counter(), time.thread_time()
        self.reporter.report(iteration + 1, step, summary, measured, calib,
                             overhead_s=self._overhead_s, own_s=self._own_s,
                             planned_ahead_s=self._ahead_s if self.sb.plan_ahead else None,
                             reduce=self.exchange.reduce, gather=self.exchange.gather_rows,
                             extra=refreshed)
        self._serve_eval_profile()
        # the report's own cost (metrics, writers, log line) counts in the next step's figure
        self._overhead_s, self._own_s = time.perf_counter() - t1, time.thread_time() - c1

    def _num_microbatches_next(self, step: PreparedStep) -> int:
        """Micro-batches of the next step by Megatron's batch-size rules (its calculator at the
        consumed samples the next step will start from)."""
        from megatron.core import num_microbatches_calculator as nmc

        consumed = step.consumed_samples
        args = self.args
        if args.step_batch_size_schedule is None:
            return megatron_count()
        calc = nmc.StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size=args.micro_batch_size, data_parallel_size=self.dp,
            decrease_batch_size_if_needed=args.decrease_batch_size_if_needed, rank=-1,
            schedule=args.step_batch_size_schedule, seq_length=args.seq_length)
        calc.update(consumed, consistency_check=False)
        return calc.get()

    def _predicted_busy(self, step: PreparedStep) -> np.ndarray:
        """[1, pp] uncorrected predicted fwd+bwd seconds of this DP rank's units under the
        step's plan (a pipeline rank's model chunks together): predicted with the plan
        (``Drafter.settle``), or here from the replayed whole plan's row."""
        if step.predicted_busy is not None:
            return np.array(step.predicted_busy, dtype=np.float64)
        units = step.units if step.units is not None else self._units(step.batch)
        busy = self.latency.busy_s(units, step.plan.densities)
        return busy[self.dp_rank:self.dp_rank + 1] if busy.shape[0] > 1 else busy

    def _modelled_busy(self, step: PreparedStep) -> np.ndarray:
        """--sb-timing-source model: the prediction, --sb-straggler-slowdown times on the
        straggler rank (its --sb-straggler-stage alone if given); a deterministic stand-in for
        Megatron's timers. [1, pp]: this DP rank's."""
        busy = self._predicted_busy(step)
        if self.sb.straggler_rank == self.dp_rank:
            stages = slice(None) if self.sb.straggler_stage < 0 else self.sb.straggler_stage
            busy[0, stages] *= self.sb.straggler_slowdown
        return busy

    def _calibrate(self, step: PreparedStep, measured: np.ndarray) -> dict:
        """This DP rank's pipeline (its factors alone: each DP rank calibrates its own):
        measured fwd+bwd over its stages vs the uncorrected prediction, and with PP each
        pipeline rank's share of it too (one slow GPU of a pipeline). ``measured``: [1, pp].
        The record's figures are the group's, reduced with the report's
        (``calibration_own``: the rank's error and factor; ``report_sums``): the mean error and
        the factors' range; with ``--sb-metrics-file`` every rank's factors (a gather, opt-in)."""
        r = self.dp_rank
        predicted = self._predicted_busy(step)
        grid = self.latency.correction_grid(r + 1, predicted.shape[1])[r:]
        corrected = float((predicted * grid).sum())
        self.latency.calibrate_ranks(predicted, measured, first=r)
        busy = float(measured.sum())
        factor = self.latency.correction(r)
        out = {"calibration_own": (abs(corrected - busy) / max(busy, 1e-12), factor)}
        if self.sb.metrics_file:            # per-rank detail, opt-in: every rank's factors
            rows = self.exchange.gather_rows(np.r_[corrected, factor, self.latency.
                                                   correction_grid(r + 1, predicted.shape[1])[r]])
            out.update(predicted_busy_s=rows[:, 0].tolist(), calibration=rows[:, 1].tolist(),
                       stage_calibration=rows[:, 2:].tolist())
        return out

    def _pop_doc_losses(self) -> dict:
        """{doc_id: [loss sum, tokens]} of this rank's step (a document split over micro-batches
        summed), moved to the host in one transfer."""
        parts, self._doc_losses = self._doc_losses, []
        if not parts:
            return {}
        ids = [d for docs, _, _ in parts for d in docs]
        sums = torch.cat([torch.stack([s.float(), n.float()], dim=1) for _, s, n in parts])
        return sum_by_doc((d, s_, n) for d, (s_, n) in zip(ids, sums.cpu().tolist()))

    def _report(self, step: PreparedStep, timings: dict, loss: tuple) -> RankReport:
        """What this rank sends at the step's end: its timings, losses, the plan checked against
        what its attention did, and its documents' sensitivity sums."""
        records = self.budget.pop_stats()
        served = self.budget.pop_served()
        bad = [] if step.plan is None else budget_violations(
            step.plan, self.dp_rank, served, min_kept(records, self.budget.stage_of),
            check_used=self.sb.selection_mode == "density")
        docs = self._pop_doc_losses()            # loss signal; also empties the list
        if self.signal == "recall":
            docs = recall_sums(records)
        return RankReport(dp=self.dp_rank, pp=self.pp_rank, fingerprint=fingerprint(step.batch),
                          fwd_s=timings.get("fwd_s", []), bwd_s=timings.get("bwd_s", []),
                          units=unit_order(self._fwd_order, self.layout, self.pp_rank),
                          step_s=timings.get("step_s"), loss=loss, violations=bad,
                          doc_values=docs if self.signal is not None else {},
                          planner_events=self._failures.take(), backend=reported(self.budget))

    def _update_sensitivity(self, step: PreparedStep, summary: StepSummary) -> None:
        """The tracker learns every document's mean signal this step (sum / count over every
        rank: loss per token, or recall per layer and head group)."""
        ids, sums = summary.doc_ids, summary.doc_sums
        if not ids.size:
            return
        self._track(ids, doc_lengths(step.batch, ids), sums[:, 0] / sums[:, 1])

    def _serve_eval_profile(self) -> None:
        """--sb-eval-density trained: evaluation (outside any step plan) reads the layers at
        the trained profile so far (``eval_profile.py``)."""
        if self.reporter.eval_profile is not None:
            self.budget.set_layer_densities(self.reporter.eval_profile.layer_densities())

    # --- checkpoint state (inside Megatron's iter_* folder, via --dataloader-save) -----------
    def state_dict(self) -> dict:
        """Everything a resume restores, as plain Python types (``state.plain_state``: the one
        place that converts numpy/torch numbers and refuses what ``weights_only`` cannot read)."""
        out = {"version": STATE_VERSION, "iteration": int(self.args.curr_iteration) + 1,
               **self._planning_state(), "timing_source": self.sb.timing_source,
               "stand_down": self.reporter.stood.state_dict(), "layout": layout_record(
                   self.dp, self.pp, self.vp, self._ready and self._ready.megatron_samples // self.dp)}
        if self.reporter.eval_profile is not None:
            out["eval_profile"] = self.reporter.eval_profile.state_dict()
        if self._ready_basis is not None:        # plan-ahead: what the next step was planned from
            out["ahead_basis"] = self.ahead_basis()
        return plain_state(out)

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            return
        if self.latency is not None and state.get("latency") is not None:
            self.latency.load_calibration_state(state["latency"])
        if self.tracker is not None and state.get("sensitivity") is not None:
            self.tracker.load_state_dict(state["sensitivity"])
            self._tracker_loaded()
        self.reporter.stood.load_state_dict(state.get("stand_down"))   # cumulative counts
        if self.reporter.eval_profile is not None:
            note = self.reporter.eval_profile.load_state_dict(state.get("eval_profile"))
            if note:
                from ..runtime.comm import say
                say(note)
            self._serve_eval_profile()
        if self.quality_probe is not None:        # the refreshed quality model (None: none)
            scales = state.get("quality_scales")
            self.quality_probe.scales = None if scales is None else tuple(scales)
            self.drafter().quality_scales = self.quality_probe.scales
