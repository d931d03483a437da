"""The step's control plane priced (``control_plane``'s and ``planner_phases``' studies): the
fixed-size tensor path of the per-step record gather (``step/exchange.py``) and any collective a
rank takes part in, for one step of a given shape.

- bytes each rank receives, exact, from the records' shapes at the default flags
  (``tensor_path``, ``record_shapes``);
- network seconds under an alpha-beta model with NCCL's constants (``MODEL``: every constant and
  where it comes from; ``collective_s`` prices one ring all-gather, all-reduce or broadcast);
- the host CPU of the gather, measured here (thread CPU time): encoding, combining and decoding
  the records (``tensor_cpu_s``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import numpy as np

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
    """Seconds of one ring ``allgather`` (``nbytes``: every rank's part, all of it),
    ``allreduce`` (``nbytes``: the vector) or ``broadcast`` (``nbytes``: the message) over
    ``n`` ranks ``stride`` apart, as NCCL's tuner prices it (the cheaper of LL and Simple),
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
        elif kind == "broadcast":      # a chain: every hop's latency (ring, not sameChannels)
            lat = model["base_lat_us"][p] + n * (inter if nodes > 1 else intra)
            alg = bus
        else:
            raise ValueError(f"collective {kind!r}: expected allgather, allreduce or broadcast")
        best = min(best, lat * 1e-6 + nbytes / (alg * 1e9))
    return best + model["host_us"] * 1e-6


def record_shapes(dp: int, pp: int, m: int, docs: int):
    """(cell RecordShape, line RecordShape, PlanShape) of a step, as the runtime sizes them at
    the default flags (no per-interval detail: no --sb-metrics-file; a tracker: documents and
    unit sensitivity travel; the do-no-harm baseline: two candidate packings; the planner's
    predicted busy seconds per (DP rank, pipeline rank))."""
    from sparsebalance_megatron.megatron.step.plan_record import PlanShape
    from sparsebalance_megatron.megatron.step.record import RecordShape

    cell = RecordShape(1, m, 0, docs)
    return cell, cell.with_stages(pp), PlanShape(dp, m, pp, 2, True, pp)


def tensor_path(dp: int, pp: int, tp: int, m: int, docs: int) -> dict:
    """Bytes each rank receives and modelled network seconds of the tensor path's six
    collectives (three gathers, three plan broadcasts)."""
    cell, line, plan = record_shapes(dp, pp, m, docs)
    levels = [("allgather", tp, 1, tp * cell.nbytes), ("allgather", pp, tp * dp, pp * cell.nbytes),
              ("allgather", dp, tp, dp * line.nbytes), ("broadcast", pp, tp * dp, plan.nbytes),
              ("broadcast", dp, tp, plan.nbytes), ("broadcast", tp, 1, plan.nbytes)]
    received = (tp - 1) * cell.nbytes + (pp - 1) * cell.nbytes + (dp - 1) * line.nbytes \
        + plan.nbytes * ((pp > 1) + (dp > 1) + (tp > 1))
    return {"bytes_per_rank": int(received), "record_bytes": {"cell": cell.nbytes,
                                                              "line": line.nbytes,
                                                              "plan": plan.nbytes},
            "gather_network_s": sum(collective_s(*lv) for lv in levels[:3]),
            "broadcast_network_s": sum(collective_s(*lv) for lv in levels[3:])}


# --- host CPU of the record gather, measured --------------------------------------------------

def _median_s(fn, repeats: int) -> float:
    """Median thread CPU seconds of ``fn`` after a warm-up call (CPU time: a loaded machine's
    waits for a core are not the work's)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return statistics.median(out)


def _synthetic_step(dp: int, pp: int, tp: int, m: int, docs: int, rng):
    """A rank's RankReport, every DP rank's document slots, and rank 0's plan payload of the
    step's shape (random values: sizes and layout matter here, not the numbers)."""
    from sparsebalance_megatron.megatron.step.record import RankReport
    from sparsebalance_megatron.policy.dst_band import DSTReport

    slots = [np.arange(r * docs, (r + 1) * docs) for r in range(dp)]
    report = RankReport(0, pp - 1, 12345, fwd_s=rng.uniform(0, 1, m).tolist(),
                        bwd_s=rng.uniform(0, 1, m).tolist(), units=[(j, pp - 1) for j in range(m)],
                        step_s=2.0, loss=(1.0, 2.0),
                        doc_values={int(d): (1.0, 2.0) for d in slots[0]})
    dst = DSTReport(1.0, 0.9, 0.8, 1.25, 1.3, 1.1, 0.5, 0.55, 0.5, 0.49, 3, 2, 0,
                    density_per_stage=tuple(rng.uniform(0.3, 1, pp)), quality_cost=0.01).as_dict()
    dst.update(raise_headroom=0.05, unit_sensitivity=np.round(rng.uniform(size=(dp, m)),
                                                              6).tolist(),
               stand_down={"dst_stood_down": False, "sab_stood_down": False, "packing_index": 0,
                           "predicted_step_s": [2.0, 2.1], "predicted_static_s": 2.1,
                           "predicted_dst_s": 2.0})
    return report, slots, (rng.uniform(0.25, 1, (dp, m, pp)).tolist(), dst)


def tensor_cpu_s(dp: int, pp: int, tp: int, m: int, docs: int, repeats: int = 3,
                 own_line: bool = False) -> dict:
    """One rank's host seconds of the tensor path on the critical path: ``gather_s`` (encode,
    combine its cell's TP records, join its pipeline, decode every DP rank's line; with
    ``own_line``, as a run does now, split its documents off and decode its own line alone: the
    DP level's sums and maxima are collectives) and ``broadcast_s`` (rank 0 encodes the plan,
    every rank decodes it)."""
    from sparsebalance_megatron.megatron.step.plan_record import decode_plan, encode_plan
    from sparsebalance_megatron.megatron.step.record import (RecordShape, combine_cell,
                                                              decode_step, encode_rank,
                                                              join_pipeline, split_docs)

    cell_shape, line_shape, plan_shape = record_shapes(dp, pp, m, docs)
    report, slots, payload = _synthetic_step(dp, pp, tp, m, docs, np.random.default_rng(0))

    def cell_of(r: int, s: int) -> np.ndarray:
        rep = replace(report, dp=r, pp=s, doc_values={int(d): (1.0, 2.0) for d in slots[r]})
        return combine_cell(np.stack([encode_rank(rep, cell_shape, slots[r])] * tp), cell_shape)

    cells = np.stack([cell_of(0, s) for s in range(pp)])
    lines = np.stack([join_pipeline(np.stack([cell_of(r, s) for s in range(pp)]), cell_shape)
                      for r in range(dp)])
    plan = encode_plan(*payload, plan_shape)

    bare = RecordShape(line_shape.stages, line_shape.timed, line_shape.units)

    def gather():
        combine_cell(np.stack([encode_rank(report, cell_shape, slots[0])] * tp), cell_shape)
        line = join_pipeline(cells, cell_shape)
        if own_line:
            decode_step(split_docs(line, line_shape, slots[0])[0][None], bare, ())
        else:
            decode_step(lines, line_shape, slots)

    def broadcast():
        encode_plan(*payload, plan_shape)
        decode_plan(plan, plan_shape)

    return {"gather_s": _median_s(gather, repeats), "broadcast_s": _median_s(broadcast, repeats)}
