"""SparseBalance runtime inside Megatron's step: budgets in, timings out.

Before a step: SAB packs the read-ahead documents (when on) and DST plans a density for every
(dp rank, micro-batch, stage) from the latency model (when on); rank 0 plans and broadcasts, so
every TP, PP and DP rank holds identical budgets. At the end of the step's backward
(``finalize_model_grads_func``) this rank's per-micro-batch timings are taken from
``config.timers``. After the step they are gathered, calibrate the latency model (per DP rank),
and the attention statistics refine SAB's sensitivity estimates.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np

from ..config import SparseBalanceConfig
from ..data import padding_lengths
from ..plan import BudgetPlan, pop_attention_stats, pop_served_densities
from . import comm

log = logging.getLogger("sparsebalance")


def table_expectation(args, sb: SparseBalanceConfig) -> dict:
    """What a latency table must have been measured on to be used by this run."""
    import megatron.core
    import torch

    from .. import __version__
    from .profile import StageShape, device_name

    return {
        "device": device_name(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "sparsebalance_megatron": __version__,
        "model": StageShape.from_megatron_args(args).as_table_model(),
        "attention": {"block_size": sb.block_size, "sink_blocks": sb.sink_blocks,
                      "local_blocks": sb.local_blocks},
        "pipeline": {"pp": args.pipeline_model_parallel_size},
    }


def _profile_command(args, sb: SparseBalanceConfig, out: str) -> list[str]:
    from .profile import StageShape

    cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--no-progress", "--out", out, *StageShape.from_megatron_args(args).cli_flags(),
           "--sb-block-size", sb.block_size, "--sb-sink-blocks", sb.sink_blocks,
           "--sb-local-blocks", sb.local_blocks, "--sb-attention-backend", sb.attention_backend]
    return [str(c) for c in cmd]


def load_latency_model(args, sb: SparseBalanceConfig):
    """The run's latency model: ``--sb-latency-table``, else one profiled now on this device.

    Any problem with the table (malformed, wrong device/model/version) stops the run before
    step 1 with the loader's message; it never trains with a broken latency model.
    """
    from ..latency.model import LatencyModel
    from ..latency.table import LatencyTableError

    expect = table_expectation(args, sb)
    path = sb.latency_table
    if path is None:
        from ..data.sources import default_cache_dir

        key = "_".join(f"{k}{int(v) if isinstance(v, bool) else v}"
                       for k, v in sorted(expect["model"].items()))
        key += (f"_pp{args.pipeline_model_parallel_size}_b{sb.block_size}s{sb.sink_blocks}"
                f"l{sb.local_blocks}_v{expect['sparsebalance_megatron']}")  # upgrade: re-profile
        path = os.path.join(sb.data_cache_dir or default_cache_dir(), "latency", key + ".json")
        if comm.rank() == 0 and not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            log.info("no --sb-latency-table: profiling this model on this device (quick grid) "
                     "-> %s", path)
            t0 = time.perf_counter()
            proc = subprocess.run(_profile_command(args, sb, path), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"error: latency profiling failed:\n{proc.stdout[-3000:]}")
            log.info("latency table profiled in %.1f s", time.perf_counter() - t0)
        comm.barrier()
    try:
        model = LatencyModel.load(path, expect=expect, force=sb.latency_table_force,
                                  calibration_ema=sb.calibration_ema)
    except (LatencyTableError, OSError) as e:
        raise SystemExit(f"error: --sb-latency-table: {e}")
    if model.pp != args.pipeline_model_parallel_size:
        raise SystemExit(f"error: --sb-latency-table {path}: profiled for {model.pp} pipeline "
                         f"stage(s), this run has {args.pipeline_model_parallel_size}")
    return model


def unit_lengths(step_data, capacity: int) -> list:
    """[dp * m] rank-major arrays of the sequences attention sees per micro-batch (padding too)."""
    out = []
    for rank in step_data.assignment:
        for mb in rank:
            lengths = [e - s for _, s, e in mb]
            out.append(np.asarray(lengths + padding_lengths(capacity - sum(lengths)),
                                  dtype=np.int64))
    return out


class SparseBalanceRuntime:
    """Owns the latency model, the sensitivity tracker and the per-step plan."""

    def __init__(self, args, sb: SparseBalanceConfig, *, dp: int, num_microbatches: int,
                 capacity: int, timers):
        from megatron.core import parallel_state as ps

        self.args, self.sb = args, sb
        self.dp, self.num_microbatches, self.capacity = dp, num_microbatches, capacity
        self.pp = args.pipeline_model_parallel_size
        self.dp_rank, self.pp_rank = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.timers = timers
        self.latency = None
        self.tracker = None
        self.last_timings: dict | None = None
        self.last_report: dict | None = None
        self.overhead_s = 0.0
        self.steps_done = 0
        if sb.dst_enabled or sb.batching_enabled:
            self.latency = load_latency_model(args, sb)
        if sb.batching_enabled:
            from ..batching.sensitivity import SensitivityTracker

            self.tracker = SensitivityTracker()
        if args.load:
            self.load_state(args.load, args.iteration)

    # --- before the step ------------------------------------------------------------------
    def packer(self):
        """The packer of the data path (--sb-packing): SAB, token-balanced or sequential."""
        from ..data.packing import sequential_pack

        method = self.sb.packing_method
        if method == "sab":
            return self._sab_pack
        if method == "token_balanced":
            return self._token_balanced_pack
        return sequential_pack

    def _token_balanced_pack(self, segments, *, capacity, dp, num_microbatches):
        from ..batching.packing import token_balanced_plan

        return token_balanced_plan(segments, dp=dp, num_microbatches=num_microbatches,
                                   max_tokens=capacity, long_sample_policy=self.sb.long_sample_policy,
                                   seed=self.sb.seed).micro_batches

    def _sab_pack(self, segments, *, capacity, dp, num_microbatches):
        from ..batching.packing import latency_sample_cost_fn, sab_plan

        t0 = time.perf_counter()
        bp = sab_plan(segments, dp=dp, num_microbatches=num_microbatches, max_tokens=capacity,
                      cost_fn=latency_sample_cost_fn(self.latency, self.sb.density),
                      sensitivity=self.tracker, long_sample_policy=self.sb.long_sample_policy,
                      seed=self.sb.seed)
        self.overhead_s += time.perf_counter() - t0
        return bp.micro_batches

    def plan_step(self, step_data) -> BudgetPlan | None:
        if not self.sb.sparse_attention_enabled:
            return None
        if not self.sb.dst_enabled:
            return BudgetPlan.static(step_data.step, self.sb.density, self.dp,
                                     step_data.num_microbatches, self.pp)
        t0 = time.perf_counter()
        payload = None
        if comm.rank() == 0:
            payload = self._plan_dst(step_data)
        densities, report = comm.broadcast_object(payload, src=0)
        self.last_report = report
        self.overhead_s += time.perf_counter() - t0
        return BudgetPlan(step_data.step, np.asarray(densities))

    def _plan_dst(self, step_data):
        from ..batching.sensitivity import unit_sensitivity
        from ..policy.costs import UnitCosts, density_grid
        from ..policy.dst import plan_dst_from_config

        sb = self.sb
        grid = density_grid(sb.density, sb.min_density, sb.max_density)
        costs = UnitCosts.from_latency(self.latency, unit_lengths(step_data, self.capacity),
                                       self.dp, step_data.num_microbatches, grid)
        sens = unit_sensitivity(step_data.assignment, self.tracker) if self.tracker else None
        headroom = self.raise_headroom()
        plan = plan_dst_from_config(sb, costs, sens, self.latency.p2p_s, raise_headroom=headroom)
        return plan.densities.tolist(), dict(plan.report.as_dict(), raise_headroom=headroom)

    def raise_headroom(self) -> float:
        """--sb-raise-headroom, or for 'auto' the latency model's median error over the last
        8 steps (``DEFAULT_RAISE_HEADROOM`` before any), capped at ``MAX_RAISE_HEADROOM``."""
        from ..config import DEFAULT_RAISE_HEADROOM, MAX_RAISE_HEADROOM

        fixed = self.sb.raise_headroom_value
        if fixed is not None:
            return fixed
        err = self.latency.recent_error(last=8 * self.dp)
        return DEFAULT_RAISE_HEADROOM if err is None else min(err, MAX_RAISE_HEADROOM)

    # --- inside the step ------------------------------------------------------------------
    def wrap_finalize(self, finalize):
        """Megatron's finalize_model_grads, preceded by taking this step's timings."""
        def finalize_model_grads(*a, **kw):
            self.last_timings = {"fwd_s": self.timers.durations_s("forward-compute"),
                                 "bwd_s": self.timers.durations_s("backward-compute")}
            return finalize(*a, **kw)
        return finalize_model_grads

    # --- after the step -------------------------------------------------------------------
    def end_step(self, step_data, plan: BudgetPlan | None, step_s: float) -> dict:
        t0 = time.perf_counter()
        out = {}
        if plan is not None:
            out["mean_density"] = float(np.mean(plan.densities))
            out["density_per_rank"] = [round(float(x), 4) for x in plan.densities.mean(axis=(1, 2))]
            out["density_per_stage"] = [round(float(x), 4) for x in plan.densities.mean(axis=(0, 1))]
        stats = _doc_recalls(pop_attention_stats()) if self.tracker is not None else {}
        served = pop_served_densities()
        gathered = comm.all_gather_object(
            (self.dp_rank, self.pp_rank, self.last_timings, stats, served, step_data.fingerprint()))
        if len({g[5] for g in gathered}) != 1:
            raise RuntimeError(f"step {step_data.step}: ranks packed different micro-batches "
                               "(the sampler/packer must be deterministic on every rank)")
        if plan is not None:
            check_budgets(plan, gathered)
            out["budgets_consistent"] = True
        measured = self._measured_busy(gathered, step_data.num_microbatches)
        if np.isfinite(measured).all():
            rank_busy = measured.sum(axis=1)
            out["rank_busy_s"] = [round(float(x), 5) for x in rank_busy]
            out["measured_imbalance"] = float(rank_busy.max() / max(rank_busy.mean(), 1e-12))
        # The first step of a run pays for warm-up (allocations, lazy init): not a latency sample.
        if self.latency is not None and plan is not None and self.steps_done > 0:
            out.update(self._calibrate(step_data, plan, measured))
        self.steps_done += 1
        if self.tracker is not None:
            self._update_sensitivity(step_data, gathered)
        if self.last_report is not None:
            r = self.last_report
            out.update(predicted_step_s=r["step_time_planned_s"],
                       predicted_static_s=r["step_time_static_s"],
                       imbalance_before=r["imbalance_before"], imbalance_after=r["imbalance_after"],
                       mean_density=r["mean_density"], units_cut=r["units_cut"],
                       units_raised=r["units_raised"], raise_headroom=r.get("raise_headroom"))
            out["plan"] = (f"pred {r['step_time_planned_s']:.3f}s (static {r['step_time_static_s']:.3f}s)"
                           f" | imb {r['imbalance_before']:.2f}->{r['imbalance_after']:.2f}"
                           f" | cut {r['units_cut']} raised {r['units_raised']}")
        self.overhead_s += time.perf_counter() - t0
        out["sb_overhead_s"] = self.overhead_s
        self.overhead_s = 0.0
        return out

    def _measured_busy(self, gathered, m: int) -> np.ndarray:
        """[dp, pp] measured fwd+bwd seconds of every rank's micro-batches (NaN: missing/bad)."""
        measured = np.full((self.dp, self.pp), np.nan)
        for dp_rank, pp_rank, timings, *_ in gathered:
            f = (timings or {}).get("fwd_s") or []
            b = (timings or {}).get("bwd_s") or []
            if len(f) == m and len(b) == m:
                measured[dp_rank, pp_rank] = float(np.sum(f) + np.sum(b))
        return measured

    def _calibrate(self, step_data, plan: BudgetPlan, measured: np.ndarray) -> dict:
        """Per DP rank: measured fwd+bwd over its stages vs the uncorrected prediction."""
        units = unit_lengths(step_data, self.capacity)
        m = step_data.num_microbatches
        predicted = np.zeros((self.dp, self.pp))
        for r in range(self.dp):
            for s in range(self.pp):
                predicted[r, s] = float(np.sum(self.latency.predict_many(
                    units[r * m:(r + 1) * m], plan.densities[r, :, s], s)))
        for r in range(self.dp):
            ok = np.isfinite(measured[r]).all()  # missing/NaN: keep the previous factor, warn once
            self.latency.calibrate(r, predicted[r] if ok else None, measured[r] if ok else None)
        return {"predicted_busy_s": [round(float(x), 5) for x in predicted.sum(axis=1)],
                "calibration": [round(self.latency.correction(r), 4) for r in range(self.dp)]}

    def _update_sensitivity(self, step_data, gathered) -> None:
        recalls: dict[int, list] = {}
        for _, _, _, stats, *_ in sorted(gathered, key=lambda g: (g[0], g[1])):
            for doc_id, values in sorted(stats.items()):
                recalls.setdefault(doc_id, []).extend(values)
        if not recalls:
            return
        lengths = {d: e - s for rank in step_data.assignment for mb in rank for d, s, e in mb}
        ids = sorted(i for i in recalls if i in lengths)
        self.tracker.update(ids, [lengths[i] for i in ids],
                            [float(np.mean(recalls[i])) for i in ids])

    # --- checkpoint side-car ----------------------------------------------------------------
    def _state_path(self, root: str, iteration: int) -> str:
        return os.path.join(root, f"sparsebalance_state_iter{iteration:07d}.json")

    def save_state(self, save_dir: str, iteration: int) -> None:
        """Calibration and sensitivity beside Megatron's checkpoint (JSON, rank 0)."""
        if comm.rank() != 0 or (self.latency is None and self.tracker is None):
            return
        state = {"iteration": iteration,
                 "calibration": self.latency.corrections() if self.latency else {},
                 "sensitivity": self.tracker.state_dict() if self.tracker else None}
        os.makedirs(save_dir, exist_ok=True)
        with open(self._state_path(save_dir, iteration), "w") as f:
            json.dump(state, f)

    def load_state(self, load_dir: str, iteration: int) -> None:
        path = self._state_path(load_dir, iteration)
        if not os.path.exists(path):
            return
        with open(path) as f:
            state = json.load(f)
        if self.latency is not None:
            self.latency.load_corrections(state.get("calibration", {}))
        if self.tracker is not None and state.get("sensitivity"):
            self.tracker.load_state_dict(state["sensitivity"])


def check_budgets(plan: BudgetPlan, gathered) -> None:
    """Every rank (all TP ranks of a micro-batch included) used exactly the plan's density."""
    bad = []
    for dp_rank, pp_rank, _, _, served, _ in gathered:
        for mb, d in (served or {}).items():
            want = plan.density(dp_rank, mb, pp_rank)
            if d != want:
                bad.append(f"(dp {dp_rank}, stage {pp_rank}, micro-batch {mb}): {d} != plan {want}")
    if bad:
        raise RuntimeError("attention budgets differ from the broadcast plan: " + "; ".join(bad[:5]))


def _doc_recalls(stats: list) -> dict:
    """{doc_id: [recall per layer]} from the attention statistics of this rank's step."""
    out: dict[int, list] = {}
    for _, doc_ids, _, _, recall in stats:
        if not doc_ids:
            continue
        for doc_id, r in zip(doc_ids, recall):  # the trailing padding sequences have no doc id
            if np.isfinite(r):
                out.setdefault(int(doc_id), []).append(float(r))
    return out
