#!/usr/bin/env python
"""Fwd+bwd time of one packed micro-batch by document mix and padding layout (CPU or GPU).

Times the end-to-end bench's model (``bench_end_to_end.CpuRunConfig``: 2 layers, hidden 64,
byte vocabulary, block-sparse attention) on a few micro-batches of ``--seq-length`` tokens with
the profiler's ``time_microbatch`` (min over repeats, one process, one torch thread):

- ``doc``: one document filling the micro-batch, then 4 / 16 / 64 equal documents, at d0: how far
  apart the cheapest and the dearest micro-batch are (what there is to balance);
- ``pad``: 1,448 real tokens (two documents) padded to the micro-batch as one padding sequence,
  or as padding pieces of 64 / 128 / 256 / 512 tokens (``data.PAD_SEQ_TOKENS`` picks one).

    python scripts/bench_microbatch_mix.py --json runs/microbatch_mix.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_end_to_end import CpuRunConfig, write_json  # noqa: E402

PAD_PIECES = (None, 64, 128, 256, 512)
REAL = [945, 503]   # two documents, 1,448 tokens (a poorly filled micro-batch of the real mix)


def pieces(n: int, size: int | None) -> list[int]:
    if size is None:
        return [n] if n else []
    return [size] * (n // size) + ([n % size] if n % size else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.profile import (build_stage, device_name,
                                                         init_single_process, time_microbatch)

    torch.set_num_threads(1)
    activate_cpu_shims()
    init_single_process()
    cfg = CpuRunConfig(seq_length=args.seq_length, density=args.density)
    shape = cfg.shape()
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=cfg.block_size)
    model, dev = build_stage(shape, sb, "only", shape.num_layers)
    s = args.seq_length
    cases = [("doc", f"{n} x {s // n}", [s // n] * n) for n in (1, 4, 16, 64)]
    pad = s - sum(REAL)
    cases += [("pad", "one sequence" if k is None else f"pieces of {k}", REAL + pieces(pad, k))
              for k in PAD_PIECES]
    rows = []
    t0 = time.perf_counter()
    print(f"{device_name()}: {shape.num_layers} layers, hidden {shape.hidden_size}, seq {s}, "
          f"d {args.density}, min over {args.repeats} repeats")
    print(f"{'part':5s} {'micro-batch':22s} {'sequences':>9s} {'fwd+bwd ms':>11s}")
    for part, name, mix in cases:
        f, b = time_microbatch(model, dev, "only", shape, mix, args.density,
                               repeats=args.repeats, warmup=1, statistic="min")
        rows.append({"part": part, "case": name, "sequences": len(mix),
                     "fwd_bwd_s": f + b})
        print(f"{part:5s} {name:22s} {len(mix):9d} {1e3 * (f + b):11.1f}", flush=True)
    result = {"meta": {"command": " ".join(sys.argv), "device": device_name(),
                       "seq_length": s, "density": args.density, "repeats": args.repeats,
                       "wall_s": time.perf_counter() - t0}, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
