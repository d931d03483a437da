"""sparsebalance-layout: the fastest Megatron pipeline layout, static and with SparseBalance.

From a latency table (``--latency-table``, as ``sparsebalance-profile`` writes it; or the
analytic Qwen2.5-0.5B H100 table with ``--analytic``) and a length mix (``--data-path`` with the
run's documents, ``--lengths`` with a JSON list of document lengths or a histogram
``{"length": count}``, or the built-in corpus), the whole ``--pipeline-model-parallel-layout``
space (uneven virtual chunks, empty and LM-head-only stages, vp 1-4) is searched on the same
global batches (``experiments.layout_search``), every layout over ``--device-memory-gib`` left
out. Prints the best static configurations (layout x packing; the best with Megatron's own
sequential packing too), the best layouts for ``--sparse-balance`` (densities meeting d0 and the
stage floor), the search's proven lower bound and gap, and the Megatron flags to paste.
``--json PATH`` writes everything. A search can take minutes: each part prints a line to stderr
as it starts and ends, with the seconds since the start (``--no-progress``: none).

    sparsebalance-layout --analytic --pp 4 --dp 32
    sparsebalance-layout --latency-table lat.json --pp 2 --dp 8 --data-path docs.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import numpy as np

HELP = __doc__.split("\n\n")[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsebalance-layout", description=HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--latency-table", help="a latency table JSON (sparsebalance-profile)")
    src.add_argument("--analytic", action="store_true",
                     help="the analytic Qwen2.5-0.5B / H100 table (published throughputs)")
    p.add_argument("--pp", type=int, required=True, help="--pipeline-model-parallel-size")
    p.add_argument("--vp", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="virtual stages per rank to try (1: plain 1F1B; more: interleaved)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="never pick a layout whose fullest rank is estimated over this many GiB "
                        "(weights, gradients, Adam state, in-flight activations, logits: "
                        "latency/memory.py); default: no limit")
    p.add_argument("--count-flags-only", action="store_true",
                   help="search only the splits Megatron's count flags build (no layout string)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="default: the table's model")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens per packed micro-batch (default: the table's model)")
    p.add_argument("--density", type=float, default=0.5, help="--sb-density (d0)")
    p.add_argument("--min-density", type=float, default=0.125)
    p.add_argument("--max-density", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="global batches simulated")
    p.add_argument("--seed", type=int, default=1234)
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data-path", help="the run's documents (.jsonl or an indexed prefix)")
    data.add_argument("--lengths", help="JSON: a list of document lengths in tokens, or a "
                      "histogram {\"length\": count}")
    p.add_argument("--tokenizer", default="qwen", help="tokenizer of --data-path / the corpus")
    p.add_argument("--top", type=int, default=5, help="rows printed per search")
    p.add_argument("--json", default=None, help="write every simulated run here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress lines on stderr (the search's parts as they run)")
    return p


def progress_printer(enabled: bool = True, stream=None):
    """``say(line)``: ``[sparsebalance-layout] 12.3 s: line`` on stderr (seconds since this
    was made), or nothing when not ``enabled``."""
    t0 = time.perf_counter()

    def say(line: str) -> None:
        if enabled:
            print(f"[sparsebalance-layout] {time.perf_counter() - t0:6.1f} s: {line}",
                  file=stream or sys.stderr, flush=True)

    return say


def read_lengths(path: str) -> np.ndarray:
    """Document lengths from a JSON list or histogram; ``ValueError`` naming the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--lengths {path}: cannot read a JSON file: {e}") from e
    if isinstance(raw, dict):
        out = []
        for k, v in raw.items():
            try:
                n, c = int(k), int(v)
            except (TypeError, ValueError):
                raise ValueError(f"--lengths {path}: entry {k!r}: {v!r}: expected "
                                 f"\"length\": count with integers") from None
            if n < 1 or c < 0 or str(n) != str(k).strip():
                raise ValueError(f"--lengths {path}: entry {k!r}: {v!r}: expected a length "
                                 f">= 1 and a count >= 0")
            out += [n] * c
        lengths = np.asarray(out, dtype=np.int64)
    elif isinstance(raw, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in raw):
            bad = next(x for x in raw if not (isinstance(x, int) and not isinstance(x, bool)
                                              and x >= 1))
            raise ValueError(f"--lengths {path}: {bad!r}: expected document lengths as "
                             f"integers >= 1")
        lengths = np.asarray(raw, dtype=np.int64)
    else:
        raise ValueError(f"--lengths {path}: expected a JSON list or object, got "
                         f"{type(raw).__name__}")
    if lengths.size == 0:
        raise ValueError(f"--lengths {path}: no documents")
    return lengths


