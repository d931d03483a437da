"""The plugin's per-step control plane as the job grows: bytes per rank and seconds of the step's
gather and plan broadcast, old pickled path against the fixed-size tensor path, from 8 to 16,384
ranks (TP 8, 4 and 1 x PP 4 and 8), with the planner's time beside it and the share of a 32K step
on the critical path (issue 77's target: <= 0.5% at 16,384 GPUs, TP 1 and TP 8 x PP 4).

Four parts:

- **Sizes** (exact): the bytes each rank receives per step. Tensor path (``step/exchange.py``): a
  cell record from each other TP rank, a cell record from each other pipeline stage, a pipeline
  line from each other DP rank, the plan three times down the same groups. Pickled path (before):
  every rank's pickled dict from every other rank (``all_gather_object`` pads to the largest) and
  the pickled plan from rank 0, with the dicts' fields as ``end_step`` filled them (per-interval
  timings, served and kept densities, units, the last stage's per-document losses). Documents
  per DP rank come from the built-in corpus at 32K tokens per micro-batch (Qwen tokenizer).
- **Time under an alpha-beta model with NCCL's constants**: each collective is a ring all-gather
  or broadcast priced as NCCL's tuner prices it (``ncclTopoTuneModel`` in NVIDIA/nccl
  ``src/graph/tuning.cc``, ``ncclTunerConstantsDefaults``: latencies in us, LL and Simple
  protocols, the cheaper taken) on DGX H100 nodes of 8 GPUs (``_exchange_paths.MODEL`` says every
  constant and where it comes from), plus the host CPU work measured here in this process: encoding,
  combining and decoding the records (tensor path), pickling and unpickling (pickled path).
- **Planner and after-step work** (measured here, thread CPU time): the step's draft (SAB
  packing, latency features, unit costs, DST: ``planner_cost``'s runtime calls) and the in-line
  work after the step (calibration, the sensitivity tracker's update, the reports' weights) on
  the built-in corpus, Qwen2.5-0.5B analytic table, best static layout; fitted as a power of
  DP x micro-batches where not measured (marked so; ``--planner-dp`` up to 4,096 measures
  every PP 4 row of 16 micro-batches to 16,384 GPUs at TP 1). Where its time goes by phase:
  ``planner_phases``.
- **gloo, measured**: spawned processes on this machine (TP 2 x PP 2 x DP n), both paths end to
  end, the slowest rank's median seconds per step.

The two paths are priced in ``_exchange_paths.py`` (sizes, the network model, host CPU, gloo);
this module measures the planner's side, builds the table and writes the JSON.

The denominator: the simulator's static step at d0 (every unit at 0.5) for the Qwen2.5-0.5B
shape at 32K tokens per micro-batch on the analytic table's best static layout (TP 1: the table
prices one GPU per stage; with TP 8 this 0.5B model's step would be shorter, which the
``share_if_tp_scaled`` column shows). The critical path at the default ``--sb-planner
process``: the control plane, the handoff to the planner process (the step's segments and the
tracker's updates sent, the draft read back: training-thread CPU, measured with a planner process
at each measured shape), the after-step work and the draft's excess over the step (a draft that
outlasts the step is waited for); in-line planning adds the whole draft instead of the handoff.
The planner's effect on a launch-bound training thread is ``planner_cost``'s
(``launch_slowdown``).

JSON: ``table`` (every shape: bytes and seconds of both paths, the planner's draft and
after-step work, the critical path and its share of the step), ``rows`` (for the simulated
studies, ``experiments/plugin_cost.py``: TP 1 x PP 4 by ``world_size`` and ``microbatches``,
``gather_ms`` and ``broadcast_ms`` of the tensor path, network and host), ``growth`` (fitted
exponents), ``target_row``, ``planner_points``, ``step_time``, ``gloo``, ``model``.

    .venv/bin/python scripts/bench.py control_plane --json docs/results/control_plane.json
"""

from __future__ import annotations

import statistics
import time
from functools import lru_cache

import numpy as np

from ._exchange_paths import (MODEL, gloo_point, pickled_cpu, pickled_path, tensor_cpu_s,
                              tensor_path)
from .common import parser, write_result

SEQ = 32768
D0 = 0.5
TARGET_SHARE = 0.005          # issue 44: <= 0.5% of a 32K step at 1,024 GPUs
TARGET = dict(dp=32, pp=4, tp=8, m=16)
DRAFT_DEADLINE_S = 1800.0     # the planner processes' stall deadline in this study (wall clock)


# --- corpus, planner, after-step work ------------------------------------------------------------

