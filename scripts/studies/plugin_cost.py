"""The plugin's own per-step cost on the critical path, as the simulator studies charge it
(``experiments/plugin_cost.py``), by part and by planner form, beside the pickled-object control
plane the runtime had before (issue 44 item 4)."""

from __future__ import annotations

import math
import pickle
import time

import numpy as np

from .common import parser, write_result

ALPHA_INTRA_S = 2e-6
ALPHA_INTER_S = 10e-6
GPUS_PER_NODE = 8
BUS_BYTES_PER_S = 25e9
PP = 4
DOCS_PER_MICROBATCH = 15
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MICROBATCHES = (8, 16, 32, 64)


def step_record(dp_rank: int, pp_rank: int, m: int, docs: int, rng) -> dict:
    """One rank's step record with the runtime's keys (``end_step``'s ``mine``), plain types."""
    doc_ids = [int(x) for x in rng.integers(0, 10_000_000, m * docs)]
    units = [(mb, pp_rank) for mb in range(m)]
    return dict(dp=dp_rank, pp=pp_rank, fwd_s=[float(x) for x in rng.random(m)],
                bwd_s=[float(x) for x in rng.random(m)], step_s=float(rng.random()), stats={},
                served={u: float(rng.random()) for u in units},
                used={u: float(rng.random()) for u in units}, units=units,
                fingerprint=int(rng.integers(0, 2**62)), loss=(float(rng.random()), 1.0),
                doc_loss={d: [float(rng.random()), float(rng.integers(1, 32768))]
                          for d in doc_ids})


def plan_payload(dp: int, m: int, stages: int, rng) -> tuple:
    """Rank 0's broadcast with DST: (densities [dp][m][stages] lists, DST's report)."""
    dens = rng.choice(np.arange(8, 65) / 64, (dp, m, stages)).tolist()
    report = {k: float(rng.random()) for k in (
        "step_time_static_s", "step_time_planned_s", "speedup", "imbalance_before",
        "imbalance_after", "mean_density", "mean_density_static", "quality_cost",
        "raise_headroom", "tolerance_used")}
    report.update(units_cut=int(dp * m), units_raised=int(dp), ranks_reverted=0,
                  density_per_stage=[float(x) for x in rng.random(stages)],
                  unit_sensitivity=np.round(rng.random((dp, m)), 6).tolist(),
                  stand_down={"dst_stood_down": False, "sab_stood_down": False,
                              "packing_index": 0, "predicted_step_s": [1.0, 1.1],
                              "predicted_static_s": 1.1, "predicted_dst_s": 1.0})
    return dens, report


def ring_s(world: int, nbytes: float) -> float:
    """One NCCL-like ring collective over ``world`` ranks moving ``nbytes`` per rank."""
    nodes = max(1, math.ceil(world / GPUS_PER_NODE))
    inter = nodes - 1 if nodes > 1 else 0
    hops = world - 1
    return (hops - inter) * ALPHA_INTRA_S + inter * ALPHA_INTER_S + hops * nbytes / BUS_BYTES_PER_S


def _min_s(fn, repeats: int = 7) -> float:
    """The fastest of ``repeats`` calls in thread CPU time (as ``planner_cost`` measures): CPU
    work on a shared machine is only ever slowed."""
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return float(min(out))


