"""The plugin's per-step planning and control plane on the per-rank path, 32 to 16,384 GPUs, against
issue 77's targets (BENCHMARKS.md, "Control plane"): a rank's draft by phase, the bytes each rank
receives, the after-step work and handoff, and the critical path at ``--sb-planner process``."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import replace

import numpy as np

from .common import median_ms, parser, write_result

SEQ = 32768
D0 = 0.5
TARGET_SHARE = 0.005
TARGET_DRAFT_S = 0.050
WORK = ("draft_s", "after_step_s", "handoff_s")
MAX_WORLD = 16384       # the GPUs the table reaches
PP8_DP = 512            # the DP size a rank's draft is also measured at with PP 8


def measure_point(dp: int, m: int = 16, pp: int = 4, seq: int = SEQ, rank=None) -> dict:
    """One shape: a rank's draft by phase (``drafts.rank_step``), the sizes its bytes are
    priced from, the after-step work, the handoff and the static step (module docstring)."""
    from multiprocessing.reduction import ForkingPickler

    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.sim import pipeline_makespan_s

    from sparsebalance_megatron.megatron.step.checks import doc_lengths
    from sparsebalance_megatron.megatron.step.record import doc_slots

    from .drafts import make_drafter, rank_after_step, rank_step

    sb = SparseBalanceConfig(sparse_balance=True)      # the default flags
    corpus = corpus_steps(dp, m, sb.density, 1, seq=seq, layout="best", pp=pp)
    lm, raw = corpus.lm, corpus.segments[0]
    drafter = make_drafter(lm, sb, dp, seq)
    q = rank_step(drafter, raw, m, rank)
    costs = q.pop("costs")
    idx = np.searchsorted(costs.densities, np.full(costs.shape, D0) - 1e-12)
    f, b = costs.at(idx)
    step_s = float(pipeline_makespan_s(f, b, lm.p2p_s, pp=lm.layout.pp).max())
    # the after-step work on the committed plan (SAB's), as end_step runs it per rank
    dens, own, own_units = q.pop("densities"), q.pop("own"), q.pop("own_units")
    r = q["rank"]
    predicted = lm.busy_s(q.pop("units"), dens)[r:r + 1]                # its own rows
    q.pop("batch")
    rng = np.random.default_rng(0)
    ids = doc_slots(own)[0]
    update = (ids, doc_lengths(own, ids), rng.uniform(1, 6, ids.size))   # its own documents
    segments = np.asarray(raw, dtype=np.int64)                          # the sampler's array
    gc.collect()
    gc.disable()                        # the collector paused, as for the draft
    try:                                # the min of 2 (a fresh tracker each), then the handoff
        after = min(rank_after_step(lm, sb, own, own_units, dens[r:r + 1], predicted, r,
                                    SensitivityTracker(), rng) for _ in range(2))
        req = ("draft", dict(iteration=1, first_bin=0, segments=segments, num_microbatches=m,
                             with_dst=False, rank=q["rank"], latency=lm.calibration_state(),
                             tracker=("updates", [update])))
        c0 = time.thread_time()
        blob = ForkingPickler.dumps(req)
        handoff = time.thread_time() - c0
    finally:
        gc.enable()
    return dict(q, dp=dp, m=m, pp=pp, layout=lm.layout.describe(),
                virtual_stages=int(dens.shape[2]), static_step_s=step_s, after_step_s=after,
                handoff_s=handoff, handoff_bytes=len(blob))


def rank_bytes(tp: int, pp: int, dp: int, m: int, q: dict, docs: int) -> list:
    """Every collective a rank takes part in per step on the per-rank path (module docstring):
    ``name``, ``where`` (draft: overlapped; step: on the critical path), ``grows`` (with DP),
    ``bytes`` received per rank (exact), ``seconds`` (``collective_s``). ``q``: a measured
    point's sizes (its rounds, row, units, candidates)."""
    out = []

    def add(name, where, grows, kind, n, stride, payload, received):
        out.append({"name": name, "where": where, "grows": grows, "bytes": int(received),
                    "seconds": collective_s(kind, n, stride, payload) if n > 1 else 0.0})

    def rounds(name, nb):                   # one all-reduce of each of ``nb`` bytes
        out.append({"name": name, "where": "draft", "grows": False,
                     "bytes": int(round(ar * sum(nb))), "count": len(nb),
                     "seconds": sum(collective_s("allreduce", dp, tp, x) for x in nb)})

    ar = 2.0 * (dp - 1) / dp                # a ring all-reduce: what a rank receives per byte
    for op in ("sum", "max"):
        rounds(f"dst.rounds.{op}", [8 * sum(r[op].values()) for r in q["rounds"] if r[op]])
    add("dst.step_max", "draft", False, "allreduce", dp, tp, 8, 2 * ar * 8)
    out[-1]["seconds"] *= 2                          # one per packing
    from sparsebalance_megatron.policy.agreed_stats import BINS, ERRORS_PER_RANK, EXACT_VALUES

    # the straggler test's and the 'auto' headroom's medians: each rank's own factors and
    # errors gathered where the group's fit the exact block, else two summed histograms
    if dp * max(pp, ERRORS_PER_RANK) <= EXACT_VALUES:
        add("dst.agreed_stats", "draft", False, "allgather", dp, tp,
            8 * dp * (pp + 2 * ERRORS_PER_RANK), 8 * (dp - 1) * (pp + 2 * ERRORS_PER_RANK))
    else:
        add("dst.agreed_stats", "draft", False, "allreduce", dp, tp, 16 * (BINS + 2),
            ar * 16 * (BINS + 2))
    add("sab.fits", "draft", False, "allreduce", dp, tp, 8, ar * 8)
    # the candidates from every rank's makespan: the range, refinements, hash-slot gathers
    for op in ("sum", "max"):
        rounds(f"sab.candidate_rounds.{op}", [8 * r[op] for r in q["span_rounds"] if r[op]])
    from sparsebalance_megatron.batching.slots import PARTNERS, ROUNDS

    cand = min(2 * (2 * ROUNDS + PARTNERS + 1), dp) * (q["unit_floats"] + docs) * 8
    add("sab.candidates", "draft", False, "allreduce", dp, tp, cand, ar * cand)
    # every rank's committed rows (densities, sensitivities): only what --sb-metrics-file records
    add("rows (--sb-metrics-file only)", "off", True, "allgather", dp, tp,
        8 * q["row_floats"] * dp, 8 * q["row_floats"] * (dp - 1))
    cell, _ = record_shapes(dp, pp, m, docs)
    add("record.tp", "step", False, "allgather", tp, 1, tp * cell.nbytes, (tp - 1) * cell.nbytes)
    add("record.pp", "step", False, "allgather", pp, tp * dp, pp * cell.nbytes,
        (pp - 1) * cell.nbytes)
    # the DP level: its line's sums (loss, tokens, violations, planner events) and maxima (step
    # time, fallback, a packing that differed); every line only for --sb-metrics-file or an error
    add("record.dp", "step", False, "allreduce", dp, tp, 8 * 4, ar * 8 * 4)
    out[-1]["seconds"] += collective_s("allreduce", dp, tp, 8 * 3) if dp > 1 else 0.0
    out[-1]["bytes"] += int(round(ar * 8 * 3))
    for op in ("sum", "max"):     # the report's figures: its sums and maxima, a fixed size
        nb = 8 * q["report_floats"][op]
        add(f"report.{op}", "step", False, "allreduce", dp, tp, nb, ar * nb)
    return out


