"""Cost of the per-step planning work on this machine (BENCHMARKS.md, the planner's own cost):
speed targets, kept out of the unit tests."""

from __future__ import annotations

import platform
import time

import numpy as np

from sparsebalance_megatron.config import DST_DESCENTS, DST_OBJECTIVES, SparseBalanceConfig

from .common import median_ms, parser, write_result
from .drafts import (beyond_the_group, group_record, make_drafter, rank_after_step, rank_dst,
                     rank_step, submit_draft)
from .slowdown import launch_slowdown

TARGET_SHARE = 0.005          # issue 44: the plugin's critical-path cost, share of the step
SHAPES = (("64x16", 64, 16, ("even", "best")), ("4x16", 4, 16, ("best",)))


def reference_ms(repeats: int = 5) -> float:
    """Thread CPU ms of a fixed computation of the planner's kind (a Python loop of small numpy
    steps over rows, a bisection over gathers, a sort): the unit the draft is also stated in,
    so that a figure does not depend on the machine's speed."""
    rng = np.random.default_rng(0)
    rows = rng.random((256, 64))
    table = np.cumsum(rng.random(200_000))
    keys = rng.random(50_000) * table[-1]

    def work():
        end = np.empty_like(rows)
        for e in range(1, rows.shape[0]):
            np.maximum(end[e - 1], rows[e], out=end[e])
            end[e] += rows[e - 1]
        lo, hi = np.zeros(keys.size, np.int64), np.full(keys.size, table.size - 1)
        for _ in range(18):
            mid = (lo + hi + 1) // 2
            ok = table.take(mid) <= keys
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        np.sort(rng.permutation(keys))

    return median_ms(work, repeats, warmup=1, cuda=False, clock=time.thread_time)


def rank_parts(phases: dict, after_ms: float) -> dict:
    """A DP rank's draft by the parts ``experiments/plugin_cost.py`` reads (ms, one packing's;
    ``phases``: ``drafts.rank_step``'s thread CPU seconds, both packings planned): its own
    draft and SAB's rows of it (the assignment, its units, the baseline's row), the features
    of its units and the unit costs, its sensitivities, DST's rounds and the committed plan's
    busy seconds (the packings' phases halved: one packing's), and ``after_ms``, its work after
    the step (``drafts.rank_after_step``)."""
    ms = {k: 1e3 * v for k, v in phases.items()}
    dst = sum(v for k, v in ms.items() if k.startswith("dst."))
    return {"sab_plan": ms["own_draft"] + ms["sab.rank_plan"],
            "features + UnitCosts.from_latency": ms["features"] + ms["unit_costs"] / 2,
            "sensitivity + DST": ms["sensitivity"] + ms["busy_s"] + dst / 2,
            "after the step: busy_s + unit_work": after_ms}


def committed(draft) -> tuple:
    """(batch, units, densities) the draft commits: SAB's packing, or the baseline's where SAB
    stood down (do no harm)."""
    densities, report = draft.payload
    batch, units = draft.packing(report["stand_down"]["packing_index"])
    return batch, units, np.asarray(densities)


