"""The plugin's per-step metrics, written where Megatron writes its own.

- TensorBoard and W&B: Megatron's writers (``get_tensorboard_writer`` / ``get_wandb_writer``, which
  exist on the last rank when ``--tensorboard-dir`` / ``--wandb-project`` are given), scalars under
  ``sparsebalance/`` at Megatron's iteration numbers, every ``--tensorboard-log-interval``.
- The console: one ``[sparsebalance]`` line per ``--log-interval`` from the last rank (where
  Megatron prints its own line), averaged over the interval like Megatron's.
- ``--sb-metrics-file``: one JSON line per step on rank 0, for scripts; it records the step's
  plan (``batching.replay.plan_record`` and the densities), which ``--sb-replay-plans`` replays.
- Do no harm (``--sb-stand-down``): per step ``dst_stood_down`` / ``sab_stood_down`` (1: the
  static plan / the baseline packing was committed), the cumulative counts in the console line
  (``stood down DST n/N (p%) SAB ...``) and in a last ``run summary`` line.

Every density figure is weighted by attention work, and documents routed to the dense kernel
(shorter than the run's routing threshold) count at density 1 in it: they keep every block.
Two are reported: the planned density (``density``, what the plan asked every unit for) and the
kept one (``kept``: kept key blocks / causal key blocks, the blocks the attention's selection
keeps, which can never fall below the sink, local and diagonal blocks every query block keeps;
on short documents these are most of a document's blocks, so the kept density is higher).
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

PREFIX = "sparsebalance/"


def step_features(batch, sb: SparseBalanceConfig, dense_below_tokens: int = 0, units=None):
    """The ``UnitFeatures`` of the step's micro-batches with the attention's block parameters
    and routing: ``units`` (the latency model's features of the step, built by the planner)
    where they were built with the same parameters, else built here."""
    from ...latency.features import UnitFeatures

    want = (sb.block_size, sb.sink_blocks, sb.local_blocks, "kept", 16, dense_below_tokens)
    if isinstance(units, UnitFeatures) and (
            units.block_size, units.sink_blocks, units.local_blocks, units.work_mode,
            units.query_chunk_blocks, units.dense_below_tokens) == want:
        return units
    return UnitFeatures.build(batch.unit_csr(with_padding=True), *want)


def unit_work(batch, sb: SparseBalanceConfig, dense_below_tokens: int = 0, units=None
              ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """([dp, m] dense attention work (kept block pairs at density 1) of every micro-batch's
    documents on the sparse path: the weight of its planned density in every density figure (a
    stage's layers all run at that density); [dp, m] that of its documents routed dense
    (shorter than ``dense_below_tokens``), which count at density 1, or None without routing).
    ``units``: the step's features if already built (``step_features``)."""
    feats = step_features(batch, sb, dense_below_tokens, units)
    shape = (batch.dp, batch.num_microbatches)
    return (feats.attention_work(1.0).reshape(shape),
            feats.dense_work.reshape(shape) if dense_below_tokens else None)


def kept_work(batch, sb: SparseBalanceConfig, densities: np.ndarray,
              dense_below_tokens: int = 0, units=None) -> np.ndarray:
    """[dp, m, stages] kept block pairs of every unit's documents on the sparse path at the
    unit's planned density (``densities`` [dp, m, stages]): the count the selection keeps
    (``latency/work.py``'s kept rule: ``ceil(density x causal blocks)`` per query block, never
    fewer than its sink, local and diagonal blocks). ``units`` as in ``unit_work``."""
    feats = step_features(batch, sb, dense_below_tokens, units)
    d = np.asarray(densities, dtype=np.float64)
    return np.stack([feats.attention_work(d[:, :, s].reshape(-1)).reshape(d.shape[:2])
                     for s in range(d.shape[2])], axis=2)


def document_tokens(batch, doc_positions: Optional[np.ndarray]) -> int:
    """Positions of the step's documents (tokens and EOD), per-document padding (context
    parallelism) left out; ``doc_positions[d]`` = document d's tokens + 1 (None: count the
    segments whole)."""
    segs = batch.segment_array()
    if doc_positions is None or not segs.size:
        return int((segs[:, 2] - segs[:, 1]).sum())
    return int((np.minimum(segs[:, 2], doc_positions[segs[:, 0]]) - segs[:, 1]).sum())


def step_record(iteration: int, step, summary, measured: np.ndarray, calib: dict, *,
                overhead_s: float, work: np.ndarray, own_s: Optional[float] = None,
                layers=None, attention_layers=None,
                doc_positions: Optional[np.ndarray] = None,
                dense_work: Optional[np.ndarray] = None,
                kept: Optional[np.ndarray] = None, totals: Optional[tuple] = None) -> dict:
    """Everything known about a finished step (identical on every rank), from the step's gathered
    ``summary`` (``step/record.py``'s ``StepSummary``). Densities are weighted
    by attention layers x attention work (``work`` [dp, m], ``layers`` [pp] decoder layers per
    stage, the run's pipeline layout, None = equal; ``attention_layers`` [pp] those with
    attention, a HybridModel's ``*`` layers, None = all); per stage and per DP rank as well as
    overall; routed documents (``dense_work`` [dp, m], None without routing) count at density 1.
    ``tokens`` (and tokens/s) count the documents' tokens and EOD (``document_tokens``);
    ``positions`` what the step computed (padding included). ``kept`` [dp, m, stages]: kept block
    pairs at the planned densities (``kept_work``): the kept density beside the planned one.
    ``totals``: (tokens, positions) of every DP rank where ``step.batch`` is one rank's own.
    ``overhead_s``: the plugin's wall seconds on the step's critical path (this rank); ``own_s``:
    of those, its own work (the training thread's CPU seconds): the rest (``sb_wait_s``) is
    waiting, for the other ranks in the step's collectives and for the planner's draft."""
    from ...policy.costs import stage_mean_densities, weighted_mean_density

    batch = step.batch
    loss_sum, loss_tokens = summary.loss
    step_s = summary.step_s
    if totals is None:              # the batch is every rank's: its own sums
        totals = (document_tokens(batch, doc_positions), int(batch.packed_lengths().sum()))
    tokens, positions = totals
    # Megatron's samples: the bins the documents came from (dp_balanced packs its own count)
    samples = step.consumed_samples - step.first_bin
    rec = {"step": iteration, "tokens": tokens, "positions": positions,
           "samples": samples, "microbatches": batch.num_microbatches,
           "consumed_samples": step.consumed_samples,
           "loss": loss_sum / loss_tokens if loss_tokens else None,
           "step_time_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
           "packing": batch.method, "split_docs": int(batch.num_split_samples),
           "sb_overhead_s": overhead_s}
    if own_s is not None:
        rec.update(sb_own_s=own_s, sb_wait_s=max(overhead_s - own_s, 0.0))
    if step.plan is not None:
        d = step.plan.densities                                     # [dp, m, pp]
        lay = np.ones(d.shape[2]) if layers is None else np.asarray(layers, dtype=np.float64)
        att = lay if attention_layers is None else np.asarray(attention_layers, np.float64)
        w = np.asarray(work, dtype=np.float64)[:, :, None] * att[None, None, :]
        dw = None if dense_work is None else \
            np.asarray(dense_work, dtype=np.float64)[:, :, None] * att[None, None, :]
        per_rank = stage_mean_densities(d.transpose(2, 1, 0), w.transpose(2, 1, 0),
                                        None if dw is None else dw.transpose(2, 1, 0))
        rec.update(budgets_consistent=True, mean_density=weighted_mean_density(d, w, dw),
                   layers_per_stage=[int(x) for x in lay],
                   attention_layers_per_stage=[int(x) for x in att],
                   density_per_rank=[float(x) for x in per_rank],
                   density_per_stage=[float(x) for x in stage_mean_densities(d, w, dw)])
        if kept is not None:
            # kept pairs / causal pairs, both over attention layers; routed documents keep all
            k = np.asarray(kept, dtype=np.float64) * att[None, None, :]
            num, den = float(k.sum()), float(w.sum())
            if dw is not None:
                num, den = num + float(dw.sum()), den + float(dw.sum())
            if den > 0:
                rec["kept_density"] = num / den
    if np.isfinite(measured).all():
        busy = measured.sum(axis=1)
        rec.update(rank_busy_s=[float(x) for x in busy],
                   measured_imbalance=float(busy.max() / max(busy.mean(), 1e-12)))
    rec.update(calib)
    r = step.report
    if r is not None:
        rec.update(predicted_step_s=r["step_time_planned_s"],
                   predicted_static_s=r["step_time_static_s"],
                   imbalance_before=r["imbalance_before"], imbalance_after=r["imbalance_after"],
                   units_cut=r["units_cut"], units_raised=r["units_raised"],
                   raise_headroom=r.get("raise_headroom"),
                   unit_sensitivity=r.get("unit_sensitivity"))
        q = r.get("quality_cost")
        if q is not None and np.isfinite(q):
            rec["predicted_loss_change"] = float(q)
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
    ("imbalance/predicted_before", "imbalance_before"),
    ("imbalance/predicted_after", "imbalance_after"), ("imbalance/measured", "measured_imbalance"),
    ("units/cut", "units_cut"), ("units/raised", "units_raised"),
    ("latency_model/error", "latency_error"), ("raise_headroom", "raise_headroom"),
    ("overhead_s", "sb_overhead_s"), ("overhead/own_s", "sb_own_s"),
    ("overhead/wait_s", "sb_wait_s"), ("planned_ahead_s", "sb_planned_ahead_s"),
    ("dst_stood_down", "dst_stood_down"), ("sab_stood_down", "sab_stood_down"),
    ("planner/events", "planner_events"), ("planner/events_total", "planner_events_total"),
)


def scalars(rec: dict) -> dict:
    """The record's numbers as ``sparsebalance/...`` scalars (``SCALARS``, then the density of
    each stage and rank); a missing or non-finite number is left out."""
    named = [(name, rec.get(key)) for name, key in SCALARS]
    named += [(f"density/stage{s}", v) for s, v in enumerate(rec.get("density_per_stage") or [])]
    named += [(f"density/rank{r}", v) for r, v in enumerate(rec.get("density_per_rank") or [])]
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
    ``plan``: the step's packing (``batching.replay.plan_record``; documents padded to a
    multiple of ``pad_multiple``; ``seed``: the run's --sb-seed), which with ``densities`` is what
    ``--sb-replay-plans`` replays."""
    from ...batching.replay import plan_record

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
        self._interval: dict = defaultdict(list)
        self.history: list = []   # records of this process (tests, scripts in the same process)
        self.doc_positions = doc_positions
        self.pad_multiple = pad_multiple
        from .compile_watch import WATCH        # Triton compiles per step (sparse attention)
        self.compiles = WATCH if sb.sparse_attention_enabled and (
            WATCH.available or WATCH.install()) else None
        self.stood = StandDownCounts()   # cumulative over the run (checkpointed by the callback)
        self.planner_events_total = 0    # planner deaths and stalls over the run, every rank
        self.fallback: Optional[dict] = None   # the attention kernel fallback (fallback_sync)

    def _gathered(self, step, units, work, dense, d, gather) -> tuple:
        """(work [dp, m], routed work [dp, m] or None, kept pairs [dp, m, stages] or None,
        (tokens, positions)) of every DP rank, each rank's rows gathered (collective): block
        pair counts and token counts, exact in float64."""
        m, batch = step.batch.num_microbatches, step.batch
        nv = 0 if d is None else d.shape[2]
        kept = None if d is None else \
            kept_work(batch, self.sb, d, self.dense_below_tokens, units)
        rows = gather(np.concatenate([
            work.reshape(-1), np.zeros(m) if dense is None else dense.reshape(-1),
            np.zeros(0) if kept is None else kept.reshape(-1),
            [document_tokens(batch, self.doc_positions), batch.packed_lengths().sum()]]))
        dp = rows.shape[0]
        return (rows[:, :m], None if dense is None else rows[:, m:2 * m],
                None if kept is None else rows[:, 2 * m:2 * m + m * nv].reshape(dp, m, nv),
                (int(rows[:, -2].sum()), int(rows[:, -1].sum())))

    def report(self, iteration: int, step, summary, measured, calib, *, overhead_s: float,
               own_s: Optional[float] = None, planned_ahead_s: Optional[float] = None,
               gather=None):
        """``overhead_s``: the plugin's seconds on the step's critical path (this rank), ``own_s``
        of them its own work (``step_record``); ``planned_ahead_s``: CPU seconds the planner's
        draft of the next step took (--sb-planner process/thread; off the critical path);
        ``gather``: every DP rank's row of a vector (``StepExchange.gather_rows``: collective),
        which a step of one rank's own micro-batches reports the whole step's figures from."""
        units = step_features(step.batch, self.sb, self.dense_below_tokens, step.units)
        work, dense = unit_work(step.batch, self.sb, self.dense_below_tokens, units)
        d = None if step.plan is None else step.plan.densities
        totals, batch = None, step.batch
        if batch.dp < self.dp:            # this rank's micro-batches: every DP rank's rows
            d = None if d is None else d[self.dp_rank:self.dp_rank + 1]
            work, dense, kept, totals = self._gathered(step, units, work, dense, d, gather)
            if self.sb.metrics_file:     # the plan's record: every rank's micro-batches
                batch = gathered_plan(batch, gather)
        else:
            kept = None if d is None else \
                kept_work(batch, self.sb, d, self.dense_below_tokens, units)
        rec = step_record(iteration, step, summary, measured, calib, overhead_s=overhead_s,
                          own_s=own_s, work=work, layers=self.layout.layers,
                          attention_layers=self.layout.attention_layers,
                          doc_positions=self.doc_positions, dense_work=dense, kept=kept,
                          totals=totals)
        if planned_ahead_s is not None:
            rec["sb_planned_ahead_s"] = planned_ahead_s
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
        self.stood.add(rec.get("dst_stood_down"), rec.get("sab_stood_down"))
        if self.stood.dst_steps or self.stood.sab_steps:
            rec["stood_down_total"] = self.stood.state_dict()
        if self.sb.metrics_file and comm.rank() == 0:
            line = dict(rec, **unit_details(step, summary, work, dp=self.dp, batch=batch,
                                            layout=self.layout, dense_work=dense,
                                            pad_multiple=self.pad_multiple,
                                            seed=self.sb.seed))
            with open(self.sb.metrics_file, "a") as f:
                f.write(json.dumps(line) + "\n")
        values = scalars(rec)
        self._write(iteration, values)
        for k, v in values.items():
            self._interval[k].append(v)
        if iteration % max(self.args.log_interval, 1) == 0 or iteration == self.args.train_iters:
            self._log_line(iteration, rec)
            self._interval.clear()
        exit_every = getattr(self.args, "exit_interval", None)   # Megatron's clean stop
        last = iteration == self.args.train_iters or bool(exit_every and
                                                          iteration % exit_every == 0)
        if last and comm.rank() == comm.world_size() - 1 and self.stood.describe():
            print(f"[sparsebalance] run summary: {self.stood.describe()} of the steps "
                  f"(do no harm: --sb-stand-down {self.sb.stand_down})", flush=True)
        return rec

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

    def _log_line(self, iteration: int, rec: dict) -> None:
        if comm.rank() != comm.world_size() - 1:   # where Megatron prints its log line
            return

        def mean(name):
            v = self._interval.get(PREFIX + name)
            return float(np.mean(v)) if v else None

        parts = [f"[sparsebalance] iteration {iteration:>6d}/{self.args.train_iters}"]
        if mean("step_time/measured_s") is not None:
            parts.append(f"fwd-bwd {mean('step_time/measured_s'):.3f} s")
        if mean("density/mean") is not None:
            stages = [mean(f"density/stage{s}") for s in range(self.stages)]
            kept = mean("density/kept")
            parts.append(f"density {mean('density/mean'):.3f}"
                         + (f" kept {kept:.3f}" if kept is not None else "")
                         + (f" (stages {'/'.join(f'{x:.2f}' for x in stages)})"
                            if self.stages > 1 else ""))
        if mean("step_time/predicted_s") is not None:
            parts.append(f"pred {mean('step_time/predicted_s'):.3f} s (static "
                         f"{mean('step_time/static_s'):.3f} s)")
            parts.append(f"imb {mean('imbalance/predicted_before'):.2f}->"
                         f"{mean('imbalance/predicted_after'):.2f}")
            cut = sum(self._interval.get(PREFIX + "units/cut", []))
            raised = sum(self._interval.get(PREFIX + "units/raised", []))
            parts.append(f"cut {int(cut)} raised {int(raised)}")
        if mean("latency_model/error") is not None:
            parts.append(f"lat err {100 * mean('latency_model/error'):.1f}%")
        if rec.get("split_docs"):
            parts.append(f"split docs {rec['split_docs']}")
        if self.stood.describe():                    # cumulative over the run
            parts.append(self.stood.describe())
        own, wait = mean("overhead/own_s"), mean("overhead/wait_s")
        parts.append(f"overhead {mean('overhead_s') or 0.0:.3f} s"
                     + (f" (own {own:.3f} s, waiting {wait:.3f} s)" if own is not None else ""))
        print(" | ".join(parts), flush=True)