def power_fit(x, y) -> dict:
    """y = c x^k by least squares in log-log: the exponent ``k`` and ``c``."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    k, logc = np.polyfit(lx, ly, 1)
    return {"exponent": float(k), "coefficient": float(np.exp(logc))}


def log_fit(x, y) -> dict:
    """y = a + b log2 x by least squares, and the largest relative residual."""
    lx, y = np.log2(np.asarray(x, float)), np.asarray(y, float)
    b, a = np.polyfit(lx, y, 1)
    return {"a": float(a), "b_per_doubling": float(b),
            "max_rel_residual": float(np.max(np.abs(a + b * lx - y) / y))}


def ladder(max_world: int, tps=(8, 4, 1), dp_min: int = 32) -> list:
    """(tp, pp, dp) of the table: TP 8, 4 and 1 x PP 4 or 8 x DP 32, 64, ... within
    ``max_world`` ranks."""
    return [(tp, pp, dp) for tp in tps for pp in (4, 8)
            for dp in (2 ** k for k in range(int(math.log2(dp_min)), 15))
            if tp * pp * dp <= max_world]


def simulator_rows(rows: list) -> list:
    """The critical path's control plane per step (the record gather: network and host) by
    world size and micro-batches for the simulated studies (``experiments/plugin_cost.py``
    reads ``world_size``, ``microbatches``, ``gather_ms``, ``broadcast_ms``): the TP 1 x PP 4
    rows. ``broadcast_ms`` is 0: the plan broadcast is gone (the rows are gathered inside the
    overlapped draft)."""
    return [{"world_size": r["world"], "microbatches": r["m"], "tp": r["tp"], "pp": r["pp"],
             "dp": r["dp"], "gather_ms": 1e3 * r["critical_path_parts_s"]["record_gather"],
             "broadcast_ms": 0.0, "bytes_per_rank": r["bytes_per_rank"]}
            for r in rows if r["tp"] == 1 and r["pp"] == 4]


def build_rows(points: list, max_world: int, m: int, repeats: int) -> tuple:
    """The table (every ladder shape) from the measured points, and the fits."""
    four = sorted((q for q in points if q["pp"] == 4), key=lambda q: q["dp"])
    fits = {k: power_fit([q["dp"] for q in four], [q[k] for q in four]) for k in WORK}
    at = {(q["dp"], q["pp"]): q for q in points}
    pairs = [(q, at[q["dp"], 4]) for q in points if q["pp"] == 8 and (q["dp"], 4) in at]
    pp_ratio = {k: float(np.median([a[k] / b[k] for a, b in pairs])) if pairs else 1.0
                for k in WORK}
    rows = []
    for tp, pp, dp in ladder(max_world):
        q = at.get((dp, pp))
        near = min([p for p in points if p["pp"] == pp] or four,
                   key=lambda p: abs(math.log(p["dp"] / dp)))    # sizes and step of the nearest
        work = {k: q[k] if q else fits[k]["coefficient"] * dp ** fits[k]["exponent"]
                * (pp_ratio[k] if pp == 8 else 1.0) for k in WORK}
        docs = near["docs_max"]
        coll = rank_bytes(tp, pp, dp, m, near, docs)
        cpu = tensor_cpu_s(dp, pp, tp, m, docs, repeats)
        record = sum(c["seconds"] for c in coll if c["where"] == "step") + cpu   # + report
        agree = sum(c["seconds"] for c in coll if c["where"] == "draft")
        step_s = near["static_step_s"]
        draft_wall = work["draft_s"] + agree
        parts = {"record_gather": record, "handoff": work["handoff_s"],
                 "after_step": work["after_step_s"],
                 "draft_past_the_step": max(0.0, draft_wall - step_s)}
        crit = sum(parts.values())
        rows.append({"tp": tp, "pp": pp, "dp": dp, "m": m, "world": tp * pp * dp,
                     "docs_per_dp_rank": docs, "measured": q is not None, "work": work,
                     "agreement_s": agree, "draft_wall_s": draft_wall,
                     "collectives": coll, "record_cpu_s": cpu,
                     "bytes_per_rank": sum(c["bytes"] for c in coll if c["where"] != "off"),
                     "bytes_fixed": sum(c["bytes"] for c in coll
                                        if c["where"] != "off" and not c["grows"]),
                     "bytes_growing": sum(c["bytes"] for c in coll
                                          if c["where"] != "off" and c["grows"]),
                     "step_s": step_s, "critical_path_s": crit, "critical_path_parts_s": parts,
                     "share_of_step": crit / step_s})
    return rows, fits, pp_ratio


def targets(rows: list, points: list) -> dict:
    """Issue 77's targets, each with the figure and met or not."""
    four = sorted((q for q in points if q["pp"] == 4 and q["m"] == 16), key=lambda q: q["dp"])
    out = {}
    q = next((p for p in four if p["dp"] == 4096), None)
    if q:
        out["draft_at_dp4096_pp4"] = {"value_s": q["draft_s"], "target_s": TARGET_DRAFT_S,
                                      "met": q["draft_s"] <= TARGET_DRAFT_S}
    if len(four) > 1:
        dps = [p["dp"] for p in four]
        lo, hi = four[0], four[-1]
        ratio = hi["draft_s"] / lo["draft_s"]
        log_ratio = math.log(hi["dp"]) / math.log(lo["dp"])
        out["draft_growth"] = {
            "power": power_fit(dps, [p["draft_s"] for p in four]),
            "log": log_fit(dps, [p["draft_s"] for p in four]),
            "ratio": ratio, "log_dp_ratio": log_ratio, "met": ratio <= log_ratio,
            "phases": {k: power_fit(dps, [max(p["phases_s"][k], 1e-7) for p in four])
                       for k in four[0]["phases_s"]}}
    for tp in (1, 8):
        r = next((r for r in rows if r["world"] == 16384 and r["tp"] == tp and r["pp"] == 4),
                 None)
        if r:
            out[f"critical_path_16384_tp{tp}_pp4"] = {"share": r["share_of_step"],
                                                      "target": TARGET_SHARE,
                                                      "met": r["share_of_step"] <= TARGET_SHARE}
    growing = sorted({c["name"] for r in rows for c in r["collectives"]
                      if c["grows"] and c["where"] != "off"})
    out["bytes_independent_of_dp"] = {"met": not growing, "growing": growing}
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "control_plane")
    args = p.parse_args(argv)
    from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels

    m, points = 16, []
    warm_up_kernels()
    measure_point(2, m, 4)                                 # compiles every kernel once
    for dp, pp in [(dp, 4) for dp in (32, 128, 512, 2048, 4096)] + [(PP8_DP, 8)]:
        q = measure_point(dp, m, pp)
        points.append(q)
        print(f"DP {dp} x PP {pp}: a rank's draft {q['draft_s'] * 1e3:.1f} ms ("
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in q["phases_s"].items())
              + f"), after the step {q['after_step_s'] * 1e3:.1f} ms, handoff "
              f"{q['handoff_s'] * 1e3:.1f} ms, step {q['static_step_s']:.3f} s; a rank's DST "
              f"over ranks: median {q['dst_rank_s']['median'] * 1e3:.1f}, p99 "
              f"{q['dst_rank_s']['p99'] * 1e3:.1f}, max {q['dst_rank_s']['max'] * 1e3:.1f} ms "
              f"(one run's phase maxima: " + ", ".join(
                  f"{x * 1e3:.1f}" for x in q['dst_rank_s']['single_run_phase_maxima'])
              + " ms)", flush=True)
    rows, fits, pp_ratio = build_rows(points, MAX_WORLD, m, repeats=1)
    tg = targets(rows, points)
    _print(rows, tg)
    if args.json:
        write_result(args.json, {
            "model": MODEL, "seq": SEQ, "d0": D0, "microbatches": m,
            "points": points, "table": rows, "rows": simulator_rows(rows),
            "growth": {"in_dp_pp4": fits, "pp8_over_pp4": pp_ratio}, "targets": tg,
            "clock": "a rank's work: thread CPU time, the collector paused (DST: each phase's "
                     "maximum over the DP ranks); network: NCCL's alpha-beta model (MODEL)"})
    return 0