@lru_cache(maxsize=None)
def _corpus_lengths():
    from sparsebalance_megatron.data import load_corpus

    return np.asarray(load_corpus(tokenizer="qwen").lengths, dtype=np.int64)


@lru_cache(maxsize=None)
def docs_per_dp_rank(dp: int, m: int) -> int:
    """The most documents any DP rank's micro-batches hold in one global batch of the built-in
    corpus (32K tokens each, long documents split, Megatron's sequential packing)."""
    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.data import GlobalBatchSampler
    from sparsebalance_megatron.megatron.step.record import doc_slots

    sampler = GlobalBatchSampler(_corpus_lengths(), capacity=SEQ, dp=dp, num_microbatches=m,
                                 seed=1, long_sample_policy="split")
    plan = sequential_plan(sampler.next_global_batch(), dp=dp, num_microbatches=m,
                           max_tokens=SEQ)
    return max(len(s) for s in doc_slots(plan.micro_batches))


WORK = ("draft_s", "after_step_s", "handoff_s")   # a planner point's measured parts


def planner_point(dp: int, m: int, pp: int, repeats: int = 2) -> dict:
    """Measured at one shape (thread CPU time, medians), each step run as the default flags run
    it: the draft (SAB, features and unit costs, sensitivity and DST) made by a planner process
    from the calibration the training side sends (``_drafts.submit_draft``), the handoff (the
    training thread's CPU sending the step: the slower of rank 0, which plans DST, and a rank
    without DST; the draft is read back by a reader thread while the step trains), the after-step work
    (``planner_cost.after_step``: the calibration's prediction and every DP rank's update, the
    tracker's update with every document, the reports' weights), and the static step the
    simulator predicts at d0 (best static layout)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.ahead import PlannerProcess
    from sparsebalance_megatron.policy import UnitCosts, density_grid
    from sparsebalance_megatron.sim import pipeline_makespan_s

    from ._drafts import make_drafter, submit_draft
    from .planner_cost import after_step, committed

    sb = SparseBalanceConfig(sparse_balance=True)      # the default flags
    corpus = corpus_steps(dp, m, sb.density, repeats + 1, seq=SEQ, layout="best", pp=pp)
    lm = corpus.lm
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    drafter = make_drafter(lm, sb, dp, SEQ)               # the training process's state
    tracker, rng = SensitivityTracker(), np.random.default_rng(0)   # after_step's
    drafts, after, steps, handoffs = [], [], [], []
    # a copy before any draft, as at launch, and a rank that does not plan DST; the deadline
    # long (a draft at DP 4,096 takes tens of seconds of wall clock on a loaded 2-core machine)
    proc = PlannerProcess(make_drafter(lm, sb, dp, SEQ), timeout_s=DRAFT_DEADLINE_S)
    other = PlannerProcess(make_drafter(lm, sb, dp, SEQ), timeout_s=DRAFT_DEADLINE_S)
    try:
        for k, segs in enumerate(corpus.segments):    # as the default flags run a step:
            c0 = time.thread_time()
            pending = submit_draft("process", drafter, proc, k, segs, m)   # hand the step over
            send = time.thread_time() - c0
            c1 = time.thread_time()
            pend_other = submit_draft("process", drafter, other, k, segs, m, with_dst=False)
            send_other = time.thread_time() - c1
            d = pending.result()                      # read its draft back
            batch, units, dens = committed(d)
            pend_other.result().packing(d.payload[1]["stand_down"]["packing_index"])
            costs = UnitCosts.from_latency(lm, units, dp, m, grid)
            idx = np.searchsorted(costs.densities, np.full(costs.shape, D0) - 1e-12)
            f, b = costs.at(idx)
            steps.append(float(pipeline_makespan_s(f, b, lm.p2p_s, pp=lm.layout.pp).max()))
            a = after_step(lm, sb, d, tracker, rng) / 1e3   # end_step's work, as it runs it
            if k:                                      # the first is a warm-up
                drafts.append(d.cpu_s)                 # the planner process's thread CPU
                handoffs.append(max(send, send_other))
                after.append(a)
    finally:
        proc.close()
        other.close()
    return {"dp": dp, "m": m, "pp": pp, "layout": lm.layout.describe(),
            "draft_s": statistics.median(drafts), "after_step_s": statistics.median(after),
            "handoff_s": statistics.median(handoffs), "static_step_s": statistics.median(steps)}


def power_fit(x, y) -> dict:
    """y = c x^k by least squares in log-log: the exponent ``k`` and ``c``."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    k, logc = np.polyfit(lx, ly, 1)
    return {"exponent": float(k), "coefficient": float(np.exp(logc))}


# --- the study ---------------------------------------------------------------------------------

