"""Cost of the per-step planning work on this machine: DST planning and batched latency prediction.

Prints a table and writes JSON (``--json``). These are speed targets, kept out of the unit tests
(no wall clock in tests):

- ``plan_dst`` of 64 DP ranks x 16 micro-batches x 4 stages (synthetic unit costs, the DST unit
  test's shape), median thread CPU time of 9 runs after a warm-up; target < 10 ms.
- ``LatencyModel.predict_many`` over a global batch of 4,096 micro-batches of 32K tokens
  (analytic table, PP=4), median of 5; target well under 250 ms.
- One step's SparseBalance work at 64 DP x 16 micro-batches x PP=4, 32K tokens, on the built-in
  corpus (SAB packing, unit costs, the runtime's DST call, the calibration's prediction and the
  reports' weights after the step), against the simulated step time of the plan (analytic
  Qwen2.5-0.5B table); target < 1% of the step. Twice: on Megatron's even split (the LM-head
  stage heavy, so DST's per-stage floor search runs) and on the best static layout.
- The same with ``--sb-plan-ahead`` (``plan_ahead_overlap``): the draft on the planner thread
  while a stand-in step runs, and what stays on the training thread's critical path.

    .venv/bin/python scripts/bench.py planner_cost --json docs/results/planner_cost.json
"""

from __future__ import annotations

import platform
import time
from types import SimpleNamespace

import numpy as np

from sparsebalance_megatron.config import DST_DESCENTS

from .common import parser, write_result


def _median_ms(fn, repeats: int, clock=time.thread_time) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e3)
    return float(np.median(out))


def _draft(lm, sb, grid, cost_fn, tracker, segs, dp, m, seq):
    """One step's plan with the runtime's calls (SAB packing, the latency model's features and
    unit costs, the micro-batch sensitivities and DST), and the thread CPU clock before, between
    and after the three parts (``marks``)."""
    from sparsebalance_megatron.batching import sab_plan, unit_sensitivity
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.policy.dst import plan_dst_from_config

    marks = [time.thread_time()]
    plan = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=seq, cost_fn=cost_fn,
                    sensitivity=tracker, seed=1)
    marks.append(time.thread_time())
    feats = lm.unit_features(plan.unit_csr(with_padding=True))
    costs = UnitCosts.from_latency(lm, feats, dp, m, grid)
    marks.append(time.thread_time())
    dst = plan_dst_from_config(sb, costs, unit_sensitivity(plan.micro_batches, tracker),
                               p2p_s=lm.p2p_s, stage_layers=lm.layout.layers)
    marks.append(time.thread_time())
    return SimpleNamespace(plan=plan, feats=feats, costs=costs, dst=dst, marks=marks)


def step_overhead(lm, dp: int = 64, m: int = 16, seq: int = 32768, repeats: int = 5,
                  layout: str = "even", objective: str = "density",
                  descent: str = "critical_path") -> dict:
    """The plugin's per-step CPU work at scale, in the runtime's order and with its calls, on the
    built-in corpus: SAB packing of a global batch; the latency model's features of the packed
    step and its unit costs; the micro-batch sensitivities and the runtime's DST call; after the
    step, the calibration's prediction (``busy_s``) and the reports' density weights
    (``unit_work``); and the step time the plan is simulated to take (the denominator).

    layout: ``even`` (the model's table as given: Megatron's default split) or ``best`` (the
    fastest static layout of the first step's data, ``layout_gap``: the configuration the
    benchmarks compare with)."""
    from sparsebalance_megatron.batching import SensitivityTracker, latency_sample_cost_fn
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.reporting import unit_work
    from sparsebalance_megatron.policy import density_grid
    from sparsebalance_megatron.sim import pipeline_makespan_s

    sb = SparseBalanceConfig(sparse_balance=True, dst_objective=objective, dst_descent=descent)
    corpus = corpus_steps(dp, m, sb.density, repeats + 1, seq=seq, layout=layout,
                          pp=lm.layout.pp)
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    cost_fn = latency_sample_cost_fn(lm, sb.density)      # packing as corpus_steps packs
    batches, lm = corpus.segments, corpus.lm
    tracker = SensitivityTracker()
    names = ("sab_plan", "features + UnitCosts.from_latency", "sensitivity + DST",
             "after the step: busy_s + unit_work")
    parts = {k: [] for k in names}
    step_s, searched = [], []
    for k, segs in enumerate(batches):
        d = _draft(lm, sb, grid, cost_fn, tracker, segs, dp, m, seq)
        costs, dst = d.costs, d.dst
        lm.busy_s(d.feats, dst.densities)
        unit_work(d.plan, sb)
        t = d.marks + [time.thread_time()]
        if k == 0:
            continue                                          # warm-up
        for j, name in enumerate(names):
            parts[name].append((t[j + 1] - t[j]) * 1e3)
        idx = np.searchsorted(costs.densities, dst.densities - 1e-12)
        f, b = costs.at(idx)
        step_s.append(float(pipeline_makespan_s(f, b, lm.p2p_s, pp=lm.layout.pp).max()))
        searched.append(dst.report.tolerance_used != sb.tolerance)
    med = {k: float(np.median(v)) for k, v in parts.items()}
    out = {"shape": f"{dp} DP x {m} micro-batches x PP{lm.layout.pp}, {seq} tokens",
           "layout": lm.layout.describe(), "parts_ms": med, "total_ms": float(sum(med.values())),
           "step_s": float(np.median(step_s)), "floor_search_steps": int(sum(searched)),
           "steps": len(step_s)}
    out["plan_ahead"] = plan_ahead_overlap(lm, sb, grid, cost_fn, batches, dp, m, seq,
                                           float(np.median(step_s)))
    return out