def _print(rows: list, tg: dict) -> None:
    print(f"{'TP':>3} {'PP':>3} {'DP':>5} {'GPUs':>6} | {'draft ms':>9} {'agree ms':>8} | "
          f"{'KB/rank':>8} {'fixed':>7} {'grows':>8} | {'after':>6} {'gather':>7} "
          f"{'crit ms':>8} {'% step':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>5} {r['world']:>6} | "
              f"{r['work']['draft_s'] * 1e3:>8.1f}{'' if r['measured'] else '*'} "
              f"{r['agreement_s'] * 1e3:>8.2f} | {r['bytes_per_rank'] / 1e3:>8.1f} "
              f"{r['bytes_fixed'] / 1e3:>7.1f} {r['bytes_growing'] / 1e3:>8.1f} | "
              f"{r['work']['after_step_s'] * 1e3:>6.1f} "
              f"{r['critical_path_parts_s']['record_gather'] * 1e3:>7.2f} "
              f"{r['critical_path_s'] * 1e3:>8.2f} {100 * r['share_of_step']:>7.3f}")
    print("(* fitted in DP)")
    for k, v in tg.items():
        print(f"target {k}: " + ", ".join(f"{a}={b}" for a, b in v.items() if a != "phases"))


# ---- the pricing: records, NCCL's alpha-beta model, the record path's host CPU ---------------

