"""``sparsebalance-profile``: measure a latency table of one pipeline stage on this device.

Usage (the model flags use Megatron's names and must match the training run)::

    sparsebalance-profile --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 \\
        --num-attention-heads 4 --num-query-groups 2 --seq-length 2048 --vocab-size 42240 \\
        --pipeline-model-parallel-size 2 --sb-block-size 64 --out lat_cpu.json [--quick]

Samples are saved as they are measured (``OUT.partial.jsonl``, ``latency/partial.py``): a
profile cut short resumes from them when run again with the same flags (``--no-resume``: it
starts over, replacing them).
``--analytic`` writes the FLOP-based H100 table of the scale study instead (no measurement).
``--dense-crossover`` measures (or, with ``--analytic``, derives) the document length from which
the sparse kernel beats the dense one, stored in the table: the routing threshold of runs with
``--sb-dense-below-tokens auto`` (``auto``: on CUDA, and for the analytic H100 table).
It lives in the Megatron adapter because measuring builds a megatron-core stage
(``launch/profile.py``); ``--analytic`` and ``--help`` need no megatron import.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def build_parser() -> argparse.ArgumentParser:
    from ..arguments import add_sparsebalance_args
    from ..latency.table import EXECUTION

    p = argparse.ArgumentParser(prog="sparsebalance-profile", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model (Megatron flag names)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=384)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=2)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=42240,
                   help="padded vocabulary of the run (default: the compact built-in corpus, qwen); the LM head dominates small models")
    g.add_argument("--seq-length", type=int, default=2048, help="tokens per packed micro-batch")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True,
                   help="gated SiLU MLP (Megatron --swiglu); --no-swiglu: GeLU MLP")
    e = p.add_argument_group("execution (Megatron flag names; recorded in the table and checked)")
    e.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="the run's TP size; only 1 can be profiled (a 1-process stage)")
    e.add_argument("--transformer-impl", choices=EXECUTION["transformer_impl"], default="local")
    e.add_argument("--recompute-granularity", choices=EXECUTION["recompute_granularity"],
                   default="none", help="activation recomputation of the run (full: uniform, "
                   "1 layer per checkpoint)")
    r = p.add_argument_group("profile")
    r.add_argument("--out", required=True, help="where to write the JSON table")
    r.add_argument("--densities", type=float, nargs="+", default=None)
    r.add_argument("--mixes", type=int, default=None, help="document-length mixes in the grid")
    r.add_argument("--repeats", type=int, default=None)
    r.add_argument("--warmup", type=int, default=None,
                   help="untimed runs before each sample (default: 1 on CUDA, where a new shape compiles; 0 on CPU; one warm-up per stage runs before the grid either way)")
    r.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="statistic over repeats; 'min' resists CPU contention on shared machines")
    r.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (training uses OMP_NUM_THREADS=1 per process)")
    r.add_argument("--quick", action="store_true", help="small grid (< 1 minute on 2 CPU cores)")
    r.add_argument("--analytic", action="store_true",
                   help="write the analytic H100 table of the given shape instead of measuring")
    r.add_argument("--dense-crossover", choices=("auto", "measure", "off"), default="auto",
                   help="measure the dense/sparse crossover (packed micro-batches of equal "
                   "documents, both kernels, at --sb-density) and route the grid's short "
                   "documents dense at it; 'auto': on CUDA and for --analytic (the CPU kernels "
                   "are functional stand-ins whose crossover would route every document dense)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-resume", action="store_true",
                   help="measure every sample anew, replacing any OUT.partial.jsonl left by a "
                   "profile cut short (samples are still saved there as they are measured); "
                   "without it a profile of the same setup resumes from them")
    add_sparsebalance_args(p)
    return p


def shape_from_cli(args):
    """The ``ModelShape`` these flags describe (the inverse of ``ModelShape.cli_flags``)."""
    from ..latency.shape import ModelShape

    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size,
                      num_attention_heads=args.num_attention_heads,
                      num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                      vocab_size=args.vocab_size, seq_length=args.seq_length,
                      pp=args.pipeline_model_parallel_size, swiglu=args.swiglu,
                      tensor_model_parallel_size=args.tensor_model_parallel_size,
                      transformer_impl=args.transformer_impl,
                      recompute_granularity=args.recompute_granularity)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..arguments import config_from_args
    from ..latency.model import LatencyModel
    from ..latency.table import write_table

    sb = config_from_args(args)
    try:
        shape_from_cli(args).check_profilable()
    except ValueError as e:
        parser.error(str(e))
    if args.analytic:
        from ..latency.analytic import analytic_table
        shape = shape_from_cli(args)
        table = analytic_table(shape, pp=args.pipeline_model_parallel_size,
                               block_size=sb.block_size, sink_blocks=sb.sink_blocks,
                               local_blocks=sb.local_blocks,
                               transformer_impl=args.transformer_impl,
                               recompute_granularity=args.recompute_granularity,
                               routing_density=None if args.dense_crossover == "off"
                               else sb.density)
        write_table(table, args.out)
        print(f"ANALYTIC table (FLOPs / published H100 throughputs, not measured) -> {args.out}")
        print(table["notes"])
        _print_coefficients(LatencyModel.from_table(table))
        return 0

    import torch
    from tqdm import tqdm

    from .launch.profile import fit_report, profile_table
    from .launch.profile_grid import QUICK_MIXES, default_mixes
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*RNG state changed.*")
    densities = args.densities or ([0.25, 1.0] if args.quick
                                   else [0.125, 0.25, 0.5, 0.75, 1.0])
    count = args.mixes or (QUICK_MIXES if args.quick else 10)
    mixes = default_mixes(args.seq_length, count, seed=sb.seed,
                          block_size=sb.block_size, length_multiple=sb.length_multiple)
    repeats = args.repeats or (2 if args.quick else 5)
    # On CUDA a new shape compiles the flex kernel: one untimed run per point keeps any compile
    # out of the samples (the grid has one token count, so there should be one shape).
    warmup = args.warmup if args.warmup is not None else (1 if torch.cuda.is_available() else 0)
    shape = shape_from_cli(args)
    crossover = args.dense_crossover == "measure" or (args.dense_crossover == "auto"
                                                      and torch.cuda.is_available())
    from ..latency.partial import PartialProfile, PartialProfileBusy, partial_path
    from .launch.profile import profile_identity
    identity = profile_identity(shape, sb, densities=densities, mixes=mixes, repeats=repeats,
                                warmup=warmup, statistic=args.statistic,
                                dense_crossover=crossover)
    try:                       # status lines go to stderr, prefixed like the runtime's
        partial = PartialProfile(partial_path(args.out), identity, fresh=args.no_resume,
                                 say=lambda ln: print(f"[sparsebalance] {ln}", file=sys.stderr,
                                                      flush=True))
    except PartialProfileBusy as e:
        parser.exit(2, f"error: {e}\n")
    if not args.no_progress:       # the bar starts after the backend choice and crossover
        first = [w for w, on in (("the attention backend (auto on CUDA)",
                                  sb.attention_backend == "auto" and torch.cuda.is_available()),
                                 ("the dense/sparse crossover", crossover)) if on]
        print(f"[sparsebalance] profiling {len(mixes)} mixes x {len(densities)} densities x "
              f"{repeats} repeats per stage kind"
              + (f"; first measuring {' and '.join(first)}" if first else ""),
              file=sys.stderr, flush=True)
    table = profile_table(shape, sb, densities=densities, mixes=mixes, repeats=repeats,
                          warmup=warmup, statistic=args.statistic, dense_crossover=crossover,
                          progress=None if args.no_progress else tqdm, partial=partial)
    write_table(table, args.out)
    partial.discard()
    print(f"profiled {len(table['measurements'])} points on {table['device']} "
          f"(torch {table['software']['torch']}, megatron-core "
          f"{table['software']['megatron_core']}) -> {args.out}")
    _print_coefficients(LatencyModel.from_table(table))
    if crossover:
        print(f"dense/sparse crossover: {table['dense_crossover_tokens']} tokens (documents "
              f"shorter run dense; 0: none)")
    print(f"{'kind':8s} {'grid MAPE':>10s} {'max err':>8s} {'n':>4s}")
    for kind, m, mx, n in fit_report(table):
        print(f"{kind:8s} {100 * m:9.1f}% {100 * mx:7.1f}% {n:4d}")
    return 0


def _print_coefficients(model) -> None:
    routed = "dense_coefficients" in model.table
    names = list(model.features) + (["dense_work"] if routed else [])
    print(f"{'kind':8s} {'pass':4s} " + " ".join(f"{f:>15s}" for f in names))
    for kind, c in sorted(model.coef.items()):
        for part in ("fwd", "bwd"):
            dense = [model.table["dense_coefficients"][kind][part]] if routed else []
            print(f"{kind:8s} {part:4s} " + " ".join(f"{x:15.4e}" for x in list(c[part]) + dense))


if __name__ == "__main__":
    sys.exit(main())
