"""The step's control plane priced (``control_plane``'s study): the fixed-size records of the
per-step gather (``step/exchange.py``) and any collective a rank takes part in, for one step of a
given shape.

- the records' shapes at the default flags (``record_shapes``), from which the study counts the
  bytes each rank receives, exact;
- network seconds under an alpha-beta model with NCCL's constants (``MODEL``: every constant and
  where it comes from; ``collective_s`` prices one ring all-gather or all-reduce);
- the host CPU of the record's path, measured here (thread CPU time): encoding, combining and
  decoding the records (``tensor_cpu_s``).
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


def _synthetic_step(dp: int, pp: int, m: int, docs: int, rng):
    """A rank's RankReport and every DP rank's document slots of the step's shape (random
    values: sizes and layout matter here, not the numbers)."""
    from sparsebalance_megatron.megatron.step.record import RankReport

    slots = [np.arange(r * docs, (r + 1) * docs) for r in range(dp)]
    report = RankReport(0, pp - 1, 12345, fwd_s=rng.uniform(0, 1, m).tolist(),
                        bwd_s=rng.uniform(0, 1, m).tolist(), units=[(j, pp - 1) for j in range(m)],
                        step_s=2.0, loss=(1.0, 2.0),
                        doc_values={int(d): (1.0, 2.0) for d in slots[0]})
    return report, slots


def tensor_cpu_s(dp: int, pp: int, tp: int, m: int, docs: int, repeats: int = 3) -> float:
    """One rank's host seconds of the record's path on the critical path: encode, combine its
    cell's TP records, join its pipeline, split its documents off and decode its own line (the
    DP level's sums and maxima are collectives)."""
    from sparsebalance_megatron.megatron.step.record import (RecordShape, combine_cell,
                                                              decode_step, encode_rank,
                                                              join_pipeline, split_docs)

    cell_shape, line_shape = record_shapes(dp, pp, m, docs)
    report, slots = _synthetic_step(dp, pp, m, docs, np.random.default_rng(0))

    def cell_of(s: int) -> np.ndarray:
        rep = replace(report, pp=s)
        return combine_cell(np.stack([encode_rank(rep, cell_shape, slots[0])] * tp), cell_shape)

    cells = np.stack([cell_of(s) for s in range(pp)])
    bare = RecordShape(line_shape.stages, line_shape.timed, line_shape.units)

    def gather():
        combine_cell(np.stack([encode_rank(report, cell_shape, slots[0])] * tp), cell_shape)
        line = join_pipeline(cells, cell_shape)
        decode_step(split_docs(line, line_shape, slots[0])[0][None], bare, ())

    return _median_s(gather, repeats)
