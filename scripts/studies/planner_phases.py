"""Where the planner's per-step work goes as data parallelism grows: the draft split by phase,
its handoff and serialisation, the after-step work and the per-rank gather's bytes, at each DP
of a ladder (the control-plane study's shape: Qwen2.5-0.5B analytic table, best static layout,
32K tokens per micro-batch, built-in corpus, default flags), with each phase's growth in DP
fitted as a power.

How it is measured (this machine is shared and loaded, so no wall clock):

- **Thread CPU time**, per phase: the planner's functions are wrapped from outside for the
  length of the study (``_phases.PhaseProfile``: each call's CPU goes to the innermost phase
  open, the garbage collector's pauses to ``gc``, what no phase holds to ``other``), so the
  same command re-measures whichever planner is in the tree; a target the tree no longer has is
  listed in the JSON's ``absent`` and its time stays with its caller.
- The draft is the runtime's (``Drafter.draft`` of rank 0: SAB's and the baseline's packings,
  DST on both under do no harm), made in this process as the planner process makes it (the same
  function; the kernels warmed up, the set-up's objects frozen out of the collector's reach as
  ``planner_worker._settle`` does), steps back to back with the after-step work between them.
- **Repeats and the minimum**: up to ``--runs`` steps per DP (fewer where the drafts have used
  ``--budget-s`` CPU seconds; at least one), each phase's figure its minimum over the steps
  (the run least disturbed by other processes' cache and frequency effects); medians in the
  JSON. A fixed reference computation (``planner_cost.reference_ms``) is timed before and
  after each DP's steps: how fast this machine ran meanwhile.
- The handoff (the step's request pickled, as the training thread sends it to its planner
  process), the reply (the draft pickled by the planner process, unpickled by the reader
  thread) and the plan record's broadcast (encoded on rank 0, decoded on every rank): thread
  CPU and bytes, measured on the step's own objects; the after-step work is ``planner_cost``'s
  (calibration of every DP rank, the tracker, the reports), split the same way. The gather's
  bytes per rank at TP 1, 4 and 8 are exact (``_exchange_paths.tensor_path``, with the most
  documents a DP rank holds in the committed packing).

The draft does not depend on TP (it plans DP x micro-batches x stages of the latency model's
units; TP changes only the table's prices), so one ladder serves TP 1 and TP 8.

    .venv/bin/python scripts/bench.py planner_phases --json docs/results/planner_phases.json
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np

from ._phases import PhaseProfile, _now, wrapper_cost_s
from .common import parser, write_result

P = "sparsebalance_megatron."
# (key, what, functions that open the phase): the draft's phases, inner ones after outer ones
DRAFT_PHASES = (
    ("sab.costs", "SAB: latency cost of segments and packed micro-batches",
     [P + "batching.latency_cost:LatencyCost.__call__",
      P + "batching.latency_cost:LatencyCost.unit_costs"]),
    ("sab.sensitivity", "SAB: the segments' sensitivity estimates",
     [P + "batching.sensitivity:SensitivityTracker.estimate"]),
    ("sab.assign", "SAB: assignment to DP ranks (LPT over all segments)",
     [P + "kernels.packing:lpt_ranks", P + "batching.assignment:SABAssignment.__init__",
      P + "batching.assignment:fallback_bins"]),
    ("sab.bins", "SAB: each rank's micro-batches (bins)",
     [P + "batching.assignment:_cut"]),
    ("sab.slots", "SAB: slots and cross-rank swaps on the simulated pipeline",
     [P + "batching.slots:arrange_slots", P + "batching.slots:seed_slots",
      P + "batching.slots:candidates", P + "batching.slots:search"]),
    ("sab.rest", "SAB: the rest (segments, order, the plan's records)",
     [P + "batching.packing:sab_plan"]),
    ("baseline", "the baseline's packing (do no harm)",
     [P + "batching.packing:sequential_plan", P + "batching.packing:token_balanced_plan"]),
    ("check", "the packings checked to hold the step's segments",
     [P + "megatron.step.checks:check_assignment", P + "megatron.step.checks:segment_counts",
      P + "batching.plan:checked_segments"]),
    ("features", "latency features of the packed micro-batches",
     [P + "latency.model:LatencyModel.unit_features", P + "batching.plan:BatchPlan.unit_csr"]),
    ("unit_costs", "unit costs over the density grid",
     [P + "policy.costs:UnitCosts.from_latency"]),
    ("sensitivity", "the micro-batches' sensitivities",
     [P + "batching.sensitivity:batch_sensitivity",
      P + "batching.sensitivity:unit_sensitivity"]),
    ("choose", "do no harm: the choice, the report",
     [P + "megatron.step.choice:choose", P + "megatron.step.choice:raise_headroom",
      P + "policy.stand_down:choose_step"]),
    ("dst.setup", "DST: settings, quality cost",
     [P + "policy.dst:plan_dst_from_config", P + "policy.quality:StageQuality.from_cost",
      P + "policy.quality:load_quality_cost"]),
    ("dst.search", "DST: the band search under the floors",
     [P + "policy.dst:plan_dst_with_floor", P + "policy.dst:_search_bands"]),
    ("dst.band", "DST band pass: set-up (tables, compiled pass)",
     [P + "policy.dst_band:plan_dst_candidates", P + "policy.dst_band:_pass"]),
    ("dst.band.static", "DST band pass: static plan, anchors, bands",
     [P + "policy.dst_band:_band"]),
    ("dst.band.cut", "DST band pass: the cut", [P + "policy.dst_band:_cut"]),
    ("dst.band.raise", "DST band pass: the raise, checked", [P + "policy.dst_band:_raise"]),
    ("dst.band.report", "DST band pass: plans and reports", [P + "policy.dst_band:_plans"]),
    ("dst.descent", "DST: the critical-path descent",
     [P + "policy.critical_path:refine_plan"]),
    ("dst.floors", "DST: the floors' checks",
     [P + "policy.floors:FloorCheck.__init__", P + "policy.floors:FloorCheck.floors_at",
      P + "policy.floors:FloorCheck.meets_at", P + "policy.floors:FloorCheck.meets"]),
    ("dst.quality", "DST: the quality cost of plans",
     [P + "policy.quality:StageQuality.plan_cost", P + "policy.quality:StageQuality.plan_cost_at",
      P + "policy.quality:StageQuality.marginal_gain"]),
    ("sim.graph", "simulator: event graphs", [P + "sim.pipeline:event_graph"]),
    ("sim.run", "simulator: earliest finishes and makespans (numpy-side calls)",
     [P + "sim.pipeline:pipeline_makespan_s", P + "sim.pipeline:EventGraph.durations",
      P + "sim.pipeline:EventGraph.earliest_finish", P + "sim.pipeline:EventGraph.makespan"]),
    ("sim.floats", "simulator: latest finishes and floats",
     [P + "policy.slack:unit_floats_from", P + "policy.slack:latest_finish"]),
    ("busy_s", "the committed plan's busy seconds (calibration's prediction)",
     [P + "latency.model:LatencyModel.busy_s"]),
)
AFTER_PHASES = (
    ("after.calibrate", "calibration of every DP rank",
     [P + "latency.calibration:Calibration.calibrate_ranks"]),
    ("after.tracker", "the sensitivity tracker's update",
     [P + "batching.sensitivity:SensitivityTracker.update"]),
    ("after.reports", "the reports' weights and kept work",
     [P + "megatron.step.report_sums:unit_work", P + "megatron.step.report_sums:kept_work"]),
    ("after.documents", "the step's documents and their lengths (every segment)",
     [P + "batching.plan:BatchPlan.segments"]),
)
EXTRA = (("gc", "garbage collector's pauses"), ("other", "in the draft, outside every phase"))
SERIAL = ("handoff", "reply_pickle", "reply_unpickle", "plan_encode", "plan_decode")


def _triples(phases):
    return [(k, t) for k, _, t in phases]


def _serialised(d, dp: int, m: int, pp: int, nv: int, segs, lm, update) -> dict:
    """Thread CPU seconds and bytes of the step's serialisation: the request the training
    thread pickles for its planner process, the reply the process pickles and the reader
    thread unpickles, and the plan record rank 0 encodes and every rank decodes."""
    from sparsebalance_megatron.megatron.step.plan_record import (PlanShape, decode_plan,
                                                                   encode_plan)
    from sparsebalance_megatron.megatron.step.planner_worker import reply

    out, clock = {}, time.thread_time
    req = ("draft", dict(iteration=1, first_bin=0, segments=segs, num_microbatches=m,
                         with_dst=True, latency=lm.calibration_state(),
                         tracker=("updates", [update])))
    for name, fn in (("handoff", lambda: ForkingPickler.dumps(req)),
                     ("reply_pickle", lambda: ForkingPickler.dumps(("ok", reply(copy.copy(d)))))):
        c0 = clock()
        blob = fn()
        out[name] = (clock() - c0, len(blob))
    c0 = clock()
    ForkingPickler.loads(blob)
    out["reply_unpickle"] = (clock() - c0, len(blob))
    shape = PlanShape(dp, m, nv, options=d.options, sensitivity=True, ranks=pp)
    c0 = clock()
    rec = encode_plan(*d.payload, shape)
    out["plan_encode"] = (clock() - c0, shape.nbytes)
    c0 = clock()
    decode_plan(rec, shape)
    out["plan_decode"] = (clock() - c0, shape.nbytes)
    return out


def _update_of(d, rng) -> tuple:
    """The tracker update a step sends its planner process (ids, lengths, values), as
    ``after_step`` makes it: every document of the committed packing."""
    from sparsebalance_megatron.megatron.step.record import doc_slots

    from .planner_cost import committed

    batch, _, _ = committed(d)
    uniq = np.unique(np.concatenate(doc_slots(batch.micro_batches)))
    lengths = {s[0]: s[2] - s[1] for s in batch.segments()}
    return uniq, [lengths[i] for i in uniq.tolist()], rng.uniform(1, 6, uniq.size)


def measure(dp: int, m: int = 16, pp: int = 4, runs: int = 3, budget_s: float = 60.0,
            seq: int = 32768, tps=(1, 4, 8)) -> dict:
    """One DP of the ladder (module docstring): every step's phases (thread CPU seconds), the
    serialisation's CPU and bytes, the after-step phases, the gather's bytes per rank."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels

    from ._drafts import make_drafter
    from sparsebalance_megatron.megatron.step.record import doc_slots

    from ._exchange_paths import tensor_path
    from .planner_cost import after_step, committed, reference_ms

    warm_up_kernels()
    sb = SparseBalanceConfig(sparse_balance=True)               # the default flags
    c0 = time.thread_time()
    corpus = corpus_steps(dp, m, sb.density, runs, seq=seq, layout="best", pp=pp)
    setup_s = time.thread_time() - c0
    lm = corpus.lm
    drafter = make_drafter(lm, sb, dp, seq)
    tracker, rng = SensitivityTracker(), np.random.default_rng(0)   # after_step's
    gc.collect()
    gc.freeze()                        # as the planner process settles before its first draft
    ref = [reference_ms(3)]
    steps, spent = [], 0.0
    draft_prof, after_prof = PhaseProfile(_triples(DRAFT_PHASES)), \
        PhaseProfile(_triples(AFTER_PHASES))
    try:
        for k, segs in enumerate(corpus.segments):
            with draft_prof:
                draft_prof.reset()
                r0 = _now()
                d = drafter.draft(k, 0, segs, m, with_dst=True)
                r1 = _now()
                total = r1[0] - r0[0]
                phases, calls = draft_prof.split(total), dict(draft_prof.calls)
                sys_s, faults = draft_prof.split(0, "sys_s"), draft_prof.split(0, "faults")
            update = _update_of(d, rng)
            serial = _serialised(d, dp, m, pp, lm.layout.num_stages, segs, lm, update)
            with after_prof:
                after_prof.reset()
                c0 = time.thread_time()
                after_step(lm, sb, d, tracker, rng)
                after = after_prof.split(time.thread_time() - c0)
            steps.append({"draft_s": total, "phases_s": phases, "calls": calls,
                          "draft_sys_s": r1[1] - r0[1], "draft_faults": r1[2] - r0[2],
                          "phases_sys_s": sys_s, "phases_faults": faults,
                          "after_s": sum(after.values()), "after_phases_s": after,
                          "serial_s": {k: v[0] for k, v in serial.items()},
                          "serial_bytes": {k: v[1] for k, v in serial.items()},
                          "stood_down": d.payload[1]["stand_down"]})
            spent += total
            if spent >= budget_s:
                break
    finally:
        gc.unfreeze()
    ref.append(reference_ms(3))
    docs = max(len(x) for x in doc_slots(committed(d)[0].micro_batches))   # the gather's
    return {"dp": dp, "m": m, "pp": pp, "layout": lm.layout.describe(), "runs": len(steps),
            "setup_cpu_s": setup_s, "reference_ms": ref,
            "docs_per_dp_rank": docs,             # the last step's, committed packing
            "segments": len(corpus.segments[0]), "absent": draft_prof.absent + after_prof.absent,
            "steps": steps, "min": _summary(steps, min),
            "median": _summary(steps, statistics.median),
            "gather_bytes_per_rank": {str(tp): tensor_path(dp, pp, tp, m, docs)["bytes_per_rank"]
                                      for tp in tps},
            "serial_bytes": steps[0]["serial_bytes"]}


