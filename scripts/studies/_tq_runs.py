"""``trained_quality``'s record of a trained run: its per-step metrics, the documents' planned and
kept densities from the recorded plans (padding left out), DST's moves, and the recorded steps
re-planned by the planner as it is now. ``continued_quality`` and the GPU form read runs with it.
"""

from __future__ import annotations

import json
import os


def document_densities(rows: list, block_size: int, d0: float) -> dict:
    """Planned and kept density of the documents alone, from the recorded plans: the metrics'
    ``mean_density`` and ``kept_density`` weigh the padding pieces that fill each micro-batch
    (256-token pseudo-documents, whose blocks no loss reads) like documents, and how much
    padding a step has depends on the packing, so static (sequential) and SAB differ in it.
    Per step, weighted by causal block pairs as the metrics are: ``planned``, ``kept`` (the
    selection's rule, ``latency/work.py``) and ``kept_d0`` (what the same documents keep at
    d0); per DST move, whether it kept any other block of a document than d0 does."""
    import numpy as np

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.features import UnitFeatures

    sb = SparseBalanceConfig()
    per = {"planned": [], "kept": [], "kept_d0": []}
    moves = {"raised": 0, "raised_keeping_no_block": 0, "cut": 0, "cut_keeping_no_block": 0}
    for r in rows:
        if r.get("densities") is None or r.get("plan") is None:
            return {}
        d = np.asarray(r["densities"], dtype=np.float64)                 # [dp, m, stages]
        layers = np.asarray(r.get("attention_layers_per_stage") or [1] * d.shape[2], float)
        lens = [np.diff(np.asarray(mb, dtype=np.int64).reshape(-1, 3)[:, 1:], axis=1)[:, 0]
                for rank in r["plan"]["micro_batches"] for mb in rank]
        f = UnitFeatures.build(lens, block_size, sb.sink_blocks, sb.local_blocks)
        w, k0 = f.attention_work(1.0), f.attention_work(d0)              # [dp * m]
        num = {"planned": 0.0, "kept": 0.0, "kept_d0": 0.0}
        for s in range(d.shape[2]):
            ds = d[:, :, s].reshape(-1)
            k = f.attention_work(ds)
            num["planned"] += layers[s] * float((ds * w).sum())
            num["kept"] += layers[s] * float(k.sum())
            num["kept_d0"] += layers[s] * float(k0.sum())
            for name, moved in (("raised", ds > d0 + 1e-12), ("cut", ds < d0 - 1e-12)):
                moves[name] += int(moved.sum())
                moves[f"{name}_keeping_no_block"] += int((moved & (k == k0)).sum())
        den = float(layers.sum() * w.sum())
        for key in per:
            per[key].append(num[key] / den)
    return {**{f"doc_{key}_density": sum(v) / len(v) for key, v in per.items()},
            "dst_moves": moves}


def replanned(run_dir: str, table: str, args, objective: str) -> dict:
    """``train_summary`` of a DST run's recorded steps re-planned by the planner as it is now:
    each step's committed packing, unit sensitivities and raise headroom, the study's latency
    table, timings modelled (no calibration), DST's plan of that packing (the stand-down's
    choices are not re-made: a step where DST stood down keeps its static plan).
    ``plans_as_recorded`` of ``dst_plans``: the steps DST planned whose plan is the run's (the
    sensitivities are recorded to 6 decimals: a near tie may order units otherwise)."""
    import numpy as np

    from sparsebalance_megatron.batching.replay import RecordedPlans
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.model import LatencyModel
    from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst import plan_dst_from_config

    rows, path = read_metrics(run_dir), os.path.join(run_dir, "metrics.jsonl")
    steps = RecordedPlans.read(path).steps
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, dst_objective=objective,
                             dense_below_tokens="0")                 # as the runs (train_cmd)
    lm = LatencyModel.load(table, force=True)
    lm = lm.with_routing(sb.routing_threshold(lm.dense_below_tokens))
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    out, same, gain = [], 0, []
    for r in rows:
        if r.get("dst_stood_down"):
            out.append(r)
            continue
        batch = steps[r["step"]]["batch"]
        costs = UnitCosts.from_latency(lm, batch.flat_lengths(with_padding=True), batch.dp,
                                       batch.num_microbatches, grid, calibrated=False,
                                       kept_units=batch.unit_csr())        # as choice.choose
        sens = r.get("unit_sensitivity")
        p = plan_dst_from_config(sb, costs, None if sens is None else np.asarray(sens),
                                 lm.p2p_s, raise_headroom=r.get("raise_headroom") or 0.0,
                                 stage_layers=r["layers_per_stage"])
        same += bool(np.array_equal(p.densities, np.asarray(r["densities"])))
        gain.append(p.report.step_time_planned_s / p.report.step_time_static_s)
        out.append(dict(r, densities=p.densities.tolist(), units_cut=p.report.units_cut,
                        units_raised=p.report.units_raised))
    # the metrics' figures with padding are the recorded plans': not these
    return {**train_summary(out, args.block_size, args.density), "plans_as_recorded": same,
            "dst_plans": len(gain), "predicted_step_vs_static": sum(gain) / max(len(gain), 1),
            "mean_kept_density": None,
            "mean_planned_density": None}


def read_metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def train_summary(rows: list, block_size: int = 32, d0: float = 0.25) -> dict:
    """What the table needs of a run's per-step metrics."""
    def mean(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None
    cut = [r.get("units_cut") or 0 for r in rows]
    raised = [r.get("units_raised") or 0 for r in rows]
    losses = [r["loss"] for r in rows]
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": len(rows), "final_train_loss": sum(tail) / len(tail),
            "train_losses": losses,
            "mean_kept_density": mean("kept_density") or 1.0,
            "mean_planned_density": mean("mean_density") or 1.0,
            "dst_steps_cut": sum(c > 0 for c in cut), "dst_steps_raised": sum(r > 0 for r in raised),
            "dst_units_cut": sum(cut), "dst_units_raised": sum(raised),
            "dst_stood_down": sum(int(r.get("dst_stood_down") or 0) for r in rows),
            "sab_stood_down": sum(int(r.get("sab_stood_down") or 0) for r in rows),
            "tokens": [r["tokens"] for r in rows], **document_densities(rows, block_size, d0)}
