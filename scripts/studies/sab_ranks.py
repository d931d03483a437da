"""SAB's packing as a DP rank pays for it (issue 77; docs/DESIGN.md section 6, "DST and SAB at
scale"): every rank's micro-batches packed on every rank (today's draft) against a rank's own
only, by phase, at DP 512 to 4,096 (the control-plane study's shape: Qwen2.5-0.5B analytic
table, best static layout, 16 micro-batches of 32K tokens, PP 4, built-in corpus, default flags).

- **whole**: the draft's SAB part as the runtime makes it: the step's segments checked once
  (``checked_segments``, ``segment_counts``), ``Drafter.pack`` by SAB (``sab_plan``), the
  packing checked (``check_assignment``) and its latency features (``unit_features``), split by
  phase (``_phases.PhaseProfile``);
- **own**: what rank r computes: ``sab_assignment`` (the segments, their costs, the cost order
  and the LPT over the DP ranks: the same on every rank), its ``units([r])`` (its segments by
  its sensitivity estimates, its cut, costs and seed slots), its ``rank_plan`` (the slot search
  over the agreed candidates, its row) and the latency features of its micro-batches. The
  agreement (every rank's units reduced: in a run the other ranks make theirs and the reductions
  carry the candidates) is made beforehand, off the clock. Measured for rank 0, the middle and
  last ranks and the critical one; the row is checked to be the whole plan's (the study stops
  otherwise); the figure is the slowest of them.

Thread CPU time, the garbage collector paused, each figure the min over ``--repeat`` runs (the
machine is shared: the run least disturbed).

    .venv/bin/python scripts/bench.py sab_ranks --json docs/results/sab_ranks.json
"""

from __future__ import annotations

import gc
import time

import numpy as np

from ._phases import PhaseProfile
from .common import parser, write_result

P = "sparsebalance_megatron."
WHOLE = (
    ("segments", "the step's segments converted and sorted once (checked_segments, "
     "segment_counts)", [P + "batching.plan:checked_segments",
                         P + "megatron.step.checks:segment_counts"]),
    ("prepare", "prepare_samples (checks, long samples)", [P + "batching.packing:prepare_samples"]),
    ("costs", "the segments' costs (sample_costs)", [P + "batching.packing:sample_costs"]),
    ("order", "the seeded cost order (assignment set-up)",
     [P + "batching.assignment:SABAssignment.__init__"]),
    ("lpt", "the LPT over DP ranks (kernels.packing.lpt_ranks)",
     [P + "kernels.packing:lpt_ranks"]),
    ("sensitivity", "the segments' sensitivity estimates",
     [P + "batching.sensitivity:SensitivityTracker.estimate"]),
    ("units", "each rank's segments in order (SABAssignment.units, the rest)",
     [P + "batching.assignment:SABAssignment.units"]),
    ("bins", "each rank's cut into micro-batches (rank_bins, first-fit-decreasing)",
     [P + "batching.assignment:_cut"]),
    ("unit_costs", "the micro-batches' per-stage costs", [P + "batching.latency_cost:"
                                                          "LatencyCost.unit_costs"]),
    ("seeds", "every rank's seed slots (simulated)", [P + "batching.slots:seed_slots"]),
    ("search", "the cross-rank slot search over the candidates",
     [P + "batching.slots:candidates", P + "batching.slots:search"]),
    ("finish", "the plan's per-segment records (finish_plan)",
     [P + "batching.packing:finish_plan"]),
    ("check", "the packing checked to hold the step's segments",
     [P + "megatron.step.checks:check_assignment"]),
    ("features", "latency features of the packed micro-batches",
     [P + "latency.model:LatencyModel.unit_features", P + "batching.plan:BatchPlan.unit_csr"]),
)
OWN = ("assign", "units", "rank_plan", "features")


def _whole(drafter, raw, m: int, repeat: int):
    """(the whole plan, its phases' thread CPU [min over runs], the total's min)."""
    from sparsebalance_megatron.batching import plan as plan_mod
    from sparsebalance_megatron.megatron.step import checks

    prof = PhaseProfile([(k, t) for k, _, t in WHOLE])
    best, total, batch = {}, float("inf"), None
    with prof:                  # (the functions looked up inside: the profile wraps them)
        for _ in range(repeat):
            prof.reset()
            c0 = time.thread_time()
            segs = plan_mod.checked_segments(list(raw))
            given = checks.segment_counts(segs)
            batch = drafter.pack(segs, m)
            drafter.checked(segs, batch, given)
            t = time.thread_time() - c0
            split = prof.split(t)
            total = min(total, t)
            best = {k: min(best.get(k, np.inf), v) for k, v in split.items()}
    return batch, best, total