def ladder(max_world: int, tps=(8, 4, 1)) -> list:
    """(tp, pp, dp) of the table: TP 8, 4 and 1 x PP 4 or 8 x DP 1, 2, 4, ... within
    ``max_world`` ranks."""
    out = []
    for tp in tps:
        for pp in (4, 8):
            dp = 1
            while tp * pp * dp <= max_world:
                out.append((tp, pp, dp))
                dp *= 2
    return out


def simulator_rows(rows: list) -> list:
    """The tensor path's critical-path ms per step by world size and micro-batches, for the
    simulated studies (``experiments/plugin_cost.py`` reads ``rows`` of ``world_size``,
    ``microbatches``, ``gather_ms``, ``broadcast_ms``): their jobs are one GPU per (DP rank,
    stage), PP 4, so the TP 1 x PP 4 rows (a CP group is a cell like a TP group)."""
    return [{"world_size": r["world"], "microbatches": r["m"], "tp": r["tp"], "pp": r["pp"],
             "dp": r["dp"],
             "gather_ms": 1e3 * (r["tensor"]["gather_network_s"] + r["tensor"]["gather_cpu_s"]),
             "broadcast_ms": 1e3 * (r["tensor"]["broadcast_network_s"]
                                    + r["tensor"]["broadcast_cpu_s"]),
             "bytes_per_rank": r["tensor"]["bytes_per_rank"]}
            for r in rows if r["tp"] == 1 and r["pp"] == 4]