def control_plane_rows(world_sizes=WORLD_SIZES, microbatches=MICROBATCHES, seed: int = 0
                       ) -> list:
    """The pickled per-step control plane (before the fixed-size one) at every (W, m) (module docstring). Unpickling W records
    is W loads: timed on a batch of 64 distinct records and scaled by W / 64."""
    rng = np.random.default_rng(seed)
    rows = []
    for m in microbatches:
        recs = [pickle.dumps(step_record(r, r % PP, m, DOCS_PER_MICROBATCH, rng))
                for r in range(64)]
        size = max(len(b) for b in recs)
        one = step_record(0, 0, m, DOCS_PER_MICROBATCH, rng)
        pickle_s = _min_s(lambda: pickle.dumps(one))
        per_record_s = _min_s(lambda: [pickle.loads(b) for b in recs]) / len(recs)
        for w in world_sizes:
            unpickle_s = per_record_s * w
            dp = max(1, w // PP)
            plan_obj = plan_payload(dp, m, PP, rng)
            plan = pickle.dumps(plan_obj)
            plan_pickle_s = _min_s(lambda: pickle.dumps(plan_obj))
            plan_unpickle_s = _min_s(lambda: pickle.loads(plan))
            coll = 2 * ring_s(w, 0) + ring_s(w, size)
            gather = pickle_s + coll + unpickle_s
            bcast = plan_pickle_s + 2 * ring_s(w, 0) + ring_s(w, len(plan)) + plan_unpickle_s
            rows.append(dict(world_size=w, microbatches=m, dp=dp, pp=PP,
                             record_bytes=size, plan_bytes=len(plan),
                             record_pickle_ms=pickle_s * 1e3, unpickle_all_ms=unpickle_s * 1e3,
                             gather_collective_ms=coll * 1e3, gather_ms=gather * 1e3,
                             broadcast_ms=bcast * 1e3))
            print(f"W={w:>5} m={m:>3}: record {size / 1e3:6.1f} KB, gather {gather * 1e3:8.2f} ms "
                  f"(unpickle {unpickle_s * 1e3:7.2f}, collectives {coll * 1e3:6.2f}), plan "
                  f"{len(plan) / 1e3:7.1f} KB, broadcast {bcast * 1e3:6.2f} ms", flush=True)
    return rows


SHAPES = (("8 DP x PP 4 x 8 mb, 32K (the studies)", dict(dp=8, microbatches=8, pp=4,
                                                         virtual_stages=4, seq_length=32768)),
          ("32 DP x PP 4 x 8 mb, 32K (the studies)", dict(dp=32, microbatches=8, pp=4,
                                                          virtual_stages=4, seq_length=32768)),
          ("64 DP x 16 x PP 4, 32K (issue 44)", dict(dp=64, microbatches=16, pp=4,
                                                     virtual_stages=4, seq_length=32768)),
          ("DP 4 x PP 4 x 16, 32K (the paper's)", dict(dp=4, microbatches=16, pp=4,
                                                       virtual_stages=4, seq_length=32768)),
          ("1,024 GPUs: DP 32 x PP 4 x TP 8 x 16, 32K", dict(dp=32, microbatches=16, pp=4,
                                                              virtual_stages=4,
                                                              seq_length=32768, tp=8)))


def breakdown(cost, step_s=None) -> list:
    """The charge of SAB + DST (stand-down on) at every ``SHAPES`` entry, per planner form."""
    from sparsebalance_megatron.config import PLANNERS
    from sparsebalance_megatron.experiments.plugin_cost import Shape

    out = []
    for name, kw in SHAPES:
        shape = Shape(**kw)
        for planner in PLANNERS:
            ch = cost.charge(shape, sab=True, dst=True, planner=planner, stand_down=True)
            row = dict(shape=name, planner=planner, total_ms=ch.plan_s * 1e3,
                       parts_ms=ch.parts_ms, flags=ch.flags, source=ch.source)
            if step_s and name in step_s:
                row["static_step_s"] = step_s[name]
                row["share_of_step"] = ch.plan_s / step_s[name]
            out.append(row)
    return out


def static_steps() -> dict:
    """The simulated step the charge is a share of: the analytic Qwen2.5-0.5B / H100 table's
    (the kernel ``auto`` runs), even split, one global batch of the built-in corpus SAB-packed
    at d0 0.5 and every unit at d0; shapes with TP are skipped (TP is not modelled)."""
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.sim import pipeline_makespan_s

    out = {}
    for name, kw in SHAPES:
        if kw.get("tp", 1) > 1:
            continue
        c = corpus_steps(kw["dp"], kw["microbatches"], 0.5, 1, seq=kw["seq_length"],
                         layout="even", pp=PP)
        costs = UnitCosts.from_latency(c.lm, c.plans[0].unit_csr(with_padding=True), kw["dp"],
                                       kw["microbatches"], np.array([0.5]))
        f, b = costs.at(np.zeros(costs.shape, dtype=np.int64))
        out[name] = float(pipeline_makespan_s(f, b, c.lm.p2p_s, pp=PP).max())
    return out


def main(argv=None) -> int:
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.plugin_cost import PluginCost

    p = parser(__doc__, "plugin_cost")
    p.add_argument("--quick", action="store_true", help="W up to 256, m 8 and 16 (a check)")
    args = p.parse_args(argv)
    rows = control_plane_rows(WORLD_SIZES[:6] if args.quick else WORLD_SIZES,
                              MICROBATCHES[:2] if args.quick else MICROBATCHES)
    sb = SparseBalanceConfig()
    cost = PluginCost.from_results(sb.dst_objective, sb.dst_descent)
    table = breakdown(cost, static_steps())
    print(f"\nSAB + DST, the plugin's critical-path cost per step as the studies charge it "
          f"({cost.planner.source}; {cost.control.source}; share: of the simulated static step)")
    print(f"{'shape':<44} {'planner':>8} {'total ms':>9} {'planning':>9} {'gather':>8} "
          f"{'bcast':>7} {'calib':>7} {'share':>7}")
    for r in table:
        q = r["parts_ms"]
        share = f"{100 * r['share_of_step']:6.2f}%" if "share_of_step" in r else f"{'-':>7}"
        print(f"{r['shape']:<44} {r['planner']:>8} {r['total_ms']:>9.1f} "
              f"{q['planning']:>9.1f} {q['gather']:>8.2f} {q['broadcast']:>7.2f} "
              f"{q['calibration']:>7.2f} {share}")
    if args.json:
        write_result(args.json, {
            "what": "the pickled-object control plane before the fixed-size one, per world "
                    "size (rows: the studies' control-plane cost where "
                    "docs/results/control_plane.json is absent), and the charge per step as "
                    "the studies price it (charge)",
            "assumptions": {"alpha_intra_s": ALPHA_INTRA_S, "alpha_inter_s": ALPHA_INTER_S,
                            "gpus_per_node": GPUS_PER_NODE, "bus_bytes_per_s": BUS_BYTES_PER_S,
                            "pp": PP, "docs_per_microbatch": DOCS_PER_MICROBATCH,
                            "sensitivity_signal": sb.sensitivity_signal},
            "rows": rows, "charge": table, "planner_cost": cost.planner.source,
            "control_plane": cost.control.source, "notes": cost.notes})
    return 0
