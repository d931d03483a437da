"""The planning half of ``SparseBalanceCallback``: a step's documents, packing and budgets, built
before the step runs, and the planner that drafts the next one while a step trains.

``StepPlanning`` is a base class of the callback, not a component of its own: its methods read the
callback's sampler, latency model, sensitivity tracker, replay, layout and capacity
(``step/callback.py`` sets them) and write the prepared step the callback's ``take_step`` reads. A step
is first a ``Draft`` (``step/drafting.py``: no collective, the same function in-line, on the planner
thread or in the planner process, ``step/ahead.py``), whose DST every rank then plans for its own
units, agreed with the other DP ranks in a few small all-reduces over a gloo copy of the DP group
(``_agree``: on the planner's reader thread while the step trains, else on the training thread
before the step's end changes what the draft read); ``_commit`` makes it the ``PreparedStep``.
Each packing is committed only where predicted no slower than the static baseline (do no harm,
``step/choice.py``). What a plan is made from: ``step/plan_basis.py``.
No torch.distributed outside ``comm``; megatron only through the callback.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...batching.plan import BatchPlan
from ...plan import BudgetPlan
from ..runtime import comm
from .checks import layout_warning
from .ahead import Drafted, PendingDraft, Planner, PlannerProcess, PlannerProcessError
from .planner_boot import PlannerPackageMismatch
from .drafting import Draft, Drafter  # noqa: F401  (Draft: the planners' result type)
from .agreement import DPReducer
from .plan_basis import LaggedBasis, PlanBasis  # noqa: F401  (LaggedBasis: its API)

PLANNER_RESTARTS = 3
"""New planner processes a rank starts after its planner dies or stalls, the k-th for the draft
``2 ** (k - 1)`` steps after the k-th failure's (the training thread drafts those between);
after that it drafts on the training thread for the rest of the run (the same plans: a draft is
one function of the same inputs, wherever it is made)."""


@dataclass
class PlannerFailures:
    """A rank's planner process deaths and stalls (``StepPlanning._planner_failed``)."""

    count: int = 0                 # so far
    down_until: float = 0.0        # after one: the iteration whose draft a new process takes
    restarting: bool = False       # a new process started, not yet ready
    unreported: int = 0            # since the last step's report (the step's gather counts them)

    def take(self) -> int:
        """The unreported ones, now reported."""
        n, self.unreported = self.unreported, 0
        return n


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
    samples: int = 0               # Megatron's samples the step consumes (dp x its micro-batch
                                   # count); 0: the batch's own (dp_balanced's count may differ)
    row: int = 0                   # this rank's row of ``batch`` (0: the batch is its own
                                   # micro-batches alone; its DP rank: a replayed whole plan)
    predicted_busy: Optional[np.ndarray] = None  # [1, pipeline ranks] uncorrected predicted
                                   # busy seconds of the plan, this DP rank's (``settle``)

    @property
    def megatron_samples(self) -> int:
        """Megatron's samples the step consumes (``samples``, or the batch's own)."""
        return self.samples or self.batch.dp * self.batch.num_microbatches

    @property
    def own(self) -> list:
        """This rank's micro-batches ([m] lists of segments)."""
        return self.batch.micro_batches[self.row]

    @property
    def consumed_samples(self) -> int:
        """Megatron's consumed samples after the step."""
        return self.first_bin + self.megatron_samples