def main(argv=None) -> int:
    p = parser(__doc__, "control_plane")
    p.add_argument("--microbatches", default="16,32,64",
                   help="micro-batches per step of the table (comma-separated)")
    p.add_argument("--max-world", type=int, default=16384)
    p.add_argument("--planner-dp", default="4,8,16,32,64",
                   help="DP sizes the planner and after-step work are measured at (PP 4)")
    p.add_argument("--planner-side-dp", type=int, default=None,
                   help="the DP the planner is also measured at with PP 8 and at the "
                        "micro-batch counts not in --planner-m (default: the largest of "
                        "--planner-dp); the other rows there are fitted")
    p.add_argument("--planner-m", default="16,64",
                   help="micro-batches the planner is measured at")
    p.add_argument("--gloo-dp", default="1,2",
                   help="DP sizes of the gloo runs (TP 2 x PP 2 x DP; 0: none)")
    p.add_argument("--gloo-repeats", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="repeats of each CPU measurement")
    args = p.parse_args(argv)
    ms = [int(x) for x in args.microbatches.split(",")]

    # planner and after-step work: measured at PP 4, fitted in DP x micro-batches; at PP 8 and
    # the other micro-batch counts at one DP (its step time, and how the work scales to PP 8)
    dps = [int(x) for x in args.planner_dp.split(",")]
    side = args.planner_side_dp or dps[-1]
    pm = [int(x) for x in args.planner_m.split(",")]
    points = [planner_point(dp, m, 4) for m in sorted(set(pm + ms))
              for dp in (dps if m in pm else [side])]
    points += [planner_point(side, m, 8) for m in ms]
    four = [q for q in points if q["pp"] == 4]
    units = [q["dp"] * q["m"] for q in four]
    fits = {k: power_fit(units, [q[k] for q in four]) for k in WORK}
    measured_at = {(q["dp"], q["m"], q["pp"]): q for q in points}
    step_by = {}             # (m, pp) -> the point of the largest DP measured there
    for q in sorted(points, key=lambda q: q["dp"]):
        step_by[q["m"], q["pp"]] = q
    pairs = [(q, measured_at[q["dp"], q["m"], 4]) for q in points
             if q["pp"] == 8 and (q["dp"], q["m"], 4) in measured_at]
    pp_ratio = {k: statistics.median(a[k] / b[k] for a, b in pairs) for k in WORK}

    rows = []
    for m in ms:
        for tp, pp, dp in ladder(args.max_world):
            docs = docs_per_dp_rank(dp, m)
            new = tensor_path(dp, pp, tp, m, docs)
            cpu = tensor_cpu_s(dp, pp, tp, m, docs, args.repeats)
            new.update(gather_cpu_s=cpu["gather_s"], broadcast_cpu_s=cpu["broadcast_s"])
            new["network_s"] = new["gather_network_s"] + new["broadcast_network_s"]
            new["cpu_s"] = cpu["gather_s"] + cpu["broadcast_s"]
            new["total_s"] = new["network_s"] + new["cpu_s"]
            oldc = pickled_cpu(dp, pp, tp, m, docs, args.repeats)
            old = pickled_path(tp * pp * dp, oldc["record_bytes"], oldc["plan_bytes"])
            old.update(record_bytes=oldc["record_bytes"], plan_bytes=oldc["plan_bytes"],
                       cpu_s=oldc["cpu_s"], total_s=old["network_s"] + oldc["cpu_s"])
            q = measured_at.get((dp, m, pp))
            work = {k: q[k] if q else fits[k]["coefficient"] * (dp * m) ** fits[k]["exponent"]
                    * (pp_ratio[k] if pp == 8 else 1.0) for k in WORK}
            draft, after, handoff = work["draft_s"], work["after_step_s"], work["handoff_s"]
            # the static step of this shape where measured, else of the largest measured DP
            step_s = (q or step_by[m, pp])["static_step_s"]
            row = {"tp": tp, "pp": pp, "dp": dp, "m": m, "world": tp * pp * dp,
                   "docs_per_dp_rank": docs, "tensor": new, "pickled": old,
                   "planner": {"draft_s": draft, "after_step_s": after,
                               "handoff_s": handoff, "measured": q is not None},
                   "step_s": step_s}
            ahead = new["total_s"] + handoff + after + max(0.0, draft - step_s)
            row["critical_path_s"] = {"plan_ahead": ahead,
                                      "in_line": new["total_s"] + after + draft}
            row["critical_path_parts_s"] = {"control_plane": new["total_s"],
                                            "handoff": handoff, "after_step": after,
                                            "draft_past_the_step": max(0.0, draft - step_s)}
            row["share_of_step"] = {k: v / step_s for k, v in row["critical_path_s"].items()}
            row["share_if_tp_scaled"] = ahead / (step_s / tp)
            rows.append(row)

    # growth: the tensor path's seconds and bytes against DP x micro-batches (TP 8, PP 4)
    sub = [r for r in rows if r["tp"] == 8 and r["pp"] == 4]
    growth = {
        "tensor_total_s": power_fit([r["dp"] * r["m"] for r in sub],
                                    [r["tensor"]["total_s"] for r in sub]),
        "tensor_bytes_per_rank": power_fit([r["dp"] * r["m"] for r in sub],
                                           [r["tensor"]["bytes_per_rank"] for r in sub]),
        "pickled_total_s": power_fit([r["dp"] * r["m"] for r in sub],
                                     [r["pickled"]["total_s"] for r in sub]),
        "critical_path_plan_ahead_s": power_fit(
            [r["dp"] * r["m"] for r in sub], [r["critical_path_s"]["plan_ahead"] for r in sub]),
        "planner_draft_s": fits["draft_s"], "after_step_s": fits["after_step_s"],
        "handoff_s": fits["handoff_s"],
        "variable": "DP x micro-batches (TP 8, PP 4; planner: PP 4, measured points)"}
    for name, pick, var in (("in_dp_at_m16", lambda r: r["m"] == 16, "dp"),
                            ("in_m_at_dp32", lambda r: r["dp"] == 32, "m")):
        part = [r for r in sub if pick(r)]
        if len({r[var] for r in part}) > 1:
            growth[name] = {k: power_fit([r[var] for r in part], [f(r) for r in part])
                            for k, f in (("tensor_total_s", lambda r: r["tensor"]["total_s"]),
                                         ("critical_path_plan_ahead_s",
                                          lambda r: r["critical_path_s"]["plan_ahead"]))}
    target = next((r for r in rows if all(r[k] == v for k, v in TARGET.items())), None)
    widest = [r for r in rows if r["world"] == args.max_world and r["pp"] == 4 and r["m"] == 16]

    gloo = []
    for dp in (int(x) for x in args.gloo_dp.split(",") if int(x) > 0):
        gloo.append(gloo_point(2, 2, dp, 16, docs_per_dp_rank(dp, 16), args.gloo_repeats))

    _print(rows, ms, growth, target, gloo, points)
    for r in widest:
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["critical_path_parts_s"].items())
        print(f"{r['world']} GPUs, TP {r['tp']} x PP 4 x DP {r['dp']}: critical path "
              f"{r['critical_path_s']['plan_ahead'] * 1e3:.1f} ms = "
              f"{100 * r['share_of_step']['plan_ahead']:.2f}% of the {r['step_s']:.2f} s step "
              f"({parts}; draft {r['planner']['draft_s'] * 1e3:.0f} ms, "
              f"{'measured' if r['planner']['measured'] else 'fitted'}; target <= "
              f"{100 * TARGET_SHARE:.1f}%)")
    if args.json:
        write_result(args.json, {
            "model": MODEL, "seq": SEQ, "d0": D0, "target": dict(TARGET, share=TARGET_SHARE),
            "step_time": [{k: q[k] for k in ("dp", "m", "pp", "layout", "static_step_s")}
                          for q in step_by.values()],
            "planner_pp8_over_pp4": pp_ratio,
            "planner_points": points, "growth": growth, "table": rows,
            "rows": simulator_rows(rows),
            "target_row": target, "gloo": gloo,
            "widest": [{k: r[k] for k in ("tp", "pp", "dp", "world", "step_s", "critical_path_s",
                                          "critical_path_parts_s", "share_of_step", "planner")}
                       for r in widest],
            "clock": "host work: thread CPU time (codec, pickle, planner, after-step work); "
                     "network: NCCL's alpha-beta model (MODEL); gloo: wall clock"})
    return 0


