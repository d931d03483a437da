"""Simulator study of SparseBalance against the best static Megatron configuration (issue 12;
BENCHMARKS.md: headline, robustness, do no harm, CP). ``--packers-only``: the dense table alone."""

from __future__ import annotations

import argparse
import time

from sparsebalance_megatron.config import MAX_RAISE_HEADROOM, ConfigError, SparseBalanceConfig
from sparsebalance_megatron.data import length_stats
from sparsebalance_megatron.experiments import StudyConfig, best_layouts, format_table, run_study
from sparsebalance_megatron.experiments.heterogeneous import parse_slow_rank
from sparsebalance_megatron.experiments.layout_search import stand_down_config
from sparsebalance_megatron.experiments.mixes import DEFAULT_TOKENS, MIXES, mix_lengths
from sparsebalance_megatron.experiments.packers import (dp_balanced_stops, format_packers,
                                                        packer_summary)
from sparsebalance_megatron.experiments.robustness import (format_summary,
                                                           same_layout_slow_rank, summarize)
from sparsebalance_megatron.experiments.study import is_dense, packing_of
from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout
from sparsebalance_megatron.latency.sparse_call import kernel_rows, price_named

from .common import MODELS, parser, write_result


# --- one mix's runs: the layout searches and rows of a point, its dense rows alone, the
# stage-floor sweep, the decomposition of sab_dst's gain, and the tables each mix prints

def idle_bound(rows: dict, layout, m: int) -> dict:
    """How much faster the best static run could get at the same work: its bubble fraction
    against the floor of its own schedule with equal units, (pp - 1) / (vp * m + pp - 1)
    (1F1B: vp = 1; interleaved 1F1B: Megatron's bubble shrinks with vp)."""
    pp, vp = layout.pp, layout.vp
    floor = (pp - 1) / (vp * m + pp - 1)
    bubble = rows["best_static"]["bubble_fraction"]
    return {"schedule": "1F1B" if vp == 1 else f"interleaved 1F1B, vp={vp}",
            "bubble_floor": floor, "best_static_bubble": bubble,
            "bound": (1 - floor) / (1 - bubble) if bubble < 1 else float("inf")}


def study_one(lm, lengths, cfg: StudyConfig, dp: int, pp: int, vps, slow=()) -> dict:
    """The search and the comparison rows of one (mix, d0, dp); with ``slow`` ranks also the
    same-layout comparison on the best static layout with and without them."""
    t0 = time.perf_counter()
    found = best_layouts(lm, lengths, cfg, dp, pp=pp, vps=vps)
    search_s = time.perf_counter() - t0
    best_static, best_sb = found["static"][0], found["sparsebalance"][0]
    # what the search's SparseBalance runs used
    cfg = stand_down_config(cfg, best_static, found["static"], found["dense"])
    best_dense = found["dense"][0]
    best_acc = found["accuracy"][0] if found["accuracy"] else best_sb
    plain = next(c for c in found["static"] if c.layout.vp == 1).layout  # best 1F1B static
    even = PipelineLayout.even(best_static.layout.num_layers, pp)
    plain_static = found["plain_static"]
    dp_balanced = next(c for c in found["static"] if c.variant == "dp_balanced")  # its best
    runs = {**dense_packings(found),
            "dp_balanced": ("dp_balanced", dp_balanced.layout),
            "static_even": ("static", even),
            "best_static": (best_static.variant, best_static.layout),
            "best_plain_static": ("static", plain_static.layout),
            "sab": ("sab", plain), "dst": ("dst", plain),
            "sab_dst": ("sab_dst", best_sb.layout),
            "sab_dst_max": ("sab_dst_max", plain),
            "sab_dst_acc": ("sab_dst_acc", best_acc.layout),
            # the decomposition's steps, on sab_dst's own layout (gain_parts)
            "static_on_sab_dst_layout": (best_static.variant, best_sb.layout),
            "sab_on_sab_dst_layout": ("sab", best_sb.layout)}
    rows = run_study(dp, cfg, lm, lengths, runs, baseline="best_static")
    # net, the best dense run is the fastest dense packing after its own cost (dense_sab pays
    # the plugin's; the others nothing), which can differ from the fastest gross
    dense_runs = [k for k in runs if k != "best_dense" and is_dense(runs[k][0])]
    net_of = {k: rows[k].get("step_time_net_s", rows[k]["step_time_s"]) for k in dense_runs}
    best_dense_net = min(dense_runs, key=net_of.get)
    for r in rows.values():   # what users run today: dense attention on its own best layout
        r["speedup_vs_dense"] = rows["best_dense"]["step_time_s"] / r["step_time_s"]
        if "step_time_net_s" in r:
            r["speedup_vs_dense_net"] = net_of[best_dense_net] / r["step_time_net_s"]
    layouts = {name: lay.describe() for name, (_, lay) in runs.items()}
    gain = gain_parts(rows)
    extra = {} if not slow else {"slow_rank": {s.describe(): same_layout_slow_rank(
        lm, lengths, cfg, dp, best_static.layout, [s]) for s in slow}}
    lb = found["static_lower_bound_s"]
    return {"rows": rows, "layouts": layouts, **extra, "gain_parts": gain,
            "best_static_packing": best_static.variant, "best_dense_packing": best_dense.variant,
            "best_dense_net": {"run": best_dense_net, "step_time_net_s": net_of[best_dense_net]},
            "stand_down": cfg.sb.stand_down, "dense_stand_down": cfg.dense_stand_down,
            "stand_down_compare": cfg.policy().stand_down_compare,
            # steps Megatron's own dp_balanced stops on (the rows give it empty micro-batches)
            "dp_balanced_megatron_stops": [dp_balanced_stops(lengths, cfg, dp), cfg.steps],
            "space": found["space"],
            "excluded_memory": found["excluded_memory"],
            "static_lower_bound_s": lb,
            "static_gap_vs_bound": (best_static.step_time_s / lb - 1) if lb else None,
            "idle_bound": idle_bound(rows, best_static.layout, cfg.microbatches),
            "best_static": best_static.as_dict(), "best_plain_static": plain_static.as_dict(),
            "best_sparsebalance": best_sb.as_dict(),
            "best_dense": best_dense.as_dict(),
            "search_s": search_s,
            "static_top5": [c.as_dict() for c in found["static"][:5]],
            "sparsebalance_top5": [c.as_dict() for c in found["sparsebalance"][:5]]}


