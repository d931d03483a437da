"""A step's draft as one function of plain inputs: its documents' packing, latency features and
(on the rank that plans DST) its budgets, with no collective and no torch.

``Drafter`` holds what a draft reads (the config, the latency model, the sensitivity tracker, the
DP size, micro-batch capacity, the stages' attention layers and a replay of recorded plans) and
``Drafter.draft`` makes one step's ``Draft`` from the step's segments. The in-line planner, the
planner thread and the planner process (``step/ahead.py``) all call it, so a plan does not
depend on where it was made. Each packing is committed only where predicted no slower than the
static baseline (do no harm, ``step/choice.py``).

Plain Python and numpy: no torch, no torch.distributed, no megatron (the planner process
imports it alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Optional

import numpy as np

from ...batching.plan import BatchingError, BatchPlan, checked_segments
from ...policy.dst_rounds import gathered
from .agreement import drive
from .checks import check_assignment, check_capacity, segment_counts
from .choice import wants_baseline_packing


@dataclass
class Draft:
    """A step planned without collectives: every rank packs the same micro-batches; the rank
    that plans DST also holds the plan the commit broadcasts."""

    iteration: int
    first_bin: int
    batch: BatchPlan
    units: object
    payload: Optional[tuple]       # the DST rank: (densities, report); else None
    replayed: object = None        # --sb-replay-plans: the recorded densities (None: dense)
    cpu_s: float = 0.0             # CPU time the draft took (its thread's)
    basis: Optional[dict] = None   # plan-ahead: the plugin state it was planned from
    baseline: Optional[tuple] = None   # (batch, units) packed the baseline's way (stand-down)
    stand_down: Optional[dict] = None  # without DST: every rank's own packing choice
    options: int = 1               # packings drafted (2: SAB and the baseline), on every rank
                                   # alike, even where the planner process sends one of them
                                   # back (``planner_worker.reply``)
    num_microbatches: int = 0      # Megatron's micro-batches per DP rank (its samples per rank)
    counts: tuple = ()             # each packing's own micro-batches per DP rank (dp_balanced's
                                   # varies by step), kept where the packing itself is not
    agreed: Optional[tuple] = None  # the run's (densities, report): this rank's DST rounds
                                   # agreed over the DP group (``StepPlanning._agree``)
    own_rank: Optional[int] = None  # a rank's own draft (``Drafter.own_draft``): its DP rank
    sab: Optional[tuple] = None    # its (SAB's assignment, the rank's units), packed by
                                   # ``Drafter.settle`` after the agreement
    predicted_busy: Optional[object] = None  # [1, pipeline ranks] this rank's uncorrected
                                   # predicted busy seconds of the committed plan (``settle``)

    def packing(self, index: int) -> tuple:
        """(batch, units) of candidate packing ``index``: 0 SAB's (or the only one), 1 the
        baseline's (the planner process leaves out the one a rank knows it will not commit)."""
        if index not in (0, 1) or index >= self.options:
            raise ValueError(f"packing {index!r}: the draft has {self.options} packing(s)")
        have = (self.batch, self.units) if index == 0 else self.baseline
        if have is None or have[0] is None:
            raise RuntimeError(f"iteration {self.iteration}: packing {index} of the draft was "
                               f"not kept")
        return have