class StepPlanning(PlanBasis):
    """Packing, drafting and committing a step's plan (a base of ``SparseBalanceCallback``)."""

    def drafter(self) -> Drafter:
        """What this rank's drafts read (built once, after the callback set its parts)."""
        if self._drafter is None:
            self._drafter = Drafter(self.sb, self.latency, self.tracker, dp=self.dp,
                                    capacity=self.capacity,
                                    attention_layers=self.layout.attention_layers,
                                    replay=self.replay,
                                    vpp_group=self.layout.pp if self.vp > 1 else None,
                                    own_length_multiple=self.own_length_multiple)
        return self._drafter

    def prepare_step(self, iteration: int, num_microbatches: int) -> None:
        """Documents, packing and budgets of ``iteration`` (collective: the DP group agrees SAB's
        candidates and DST's rounds)."""
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
        segments = self.sampler.next_bin_array(self.dp * num_microbatches)
        return self._timed_draft(iteration=iteration, first_bin=first_bin, segments=segments,
                                 num_microbatches=num_microbatches, with_dst=False,
                                 rank=self.dp_rank)

    def _timed_draft(self, **request) -> Draft:
        """A draft made here; its wall time joins the planner process's recent drafts (the
        first step's is what its first deadline is taken from)."""
        t0 = time.perf_counter()
        draft = self.drafter().draft(**request)
        if self._process is not None:
            self._process.note_draft_s(time.perf_counter() - t0)
        return draft

    def _commit(self, draft: Draft) -> None:
        """The draft becomes the prepared step (collective where its DST is not agreed yet)."""
        plan, report, sb = None, None, self.sb
        if self.replay is not None and sb.sparse_attention_enabled:   # every rank read it
            plan = BudgetPlan(draft.iteration, draft.replayed)
        elif self._agreeing():            # in-line: agreed here, after the calibration
            densities, report = draft.agreed or self._agree(draft)
            if densities is not None:          # its own rows, or every rank's (gathered)
                d = np.asarray(densities)
                plan = BudgetPlan(draft.iteration, d, 0 if len(d) == self.dp else self.dp_rank)
        stand = report.get("stand_down") if report is not None else draft.stand_down
        # SAB's packing, or the baseline's where SAB stood down
        batch, units = draft.packing(1 if stand is not None and stand["packing_index"] == 1
                                     else 0)
        if plan is None and sb.sparse_attention_enabled:
            plan = BudgetPlan.static(draft.iteration, sb.density, self.dp,
                                     batch.num_microbatches, self.layout.num_stages)
        self._ready = PreparedStep(draft.iteration, draft.first_bin, batch, plan, report,
                                   units, stand, self.dp * draft.num_microbatches,
                                   row=0 if draft.own_rank is not None else self.dp_rank,
                                   predicted_busy=draft.predicted_busy)
        self._advance_basis(draft.basis)
        self._ready_basis = draft.basis
        if not self._layout_checked:
            self._layout_checked = True
            self._check_layout(batch, units)

    def _agree(self, draft: Draft, replay=None) -> tuple:
        """(densities, report) of ``draft``'s step: this rank's DST of its own units, agreed
        with the other DP ranks' over the DP group's gloo copy (collective: every rank, once a
        step, in the planner process while the step trains, its rounds relayed by the reader
        thread, or on the planner thread, else on the training thread before the step's end
        changes the state the draft read). ``replay``: the reducer that resumes the rounds the
        planner process began (``relay.ReplayingReducer``)."""
        return self.drafter().settle(draft, rank=self.dp_rank, agree=replay or self._reducer())

    def _reducer(self) -> DPReducer:
        return DPReducer(self.exchange.groups.rounds)

    def _agreeing(self) -> bool:
        """Whether a draft is settled over the DP group: every rank's own draft is (SAB's
        agreement, the do-no-harm race, DST, the rows the step's consumers read); a replayed
        whole plan is not."""
        return self.replay is None

    def _plan_ahead(self) -> None:
        """--sb-planner process/thread: start drafting the step after the prepared one, from
        the current state (which nothing changes until ``end_step`` joins the draft). Where the
        planner process is down after a failure, the training thread drafts it now."""
        step = self._ready
        if not self.sb.plan_ahead or step is None or step.iteration + 1 >= self.args.train_iters:
            return
        m, it = self._num_microbatches_next(step), step.iteration + 1
        basis = self._lagged_basis()
        if self.sb.planner == "thread":
            self._planner = Planner(lambda: self._agreed(self._draft(it, m)), basis)
            return
        if not self._planner_up(it):
            self._planner = Drafted(self._draft(it, m), basis)
            return
        late = self._process.still_late()
        if late is not None:        # late at the last step's end and still not back: stalled
            self._planner_failed(late.still_stalled(), it)
            self._planner = Drafted(self._draft(it, m), basis)
            return
        first_bin = self.sampler.bins
        segments = self.sampler.next_bin_array(self.dp * m)
        fault, process = self._planner_fault(it), self._process
        if fault in ("planner-stop", "planner-kill-drafting"):
            process.stop_for_test()          # it can answer nothing now
        elif fault == "planner-kill-idle":
            process.kill()
        self._planner = process.submit(
            it, first_bin, segments, m, with_dst=False, rank=self.dp_rank,
            latency_state=basis.latency,
            tracker_sync=self._tracker_sync(), basis=basis,
            quality_scales=self.drafter().quality_scales,
            settle=(self.dp_rank, self._reducer()) if self._agreeing() else None,
            on_round=(lambda k: k == 1 and process.kill())
            if fault == "planner-kill-agreeing" else None)   # killed after its first round
        if fault == "planner-kill-drafting":
            self._process.kill()

    def start_planner(self) -> None:
        """--sb-planner process: start this rank's planner process (once; it reads its copy of
        the Drafter and imports while the first step is prepared, before training starts)."""
        if self.sb.planner == "process" and self._process is None and not self._failures.count:
            self._start_process()

    def _start_process(self) -> None:
        self._process = PlannerProcess(self.drafter(), timeout_s=self._planner_timeout_s())
        self._tracker_synced = False

    def _planner_timeout_s(self) -> float:
        """--sb-planner-timeout, at most half the distributed timeout in effect: the peers of a
        rank that waits for its planner wait in a collective meanwhile."""
        from ..runtime.watchdog_judgement import distributed_timeouts_s
        limit = self.sb.planner_timeout
        if getattr(self.args, "distributed_timeout_minutes", None) is not None:
            limit = min([limit] + [0.5 * t for t in distributed_timeouts_s(self.args) if t])
        return limit

    def _planner_up(self, iteration: int) -> bool:
        """Whether ``iteration`` goes to the planner process: it runs, or after a failure a new
        one is due (started now; it drafts once ready, the training thread until then)."""
        if self._process is None:
            if not self._failures.count:
                self.start_planner()
                return True
            if iteration < self._failures.down_until:
                return False
            self._start_process()
            self._failures.restarting = True
        if self._failures.restarting:
            try:
                if not self._process.ready_now():
                    return False
            except PlannerProcessError as e:
                self._planner_failed(e, iteration)
                return False
            except PlannerPackageMismatch as e:   # the package changed on disk mid-run
                self._process.close()
                self._process, self._failures.restarting = None, False
                self._failures.down_until = math.inf
                comm.say_rank(f"warning: rank {comm.rank()}: {e}; the training thread drafts "
                              f"every step from now on (the rank's own code)")
                return False
            self._failures.restarting = False
            comm.say_rank(f"rank {comm.rank()}: the new planner process (pid "
                          f"{self._process.pid}) drafts from iteration {iteration + 1} on")
        return True

    def join_ahead(self) -> Optional[Draft]:
        """The next step's draft made while this one trained (None: none was started). Where
        the planner process died or stalled, the training thread drafts the same step from the
        same inputs (the state the draft read has not changed since it was asked for), and the
        rank goes on as ``_planner_failed`` says. Its DST is agreed before the step's end
        changes that state (collective, where no planner thread agreed it already)."""
        planner, self._planner = self._planner, None
        if planner is None:
            return None
        draft = self._joined(planner)
        rounds = getattr(planner, "rounds", None)      # the process's settle, relayed
        return self._agreed(draft, None if rounds is None or rounds.reducer is None
                            else rounds.replaying())

    def _agreed(self, draft: Draft, replay=None) -> Draft:
        """``draft`` with its DST agreed (``_agree``) where it is not yet; ``replay``: the
        rounds the planner process made before it stopped, replayed first."""
        if self._agreeing() and draft.agreed is None:
            draft.agreed = self._agree(draft, replay)
        return draft

    def _joined(self, planner) -> Draft:
        if not isinstance(planner, PendingDraft):
            return planner.result()
        waiting = f"waiting for the planner process (pid {planner.pid})"
        watchdog = None if planner.done() else self.watchdog
        if watchdog is not None:
            watchdog.enter(waiting)
        try:
            return planner.result()
        except PlannerProcessError as e:
            made = len(planner.rounds.done)     # DST rounds it made: replayed, then the rest
            if e.phase == "late":               # it runs: left to finish, its draft dropped
                self._planner_late(e, planner.request["iteration"], made)
            else:
                self._planner_failed(e, planner.request["iteration"], made)
            draft = self._timed_draft(**planner.request)
            draft.basis = planner.basis
            return draft
        finally:
            if watchdog is not None:
                watchdog.leave(waiting)

    def _planner_failed(self, err: PlannerProcessError, iteration: int, made: int = 0) -> None:
        """One line naming the rank, the process, what ended it and what the run does now; the
        process ended and reaped; the next one due ``PLANNER_RESTARTS`` says when. ``made``:
        the DST rounds it made (the training thread replays them)."""
        self._process.kill()
        self._process.close()
        self._process, self._failures.restarting = None, False
        self._failures.count += 1
        self._failures.unreported += 1
        n = self._failures.count
        if n <= PLANNER_RESTARTS:
            wait = 2 ** (n - 1)
            self._failures.down_until = iteration + wait
            now = (f"the training thread drafts iteration {iteration + 1} from the same inputs "
                   f"(the same plan{_resumed(made)}), and a new planner process starts for "
                   f"iteration {iteration + wait + 1}'s draft (restart {n} of {PLANNER_RESTARTS})")
        else:
            self._failures.down_until = math.inf
            now = (f"the training thread drafts every step from now on (the same plans; "
                   f"{PLANNER_RESTARTS} restarts used{_resumed(made)})")
        comm.say_rank(f"warning: rank {comm.rank()}: {err}; {now}")

    def _planner_late(self, err: PlannerProcessError, iteration: int, made: int = 0) -> None:
        """A draft past its deadline from a process that still runs: the training thread drafts
        it (one line, counted as an event); the process goes on and its draft is dropped when it
        comes. Still not back at the next draft, it counts as stalled (``_plan_ahead``)."""
        self._failures.unreported += 1
        comm.say_rank(f"warning: rank {comm.rank()}: {err}; the training thread drafts "
                      f"iteration {iteration + 1} from the same inputs (the same plan"
                      f"{_resumed(made)})")

    def _planner_fault(self, iteration: int) -> Optional[str]:
        """--sb-fault RANK:STEP:planner-* (tests): the kind, at the draft of iteration STEP on
        global rank RANK."""
        for rank, step, kind in self.sb.fault_specs or ():
            if kind.startswith("planner-") and comm.rank() == rank and iteration + 1 == step:
                comm.say_rank(f"--sb-fault: injecting '{kind}' on rank {rank} at iteration "
                              f"{step}'s draft (planner process pid {self._process.pid})")
                return kind
        return None

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
        """Once, on rank 0: ``checks.layout_warning``'s line, if any (GPT layer splits only)."""
        if comm.rank() != 0 or self.latency is None or self.layout.pp < 2 \
                or self.layout.pattern is not None:   # the search splits GPT layers only
            return
        if line := layout_warning(self.latency, units, batch.dp, batch.num_microbatches,
                                  self.layout, self.sb.density):
            comm.say(line)


def _resumed(made: int) -> str:
    """What the warning adds where the planner process had made some of the step's rounds."""
    return f"; its {made} DST round(s) over the DP group replayed, the rest made" if made else ""