def _rows(title, choices, base_s, top):
    lines = [f"\n{title}",
             f"{'layout':<26} {'packing':<15} {'step_s':>8} {'vs even':>8} {'density':>8} "
             f"{'per stage':<30} flags"]
    for c in choices[:top]:
        st = " ".join(f"{d:.2f}" for d in c.row["density_per_stage"])
        lines.append(f"{c.layout.describe():<26} {c.variant:<15} {c.step_time_s:>8.3f} "
                     f"{base_s / c.step_time_s:>8.3f} {c.row['mean_density']:>8.3f} "
                     f"{st:<30} {' '.join(c.flags) or '(default split)'}"
                     + ("" if c.qualifies else "  [starves a stage]"))
    return "\n".join(lines)


def _space_line(vp, r: dict) -> str:
    """One vp's search: best, proven bound, gap (0 when every layout was simulated)."""
    gap = ("exact" if r["exact"] else "gap ?" if r["gap_vs_bound"] is None
           else f"gap <= {r['gap_vs_bound']:.1%}")
    bound = r["lower_bound_s"] if r["lower_bound_s"] is not None else float("nan")
    return (f"vp={vp}: best {r['best_s']:.3f} s ({r['best']}), bound {bound:.3f} s, {gap}, "
            f"{r['evaluated']} simulated")