def plan_ahead_overlap(lm, sb, grid, cost_fn, batches, dp, m, seq, step_s: float) -> dict:
    """--sb-plan-ahead at the same scale: each step's draft (SAB, features, unit costs, DST)
    runs on the runtime's planner thread (``step_planning.Planner``) while the training thread
    stands in for a GPU-bound step (blocked ``step_s`` seconds with the GIL released, as it is
    in CUDA synchronisation and NCCL waits); measured on the training thread: the wait at the
    join, and the after-step work (calibration's ``busy_s``, the reports' ``unit_work``). What
    a CPU-bound training thread (kernel launches holding the GIL) would lose to the planner is
    not modelled: the draft's CPU time is its bound."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.megatron.step.planning import Planner
    from sparsebalance_megatron.megatron.step.reporting import unit_work

    tracker = SensitivityTracker()

    def draft(segs):
        return _draft(lm, sb, grid, cost_fn, tracker, segs, dp, m, seq)

    waits, after, drafts = [], [], []
    current = draft(batches[0])
    for segs in batches[1:]:
        planner = Planner(lambda segs=segs: draft(segs), basis={})
        time.sleep(step_s)                          # the step trains (GIL released)
        t0 = time.perf_counter()                    # end_step: join the next step's draft ...
        nxt = planner.result()
        waits.append((time.perf_counter() - t0) * 1e3)
        t1 = time.thread_time()
        lm.busy_s(current.feats, current.dst.densities)   # ... calibration's prediction ...
        unit_work(current.plan, sb)                       # ... and the reports' weights
        after.append((time.thread_time() - t1) * 1e3)
        drafts.append((nxt.marks[-1] - nxt.marks[0]) * 1e3)
        current = nxt
    on_path = float(np.median(waits) + np.median(after))
    return {"stand_in_step_s": step_s, "draft_cpu_ms": float(np.median(drafts)),
            "join_wait_ms": float(np.median(waits)), "after_step_ms": float(np.median(after)),
            "critical_path_ms": on_path, "share_of_step": on_path / (1e3 * step_s)}


def main(argv=None) -> int:
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.policy import UnitCosts, density_grid, plan_dst

    p = parser(__doc__, "planner_cost")
    p.add_argument("--dst-objective", default="density", choices=["density", "quality"],
                   help="DST's objective in the per-step rows (--sb-dst-objective)")
    p.add_argument("--dst-descent", default=DST_DESCENTS[0], choices=DST_DESCENTS,
                   help="DST's critical-path descent in the per-step rows (--sb-dst-descent)")
    args = p.parse_args(argv)

    rng = np.random.default_rng(7)
    grid = density_grid(0.5, 0.125, 1.0)
    fixed = rng.uniform(0.05, 0.2, (64, 16, 4))
    attn = rng.uniform(0.0, 0.4, (64, 16, 4))
    costs = UnitCosts.affine(grid, fixed, attn)
    sens = rng.random((64, 16))
    plan_ms = _median_ms(lambda: plan_dst(costs, sens, 0.5, 0.125, 1.0), 9)

    lm = LatencyModel.analytic(pp=4)
    units = [np.diff(np.r_[0, np.sort(rng.choice(32767, rng.integers(1, 30), replace=False) + 1),
                           32768]) for _ in range(4096)]
    d = rng.choice(np.linspace(0.125, 1.0, 8), 4096)
    predict_ms = _median_ms(lambda: lm.predict_many(units, d, 1), 5)

    steps = {lay: step_overhead(lm, layout=lay, objective=args.dst_objective,
                               descent=args.dst_descent)
             for lay in ("even", "best")}
    rows = [("plan_dst 64 x 16 x 4", plan_ms, 10.0),
            ("predict_many 4,096 x 32K (pp 4)", predict_ms, 250.0)]
    for lay, step in steps.items():
        tag = f"{lay} {step['layout']}"
        rows += [(f"step ({tag}): {k}", v, None) for k, v in step["parts_ms"].items()]
        rows.append((f"step ({tag}): all of it", step["total_ms"],
                     0.01 * step["step_s"] * 1e3))
        ahead = step["plan_ahead"]
        rows.append((f"step ({tag}), --sb-plan-ahead: draft (planner thread)",
                     ahead["draft_cpu_ms"], None))
        rows.append((f"step ({tag}), --sb-plan-ahead: critical path", ahead["critical_path_ms"],
                     0.01 * step["step_s"] * 1e3))
    print(f"{'what':<62} {'median ms':>10} {'target ms':>10}")
    for name, ms, target in rows:
        print(f"{name:<62} {ms:>10.2f} {'-' if target is None else f'{target:.1f}':>10}")
    for lay, step in steps.items():
        print(f"per step, {lay} layout {step['layout']}: {step['total_ms']:.1f} ms of a simulated "
              f"{step['step_s']:.2f} s step = {100 * step['total_ms'] / (1e3 * step['step_s']):.2f}%"
              f" (target < 1%); DST's floor search ran in {step['floor_search_steps']} of "
              f"{step['steps']} steps")
        a = step["plan_ahead"]
        print(f"  with --sb-plan-ahead: {a['critical_path_ms']:.1f} ms on the critical path "
              f"(join wait {a['join_wait_ms']:.2f} ms + after-step work "
              f"{a['after_step_ms']:.1f} ms) = {100 * a['share_of_step']:.2f}% of the step; the "
              f"draft's {a['draft_cpu_ms']:.1f} ms ran on the planner thread")
    if args.json:
        write_result(args.json, {
            "machine": platform.processor() or platform.machine(),
            "clock": "thread CPU time", "dst_objective": args.dst_objective,
            "dst_descent": args.dst_descent, "steps": steps,
            "rows": [dict(what=n, median_ms=m, target_ms=t) for n, m, t in rows]})
    return 0