def after_step(lm, sb, draft, tracker=None, rng=None) -> float:
    """Thread CPU ms of the after-step work on the training thread, as ``end_step`` runs it: the
    calibration's prediction and every DP rank's update (a stand-in measurement, x 0.9-1.1), the
    tracker's update with every document of the step, and the reports' density weights and kept
    work. ``tracker``: a ``SensitivityTracker`` (None: a fresh one)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.megatron.step.record import doc_slots
    from sparsebalance_megatron.megatron.step.report_sums import kept_work, unit_work

    batch, units, densities = committed(draft)
    tracker = SensitivityTracker() if tracker is None else tracker
    rng = np.random.default_rng(0) if rng is None else rng
    uniq = np.unique(np.concatenate(doc_slots(batch.micro_batches)))
    noise = rng.uniform(0.9, 1.1, (len(batch.micro_batches), lm.layout.pp))
    signal = rng.uniform(1, 6, uniq.size)
    t0 = time.thread_time()                            # end_step's work, in its order
    predicted = np.array(draft.payload[1]["predicted_busy_s"], dtype=np.float64)
    lm.calibrate_ranks(predicted, predicted * noise)
    lengths = {s[0]: s[2] - s[1] for s in batch.segments()}
    tracker.update(uniq, [lengths[i] for i in uniq.tolist()], signal)
    routing = lm.dense_below_tokens or 0                 # the reports' routing: the model's
    unit_work(batch, sb, routing, units=units)
    kept_work(batch, sb, densities, routing, units=units)
    return (time.thread_time() - t0) * 1e3


def step_overhead(sb, dp: int = 64, m: int = 16, seq: int = 32768, repeats: int = 5,
                  layout: str = "even", pp: int = 4, ahead: bool = True) -> dict:
    """The plugin's per-step CPU work at one shape (module docstring), on the built-in corpus;
    ``layout``: ``even`` (Megatron's default split) or ``best`` (the fastest static layout of the
    first step's data, ``layout_gap``: the configuration the benchmarks compare with)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.policy import UnitCosts, density_grid
    from sparsebalance_megatron.policy.stand_down import plan_step_time_s

    corpus = corpus_steps(dp, m, sb.density, repeats + 1, seq=seq, layout=layout, pp=pp)
    lm, batches = corpus.lm, corpus.segments
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    drafter = make_drafter(lm, sb, dp, seq)
    after_tracker, after_rng = SensitivityTracker(), np.random.default_rng(0)   # after_step's
    parts, drafts, whole, step_s, searched, stood, ranks = {}, [], [], [], [], [], []
    # the whole plan's drafts back to back (every rank's DST in one process: the step time the
    # shape is priced against, with the after-step work between, which moves the calibration),
    # then a DP rank's draft at each draft's calibration (``drafts.rank_step``: the critical
    # rank's own draft and settle, its DST rounds, each phase the least of 3 runs) by parts
    states, done = [], []
    ref_before = reference_ms()         # this VM's speed drifts: measured around the drafts
    for k, segs in enumerate(batches):
        states.append(lm.calibration_state())
        d = drafter.draft(k, 0, segs, m, with_dst=True)
        done.append((d, after_step(lm, sb, d, after_tracker, after_rng)))
    ref_around = (ref_before + reference_ms()) / 2
    final = lm.calibration_state()
    for k, segs in enumerate(batches):
        lm.load_calibration_state(states[k])
        q = rank_step(drafter, segs, m)             # a rank's draft, as control_plane's
        r, dens = q["rank"], q["densities"]
        after = rank_after_step(lm, sb, q["own"], q["own_units"], dens[r:r + 1],
                                lm.busy_s(q["units"], dens)[r:r + 1], r, after_tracker,
                                after_rng)
        ranks.append(r)
        if k == 0:
            continue                                          # warm-up
        for name, v in rank_parts(q["phases_s"], 1e3 * after).items():
            parts.setdefault(name, []).append(v)
        drafts.append(q["draft_s"] * 1e3)
    for k, (d, _) in enumerate(done):
        if k == 0:
            continue
        whole.append(d.cpu_s * 1e3)
        lm.load_calibration_state(states[k + 1] if k + 1 < len(states) else final)
        _, units, densities = committed(d)
        step_s.append(plan_step_time_s(UnitCosts.from_latency(lm, units, dp, m, grid),
                                       densities, lm.p2p_s))
        searched.append(d.payload[1]["tolerance_used"] != sb.tolerance)
        stood.append(bool(d.payload[1]["stand_down"]["sab_stood_down"]))
    lm.load_calibration_state(final)
    med = {k: float(np.median(v)) for k, v in parts.items()}
    after = med["after the step: busy_s + unit_work"]
    out = {"shape": f"{dp} DP x {m} micro-batches x PP{pp}, {seq} tokens",
           "dp": dp, "microbatches": m, "pp": pp, "seq_length": seq,
           "virtual_stages": lm.layout.num_stages, "layout": lm.layout.describe(),
           "candidates": 2 if drafter.sb.stand_down != "off" else 1,
           "dst_candidates": 2 if drafter.sb.stand_down != "off"
           and drafter.sb.stand_down_compare == "planned" else 1,
           "parts_ms": med, "draft_ms": float(np.median(drafts)),
           "draft_ms_each": [round(x, 2) for x in drafts],
           "draft_all_ranks_ms": float(np.median(whole)), "per_rank": True,
           "reference_ms_around": ref_around,
           "total_ms": float(np.median(drafts)) + after,
           "step_s": float(np.median(step_s)), "floor_search_steps": int(sum(searched)),
           "sab_stood_down_steps": int(sum(stood)), "steps": len(step_s)}
    out["inline_share_of_step"] = out["total_ms"] / (1e3 * out["step_s"])
    if ahead:
        for planner in ("process", "thread"):
            key = "plan_ahead" if planner == "process" else "plan_ahead_thread"
            out[key] = plan_ahead_overlap(lm, sb, dp, m, seq, batches, out["step_s"], planner,
                                          ranks)
    return out


def plan_ahead_overlap(lm, sb, dp, m, seq, batches, step_s: float, planner: str,
                       ranks: list) -> dict:
    """--sb-planner ``planner`` at one shape, for one DP rank as a run makes it: each step's own
    draft of rank ``ranks[k]`` made and settled by the runtime's planner (``submit_draft`` with
    ``settle``), its rounds answered by a stand-in for the DP group (``drafts.group_record``:
    every rank's settle of the step made in lockstep beforehand, off the clock; the rank's plan
    checked to be the group's) while the training thread stands in for a GPU-bound step
    (``step_s`` seconds, GIL released); on the training thread the handoff (thread CPU), the
    wait at the join and the rank's after-step work (``drafts.rank_after_step``); the reader
    thread's CPU reading the draft back, and the wall time of its relayed rounds, beside it."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.megatron.step.ahead import PlannerProcess
    from sparsebalance_megatron.megatron.step.relay import ReplayingReducer

    drafter = make_drafter(lm, sb, dp, seq)
    after_tracker, after_rng = SensitivityTracker(), np.random.default_rng(0)   # after_step's
    proc = PlannerProcess(drafter) if planner == "process" else None
    got = {k: [] for k in ("send", "wait", "reader", "rounds_wall", "after", "draft")}
    current, made = None, []
    try:
        for k, segs in enumerate(batches):             # step 0: the planner's warm-up
            r = ranks[k]
            record, settled = group_record(drafter, k, segs, m, r)     # the DP group's answers
            group = ReplayingReducer(record, beyond_the_group)
            c0 = time.thread_time()
            pending = submit_draft(planner, drafter, proc, k, segs, m, with_dst=False,
                                   settle=(r, group))
            send = (time.thread_time() - c0) * 1e3
            time.sleep(step_s)                          # the step trains (GIL released)
            nxt = pending.result()                      # end_step: join the next step's draft
            densities, report = nxt.agreed
            if group.calls != len(record) or not np.array_equal(densities, settled[r][0]):
                raise SystemExit(f"step {k}, rank {r}: the planner's settle is not the group's "
                                 f"({group.calls} of {len(record)} rounds)")
            batch, units = nxt.packing(report["stand_down"]["packing_index"])   # the commit
            a = None if current is None else rank_after_step(
                lm, sb, *current, after_tracker, after_rng)
            current = (batch, units, np.asarray(densities), nxt.predicted_busy, r)
            made.append(len(record))
            relayed = getattr(pending, "rounds", None)  # the process's, relayed (a thread: none)
            if k:
                for key, v in (("send", send), ("after", 1e3 * a),
                               ("wait", pending.wait_s * 1e3),
                               ("reader", getattr(pending, "recv_s", 0.0) * 1e3),
                               ("rounds_wall", 0.0 if relayed is None else relayed.wait_s * 1e3),
                               ("draft", nxt.cpu_s * 1e3)):
                    got[key].append(v)
    finally:
        if proc is not None:
            proc.close()
    med = {k: float(np.median(v)) for k, v in got.items()}
    on_path = med["send"] + med["wait"] + med["after"]
    return {"planner": planner, "stand_in_step_s": step_s, "per_rank": True,
            "ranks": [int(x) for x in ranks], "rounds": made,
            "own_draft_cpu_ms": med["draft"], "handoff_ms": med["send"],
            "reader_ms": med["reader"], "relayed_rounds_wall_ms": med["rounds_wall"],
            "join_wait_ms": med["wait"], "after_step_ms": med["after"],
            "critical_path_ms": on_path, "share_of_step": on_path / (1e3 * step_s)}


def main(argv=None) -> int:
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.policy import DSTSettings, UnitCosts, density_grid

    defaults = SparseBalanceConfig()
    p = parser(__doc__, "planner_cost")
    p.add_argument("--dst-objective", default=defaults.dst_objective, choices=DST_OBJECTIVES,
                   help="DST's objective in the per-step rows (--sb-dst-objective)")
    p.add_argument("--dst-descent", default=defaults.dst_descent, choices=DST_DESCENTS,
                   help="DST's critical-path descent in the per-step rows (--sb-dst-descent)")
    p.add_argument("--repeats", type=int, default=5, help="steps timed per shape (after one "
                   "warm-up step)")
    p.add_argument("--no-slowdown", action="store_true",
                   help="skip the training-thread slowdown test")
    args = p.parse_args(argv)
    sb = SparseBalanceConfig(sparse_balance=True, dst_objective=args.dst_objective,
                             dst_descent=args.dst_descent)
    rng = np.random.default_rng(7)
    grid = density_grid(0.5, 0.125, 1.0)
    fixed = rng.uniform(0.05, 0.2, (64, 16, 4))
    attn = rng.uniform(0.0, 0.4, (64, 16, 4))
    t = fixed[..., None] + attn[..., None] * grid             # seconds: a third forward
    costs = UnitCosts(grid, t * (1.0 / 3.0), t * (1.0 - 1.0 / 3.0), attn)
    sens = rng.random((64, 16))
    settings = DSTSettings(0.5, 0.125, 1.0)
    plan_ms = 1e3 * float(rank_dst(costs, sens, settings, None, None, repeats=9)["cpu"]
                          .max(axis=0).sum())
    lm = LatencyModel.analytic(pp=4)
    units = [np.diff(np.r_[0, np.sort(rng.choice(32767, rng.integers(1, 30), replace=False) + 1),
                           32768]) for _ in range(4096)]
    d = rng.choice(np.linspace(0.125, 1.0, 8), 4096)
    predict_ms = median_ms(lambda: lm.predict_many(units, d, 1), 5, warmup=1, cuda=False,
                           clock=time.thread_time)
    ref_ms = reference_ms()

    steps, shapes = {}, {}
    for name, dp, m, layouts in SHAPES:
        for lay in layouts:
            out = step_overhead(sb, dp=dp, m=m, layout=lay, repeats=args.repeats)
            out["draft_over_reference"] = out["draft_ms"] / out["reference_ms_around"]
            shapes[f"{name} {lay}"] = out
            if name == "64x16":
                steps[lay] = out            # the keys earlier results used
    rows = [("a rank's DST rounds 64 x 16 x 4", plan_ms, 10.0),
            ("predict_many 4,096 x 32K (pp 4)", predict_ms, 250.0),
            ("reference computation (the unit of 'x ref')", ref_ms, None)]
    for tag, step in shapes.items():
        tag = f"{tag} {step['layout']}"
        budget = TARGET_SHARE * step["step_s"] * 1e3
        rows += [(f"{tag}: {k}", v, None) for k, v in step["parts_ms"].items()]
        rows.append((f"{tag}: a rank's draft ({step['candidates']} packings, DST on "
                     f"{step['dst_candidates']}; "
                     f"{step['draft_over_reference']:.1f} x ref)", step["draft_ms"], 50.0))
        rows.append((f"{tag}: the whole draft, every rank's DST serially",
                     step["draft_all_ranks_ms"], None))
        rows.append((f"{tag}: --sb-planner inline, critical path", step["total_ms"], budget))
        for key in ("plan_ahead", "plan_ahead_thread"):
            a = step[key]
            rows.append((f"{tag}: --sb-planner {a['planner']}, critical path",
                         a["critical_path_ms"], budget))
    slow = None if args.no_slowdown else launch_slowdown(
        sb, window_s=shapes["64x16 best"]["step_s"])
    print(f"{'what':<78} {'median ms':>10} {'target ms':>10}")
    for name, ms, target in rows:
        print(f"{name:<78} {ms:>10.2f} {'-' if target is None else f'{target:.1f}':>10}")
    for tag, step in shapes.items():
        print(f"{tag} {step['layout']}: simulated step {step['step_s']:.2f} s; in-line "
              f"{100 * step['inline_share_of_step']:.2f}%, ahead in a process "
              f"{100 * step['plan_ahead']['share_of_step']:.3f}% (a DP rank's: handoff "
              f"{step['plan_ahead']['handoff_ms']:.1f} ms; read back off the path in "
              f"{step['plan_ahead']['reader_ms']:.1f} ms, its "
              f"{step['plan_ahead']['rounds'][-1]} rounds relayed in "
              f"{step['plan_ahead']['relayed_rounds_wall_ms']:.1f} ms; join wait "
              f"{step['plan_ahead']['join_wait_ms']:.1f} ms, after-step "
              f"{step['plan_ahead']['after_step_ms']:.1f} ms), on a thread "
              f"{100 * step['plan_ahead_thread']['share_of_step']:.3f}% (target <= "
              f"{100 * TARGET_SHARE:.1f}%); floor search in {step['floor_search_steps']} and "
              f"SAB stood down in {step['sab_stood_down_steps']} of {step['steps']} steps")
    if slow is not None:
        for planner in ("thread", "process"):
            s = slow[planner]
            print(f"launch-bound training thread beside the {planner} planner: "
                  f"{100 * s['slowdown']:.2f}% slower ({s['ops_per_s']:.0f} vs "
                  f"{slow['baseline_ops_per_s']:.0f} ops/s in {slow['window_s']:.1f} s steps, "
                  f"{s['join_ms']:.1f} ms at the join), local {100 * s['local']:.3f}% (the "
                  f"{s['draft_wall_ms']:.0f} ms draft's bursts against the window's others, net "
                  f"of the control's {100 * slow['control_local']:.3f}%); target <= "
                  f"{100 * TARGET_SHARE:.1f}%")
    if args.json:
        write_result(args.json, {
            "machine": platform.processor() or platform.machine(),
            "clock": "thread CPU time", "dst_objective": args.dst_objective,
            "dst_descent": args.dst_descent, "stand_down_compare": sb.stand_down_compare,
            "planner": sb.planner, "reference_ms": ref_ms,
            "steps": steps, "shapes": shapes, "launch_slowdown": slow,
            "rows": [dict(what=n, median_ms=m, target_ms=t) for n, m, t in rows]})
    return 0