class Drafter:
    """What a draft reads, and the draft (``draft``). ``latency`` (a ``LatencyModel``) and
    ``tracker`` (a ``SensitivityTracker``) may be None (no DST, no SAB); ``replay`` a
    ``launch.replay.PlanReplay`` or None. Picklable: the planner process gets a copy."""

    def __init__(self, sb, latency, tracker, *, dp: int, capacity: int, attention_layers,
                 replay=None, vpp_group: Optional[int] = None, own_length_multiple: int = 1):
        self.sb, self.latency, self.tracker, self.replay = sb, latency, tracker, replay
        self.dp, self.capacity = int(dp), int(capacity)
        self.attention_layers = tuple(attention_layers)
        # Megatron's dp_balanced: its group multiple under VPP (the pipeline size, as
        # wrap_data_iterator passes it) and, at fixed length, the multiple its micro-batches
        # (their documents only) are rounded up to (what CP and sequence parallelism need)
        self.vpp_group, self.own_length_multiple = vpp_group, int(own_length_multiple)
        # the quality model's depth-group scales of the run's last refresh (None: as loaded;
        # step/quality_probe.py): set between drafts, sent to the planner process with each
        self.quality_scales: Optional[tuple] = None

    def draft(self, iteration: int, first_bin: int, segments, num_microbatches: int, *,
              with_dst: bool, rank: Optional[int] = None) -> Draft:
        """The step's packing(s), latency features and, with ``with_dst`` (the rank that plans),
        DST's plan; ``segments``: the step's global batch (the sampler's ``next_bin_array``).
        ``rank``: DP rank r's own draft (``own_draft``: its SAB units, its rows of the other
        packings; ``settle`` packs and plans it)."""
        t0 = time.thread_time()
        sb = self.sb
        replayed, payload, stand = None, None, None
        if rank is not None and self.replay is None:
            return self.own_draft(iteration, first_bin, segments, num_microbatches, rank, t0)
        if self.replay is not None:            # the recorded packing and densities
            batch, replayed = self.replay.step(iteration, first_bin, segments, num_microbatches)
            options = [self.checked(segments, batch)]
        else:
            segments = checked_segments(segments)            # converted once for every packing
            given = segment_counts(segments)                 # checked against every packing
            options = [self._packed(segments, num_microbatches, given=given)]
            if wants_baseline_packing(sb, self.latency):      # do no harm: SAB vs baseline
                try:
                    options.append(self._packed(segments, num_microbatches, sb.stand_down,
                                                given))
                except BatchingError:   # dp_balanced's rule has no packing (Megatron stops):
                    if sb.stand_down != "dp_balanced":  # every rank alike, SAB's the only
                        raise                           # candidate; any other packer's is a bug
            if sb.dst_enabled:
                if with_dst:
                    densities, report, _ = self.choose(options, dst=True)
                    payload = (densities, report)
            elif len(options) > 1:
                stand = self.choose(options, dst=False)[2]
        return Draft(iteration, first_bin, *options[0], payload, replayed,
                     cpu_s=time.thread_time() - t0,
                     baseline=options[1] if len(options) > 1 else None, stand_down=stand,
                     options=len(options), num_microbatches=int(num_microbatches),
                     counts=tuple(b.num_microbatches for b, _ in options))

    def own_draft(self, iteration: int, first_bin: int, segments, num_microbatches: int,
                  rank: int, t0: float) -> Draft:
        """DP rank ``rank``'s draft (no collective): SAB's assignment of the whole batch (every
        rank's alike, n log dp) and the rank's own units, or the rank's row of any other
        packing; the baseline's row where the stand-down races it."""
        sb, m = self.sb, int(num_microbatches)
        segments = checked_segments(segments)
        own, sab = (None, None), None
        if sb.packing_method == "sab":
            a = self.assignment(segments, m)
            sab = (a, a.units(np.array([rank])))
        else:
            own = self._own_row(self.pack(segments, m, rank=rank), rank)
        baseline = None
        if wants_baseline_packing(sb, self.latency):
            try:
                baseline = self._own_row(self.pack(segments, m, sb.stand_down, rank=rank), rank)
            except BatchingError:
                if sb.stand_down != "dp_balanced":
                    raise
        return Draft(iteration, first_bin, *own, None, cpu_s=time.thread_time() - t0,
                     baseline=baseline, options=1 + (baseline is not None),
                     num_microbatches=m, own_rank=rank, sab=sab)

    def _own_row(self, batch: BatchPlan, rank: int) -> tuple:
        """(row ``rank`` of ``batch`` (or ``batch``, that row already) as a one-row plan, its
        features), checked to fit."""
        row = batch.row_plan(rank) if batch.dp == self.dp else batch
        check_capacity(row, self.capacity, rank)
        return row, self.units(row)

    def assignment(self, segments, num_microbatches: int):
        """SAB's assignment of the step (``packing.sab_assignment``: every rank's alike); its
        ``plan()`` is the SAB packing (``pack``), a rank's own ``rank_plan(units([r]),
        agreement)``."""
        from ...batching.packing import sab_assignment

        return sab_assignment(segments, **self._sab_args(num_microbatches))

    def _sab_args(self, num_microbatches: int) -> dict:
        """SAB's arguments in this run: priced with the micro-batches' own padding, arranged on
        its pipeline, grouped by the tracker's sensitivities."""
        from ...batching.packing import latency_sample_cost_fn

        sb = self.sb
        return dict(dp=self.dp, num_microbatches=num_microbatches, max_tokens=self.capacity,
                    cost_fn=latency_sample_cost_fn(self.latency, sb.density),
                    sensitivity=self.tracker, long_sample_policy=sb.long_sample_policy,
                    seed=sb.seed, length_multiple=sb.length_multiple)

    def pack(self, segments, num_microbatches: int, method: Optional[str] = None,
             rank: Optional[int] = None) -> BatchPlan:
        """The step's micro-batches by --sb-packing (or ``method``): sequential (Megatron),
        token_balanced, SAB, or (a stand-down's baseline) Megatron's dp_balanced: its own
        micro-batch count, each micro-batch its documents only (``own_length_multiple`` at
        fixed length), as Megatron's packer makes them. ``rank``: the sequential packing gives
        that DP rank's row alone (the others every rank's)."""
        from ...batching.packing import sab_plan, sequential_plan, token_balanced_plan

        sb, kw = self.sb, dict(dp=self.dp, num_microbatches=num_microbatches,
                               max_tokens=self.capacity)
        method = method or sb.packing_method
        if method == "sab":
            plan = sab_plan(segments, **self._sab_args(num_microbatches))
        elif method == "token_balanced":
            plan = token_balanced_plan(segments, long_sample_policy=sb.long_sample_policy,
                                       seed=sb.seed, **kw)
        elif method == "dp_balanced":
            from ...batching.dp_balanced import dp_balanced_plan
            plan = dp_balanced_plan(segments, long_sample_policy=sb.long_sample_policy,
                                    microbatch_group_size_per_vp_stage=self.vpp_group, **kw)
            return plan.with_length_multiple(sb.length_multiple or self.own_length_multiple)
        else:                   # sequential: with ``rank``, that rank's row alone
            plan = sequential_plan(segments, rank=rank, **kw)
        # variable-length micro-batches: the planner's units end where the packed tensors do
        return plan.with_length_multiple(sb.length_multiple)

    def _packed(self, segments, num_microbatches: int, method: Optional[str] = None,
                given=None) -> tuple:
        return self.checked(segments, self.pack(segments, num_microbatches, method), given)

    def checked(self, segments, batch: BatchPlan, given=None) -> tuple:
        """(batch, its latency features), once the batch is checked to hold ``segments``
        (``given``: their ``segment_counts``, where the caller has them)."""
        check_assignment(segments, batch, self.capacity, given)
        return batch, self.units(batch)

    def units(self, batch: BatchPlan):
        """The latency model's features of the step's packed micro-batches, built once per step
        and shared by DST, calibration and the layout check (None without a latency model)."""
        if self.latency is None:
            return None
        return self.latency.unit_features(batch.unit_csr(with_padding=True))

    def settle(self, draft: Draft, *, rank: int, agree) -> tuple:
        """(densities, report) of ``draft``'s step as DP rank ``rank`` commits it:
        ``settle_rounds`` driven to its end through ``agree`` (a ``DPReducer``, or anything with
        its ``__call__``: collective), the step's one exchange with the other DP ranks. The one
        entry for a rank's agreement, wherever it runs."""
        return drive(self.settle_rounds(draft, rank=rank), agree)

    def settle_rounds(self, draft: Draft, *, rank: int) -> Generator[dict, dict, tuple]:
        """Every round DP rank ``rank`` makes to commit ``draft``'s step, in order: its DST of
        its own units, agreed with the other DP ranks. A rank's own draft (``own_draft``) is
        packed here first (SAB's rounds: ``batching.sab_rounds``) and commits its own rows:
        densities [1][m][stages] (without DST: (None, None), its stand-down record on the
        draft)."""
        own = draft.own_rank is not None
        if draft.sab is not None:       # SAB's agreement, then this rank's micro-batches
            from ...batching.sab_rounds import packing_rounds

            a, mine = draft.sab
            draft.batch = yield from packing_rounds(a, mine)
            check_capacity(draft.batch, self.capacity, rank)
            draft.units, draft.sab = self.units(draft.batch), None
        options = [draft.packing(i) for i in range(draft.options)]
        densities, report = None, None
        if not self.sb.dst_enabled:     # a rank's own packings: the static race, agreed
            if own and len(options) > 1:
                draft.stand_down = (yield from self.choose_rounds(
                    options, dst=False, rank=rank, agreed=True, own_rows=True))[2]
            else:
                draft.stand_down = None
        else:
            densities, report, _ = yield from self.choose_rounds(
                options, dst=True, rank=rank, agreed=True, own_rows=own)
        if own:
            densities = yield from self._committed(draft, densities, report)
        return densities, report

    def _committed(self, draft: Draft, densities, report) -> Generator[dict, dict, object]:
        """What a rank's own draft commits: its own rows (densities [1][m][stages]; None: a
        static plan's), and its uncorrected predicted busy seconds, which it calibrates its
        pipeline with after the step (``Draft.predicted_busy``, [1, pipeline ranks]; NaN
        without a plan). Only ``--sb-metrics-file``, which records every unit, gathers every
        DP rank's rows (collective, [dp, m x stages + m] floats): the densities and the units'
        sensitivities (the report's; without the file it holds none)."""
        stand = report["stand_down"] if report is not None else draft.stand_down
        batch, units = draft.packing(int(stand["packing_index"]) if stand else 0)
        m, nv, lm = batch.num_microbatches, len(self.attention_layers), self.latency
        pp = lm.layout.pp if lm is not None else 0
        d = np.asarray(densities, dtype=np.float64) if densities is not None else (
            np.full((1, m, nv), self.sb.density) if self.sb.sparse_attention_enabled else None)
        draft.predicted_busy = lm.busy_s(units, d) if lm is not None and d is not None else \
            np.full((1, pp), np.nan)
        sens = report.get("unit_sensitivity") if report is not None else None
        if not self.sb.metrics_file:
            if report is not None:
                report.update(predicted_busy_s=draft.predicted_busy.tolist(),
                              unit_sensitivity=None)
            return densities
        rows = yield from gathered(np.concatenate([
            np.zeros(m * nv) if densities is None else d.reshape(-1),
            np.zeros(m) if sens is None else np.asarray(sens, np.float64).reshape(-1)]))
        if report is None:
            return None
        report.update(predicted_busy_s=draft.predicted_busy.tolist(), unit_sensitivity=None
                      if sens is None else rows[:, m * nv:].tolist())
        return rows[:, :m * nv].reshape(-1, m, nv).tolist()

    def choose(self, options: list, *, dst: bool):
        """(densities, DST report, stand-down record) of the whole step, planned in one process
        (every DP rank's rounds in lockstep: ``choose_rounds`` asks none of a group)."""
        return drive(self.choose_rounds(options, dst=dst), None)

    def choose_rounds(self, options: list, *, dst: bool, rank: Optional[int] = None,
                      agreed: bool = False, own_rows: bool = False
                      ) -> Generator[dict, dict, tuple]:
        """The rounds of the step's (densities, DST report, stand-down record): DST on each
        packing option, under the do-no-harm rule (``step/choice.py``); with ``rank`` and
        ``agreed`` (the rounds reduced over the DP group) this rank plans its own units."""
        from .choice import choose_rounds, raise_headroom

        # a rank that plans its own units agrees the headroom with the group (``choose_rounds``)
        local = dst and (rank is None or not agreed)
        return (yield from choose_rounds(
            self.sb, self.latency, options, self.dp, tracker=self.tracker, dst=dst,
            raise_headroom=raise_headroom(self.sb, self.latency, self.dp) if local else None,
            stage_layers=self.attention_layers, rank=rank, agreed=agreed, own_rows=own_rows,
            quality_scales=self.quality_scales))
