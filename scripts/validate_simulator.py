#!/usr/bin/env python
"""Validate the 1F1B simulator against a real torchrun run: simulated vs measured step time.

Runs the project's training entry (``sparsebalance_megatron.megatron.trainer``) and, after every
step, gathers each rank's per-micro-batch forward/backward times (Megatron's
``forward-compute`` / ``backward-compute`` timers) and the measured step time. The simulator is
fed the measured per-micro-batch times of every (dp rank, stage); its makespan is compared with
the measured step time (which also holds the optimizer step and gradient reduction, so the
simulator should come out slightly below it).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
        scripts/validate_simulator.py --json sim_validation.json -- \
        --pipeline-model-parallel-size 2 --num-layers 4 ... (the trainer's flags)

Writes ``{"steps": [...], "mean_abs_error": float, "device": str, ...}`` from rank 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    argv = sys.argv[1:]
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    else:
        own, rest = argv, []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--p2p-s", type=float, default=0.0, help="p2p latency given to the simulator")
    args = p.parse_args(own)

    from megatron.core import parallel_state as ps

    from sparsebalance_megatron.megatron import comm
    from sparsebalance_megatron.megatron.profile import device_name
    from sparsebalance_megatron.megatron.trainer import build, shutdown, train
    from sparsebalance_megatron.sim import simulate_1f1b

    state = build(rest)
    runtime = state["runtime"]
    dp, pp = ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    dp_rank, pp_rank = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    records = []
    orig_end_step = runtime.end_step

    def end_step(step_data, plan, step_s):
        out = orig_end_step(step_data, plan, step_s)
        t = runtime.last_timings or {"fwd_s": [], "bwd_s": []}
        gathered = comm.all_gather_object(
            {"dp": dp_rank, "pp": pp_rank, "fwd_s": t["fwd_s"], "bwd_s": t["bwd_s"],
             "step_s": step_s})
        if comm.rank() == 0:
            m = len(gathered[0]["fwd_s"])
            f, b = np.zeros((dp, m, pp)), np.zeros((dp, m, pp))
            for g in gathered:
                f[g["dp"], :, g["pp"]] = g["fwd_s"]
                b[g["dp"], :, g["pp"]] = g["bwd_s"]
            sim = simulate_1f1b(f, b, args.p2p_s)
            measured = max(g["step_s"] for g in gathered)
            records.append({"step": step_data.step, "measured_s": measured,
                            "simulated_s": sim.step_time_s,
                            "error": (sim.step_time_s - measured) / measured,
                            "bubble_fraction": sim.bubble_fraction,
                            "fwd_s": f.tolist(), "bwd_s": b.tolist()})
        return out

    runtime.end_step = end_step
    train(state)
    if comm.rank() == 0:
        steady = records[1:] or records          # the first step pays for warm-up
        err = np.array([r["error"] for r in steady])
        result = {"device": device_name(), "dp": dp, "pp": pp, "p2p_s": args.p2p_s,
                  "n_steps": len(steady), "mean_abs_error": float(np.mean(np.abs(err))),
                  "mean_error": float(np.mean(err)), "max_abs_error": float(np.max(np.abs(err))),
                  "trainer_args": rest, "steps": records}
        print(f"{'step':>4s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s}")
        for r in records:
            print(f"{r['step']:4d} {r['measured_s']:10.3f} {r['simulated_s']:11.3f} "
                  f"{100 * r['error']:6.1f}%")
        print(f"simulated vs measured step time over {len(steady)} steady steps: mean |error| "
              f"{100 * result['mean_abs_error']:.1f}%, mean {100 * result['mean_error']:+.1f}%, "
              f"max |error| {100 * result['max_abs_error']:.1f}% (dp={dp}, pp={pp})")
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    comm.barrier()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
