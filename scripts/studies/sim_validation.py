"""Validate the 1F1B simulator against a real torchrun run: simulated vs measured step time (the
simulator fed every rank's measured per-micro-batch times; docs/benchmarks/latency-model.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .common import ROOT, parser, torchrun, write_result

P2P_S = 0.0          # the p2p latency given to the simulator (every documented run)
ENTRY = os.path.join(ROOT, "examples", "pretrain_gpt_sparsebalance.py")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--") if "--" in argv else len(argv)      # the entry's flags after "--"
    own, rest = argv[:i], argv[i + 1:]
    p = parser(__doc__, "sim_validation", json_required=True)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args(own)

    from sparsebalance_megatron.megatron.launch.profile import device_name
    from sparsebalance_megatron.sim import simulate_1f1b

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [*torchrun(args.nproc), ENTRY, *rest, "--sb-metrics-file", str(metrics)]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            return proc.returncode
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    records = []
    for r in lines:
        f = np.asarray(r["microbatch_fwd_s"], dtype=np.float64)     # [dp, m, pp]
        b = np.asarray(r["microbatch_bwd_s"], dtype=np.float64)
        if not (np.isfinite(f).all() and np.isfinite(b).all()):
            continue
        sim = simulate_1f1b(f, b, P2P_S)
        measured = r["step_time_s"]
        records.append({"step": r["step"], "measured_s": measured,
                        "simulated_s": sim.step_time_s,
                        "error": (sim.step_time_s - measured) / measured,
                        "bubble_fraction": sim.bubble_fraction,
                        "fwd_s": f.tolist(), "bwd_s": b.tolist()})
    steady = records[1:] or records          # the first step pays for warm-up
    err = np.array([r["error"] for r in steady])
    dp, m, pp = np.asarray(lines[0]["microbatch_fwd_s"]).shape
    result = {"device": device_name(), "dp": int(dp), "pp": int(pp), "p2p_s": P2P_S,
              "n_steps": len(steady), "mean_abs_error": float(np.mean(np.abs(err))),
              "mean_error": float(np.mean(err)), "max_abs_error": float(np.max(np.abs(err))),
              "entry_args": rest, "steps": records}
    print(f"{'step':>4s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s}")
    for r in records:
        print(f"{r['step']:4d} {r['measured_s']:10.3f} {r['simulated_s']:11.3f} "
              f"{100 * r['error']:6.1f}%")
    print(f"simulated vs measured schedule time over {len(steady)} steady steps: mean |error| "
          f"{100 * result['mean_abs_error']:.1f}%, mean {100 * result['mean_error']:+.1f}%, "
          f"max |error| {100 * result['max_abs_error']:.1f}% (dp={dp}, pp={pp})")
    write_result(args.json, result)
    return 0
