"""The plugin's per-step metrics, written where Megatron writes its own.

- TensorBoard and W&B: Megatron's writers (``get_tensorboard_writer`` / ``get_wandb_writer``, which
  exist on the last rank when ``--tensorboard-dir`` / ``--wandb-project`` are given), scalars under
  ``sparsebalance/`` at Megatron's iteration numbers, every ``--tensorboard-log-interval``.
- The console (``console.py``): one ``[sparsebalance]`` line per ``--log-interval`` from the last
  rank (where Megatron prints its own line), averaged over the interval like Megatron's.
- ``--sb-metrics-file``: one JSON line per step on rank 0, for scripts; it records the step's
  plan (``launch.replay.plan_record`` and the densities), which ``--sb-replay-plans`` replays.
- Do no harm (``--sb-stand-down``): per step ``dst_stood_down`` / ``sab_stood_down`` (1: the
  static plan / the baseline packing was committed), the cumulative counts in the console line
  (``stood down DST n/N (p%) SAB ...``) and in a last ``run summary`` line.

Every density figure is weighted by attention work, and documents routed to the dense kernel
(shorter than the run's routing threshold) count at density 1 in it: they keep every block.
Two are reported: the planned density (``density``, what the plan asked every unit for) and the
kept one (``kept``: kept key blocks / causal key blocks, the blocks the attention's selection
keeps, which can never fall below the sink, local and diagonal blocks every query block keeps;
on short documents these are most of a document's blocks, so the kept density is higher).

The figures are the whole step's, made of fixed-size sums over the DP group
(``report_sums``: each rank's own micro-batches, one all-reduce, whatever the DP size): the
means overall and per stage, the DP ranks' least and greatest density (``density_rank_min`` /
``_max``) and busy seconds (``busy_max_s``, ``busy_mean_s``, ``measured_imbalance`` = max /
mean), tokens and positions. Only ``--sb-metrics-file``'s per-unit detail gathers every rank's
rows (its work and the plan: [dp, m] figures, opt-in).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Optional

import numpy as np

from ...batching.plan import gathered_plan
from ...config import SparseBalanceConfig
from ...policy.stand_down import StandDownCounts
from ..runtime import comm
from .console import PREFIX, console_line
from .eval_profile import TrainedProfile
from .report_sums import rank_parts, step_features, step_figures, summed_parts, unit_work



def step_record(iteration: int, step, summary, calib: dict, *, figures: dict,
                overhead_s: float, own_s: Optional[float] = None) -> dict:
    """Everything known about a finished step (identical on every rank), from the step's gathered
    ``summary`` (``step/record.py``'s ``StepSummary``) and ``figures``, the whole step's
    (``step_figures``: the DP group's sums). ``tokens`` (and tokens/s) count the documents'
    tokens and EOD (``document_tokens``); ``positions`` what the step computed (padding
    included). ``overhead_s``: the plugin's wall seconds on the step's critical path (this
    rank); ``own_s``: of those, its own work (the training thread's CPU seconds): the rest
    (``sb_wait_s``) is waiting, for the other ranks in the step's collectives and for the
    planner's draft."""
    batch = step.batch
    loss_sum, loss_tokens = summary.loss
    step_s, tokens = summary.step_s, figures["tokens"]
    # Megatron's samples: the bins the documents came from (dp_balanced packs its own count)
    samples = step.consumed_samples - step.first_bin
    rec = {"step": iteration, "tokens": tokens, "positions": figures["positions"],
           "samples": samples, "microbatches": batch.num_microbatches,
           "consumed_samples": step.consumed_samples,
           "loss": loss_sum / loss_tokens if loss_tokens else None,
           "step_time_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
           "packing": batch.method, "split_docs": int(batch.num_split_samples),
           "sb_overhead_s": overhead_s}
    if own_s is not None:
        rec.update(sb_own_s=own_s, sb_wait_s=max(overhead_s - own_s, 0.0))
    rec.update(figures)
    rec.update(calib)
    r = step.report
    if r is not None:
        rec.update(predicted_step_s=r["step_time_planned_s"],
                   predicted_static_s=r["step_time_static_s"],
                   imbalance_before=r["imbalance_before"], imbalance_after=r["imbalance_after"],
                   units_cut=r["units_cut"], units_raised=r["units_raised"],
                   raise_headroom=r.get("raise_headroom"),
                   unit_sensitivity=r.get("unit_sensitivity"))
        q, sd = r.get("quality_cost"), r.get("quality_sd")
        if q is not None and np.isfinite(q):
            rec["predicted_loss_change"] = float(q)
        if sd is not None and np.isfinite(sd):
            rec["predicted_loss_sd"] = float(sd)
        if r.get("adopted"):            # the quality objective: 1 where the cuts did not pay
            rec["dst_no_cuts"] = int(r["adopted"] == "no_cuts")
            rec["exchange_rate"] = float(r["exchange_rate"])
    sd = getattr(step, "stand_down", None)
    if sd is not None:                   # do no harm (policy.stand_down): 1 = stood down
        for part in ("dst", "sab"):
            if sd.get(f"{part}_stood_down") is not None:
                rec[f"{part}_stood_down"] = int(sd[f"{part}_stood_down"])
        if sd.get("predicted_dst_s") is not None:
            rec["predicted_dst_s"] = sd["predicted_dst_s"]
    return rec


# (scalar name under ``sparsebalance/``, record key) of each single number the record carries
SCALARS = (
    ("loss", "loss"), ("step_time/measured_s", "step_time_s"),
    ("step_time/predicted_s", "predicted_step_s"), ("step_time/static_s", "predicted_static_s"),
    ("density/mean", "mean_density"), ("density/kept", "kept_density"),
    ("density/rank_min", "density_rank_min"), ("density/rank_max", "density_rank_max"),
    ("imbalance/predicted_before", "imbalance_before"),
    ("imbalance/predicted_after", "imbalance_after"), ("imbalance/measured", "measured_imbalance"),
    ("busy/max_s", "busy_max_s"), ("busy/mean_s", "busy_mean_s"),
    ("units/cut", "units_cut"), ("units/raised", "units_raised"),
    ("latency_model/error", "latency_error"), ("raise_headroom", "raise_headroom"),
    ("latency_model/correction_min", "calibration_min"),
    ("latency_model/correction_max", "calibration_max"),
    ("overhead_s", "sb_overhead_s"), ("overhead/own_s", "sb_own_s"),
    ("overhead/wait_s", "sb_wait_s"), ("planned_ahead_s", "sb_planned_ahead_s"),
    ("dst_stood_down", "dst_stood_down"), ("sab_stood_down", "sab_stood_down"),
    ("quality/predicted_loss_change", "predicted_loss_change"),
    ("quality/predicted_loss_sd", "predicted_loss_sd"), ("dst/no_cuts", "dst_no_cuts"),
    ("quality/exchange_rate", "exchange_rate"), ("quality/refresh_s", "quality_refresh_s"),
    ("planner/events", "planner_events"), ("planner/events_total", "planner_events_total"),
)


def scalars(rec: dict) -> dict:
    """The record's numbers as ``sparsebalance/...`` scalars (``SCALARS``, then the density of
    each stage, and with --sb-eval-density trained its evaluation density); a missing or
    non-finite number is left out."""
    named = [(name, rec.get(key)) for name, key in SCALARS]
    for tag, key in (("stage", "density_per_stage"), ("eval_stage", "eval_density_per_stage")):
        named += [(f"density/{tag}{s}", v) for s, v in enumerate(rec.get(key) or [])]
    return {PREFIX + name: float(v) for name, v in named if v is not None and np.isfinite(v)}


def unit_details(step, summary, work: np.ndarray, *, dp: int, layout, batch=None,
                 dense_work: Optional[np.ndarray] = None, pad_multiple: int = 1,
                 seed: Optional[int] = None) -> dict:
    """Per-unit detail for ``--sb-metrics-file`` (scripts that study plans): the densities
    [dp][m][stages], each unit's dense attention work [dp][m] (its weight in density means; with
    routing also ``dense_work``, that of its routed documents, at density 1) and
    the measured forward/backward seconds [dp][m][stages] (None where a rank reported none; the
    slowest TP/CP rank of a cell, ``summary.unit_times``); stages are the layout's virtual
    stages. A rank's timer intervals are mapped to units by the order it ran them (``units``:
    forward order; the backward runs the model chunks reversed).
    ``plan``: the step's packing (``launch.replay.plan_record``; documents padded to a
    multiple of ``pad_multiple``; ``seed``: the run's --sb-seed), which with ``densities`` is what
    ``--sb-replay-plans`` replays."""
    from ..launch.replay import plan_record

    batch = step.batch if batch is None else batch      # every DP rank's micro-batches
    m, nv, vp = batch.num_microbatches, layout.num_stages, layout.vp
    fwd = [[[None] * nv for _ in range(m)] for _ in range(dp)]
    bwd = [[[None] * nv for _ in range(m)] for _ in range(dp)]
    for (r, pp), (units, fwd_s, bwd_s) in sorted(summary.unit_times.items()):
        if len(units) == len(fwd_s) == len(bwd_s) == m * vp:
            for k, (j, v) in enumerate(units):
                back = layout.stage_of(pp, vp - 1 - layout.chunk_of(v))
                fwd[r][j][v] = float(fwd_s[k])
                bwd[r][j][back] = float(bwd_s[k])
    out = {"attn_work": np.asarray(work).tolist(), "microbatch_fwd_s": fwd,
           "microbatch_bwd_s": bwd,
           "plan": plan_record(batch, step.first_bin, pad_multiple, seed)}
    if dense_work is not None:
        out["dense_work"] = np.asarray(dense_work).tolist()
    if step.plan is not None:
        out["densities"] = step.plan.densities.tolist()
    return out


class StepReporter:
    """Sends each step's record to the metrics file, Megatron's writers and the console."""

    def __init__(self, args, sb: SparseBalanceConfig, *, dp: int, dp_rank: int = 0,
                 layout=None,
                 doc_positions: Optional[np.ndarray] = None, dense_below_tokens: int = 0,
                 pad_multiple: int = 1):
        """``doc_positions``: [documents] tokens + EOD of every document of the corpus, so that
        ``tokens`` leaves per-document padding out (``document_tokens``); documents shorter
        than ``dense_below_tokens`` run dense (the run's routing threshold; 0: none);
        ``pad_multiple``: what documents are padded to (recorded with the plan)."""
        from ...latency.layout import PipelineLayout

        self.args, self.sb, self.dp, self.dp_rank = args, sb, dp, dp_rank
        self.dense_below_tokens = dense_below_tokens
        self.layout = layout if layout is not None else PipelineLayout(1, 1, (1,))
        self.stages = self.layout.num_stages
        self.interval: dict = defaultdict(list)
        self.history: list = []   # records of this process (tests, scripts in the same process)
        self.doc_positions = doc_positions
        self.pad_multiple = pad_multiple
        from .compile_watch import WATCH        # Triton compiles per step (sparse attention)
        self.compiles = WATCH if sb.sparse_attention_enabled and (
            WATCH.available or WATCH.install()) else None
        self.stood = StandDownCounts()   # cumulative over the run (checkpointed by the callback)
        # DST's predictions over the steps this process planned: static and planned seconds,
        # predicted loss change (token-weighted, summed), steps, steps without cuts
        self.predicted = {"static_s": 0.0, "planned_s": 0.0, "loss": 0.0, "steps": 0,
                          "no_cuts": 0, "quality_steps": 0, "rate": 0.0}
        self.planner_events_total = 0    # planner deaths and stalls over the run, every rank
        self.fallback: Optional[dict] = None   # the attention kernel fallback (fallback_sync)
        self.eval_profile = TrainedProfile.of(self.layout, sb)   # --sb-eval-density trained

    def _parts(self, step, row: int, measured, units=None, calibration=None) -> dict:
        """DP rank ``row``'s ``rank_parts`` of ``step`` (its row of a whole plan, or the batch
        that is its own), with its busy seconds: its row of ``measured`` ([dp, pp] or its own
        [1, pp]), and this rank's ``calibration`` (``rank_parts``')."""
        batch = step.batch
        own = batch if batch.dp == 1 else batch.row_plan(row)
        busy = np.asarray(measured, dtype=np.float64)
        busy = busy[row if busy.shape[0] == self.dp else 0].sum()
        return rank_parts(own, self.sb, None if step.plan is None else
                          step.plan.rows(row), layers=self.layout.layers,
                          attention_layers=self.layout.attention_layers,
                          dense_below_tokens=self.dense_below_tokens,
                          doc_positions=self.doc_positions,
                          units=units if batch.dp == 1 else None, busy=busy,
                          calibration=calibration, kept_curve_grid=None if
                          self.eval_profile is None else self.eval_profile.GRID)

    def _detail(self, step, units, gather) -> tuple:
        """(work [dp, m], routed work [dp, m] or None, the plan of every DP rank) for the
        metrics file's per-unit detail (``unit_details``); where the step's batch is this
        rank's own, every rank's rows gathered (collective: [dp, 2m] floats, and the plan's
        segments, ``gathered_plan``)."""
        batch = step.batch
        work, dense = unit_work(batch, self.sb, self.dense_below_tokens, units)
        if batch.dp < self.dp:
            m = batch.num_microbatches
            rows = gather(np.concatenate([work.reshape(-1), np.zeros(m) if dense is None
                                          else dense.reshape(-1)]))
            work, dense = rows[:, :m], None if dense is None else rows[:, m:]
            batch = gathered_plan(batch, gather)
        return work, dense, batch

    def report(self, iteration: int, step, summary, measured, calib, *, overhead_s: float,
               own_s: Optional[float] = None, planned_ahead_s: Optional[float] = None,
               reduce=None, gather=None, extra: Optional[dict] = None):
        """``overhead_s``: the plugin's seconds on the step's critical path (this rank), ``own_s``
        of them its own work (``step_record``); ``planned_ahead_s``: CPU seconds the planner's
        draft of the next step took (--sb-planner process/thread; off the critical path);
        ``measured``: busy seconds [dp, pp] or this rank's [1, pp] (NaN: untimed); ``calib``:
        the record's calibration fields, its ``calibration_own`` (this rank's error and factor)
        reduced with the figures.
        The figures are the DP group's sums of every rank's own parts: ``reduce``
        (``StepExchange.reduce``: collective, a fixed size); None: the step's batch is every
        rank's (a whole plan in one process) and every row's parts are summed here. ``gather``:
        every DP rank's row of a vector (``StepExchange.gather_rows``: collective), only for
        ``--sb-metrics-file``'s per-unit detail where the batch is this rank's own. ``extra``:
        the record's fields of the step's quality refresh (``step/quality_probe.py``)."""
        batch = step.batch
        if reduce is None and batch.dp != self.dp:
            raise ValueError(f"the step's batch holds {batch.dp} of {self.dp} DP ranks' "
                             f"micro-batches: its figures need the DP group's reduce")
        units = step_features(batch, self.sb, self.dense_below_tokens, step.units) \
            if batch.dp == 1 else step.units      # a whole plan's: each row builds its own
        calib = dict(calib)
        own = calib.pop("calibration_own", None)
        if reduce is None:
            total = summed_parts([self._parts(step, r, measured, units, own)
                                  for r in range(self.dp)])
        else:
            total = reduce(self._parts(step, self.dp_rank, measured, units, own))
        figures = step_figures(total, layers=self.layout.layers,
                               attention_layers=self.layout.attention_layers)
        rec = step_record(iteration, step, summary, calib, figures=figures,
                          overhead_s=overhead_s, own_s=own_s)
        if planned_ahead_s is not None:
            rec["sb_planned_ahead_s"] = planned_ahead_s
        if self.eval_profile is not None:
            rec["eval_density_per_stage"] = self.eval_profile.add(rec.get("density_per_stage"),
                                                                  total.get("kept_curve"))
        rec.update(extra or {})
        # every rank's planner process deaths and stalls, reported with the step after them
        self.planner_events_total += summary.planner_events
        if self.planner_events_total:
            rec["planner_events"] = summary.planner_events
            rec["planner_events_total"] = self.planner_events_total
        if self.fallback is not None:     # the kernel every rank runs after a fallback
            rec["attention_backend"] = self.fallback["to"]
            rec["attention_fallback"] = f"{self.fallback['from']} -> {self.fallback['to']}"
        if self.compiles is not None:     # this rank's, since the last step
            rec["kernel_compiles"], rec["kernel_compile_s"] = self.compiles.take()
        self.history.append(rec)
        self._predicted(rec)
        self.stood.add(rec.get("dst_stood_down"), rec.get("sab_stood_down"))
        if self.stood.dst_steps or self.stood.sab_steps:
            rec["stood_down_total"] = self.stood.state_dict()
        detail = self._detail(step, units, gather) if self.sb.metrics_file else None
        if detail is not None and comm.rank() == 0:
            work, dense, batch = detail
            line = dict(rec, **unit_details(step, summary, work, dp=self.dp, batch=batch,
                                            layout=self.layout, dense_work=dense,
                                            pad_multiple=self.pad_multiple,
                                            seed=self.sb.seed))
            with open(self.sb.metrics_file, "a") as f:
                f.write(json.dumps(line) + "\n")
        values = scalars(rec)
        self._write(iteration, values)
        for k, v in values.items():
            self.interval[k].append(v)
        if iteration % max(self.args.log_interval, 1) == 0 or iteration == self.args.train_iters:
            if comm.rank() == comm.world_size() - 1:   # where Megatron prints its log line
                print(console_line(iteration, rec, self), flush=True)
            self.interval.clear()
        exit_every = getattr(self.args, "exit_interval", None)   # Megatron's clean stop
        last = iteration == self.args.train_iters or bool(exit_every and
                                                          iteration % exit_every == 0)
        if last and comm.rank() == comm.world_size() - 1:
            if self.stood.describe():
                print(f"[sparsebalance] run summary: {self.stood.describe()} of the steps "
                      f"(do no harm: --sb-stand-down {self.sb.stand_down})", flush=True)
            if self.predicted["steps"]:
                print(f"[sparsebalance] run predictions: {self.describe_predicted()}", flush=True)
            if self.eval_profile is not None and self.eval_profile.steps:
                print(f"[sparsebalance] {self.eval_profile.describe()}", flush=True)
        return rec

    def _predicted(self, rec: dict) -> None:
        """Add a step's predictions to the run's (``describe_predicted``)."""
        if rec.get("predicted_step_s") is None:
            return
        p = self.predicted
        p["static_s"] += rec["predicted_static_s"]
        p["planned_s"] += rec["predicted_step_s"]
        p["steps"] += 1
        if rec.get("predicted_loss_change") is not None:
            p["loss"] += rec["predicted_loss_change"]
            p["quality_steps"] += 1
        p["no_cuts"] += rec.get("dst_no_cuts", 0)
        p["rate"] += rec.get("exchange_rate", 0.0)

    def describe_predicted(self) -> str:
        """What DST predicted over the steps this process planned: the step against static,
        the loss change against uniform --sb-density, and where its cuts did not pay."""
        p = self.predicted
        gain = 100.0 * (1.0 - p["planned_s"] / p["static_s"]) if p["static_s"] else 0.0
        out = (f"DST planned {p['steps']} steps, predicted {gain:+.2f}% faster than the static "
               f"plan")
        if p["quality_steps"]:
            out += (f" and {p['loss'] / p['quality_steps']:+.4f} nats of loss per token against "
                    f"uniform density {self.sb.density:g} (mean of the steps); the plan without "
                    f"cuts was kept on {p['no_cuts']}/{p['quality_steps']} steps (cuts that did "
                    f"not pay at --sb-exchange-rate {self.sb.exchange_rate}: "
                    f"{p['rate'] / p['quality_steps']:.4f} nats per 1% on average)")
        return out

    def _write(self, iteration: int, values: dict) -> None:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        every = max(getattr(self.args, "tensorboard_log_interval", 1) or 1, 1)
        if iteration % every:
            return
        writer = get_tensorboard_writer()
        if writer:
            for k, v in values.items():
                writer.add_scalar(k, v, iteration)
        wandb = get_wandb_writer()
        if wandb:
            wandb.log(values, iteration)