def main(argv: Optional[list] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .config import SparseBalanceConfig
    from .data import load_corpus
    from .experiments import StudyConfig, best_layouts
    from .latency import LatencyModel, LatencyTableError, LayoutError, ModelShape

    for flag, value in (("--pp", args.pp), ("--dp", args.dp), ("--microbatches", args.microbatches),
                        ("--steps", args.steps), ("--num-layers", args.num_layers),
                        ("--seq-length", args.seq_length), ("--top", args.top),
                        *(("--vp", v) for v in args.vp)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: expected an integer >= 1")
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        parser.error(f"--device-memory-gib {args.device_memory_gib}: expected a number of GiB > 0")
    if args.num_layers is not None and args.num_layers < args.pp:
        parser.error(f"--num-layers {args.num_layers} is less than --pp {args.pp}: a pipeline "
                     f"stage would hold no layer")
    try:
        if args.analytic:
            shape = ModelShape(**({"num_layers": args.num_layers} if args.num_layers else {}))
            # the analytic table's own split only needs the stage kinds (and a middle stage)
            n = shape.num_layers
            pp_table = 1 if args.pp == 1 else (2 if n % 2 == 0 else n)
            lm = LatencyModel.analytic(shape, pp=pp_table)
        else:
            lm = LatencyModel.load(args.latency_table)
    except (LatencyTableError, ValueError) as e:
        parser.error(str(e))
    num_layers = args.num_layers or int(lm.table["model"]["num_layers"])
    seq = args.seq_length or int(lm.table["model"]["seq_length"])
    say = progress_printer(not args.no_progress)
    say("reading the document lengths" + (f" of {args.data_path}" if args.data_path else
                                          f" of {args.lengths}" if args.lengths else
                                          " of the built-in corpus"))
    try:
        lengths = (read_lengths(args.lengths) if args.lengths else
                   np.asarray(load_corpus(args.data_path, tokenizer=args.tokenizer).lengths,
                              dtype=np.int64))
    except ValueError as e:
        parser.error(str(e))
    cfg = StudyConfig(microbatches=args.microbatches, seq_length=seq, steps=args.steps,
                      seed=args.seed, sb=SparseBalanceConfig(
                          sparse_balance=True, density=args.density,
                          min_density=args.min_density, max_density=args.max_density))
    t0 = time.perf_counter()
    try:
        res = best_layouts(lm, lengths, cfg, args.dp, pp=args.pp, num_layers=num_layers,
                           vps=args.vp, device_memory_gib=args.device_memory_gib,
                           whole_space=not args.count_flags_only, progress=say,
                           dense_packings=("dense",))
    except (LayoutError, ValueError) as e:
        print(f"sparsebalance-layout: error: {e}", file=sys.stderr)
        return 2
    say("done")
    even = res["even_static"]
    base = even.step_time_s if even is not None else res["static"][0].step_time_s
    print(f"{num_layers} layers, pp={args.pp}, vp in {args.vp}, dp={args.dp}, "
          f"m={args.microbatches}, {seq} tokens per micro-batch, d0={args.density}; "
          f"{len(lengths)} documents; latency: {lm.table.get('device')} "
          f"({lm.table.get('source')}); {time.perf_counter() - t0:.1f} s")
    if even is not None:
        print(f"Megatron's default (even split, sequential packing): {base:.3f} s per step")
    else:
        print(f"Megatron's default split does not exist for {num_layers} layers over pp="
              f"{args.pp}; 'vs even' below is relative to the best static configuration")
    print(_rows("Best static configurations (every unit at d0; token_balanced is the plugin's "
                "packing)", res["static"], base, args.top))
    plain = res["plain_static"]
    print(_rows("Best plain Megatron (sequential packing, no plugin)", [plain], base, 1))
    if args.device_memory_gib is not None:
        print(f"layouts over --device-memory-gib {args.device_memory_gib}: "
              f"{res['excluded_memory']} left out")
    for key, per in res["space"].items():
        print(f"search {key:<15}" + "; ".join(_space_line(vp, r) for vp, r in per.items()))
    print(_rows("Best layouts for --sparse-balance (SAB + DST)", res["sparsebalance"], base,
                args.top))
    if res["accuracy"]:
        print(_rows("Densest --sparse-balance --sb-raise-to static layouts no slower than the "
                    "best static configuration (free accuracy)", res["accuracy"], base,
                    args.top))
    best_s, best_sb = res["static"][0], res["sparsebalance"][0]
    packing = {"token_balanced": " --sb-packing token_balanced",
               "dp_balanced": " --sequence-packing-scheduler dp_balanced (Megatron-LM dev, "
                              "without the plugin)"}.get(best_s.variant, "")
    print(f"\nstatic:         {' '.join(best_s.flags) or '(default split)'}{packing}")
    print(f"sparse-balance: {' '.join(best_sb.flags) or '(default split)'} --sparse-balance "
          f"--sb-density {args.density}")
    print(f"sparse-balance vs the best static: {best_s.step_time_s / best_sb.step_time_s:.3f}x "
          f"(simulated)")
    if res["accuracy"]:
        a = res["accuracy"][0]
        print(f"free accuracy:  {' '.join(a.flags) or '(default split)'} --sparse-balance "
              f"--sb-raise-to static: density {a.row['mean_density']:.3f} (d0 {args.density}) "
              f"at {best_s.step_time_s / a.step_time_s:.3f}x the best static's speed")
    if args.json:
        out = {"config": vars(args), "num_layers": num_layers, "seq_length": seq,
               "even_static": even.as_dict() if even is not None else None,
               "static": [c.as_dict() for c in res["static"]],
               "plain_static": res["plain_static"].as_dict(), "space": res["space"],
               "excluded_memory": res["excluded_memory"],
               "static_lower_bound_s": res["static_lower_bound_s"],
               "sparsebalance": [c.as_dict() for c in res["sparsebalance"]],
               "accuracy": [c.as_dict() for c in res["accuracy"]]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