def _summary(steps: list, pick) -> dict:
    """Every phase's (draft, after-step, serialisation) figure over the steps by ``pick``."""
    out = {k: pick([s[k] for s in steps])
           for k in ("draft_s", "after_s", "draft_sys_s", "draft_faults")}
    out["draft_user_s"] = pick([s["draft_s"] - s["draft_sys_s"] for s in steps])
    for group in ("phases_s", "after_phases_s", "serial_s", "phases_sys_s", "phases_faults"):
        out[group] = {k: pick([s[group][k] for s in steps]) for k in steps[0][group]}
    return out


def _after(key: str) -> str:
    """An after-step phase's name in ``growth`` (its gc and other apart from the draft's)."""
    return key if key.startswith("after.") else f"after.{key}"


def growth(points: list) -> dict:
    """Per figure: the exponent k and coefficient of ``c x DP^k`` fitted to the minima over
    the points' DPs (figures under 0.05 ms at every DP are left out: clock noise)."""
    from .control_plane import power_fit

    dps = [q["dp"] for q in points]
    if len(set(dps)) < 2:
        return {}
    series = {"draft": [q["min"]["draft_s"] for q in points],
              "draft_user": [q["min"]["draft_user_s"] for q in points],
              "draft_sys": [q["min"]["draft_sys_s"] for q in points],
              "after_step": [q["min"]["after_s"] for q in points]}
    for group in ("phases_s", "after_phases_s", "serial_s"):
        for k in points[0]["min"][group]:
            series[_after(k) if group == "after_phases_s" else k] = \
                [q["min"][group][k] for q in points]
    for k in points[0]["serial_bytes"]:
        series[f"{k}_bytes"] = [q["serial_bytes"][k] for q in points]
    for tp in points[0]["gather_bytes_per_rank"]:
        series[f"gather_bytes_tp{tp}"] = [q["gather_bytes_per_rank"][tp] for q in points]
    out = {}
    for k, ys in series.items():
        if max(ys) < 5e-5 or min(ys) <= 0:
            continue
        out[k] = power_fit(dps, ys)
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "planner_phases")
    p.add_argument("--dp", default="32,64,128,256,512,1024,2048,4096",
                   help="DP sizes of the ladder (comma-separated)")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--runs", type=int, default=3, help="steps measured per DP, at most")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="a DP stops repeating once its drafts used this many CPU seconds")
    args = p.parse_args(argv)
    wcost = wrapper_cost_s()
    points = []
    for dp in (int(x) for x in args.dp.split(",")):
        q = measure(dp, args.microbatches, args.pp, args.runs, args.budget_s)
        q["wrapper_cost_s"] = wcost * sum(q["steps"][0]["calls"].values())
        points.append(q)
        print(f"DP {dp}: draft {q['min']['draft_s'] * 1e3:.1f} ms (min of {q['runs']}), "
              f"reference {q['reference_ms'][0]:.1f}/{q['reference_ms'][1]:.1f} ms", flush=True)
    fits = growth(points)
    _print(points, fits)
    if args.json:
        write_result(args.json, {
            "clock": "thread CPU time; each figure the minimum over a DP's steps",
            "phases": {k: w for k, w, _ in DRAFT_PHASES + AFTER_PHASES} | dict(EXTRA),
            "targets": {k: t for k, _, t in DRAFT_PHASES + AFTER_PHASES},
            "wrapper_cost_per_call_s": wcost, "points": points, "growth": fits})
    return 0