def dense_packings(found) -> dict:
    """The best dense run and each dense packing on its own best layout, as ``run_study``
    takes runs."""
    best = found["dense"][0]
    return {"best_dense": (best.variant, best.layout),
            **{v if v != "dense" else "dense_sequential":
               (v, next(c for c in found["dense"] if c.variant == v).layout)
               for v in ("dense", "dense_token_balanced", "dense_dp_balanced", "dense_sab")}}


def gain_parts(rows: dict) -> dict:
    """Which part of ``sab_dst``'s net speedup over the best static configuration is the layout,
    the packing, DST and the plugin's own cost: the best static configuration, then its packing
    on ``sab_dst``'s layout (``layout``), SAB's packing there at the static density
    (``packing``), DST's plans on it (``dst``: ``sab_dst`` gross) and what the plugin costs a
    step (``plugin_cost``, <= 1). Ratios of step times; their product is the net speedup."""
    t = {k: rows[k]["step_time_s"] for k in ("best_static", "static_on_sab_dst_layout",
                                             "sab_on_sab_dst_layout", "sab_dst")}
    net = rows["sab_dst"].get("step_time_net_s", t["sab_dst"])
    return {"layout": t["best_static"] / t["static_on_sab_dst_layout"],
            "packing": t["static_on_sab_dst_layout"] / t["sab_on_sab_dst_layout"],
            "dst": t["sab_on_sab_dst_layout"] / t["sab_dst"],
            "plugin_cost": t["sab_dst"] / net, "net": t["best_static"] / net}


def packers_one(lm, lengths, cfg: StudyConfig, dp: int, pp: int, vps) -> dict:
    """``--packers-only``: study_one's dense rows alone (every dense packing on its own best
    layout among the same candidates)."""
    t0 = time.perf_counter()
    found = best_layouts(lm, lengths, cfg, dp, pp=pp, vps=vps, dense_only=True)
    search_s = time.perf_counter() - t0
    best_dense = found["dense"][0]
    cfg = stand_down_config(cfg, best_dense, (), found["dense"])
    runs = dense_packings(found)
    rows = run_study(dp, cfg, lm, lengths, runs, baseline="best_dense")
    for r in rows.values():
        r["speedup_vs_dense"] = rows["best_dense"]["step_time_s"] / r["step_time_s"]
    return {"rows": rows, "layouts": {name: lay.describe() for name, (_, lay) in runs.items()},
            "best_dense_packing": best_dense.variant, "dense_stand_down": cfg.dense_stand_down,
            "dp_balanced_megatron_stops": [dp_balanced_stops(lengths, cfg, dp), cfg.steps],
            "space": found["space"], "excluded_memory": found["excluded_memory"],
            "best_dense": best_dense.as_dict(), "search_s": search_s}