GPUS_PER_NODE = 8

# NCCL's tuner, NVIDIA/nccl src/graph/tuning.cc (ncclTunerConstantsDefaults, ncclTopoTuneModel,
# getNetOverhead; latencies in us). Bandwidths: DGX H100, NVLink 4 (450 GB/s a direction, ~360
# GB/s of ring bus bandwidth in nccl-tests) and one 400 Gb/s NDR InfiniBand port per GPU (50
# GB/s line rate, ~45 GB/s bus bandwidth); LL caps at llMaxBws (Hopper one node 141, several
# nodes of Intel x86 20.4 GB/s). ``host_us``: copying a small record to the GPU and back and
# waiting for it (two cudaMemcpy of a few KB, ~10 us each: an assumption, not measured here).
# An all-reduce is the cheaper of the ring and the tree (latency base + 2 x (intra-node hops x
# NVLink's + log2 nodes x the network tree's); the tree's base latency taken as the ring's).
MODEL = {
    "source": "NVIDIA/nccl src/graph/tuning.cc: ncclTunerConstantsDefaults, ncclTopoTuneModel",
    "base_lat_us": {"LL": 6.6, "Simple": 8.4},             # baseLatencies, Ring
    "nvlink_lat_us": {"LL": 0.6, "Simple": 3.4},           # hwLatencies NVLINK, Ring
    "net_ring_lat_us": {"LL": 2.7, "Simple": 14.0},        # hwLatencies NET, Ring
    "net_tree_lat_us": {"LL": 5.0, "Simple": 14.0},        # NET, Tree: inter latency at 1 GPU/node
    "net_overhead_us": 1.0,                                # getNetOverhead, x86 Intel (x3 Simple)
    "bus_gbps": {"intra": 360.0, "inter": 45.0},           # Simple ring bus bandwidth
    "ll_max_gbps": {"intra": 141.0, "inter": 20.4},        # llMaxBws: Hopper N1, Intel N4
    "ll_bw_factor": 0.5,                                   # Ring/LL: busBw * .5
    "tree_bw_factor": 0.92 * 0.5,                          # Tree: busBw * .92, allreduce's .5
    "host_us": 20.0,
    "gpus_per_node": GPUS_PER_NODE,
}