def _own(lm, kw: dict, segs, agreed, rank: int, whole, repeat: int) -> dict:
    """Rank ``rank``'s own packing by part (the min over ``repeat`` runs of each)."""
    from sparsebalance_megatron.batching.packing import sab_assignment

    best = dict.fromkeys(OWN + ("total",), np.inf)
    for _ in range(repeat):
        c = time.thread_time
        t0 = c()
        asg = sab_assignment(segs, **kw)
        t1 = c()
        mine = asg.units([rank])
        t2 = c()
        plan = asg.rank_plan(mine, agreed)
        t3 = c()
        lm.unit_features(plan.unit_csr(with_padding=True))
        t4 = c()
        for k, v in zip(OWN + ("total",), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            best[k] = min(best[k], v)
    if plan.micro_batches[0] != whole.micro_batches[rank] \
            or plan.predicted_rank_cost_s[0] != whole.predicted_rank_cost_s[rank]:
        raise SystemExit(f"rank {rank}: its own plan is not row {rank} of the whole plan")
    return best


def measure(dp: int, m: int, pp: int, repeat: int, seq: int = 32768) -> dict:
    from sparsebalance_megatron.batching.packing import latency_sample_cost_fn, sab_assignment
    from sparsebalance_megatron.batching.plan import checked_segments
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels

    from ._drafts import make_drafter

    warm_up_kernels()
    sb = SparseBalanceConfig(sparse_balance=True)               # the default flags
    corpus = corpus_steps(dp, m, sb.density, 1, seq=seq, layout="best", pp=pp)
    lm, raw = corpus.lm, corpus.segments[0]
    drafter = make_drafter(lm, sb, dp, seq)
    gc.collect()
    gc.disable()
    try:
        whole, phases, total = _whole(drafter, raw, m, repeat)
        segs = checked_segments(raw)
        kw = dict(dp=dp, num_microbatches=m, max_tokens=seq, sensitivity=drafter.tracker,
                  cost_fn=latency_sample_cost_fn(lm, sb.density), seed=sb.seed,
                  long_sample_policy=sb.long_sample_policy, length_multiple=sb.length_multiple)
        asg = sab_assignment(segs, **kw)
        agreed = asg.agree(asg.units())                          # the other ranks' part
        c = agreed.candidates
        critical = int(c.ranks[np.argmax(c.span_s)]) if c is not None else 0
        ranks = sorted({0, dp // 2, dp - 1, critical})
        own = {r: _own(lm, kw, segs, agreed, r, whole, repeat) for r in ranks}
    finally:
        gc.enable()
    slowest = max(own, key=lambda r: own[r]["total"])
    return {"dp": dp, "m": m, "pp": pp, "seq": seq, "layout": lm.layout.describe(),
            "segments": len(raw), "whole_s": total, "whole_phases_s": phases,
            "own_s": {str(r): v for r, v in own.items()}, "own_max_s": own[slowest]["total"],
            "own_slowest_rank": slowest, "critical_rank": critical,
            "candidates": None if c is None else c.ranks.size}


def main(argv=None) -> int:
    p = parser(__doc__, "sab_ranks")
    p.add_argument("--dp", default="512,1024,2048,4096", help="DP sizes, comma-separated")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3, help="runs of each (thread CPU: the min)")
    p.add_argument("--seq", type=int, default=32768, help="tokens per micro-batch")
    a = p.parse_args(argv)
    points = []
    for dp in (int(x) for x in a.dp.split(",")):
        pt = measure(dp, a.microbatches, a.pp, a.repeat, a.seq)
        points.append(pt)
        print(f"DP {dp}: {pt['segments']} segments, whole {1e3 * pt['whole_s']:.1f} ms, own "
              f"{1e3 * pt['own_max_s']:.1f} ms (slowest of ranks {sorted(pt['own_s'])})",
              flush=True)
    _print(points)
    write_result(a.json, {"clock": "thread CPU time, the collector paused; each figure the "
                                   "minimum over --repeat runs",
                          "whole_phases": {k: w for k, w, _ in WHOLE}, "points": points})
    return 0


def _print(points: list) -> None:
    print(f"{'thread CPU ms (min)':<22}" + "".join(f"{q['dp']:>9}" for q in points))
    for k, _, _ in WHOLE:
        print(f"  {k:<20}" + "".join(f"{1e3 * q['whole_phases_s'][k]:9.1f}" for q in points))
    print(f"  {'other':<20}" + "".join(f"{1e3 * q['whole_phases_s']['other']:9.1f}"
                                       for q in points))
    print(f"{'whole batch':<22}" + "".join(f"{1e3 * q['whole_s']:9.1f}" for q in points))
    for k in OWN:
        print(f"  own {k:<16}" + "".join(
            f"{1e3 * q['own_s'][str(q['own_slowest_rank'])][k]:9.1f}" for q in points))
    print(f"{'own rank (slowest)':<22}" + "".join(f"{1e3 * q['own_max_s']:9.1f}"
                                                 for q in points))