def floor_sweep(lm, lengths, cfg: StudyConfig, dp: int, pp: int, floors, found) -> dict:
    """sab_dst at every stage floor, on the even split and on its best layout, against the
    best static configuration found for this (mix, d0, dp)."""
    best = found["best_static"]
    static_layout = PipelineLayout.from_dict(best["layout"])
    if cfg.sb.stand_down != "off":   # stand down as the study's runs did (the best static's one)
        cfg = cfg.with_flags(stand_down=found.get("stand_down") or packing_of(best["variant"]))
    sb_layout = PipelineLayout.from_dict(found["best_sparsebalance"]["layout"])
    even = PipelineLayout.even(static_layout.num_layers, pp)
    out = {}
    for name, lay in ((f"even {even.describe()}", even),
                      (f"best {sb_layout.describe()}", sb_layout)):
        out[name] = {}
        for f in floors:
            c = cfg.with_flags(stage_density_floor=float(f))
            rows = run_study(dp, c, lm, lengths, {"base": (best["variant"], static_layout),
                                                  "sb": ("sab_dst", lay)}, baseline="base")
            out[name][str(f)] = rows["sb"]
    return out


def study_mix(args, out: dict, lm, cp: int, mix: str, seed=None) -> None:
    """Every d0 and DP size of one length mix (and seed) at one CP size, into ``out``."""
    tag = "" if cp == 1 else f"/cp={cp}"
    name = mix if seed is None else f"{mix}/seed={seed}"
    seed = args.seed if seed is None else seed
    lengths = mix_lengths(mix, seed, total_tokens=args.total_tokens, tokenizer=args.tokenizer)
    out.setdefault("corpus", {})[name] = length_stats(lengths)
    mix = name
    for d0 in args.densities[:1] if args.packers_only else args.densities:
        flags = dict(density=d0, min_density=args.min_density, max_density=args.max_density,
                     raise_headroom=args.raise_headroom,
                     stand_down="off" if args.stand_down == "off" else None)
        cfg = StudyConfig(microbatches=args.microbatches, seq_length=args.seq_length,
                          steps=args.steps, seed=seed, sb=SparseBalanceConfig(
                              sparse_balance=True,
                              **{k: v for k, v in flags.items() if v is not None}),
                          microbatch_multiple=args.microbatch_multiple,
                          device_memory_gib=args.device_memory_gib,
                          plugin_cost=args.plugin_cost)
        res = {}
        if args.packers_only:
            for dp in args.ranks:
                r = packers_one(lm, lengths, cfg, dp, args.pp, args.vp)
                out["results"][f"{mix}/d0={d0}/dp={dp}{tag}"] = r
                print(f"{mix} dp={dp}: " + ", ".join(f"{k} {r['rows'][k]['step_time_s']:.3f} s "
                      f"({v})" for k, v in r["layouts"].items()) + f"; search "
                      f"{r['search_s']:.1f} s", flush=True)
            continue
        for dp in args.ranks:
            r = study_one(lm, lengths, cfg, dp, args.pp, args.vp, args.slow_rank)
            r["dense_below_tokens"] = lm.dense_below_tokens     # 0: no routing
            res[str(dp)] = r
            out["results"][f"{mix}/d0={d0}/dp={dp}{tag}"] = r
        if args.floor_sweep:
            dp = args.ranks[-1]
            sweep = floor_sweep(lm, lengths, cfg, dp, args.pp, args.floor_sweep,
                                res[str(dp)])
            out.setdefault("floor_sweep", {})[f"{mix}/d0={d0}/dp={dp}{tag}"] = sweep
            print(f"\nstage floor sweep (sab_dst, {mix}, d0={d0}, {dp} ranks; speedup vs "
                  f"best static, layer-weighted density, lowest stage, predicted loss "
                  f"change vs uniform d0):")
            for name, rows in sweep.items():
                print(f"  {name:<22} " + "  ".join(
                    f"floor {f}: {r['speedup_vs_static']:.3f}x d={r['mean_density']:.3f} "
                    f"min={r['min_stage_density']:.3f} loss={r['predicted_loss']:+.4f}"
                    for f, r in rows.items()))
        title = (f"mix={mix} ({len(lengths)} docs), d0={d0}"
                 f"{f', CP={cp}' if cp > 1 else ''}: speedup vs the best static "
                 f"configuration")
        print(format_table(title, {dp: r["rows"] for dp, r in res.items()}))
        for dp, r in res.items():
            lay = ", ".join(f"{k} {v}" for k, v in r["layouts"].items())
            st = " ".join(f"{x:.2f}" for x in r["rows"]["sab_dst"]["density_per_stage"])
            ib = r["idle_bound"]
            gap = r["static_gap_vs_bound"]
            g = r["gain_parts"]
            print(f"{dp:>6} sab_dst vs best static, net {g['net']:.3f}x = layout "
                  f"{g['layout']:.3f} x packing {g['packing']:.3f} x DST {g['dst']:.3f} x "
                  f"the plugin's cost {g['plugin_cost']:.4f}")
            print(f"{dp:>6} layouts: {lay}; best static packing "
                  f"{r['best_static']['variant']}; sab_dst per stage {st}; "
                  f"search {r['search_s']:.1f} s; static lower bound "
                  f"{r['static_lower_bound_s'] or float('nan'):.3f} s (gap "
                  f"{'-' if gap is None else f'{gap:.3f}'}); idle-time bound {ib['bound']:.3f}x "
                  f"({ib['schedule']}, floor {ib['bubble_floor']:.3f}); layouts over the "
                  f"memory limit: {r['excluded_memory']}")


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
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--seq-length", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="global batches per configuration")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b",
                   help="the analytic H100 table's model shape")
    p.add_argument("--sparse-kernel", choices=("auto", "flex", "triton"), default="auto",
                   help="the sparse kernel that prices the sparse call "
                        "(auto: what --sb-attention-backend auto runs, measured; triton: the "
                        "plugin's own kernel, an estimate until a device measures it)")
    p.add_argument("--kernel-table", nargs="+", default=None, metavar="PATH",
                   help="device kernel tables (attention_gpu's "
                        "JSONs, e.g. a run's two calls) whose rows price the sparse kernels")
    p.add_argument("--context-parallel", type=int, nargs="+", default=[1],
                   help="CP sizes (a2a scheme) to study; each one's results are keyed .../cp=N "
                        "when N > 1")
    p.add_argument("--floor-sweep", type=float, nargs="*", default=[0.0, 0.5, 0.75, 0.9],
                   help="--sb-stage-density-floor values tried for sab_dst on the even split and "
                        "on its best layout (the evidence for the default); none: skip")
    p.add_argument("--raise-headroom", default=None,
                   help="--sb-raise-headroom of every DST plan: a fraction in [0, 0.5] or 'auto' "
                        "(default: the runtime's; 'auto' is its pre-measurement value here)")
    p.add_argument("--microbatch-multiple", type=int, default=0,
                   help="--sb-microbatch-multiple of every run (0: fixed --seq-length "
                        "micro-batches; K: each micro-batch its documents rounded up to K)")
    p.add_argument("--stand-down", choices=("best_static", "off"), default="best_static",
                   help="do no harm (issue 27, --sb-stand-down): SAB runs stand down to the best "
                        "static configuration's packing and DST plans to the static plan when "
                        "predicted no faster (best_static), or never (off: the ablation)")
    p.add_argument("--packers-only", action="store_true",
                   help="dense attention by packing alone (sequential, token-balanced, "
                        "dp_balanced, SAB, each on its own best layout; the SAB vs dp_balanced "
                        "table): the full study's searches and dense rows without its static "
                        "sparse, SparseBalance or floor-sweep runs; dense runs "
                        "ignore d0, so the first --densities value keys the rows")
    p.add_argument("--quick", action="store_true", help="ranks 8, d0 0.5, file mix, 1 step")
    args = p.parse_args(argv)
    # what every documented run used (recorded in the JSON's config): DST at the runtime's
    # objective, descent and tolerance, no routing
    args.min_density, args.max_density, args.tokenizer, args.seed = 0.125, 1.0, "qwen", 1234
    sb = SparseBalanceConfig()
    args.routing, args.dst_objective, args.dst_descent, args.tolerance = \
        "off", sb.dst_objective, sb.dst_descent, sb.tolerance
    # checked here, before any search: the runtime's own checks, named by this script's flags
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        p.error(f"--device-memory-gib {args.device_memory_gib}: expected a number of GiB > 0")
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
    try:            # the analytic table's sparse price, from the kernel tables if given
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
    shape = ModelShape(**{**MODELS[args.model], "seq_length": args.seq_length})
    lm0 = LatencyModel.analytic(shape, pp=args.pp, sparse_price=args.price)
    source = (f"ANALYTIC {args.model} / {args.seq_length // 1024}K / H100 table (published "
              f"throughputs for the GEMMs, not measured; dense attention measured: cuDNN on an "
              f"H100)")
    from sparsebalance_megatron.latency.sparse_call import table_sparse_kernel
    source += f"; sparse call priced by {table_sparse_kernel(lm0.table)}"
    models = {cp: lm0.with_context_parallel(cp) for cp in args.context_parallel}
    if args.context_parallel != [1]:
        cost = next(m.context_parallel for m in models.values() if m.context_parallel)
        source += (f"; CP a2a at an ASSUMED {cost.a2a_bytes_per_s / 1e9:.0f} GB/s per rank, "
                   f"{cost.collective_latency_s * 1e6:.0f} us per collective")
    from sparsebalance_megatron.experiments.plugin_cost import PluginCost
    plugin_cost = args.plugin_cost = PluginCost.from_results(args.dst_objective, args.dst_descent)
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
                      if k not in ("json", "price", "plugin_cost")},
           "latency_source": source, "sparse_kernel": lm0.table["sparse_call"],
           "plugin_cost": {
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

