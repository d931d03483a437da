"""Simulator study of DST and SAB (issues 4 and 5): DP ranks x PP=4 on the real length mix.

For every DP size and a few global batches (steps), the real corpus (CPython stdlib + Shakespeare,
qwen tokenizer; ``data.load_corpus``) is cut into global batches by the data pipeline's
``GlobalBatchSampler`` (sequential fill of dp x m micro-batches of --seq-length tokens), packed
by Megatron's sequential order or by SAB, timed by the latency model (default: the analytic
Qwen2.5-0.5B / 32K-token / H100 table, ``LatencyModel.analytic``; or a profiled table with
--table) and stepped through the 1F1B simulator (``sparsebalance_megatron.sim.study``). Variants:

- ``static``: sequential packing, every unit at d0 (static sparse attention; the baseline);
- ``dst_<anchor>``: sequential packing + DST with that anchor (mean, median, min, max);
- ``token_balanced``: length-aware balancer at d0; ``sab``: SAB at d0; ``sab_dst``: SAB + DST.

Per variant: step time summed over the steps, speedup vs static, imbalance (max / mean of the
per-rank makespans, averaged over steps), bubble fraction, mean density weighted by dense
attention work. Sensitivities come from the length prior (nothing has been measured in a
simulation). Prints a table; ``--json PATH`` writes everything.

    python scripts/bench_sim_study.py --json sim_study.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from sparsebalance_megatron.data import load_corpus
from sparsebalance_megatron.latency import LatencyModel
from sparsebalance_megatron.sim.study import StudyConfig, format_table, run_config

ANCHORS = ("mean", "median", "min", "max")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="DP sizes of the DST anchor study")
    p.add_argument("--sab-ranks", type=int, nargs="+", default=[8, 32, 256],
                   help="DP sizes of the SAB / SAB+DST comparison")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--seq-length", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--density", type=float, default=0.5, help="d0")
    p.add_argument("--min-density", type=float, default=0.125)
    p.add_argument("--max-density", type=float, default=1.0)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=3, help="global batches per configuration")
    p.add_argument("--table", default=None, help="profiled latency table (JSON); default: "
                   "the analytic Qwen2.5-0.5B H100 table")
    p.add_argument("--table-force", action="store_true")
    p.add_argument("--tokenizer", default="qwen")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="ranks 8 32, sab-ranks 8 32, 1 step")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def study_config(args) -> StudyConfig:
    return StudyConfig(microbatches=args.microbatches, seq_length=args.seq_length,
                       density=args.density, min_density=args.min_density,
                       max_density=args.max_density, tolerance=args.tolerance, steps=args.steps,
                       seed=args.seed)


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.ranks, args.sab_ranks, args.steps = [8, 32], [8, 32], 1
    if args.table:
        lm = LatencyModel.load(args.table, force=args.table_force)
        source = f"table {args.table} ({lm.table.get('device')})"
    else:
        lm = LatencyModel.analytic(pp=args.pp)
        source = "ANALYTIC Qwen2.5-0.5B / 32K / H100 table (published throughputs, not measured)"
    if lm.pp != args.pp:
        sys.exit(f"--table has pp={lm.pp}: expected --pp {args.pp}")
    corpus = load_corpus(tokenizer=args.tokenizer)
    lengths = np.asarray(corpus.lengths, dtype=np.int64)
    cfg = study_config(args)
    print(f"latency: {source}\ncorpus: {corpus!r}\npp={args.pp} m={args.microbatches} "
          f"seq_length={args.seq_length} d0={args.density} [{args.min_density}, "
          f"{args.max_density}] tolerance={args.tolerance} steps={args.steps}")
    t0 = time.perf_counter()
    anchors = {str(dp): run_config(dp, cfg, lm, lengths,
                                   ["static"] + [f"dst_{a}" for a in ANCHORS])
               for dp in args.ranks}
    print(format_table("DST anchors (sequential packing)", anchors))
    sab = {str(dp): run_config(dp, cfg, lm, lengths,
                               ["static", "token_balanced", "sab", "dst_mean", "sab_dst"])
           for dp in args.sab_ranks}
    print(format_table("SAB and SAB+DST (DST anchor mean)", sab))
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"},
               "latency_source": source, "corpus": corpus.stats(),
               "anchors": anchors, "sab": sab}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
