"""Simulator study of SparseBalance against the best static Megatron configuration (issue 12).

For every length mix (the built-in corpus cut into whole files, or into sections: a heavy tail of
short documents), d0 and DP size, the layout search (``experiments.layout_search``, what
``sparsebalance-layout`` runs) finds:

- ``best_static``: the fastest static configuration: the whole ``--pipeline-model-parallel-layout``
  space (issue 27: uneven chunks, empty and LM-head-only stages, vp 1-4; ``--count-flags-only``:
  the count-flag splits of issue 12) x Megatron's sequential packing, the plugin's
  token-balanced packing or Megatron's dp_balanced packer (issue 41; ``batching.dp_balanced``),
  all at d0 (the JSON names the packing);
- ``best_plain_static``: the same with Megatron's sequential packing only (no plugin at all);
- ``best_dense``: the fastest dense configuration (every split x sequential, token-balanced,
  dp_balanced and SAB packing, dense attention, issue 41; ``speedup_vs_dense`` divides by it);
  ``dense_sequential``, ``dense_token_balanced``, ``dense_dp_balanced`` and ``dense_sab`` (SAB
  packing with dense attention, ``--sb-batching`` alone, standing down to the faster of the
  dense sequential and token-balanced configurations) are each packing on its own best layout,
  and ``dp_balanced`` is static sparse attention with Megatron's packer on its own best layout.
  Dense attention is priced by the table's dense kernel: on the analytic table cuDNN's measured
  H100 costs (``latency/analytic.py``), not the sparse kernel at density 1;
- ``sab_dst``: the fastest SAB + DST layout (vp 1 or 2) whose plan keeps the layer-weighted
  density >= d0 and every stage >= the stage floor x d0.

Rows, all on the same global batches, speedups vs ``best_static``:
``static_even`` (Megatron's default: even split, sequential packing; the old baseline, labelled),
``best_static``, ``sab`` and ``dst`` (each alone on the best plain-1F1B static layout),
the dense and dp_balanced rows above, ``sab_dst`` (on its own best layout), ``sab_dst_max`` (SAB + DST that never cuts, on the best
plain static layout) and ``sab_dst_acc`` (SAB + DST with ``--sb-raise-to static`` on the layout
no slower than best_static's with the lowest predicted loss, the densest under the density
objective: the "free accuracy" row).
Do no harm (issue 27, ``--stand-down``): every SAB run stands down to the best static
configuration's packing in a step where SAB is predicted no faster (``--stand-down-compare``:
on DST's plans of both, the runtime's default, or on the packings' static plans), and every DST
plan to the static plan where it is predicted slower (``policy.stand_down``); the ``dst_sd`` /
``sab_sd`` columns are the fractions of steps that stood down. ``--stand-down off`` is the
ablation.
DST is the runtime's own ``plan_dst_from_config`` (floors, raise headroom, and the runtime's default
``--sb-dst-objective`` unless ``--dst-objective`` names one; the JSON's config records which).
Densities are weighted by layers x dense attention work, overall and per stage; ``predicted_loss`` is the LM-loss change
against uniform d0 that the shipped quality cost predicts for a run's plans (both objectives).

Latency: the analytic Qwen2.5-0.5B / H100 table (published throughputs for the GEMMs; attention
measured on an H100: dense cuDNN, and the sparse call of the kernel ``--sb-attention-backend auto``
runs, ``latency/sparse_call.py``; its micro-batch is --seq-length tokens), another model's shape
(--model), or --table (a device latency table: its own measured kernel prices everything).
``--sparse-kernel``: which sparse kernel prices the analytic table (auto: flex, the only one
timed on a GPU at two lengths and auto's choice before any measurement; with
``--microbatch-multiple`` > 0, auto chooses among the length-free kernels only, as the runtime
does, and flex's figure stands in, labelled, until a kernel table times one; triton: the
plugin's own kernel, an ESTIMATE from attention/work_model.py until a device times it);
``--kernel-table PATH...``: device kernel tables (``scripts/bench.py attention_gpu``) whose
measurements replace the committed one and the estimate. Every row names the kernel that priced
it (``attention_kernel``, the tables' ``kernel`` column; ``attention_priced_by`` in full).

Net of the plugin's own cost (issue 44, default ``--plugin-cost on``): every SparseBalance row
pays its per-step critical-path cost (``experiments/plugin_cost.py``: planning as ``--planner``
says, default the runtime's ``--sb-planner process``, ahead of the step; ``inline`` on it; the
control plane at the row's world size, calibration), from the
measurements it names (``plugin_cost_source``; the JSON's ``plugin_cost``); rows carry gross and
net step times and speedups side by side (``speedup_vs_static_net``, ``speedup_vs_dense_net``),
and do no harm compares net times (``net_sd``: steps stood down without planning). ``--routing derived``: the analytic table routes documents below the
dense/sparse crossover derived from its own costs at each d0 (as the runtime routes at a
profiled table's crossover); default ``off``: every document of a sparse run goes sparse.
Prints tables; ``--json PATH`` writes everything.

Context parallelism (issue 14): ``--context-parallel 2 4 8`` repeats the study with the latency
model of one rank of a CP group of that size (``LatencyModel.with_context_parallel``: the a2a
scheme, the assumed NVLink all-to-all bandwidth of ``DeviceProfile``); DP and PP stay as given, so
each CP size uses CP times the GPUs. The query heads must split over every size (Qwen2.5-0.5B's 14
do only for 2: use ``--model llama3.2-1b``, 32 query / 8 KV heads).

    python scripts/bench.py sim_study --json runs/sim_study.json

Robustness (issue 27): ``--mixes`` also takes the seeded families of ``experiments.mixes``
(``lognormal_short``, ``long_tail``, ``both``) and ``--seeds 0 1 2`` repeats every mix with each
seed (the synthetic mix's draw and the sampler's shuffle; results keyed ``MIX/seed=S/...``).
``--slow-rank R:FACTOR`` (``experiments.heterogeneous``: global rank R = dp_rank + dp x pipeline
rank computes FACTOR times slower; several are studied one at a time) adds to every row static,
DST, SAB and SAB + DST on the best static configuration's layout with and without that GPU
slowed. After the tables, dense attention by packing (``experiments.packers``: SAB against
dp_balanced and the faster of sequential / token-balanced, every row and the median) and a summary
(``experiments.robustness``): every row's sab_dst speedup over the best static, worst, median,
how many rows meet >= 1.00x, and DST over static with the slow rank; in the JSON as ``summary``.

    python scripts/bench.py sim_study --mixes file section lognormal_short long_tail both \
        --seeds 0 1 2 --ranks 8 --densities 0.5 --steps 1 --floor-sweep \
        --slow-rank 1:1.1 9:1.1 17:1.1 25:1.1 \
        --json runs/sim_study_robustness.json

``--packers-only``: that dense table alone (issue 41's SAB vs dp_balanced): the same layout
searches, so the same candidate layouts and the same four dense rows as the full study, without
the static sparse, SparseBalance, accuracy and floor-sweep runs that cost the full study an hour.
"""