def _print(rows, ms, growth, target, gloo, points) -> None:
    print(f"{'TP':>3} {'PP':>3} {'DP':>4} {'m':>3} {'GPUs':>5} {'docs':>5} | "
          f"{'tensor KB':>9} {'net ms':>7} {'cpu ms':>7} | {'pickled KB':>10} {'net ms':>7} "
          f"{'cpu ms':>8} | {'crit ms':>8} {'% step':>7}")
    for r in rows:
        t, o = r["tensor"], r["pickled"]
        crit = r.get("critical_path_s", {}).get("plan_ahead")
        share = r.get("share_of_step", {}).get("plan_ahead")
        print(f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['m']:>3} {r['world']:>5} "
              f"{r['docs_per_dp_rank']:>5} | {t['bytes_per_rank'] / 1e3:>9.1f} "
              f"{t['network_s'] * 1e3:>7.2f} {t['cpu_s'] * 1e3:>7.2f} | "
              f"{o['bytes_per_rank'] / 1e3:>10.1f} {o['network_s'] * 1e3:>7.2f} "
              f"{o['cpu_s'] * 1e3:>8.1f} | "
              f"{'-' if crit is None else f'{crit * 1e3:.2f}':>8} "
              f"{'-' if share is None else f'{100 * share:.3f}':>7}")
    print("\nplanner and after-step work (measured, best static layout, thread CPU):")
    for q in points:
        print(f"  DP {q['dp']:>3} x m {q['m']:>3} x PP {q['pp']}: draft "
              f"{q['draft_s'] * 1e3:8.1f} ms, handoff {q['handoff_s'] * 1e3:5.1f} ms, after "
              f"the step {q['after_step_s'] * 1e3:6.1f} ms, static step {q['static_step_s']:.3f}"
              f" s ({q['layout']})")
    print("\ngrowth exponents in DP x micro-batches (TP 8, PP 4): " + ", ".join(
        f"{k} {v['exponent']:.2f}" for k, v in growth.items()
        if isinstance(v, dict) and "exponent" in v))
    for name in ("in_dp_at_m16", "in_m_at_dp32"):
        if name in growth:
            print(f"  {name}: " + ", ".join(f"{k} {v['exponent']:.2f}"
                                            for k, v in growth[name].items()))
    t = target
    if t is None:
        print(f"\n(the target's shape, {TARGET}, is not among the rows)")
    else:
        print(f"\ntarget: {t['world']} GPUs (DP {t['dp']} x PP {t['pp']} x TP {t['tp']}, "
              f"{t['m']} micro-batches, 32K): critical path with the default --sb-planner process "
              f"{t['critical_path_s']['plan_ahead'] * 1e3:.2f} ms = "
              f"{100 * t['share_of_step']['plan_ahead']:.3f}% of the simulated {t['step_s']:.2f} s "
              f"step (control plane {t['critical_path_parts_s']['control_plane'] * 1e3:.2f} ms, "
              f"handoff {t['critical_path_parts_s']['handoff'] * 1e3:.2f} ms, after the step "
              f"{t['critical_path_parts_s']['after_step'] * 1e3:.2f} ms; target <= "
              f"{100 * TARGET_SHARE:.1f}%: "
              f"{'met' if t['share_of_step']['plan_ahead'] <= TARGET_SHARE else 'NOT met'}); "
              f"in-line planning {100 * t['share_of_step']['in_line']:.2f}%; with TP 8 scaling "
              f"the step 8x: {100 * t['share_if_tp_scaled']:.3f}%")
    if gloo:
        print("\ngloo on this machine (TP 2 x PP 2 x DP n, 16 micro-batches, slowest rank, "
              "median):")
        for g in gloo:
            print(f"  {g['world']:>3} ranks: pickled {g['pickled_s'] * 1e3:7.2f} ms, tensor "
                  f"{g['tensor_s'] * 1e3:7.2f} ms")