# --- the alpha-beta model ----------------------------------------------------------------------

def _placement(n: int, stride: int) -> tuple:
    """(nodes, GPUs per node) of a group of ``n`` ranks ``stride`` apart in Megatron's order."""
    per = max(1, min(n, GPUS_PER_NODE // stride)) if stride < GPUS_PER_NODE else 1
    return math.ceil(n / per), per


def collective_s(kind: str, n: int, stride: int, nbytes: float, model=MODEL) -> float:
    """Seconds of one ring ``allgather`` (``nbytes``: every rank's part, all of it) or
    ``allreduce`` (``nbytes``: the vector) over ``n`` ranks ``stride`` apart, as NCCL's tuner prices it (the cheaper of LL and Simple),
    plus the host's copies."""
    if n <= 1:
        return 0.0
    nodes, ppn = _placement(n, stride)
    best = math.inf
    for p in ("LL", "Simple"):
        intra = model["nvlink_lat_us"][p]
        inter = (model["net_tree_lat_us"] if ppn == 1 else model["net_ring_lat_us"])[p]
        if nodes > 1:
            over = model["net_overhead_us"] * (3 if p == "Simple" else 1)
            intra = max(intra, over)
        where = "inter" if nodes > 1 else "intra"
        bus = model["bus_gbps"][where]
        if p == "LL":
            bus = min(model["ll_max_gbps"][where], bus * model["ll_bw_factor"])
        if kind == "allgather":
            steps, inter_steps = n - 1, nodes - 1
            lat = model["base_lat_us"][p] + (steps - inter_steps) * intra + inter_steps * inter
            alg = bus * n / steps
        elif kind == "allreduce":     # ring (reduce-scatter, all-gather) or tree, the cheaper
            steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
            lat = model["base_lat_us"][p] + (steps - inter_steps) * intra + inter_steps * inter
            alg = bus * n / steps
            tree = model["base_lat_us"][p] + 2 * ((ppn - 1) * model["nvlink_lat_us"][p]
                                                  + math.log2(nodes) * model["net_tree_lat_us"][p])
            best = min(best, tree * 1e-6 + nbytes / (bus * model["tree_bw_factor"] * 1e9))
        else:
            raise ValueError(f"collective {kind!r}: expected allgather or allreduce")
        best = min(best, lat * 1e-6 + nbytes / (alg * 1e9))
    return best + model["host_us"] * 1e-6


def record_shapes(dp: int, pp: int, m: int, docs: int):
    """(cell RecordShape, line RecordShape) of a step, as the runtime sizes them at the default
    flags (no per-interval detail: no --sb-metrics-file; a tracker: documents travel)."""
    from sparsebalance_megatron.megatron.step.record import RecordShape

    cell = RecordShape(1, m, 0, docs)
    return cell, cell.with_stages(pp)


# --- host CPU of the record gather, measured --------------------------------------------------

def tensor_cpu_s(dp: int, pp: int, tp: int, m: int, docs: int, repeats: int = 3) -> float:
    """One rank's host seconds of the record's path on the critical path: encode, combine its
    cell's TP records, join its pipeline, split its documents off and decode its own line (the
    DP level's sums and maxima are collectives)."""
    from sparsebalance_megatron.megatron.step.record import (RankReport, RecordShape,
                                                              combine_cell, decode_step,
                                                              encode_rank, join_pipeline,
                                                              split_docs)

    cell_shape, line_shape = record_shapes(dp, pp, m, docs)
    # the step's shape with random values (sizes and layout matter here, not the numbers)
    rng, own = np.random.default_rng(0), np.arange(docs)          # DP rank 0's document slots
    report = RankReport(0, pp - 1, 12345, fwd_s=rng.uniform(0, 1, m).tolist(),
                        bwd_s=rng.uniform(0, 1, m).tolist(), units=[(j, pp - 1) for j in range(m)],
                        step_s=2.0, loss=(1.0, 2.0), doc_values={int(d): (1.0, 2.0) for d in own})

    def cell_of(s: int) -> np.ndarray:
        rep = replace(report, pp=s)
        return combine_cell(np.stack([encode_rank(rep, cell_shape, own)] * tp), cell_shape)

    cells = np.stack([cell_of(s) for s in range(pp)])
    bare = RecordShape(line_shape.stages, line_shape.timed, line_shape.units)

    def gather():
        combine_cell(np.stack([encode_rank(report, cell_shape, own)] * tp), cell_shape)
        line = join_pipeline(cells, cell_shape)
        decode_step(split_docs(line, line_shape, own)[0][None], bare, ())

    return median_ms(gather, repeats, warmup=1, cuda=False, clock=time.thread_time) / 1e3