from __future__ import annotations

import argparse
import time

from sparsebalance_megatron.config import (DST_DESCENTS, DST_OBJECTIVES, MAX_RAISE_HEADROOM,
                                           PLANNERS, STAND_DOWN_COMPARES, ConfigError,
                                           SparseBalanceConfig)
from sparsebalance_megatron.experiments.heterogeneous import parse_slow_rank
from sparsebalance_megatron.experiments.mixes import DEFAULT_TOKENS, MIXES
from sparsebalance_megatron.experiments.packers import format_packers, packer_summary
from sparsebalance_megatron.experiments.robustness import format_summary, summarize
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.latency.sparse_call import kernel_rows, price_named

from ._sim_study_runs import study_mix          # the study's points
from .common import MODELS, parser, write_result


def _slow_rank(text):
    try:
        return parse_slow_rank(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None):
    p = parser(__doc__, "sim_study")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25], help="d0 values")
    p.add_argument("--mixes", nargs="+", default=["file", "section"], choices=MIXES,
                   help="length mixes: the built-in corpus's document units (file, section) or "
                        "the seeded families of experiments/mixes.py")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="repeat every mix with each seed (the synthetic draw and the sampler's "
                        "shuffle); default: --seed alone, results keyed without it")
    p.add_argument("--total-tokens", type=int, default=DEFAULT_TOKENS,
                   help="tokens drawn per synthetic mix")
    p.add_argument("--slow-rank", type=_slow_rank, nargs="*", default=[],
                   help="R:FACTOR: global rank R (dp_rank + dp x pipeline rank) computes FACTOR "
                        "times slower; adds the same-layout comparison with and without it, "
                        "each one given alone")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vp", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="the layout search never picks a layout whose fullest rank is "
                        "estimated over this (latency/memory.py); default: no limit")
    p.add_argument("--count-flags-only", action="store_true",
                   help="search only the layouts Megatron's count flags build (before issue 27)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--seq-length", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--min-density", type=float, default=0.125)
    p.add_argument("--max-density", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="global batches per configuration")
    p.add_argument("--table", default=None, help="profiled latency table (JSON); default: "
                   "the analytic Qwen2.5-0.5B H100 table")
    p.add_argument("--table-force", action="store_true")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b",
                   help="the analytic table's model shape (without --table)")
    p.add_argument("--sparse-kernel", choices=("auto", "flex", "triton"), default="auto",
                   help="analytic table only: the sparse kernel that prices the sparse call "
                        "(auto: what --sb-attention-backend auto runs, measured; triton: the "
                        "plugin's own kernel, an estimate until a device measures it)")
    p.add_argument("--kernel-table", nargs="+", default=None, metavar="PATH",
                   help="analytic table only: device kernel tables (attention_gpu's "
                        "JSONs, e.g. a run's two calls) whose rows price the sparse kernels")
    p.add_argument("--plugin-cost", choices=("on", "off"), default="on",
                   help="on: every SparseBalance row pays the plugin's own per-step cost "
                        "(net figures beside the gross); off: gross only")
    p.add_argument("--planner", choices=("default",) + PLANNERS, default="default",
                   help="--sb-planner the rows assume (prices their planning; default: the "
                        "runtime's default, process: planning ahead)")
    p.add_argument("--routing", choices=("off", "derived"), default="off",
                   help="analytic table only: 'derived' routes documents shorter than the "
                        "crossover derived from the table's costs at each d0 to the dense kernel "
                        "(what the runtime does with a profiled table); 'off': no routing")
    p.add_argument("--context-parallel", type=int, nargs="+", default=[1],
                   help="CP sizes (a2a scheme) to study; each one's results are keyed .../cp=N "
                        "when N > 1")
    p.add_argument("--tokenizer", default="qwen")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--floor-sweep", type=float, nargs="*", default=[0.0, 0.5, 0.75, 0.9],
                   help="--sb-stage-density-floor values tried for sab_dst on the even split and "
                        "on its best layout (the evidence for the default); none: skip")
    p.add_argument("--dst-objective", choices=DST_OBJECTIVES, default=None,
                   help="--sb-dst-objective of every DST plan (default: the runtime's, "
                        f"{SparseBalanceConfig().dst_objective})")
    p.add_argument("--dst-descent", choices=DST_DESCENTS, default=None,
                   help="--sb-dst-descent of every DST plan (default: the runtime's, "
                        f"{SparseBalanceConfig().dst_descent}; 'off': the band rule alone)")
    p.add_argument("--raise-headroom", default=None,
                   help="--sb-raise-headroom of every DST plan: a fraction in [0, 0.5] or 'auto' "
                        "(default: the runtime's; 'auto' is its pre-measurement value here)")
    p.add_argument("--tolerance", type=float, default=SparseBalanceConfig().tolerance,
                   help="--sb-tolerance p of every DST plan (units above (1 + p) x the anchor "
                        "are cut)")
    p.add_argument("--microbatch-multiple", type=int, default=0,
                   help="--sb-microbatch-multiple of every run (0: fixed --seq-length "
                        "micro-batches; K: each micro-batch its documents rounded up to K)")
    p.add_argument("--stand-down", choices=("best_static", "off"), default="best_static",
                   help="do no harm (issue 27, --sb-stand-down): SAB runs stand down to the best "
                        "static configuration's packing and DST plans to the static plan when "
                        "predicted no faster (best_static), or never (off: the ablation)")
    p.add_argument("--stand-down-compare", choices=STAND_DOWN_COMPARES, default=None,
                   help="--sb-stand-down-compare of the SAB runs (default: the runtime's, "
                        f"{SparseBalanceConfig().stand_down_compare}): DST's plans of both "
                        "packings, or their static plans, DST planning the one chosen "
                        "('static')")
    p.add_argument("--packers-only", action="store_true",
                   help="dense attention by packing alone (sequential, token-balanced, "
                        "dp_balanced, SAB, each on its own best layout; the SAB vs dp_balanced "
                        "table): the full study's searches and dense rows without its static "
                        "sparse, SparseBalance or floor-sweep runs; dense runs "
                        "ignore d0, so the first --densities value keys the rows")
    p.add_argument("--quick", action="store_true", help="ranks 8, d0 0.5, file mix, 1 step")
    args = p.parse_args(argv)
    # checked here, before any search: the runtime's own checks, named by this script's flags
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        p.error(f"--device-memory-gib {args.device_memory_gib}: expected a number of GiB > 0")
    if args.routing != "off" and args.table:
        p.error(f"--routing {args.routing}: only with the analytic table (a --table routes at "
                f"its own measured crossover)")
    if args.table and (args.sparse_kernel != "auto" or args.kernel_table):
        p.error("--sparse-kernel / --kernel-table: only with the analytic table (a --table is "
                "priced by its own measured kernel)")
    if args.sparse_kernel == "flex" and args.microbatch_multiple:
        p.error(f"--sparse-kernel flex with --microbatch-multiple {args.microbatch_multiple}: the "
                f"runtime refuses variable lengths with flex (a kernel compile per length); "
                f"auto prices a length-free kernel there")
    if args.raise_headroom is not None:
        try:
            SparseBalanceConfig(raise_headroom=args.raise_headroom)
        except ConfigError:
            p.error(f"--raise-headroom {args.raise_headroom!r}: expected 'auto' or a number in "
                    f"[0, {MAX_RAISE_HEADROOM}]")
    if args.quick:
        args.ranks, args.densities, args.mixes, args.steps = [8], [0.5], ["file"], 1
    args.price = None
    if not args.table:      # the analytic table's sparse price, from the kernel tables if given
        try:
            rows = [r for path in args.kernel_table for r in kernel_rows(path)] \
                if args.kernel_table else None
            args.price = price_named(args.sparse_kernel, rows, microbatch_tokens=args.seq_length,
                                     density=args.densities[0],
                                     length_free=args.microbatch_multiple > 0)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--kernel-table {' '.join(args.kernel_table or [])}: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        lm0 = LatencyModel.load(args.table, force=args.table_force)
        source = f"table {args.table} ({lm0.table.get('device')})"
    else:
        shape = ModelShape(**{**MODELS[args.model], "seq_length": args.seq_length})
        lm0 = LatencyModel.analytic(shape, pp=args.pp, sparse_price=args.price)
        source = (f"ANALYTIC {args.model} / {args.seq_length // 1024}K / H100 table (published "
                  f"throughputs for the GEMMs, not measured; dense attention measured: cuDNN on "
                  f"an H100)")
    from sparsebalance_megatron.latency.sparse_call import table_sparse_kernel
    source += f"; sparse call priced by {table_sparse_kernel(lm0.table)}"
    if args.routing == "derived":
        source += "; routing at the crossover derived at each d0"
    models = {cp: lm0.with_context_parallel(cp) for cp in args.context_parallel}
    if args.context_parallel != [1]:
        dev = lm0.table.get("device_profile") or {}
        cost = next(m.context_parallel for m in models.values() if m.context_parallel)
        source += (f"; CP a2a at an ASSUMED {cost.a2a_bytes_per_s / 1e9:.0f} GB/s per rank, "
                   f"{cost.collective_latency_s * 1e6:.0f} us per collective"
                   + ("" if dev else " (DeviceProfile defaults)"))
    if args.dst_objective is None:
        args.dst_objective = SparseBalanceConfig().dst_objective
    if args.dst_descent is None:
        args.dst_descent = SparseBalanceConfig().dst_descent
    plugin_cost = None
    if args.plugin_cost == "on":
        from sparsebalance_megatron.experiments.plugin_cost import PluginCost
        plugin_cost = PluginCost.from_results(args.dst_objective, args.dst_descent)
    args.plugin_cost_model = plugin_cost
    if plugin_cost is not None:
        print("; ".join([f"plugin cost (net rows): {plugin_cost.planner.source} (planning, "
                         f"calibration), {plugin_cost.control.source} (control plane)"]
                        + plugin_cost.notes))
    print(f"latency: {source}\npp={args.pp} vp={args.vp} m={args.microbatches} "
          f"seq_length={args.seq_length} d in [{args.min_density}, {args.max_density}] "
          f"steps={args.steps} dst_objective={args.dst_objective} "
          f"dst_descent={args.dst_descent}")
    t0 = time.perf_counter()
    out = {"config": {k: ([s.describe() for s in v] if k == "slow_rank" else v)
                      for k, v in vars(args).items()
                      if k not in ("json", "price", "plugin_cost_model")},
           "latency_source": source, "sparse_kernel": models_price(lm0),
           "plugin_cost": None if plugin_cost is None else {
               "planner": plugin_cost.planner.source, "control_plane": plugin_cost.control.source,
               "dst_flags": plugin_cost.dst_flags, "notes": plugin_cost.notes},
           "results": {}}
    for cp, lm in models.items():
        for mix in args.mixes:
            for seed in (args.seeds or [None]):
                study_mix(args, out, lm, cp, mix, seed)
    out["packers"] = packer_summary(out["results"])
    print(format_packers(out["packers"]))
    if not args.packers_only:
        out["summary"] = summarize(out["results"])
        print(format_summary(out["summary"]))
    out["wall_s"] = time.perf_counter() - t0
    print(f"\n({out['wall_s']:.1f} s)")
    write_result(args.json, out)
    return 0


def models_price(lm) -> dict:
    """The record of what prices the sparse call (``sparse_call`` of an analytic table, else
    the device table's kernel)."""
    from sparsebalance_megatron.latency.sparse_call import kernel_labels
    return lm.table.get("sparse_call") or {"described": kernel_labels(lm.table)["sparse"][1]}