def _print(points: list, fits: dict) -> None:
    dps = [q["dp"] for q in points]
    head = f"{'phase (thread CPU ms, min)':<28}" + "".join(f"{d:>9}" for d in dps) + "   DP^k"

    def row(name, key, vals):
        k = fits.get(key, {}).get("exponent")
        print(f"{name:<28}" + "".join(f"{v:>9.1f}" for v in vals)
              + (f"   {k:5.2f}" if k is not None else "      -"))

    print(head)
    for key in [k for k, _, _ in DRAFT_PHASES] + [k for k, _ in EXTRA]:
        row(key, key, [1e3 * q["min"]["phases_s"][key] for q in points])
    row("draft (min)", "draft", [1e3 * q["min"]["draft_s"] for q in points])
    row("  of which user (min)", "draft_user", [1e3 * q["min"]["draft_user_s"] for q in points])
    row("  of which system (min)", "draft_sys", [1e3 * q["min"]["draft_sys_s"] for q in points])
    print(f"{'  page faults (min)':<28}" + "".join(f"{q['min']['draft_faults']:>9.0f}"
                                                   for q in points))
    for key in [k for k, _, _ in AFTER_PHASES] + [k for k, _ in EXTRA]:
        row(_after(key), _after(key), [1e3 * q["min"]["after_phases_s"][key] for q in points])
    row("after-step work", "after_step", [1e3 * q["min"]["after_s"] for q in points])
    for key in SERIAL:
        row(key, key, [1e3 * q["min"]["serial_s"][key] for q in points])
    for key in SERIAL[:3]:
        row(f"{key} KB", f"{key}_bytes", [q["serial_bytes"][key] / 1e3 for q in points])
    row("plan record KB", "plan_encode_bytes",
        [q["serial_bytes"]["plan_encode"] / 1e3 for q in points])
    for tp in points[0]["gather_bytes_per_rank"]:
        row(f"gather KB/rank, TP {tp}", f"gather_bytes_tp{tp}",
            [q["gather_bytes_per_rank"][tp] / 1e3 for q in points])
    absent = sorted({a for q in points for a in q["absent"]})
    if absent:
        print("not in this tree (time stays with the caller): " + ", ".join(absent))
