"""What the simulator study (``sim_study``) runs for each length mix, d0, DP
size and CP size: the layout searches and the comparison rows of one point (``study_one``; its
dense rows alone: ``packers_one``), the stage-floor sweep, the decomposition of ``sab_dst``'s gain,
and the tables each mix prints. The command line, the latency source and the JSON stay in the
study.
"""

from __future__ import annotations

import time

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.data import length_stats
from sparsebalance_megatron.experiments import StudyConfig, best_layouts, format_table, run_study
from sparsebalance_megatron.experiments.layout_search import stand_down_config
from sparsebalance_megatron.experiments.mixes import mix_lengths
from sparsebalance_megatron.experiments.packers import dp_balanced_stops
from sparsebalance_megatron.experiments.robustness import same_layout_slow_rank
from sparsebalance_megatron.experiments.study import is_dense, packing_of
from sparsebalance_megatron.latency import LatencyModel, ModelShape, PipelineLayout

from .common import MODELS


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


def study_one(lm, lengths, cfg: StudyConfig, dp: int, pp: int, vps, slow=(),
              whole_space: bool = True) -> dict:
    """The search and the comparison rows of one (mix, d0, dp); with ``slow`` ranks also the
    same-layout comparison on the best static layout with and without them."""
    t0 = time.perf_counter()
    found = best_layouts(lm, lengths, cfg, dp, pp=pp, vps=vps, whole_space=whole_space)
    search_s = time.perf_counter() - t0
    best_static, best_sb = found["static"][0], found["sparsebalance"][0]
    # what the search's SparseBalance runs used
    cfg = stand_down_config(cfg, best_static, found["static"], found["dense"])
    best_dense = found["dense"][0]

    def best_of(choices, variant):     # each packing on its own best layout
        return next(c for c in choices if c.variant == variant).layout
    best_acc = found["accuracy"][0] if found["accuracy"] else best_sb
    plain = next(c for c in found["static"] if c.layout.vp == 1).layout  # best 1F1B static
    even = PipelineLayout.even(best_static.layout.num_layers, pp)
    plain_static = found["plain_static"]
    runs = {"best_dense": (best_dense.variant, best_dense.layout),
            **{v if v != "dense" else "dense_sequential": (v, best_of(found["dense"], v))
               for v in ("dense", "dense_token_balanced", "dense_dp_balanced", "dense_sab")},
            "dp_balanced": ("dp_balanced", best_of(found["static"], "dp_balanced")),
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


def packers_one(lm, lengths, cfg: StudyConfig, dp: int, pp: int, vps,
                whole_space: bool = True) -> dict:
    """``--packers-only``: study_one's dense rows alone (every dense packing on its own best
    layout among the same candidates)."""
    t0 = time.perf_counter()
    found = best_layouts(lm, lengths, cfg, dp, pp=pp, vps=vps, whole_space=whole_space,
                         dense_only=True)
    search_s = time.perf_counter() - t0
    cfg = stand_down_config(cfg, found["dense"][0], (), found["dense"])
    best_dense = found["dense"][0]
    runs = {"best_dense": (best_dense.variant, best_dense.layout),
            **{v if v != "dense" else "dense_sequential":
               (v, next(c for c in found["dense"] if c.variant == v).layout)
               for v in ("dense", "dense_token_balanced", "dense_dp_balanced", "dense_sab")}}
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


def routed_model(lm, args, d0: float, cp: int):
    """The analytic model of ``args`` routing at the crossover its costs give at ``d0``."""
    shape = ModelShape(**{**MODELS[args.model], "seq_length": args.seq_length})
    routed = LatencyModel.analytic(shape, pp=args.pp, routing_density=d0,
                                   sparse_price=args.price)
    print(f"routing at d0={d0}: documents under {routed.dense_below_tokens} tokens run dense")
    return routed.with_context_parallel(cp)


def study_mix(args, out: dict, lm, cp: int, mix: str, seed=None) -> None:
    """Every d0 and DP size of one length mix (and seed) at one CP size, into ``out``."""
    tag = "" if cp == 1 else f"/cp={cp}"
    name = mix if seed is None else f"{mix}/seed={seed}"
    seed = args.seed if seed is None else seed
    lengths = mix_lengths(mix, seed, total_tokens=args.total_tokens, tokenizer=args.tokenizer)
    out.setdefault("corpus", {})[name] = length_stats(lengths)
    mix = name
    for d0 in args.densities[:1] if args.packers_only else args.densities:
        if args.routing == "derived":      # the crossover depends on d0
            lm = routed_model(lm, args, d0, cp)
        flags = dict(density=d0, min_density=args.min_density, max_density=args.max_density,
                     dst_objective=args.dst_objective, tolerance=args.tolerance,
                     dst_descent=args.dst_descent, raise_headroom=args.raise_headroom,
                     stand_down="off" if args.stand_down == "off" else None,
                     stand_down_compare=args.stand_down_compare,
                     planner=None if args.planner == "default" else args.planner)
        cfg = StudyConfig(microbatches=args.microbatches, seq_length=args.seq_length,
                          steps=args.steps, seed=seed, sb=SparseBalanceConfig(
                              sparse_balance=True,
                              **{k: v for k, v in flags.items() if v is not None}),
                          microbatch_multiple=args.microbatch_multiple,
                          device_memory_gib=args.device_memory_gib,
                          plugin_cost=args.plugin_cost_model)
        res = {}
        if args.packers_only:
            for dp in args.ranks:
                r = packers_one(lm, lengths, cfg, dp, args.pp, args.vp,
                                whole_space=not args.count_flags_only)
                out["results"][f"{mix}/d0={d0}/dp={dp}{tag}"] = r
                print(f"{mix} dp={dp}: " + ", ".join(f"{k} {r['rows'][k]['step_time_s']:.3f} s "
                      f"({v})" for k, v in r["layouts"].items()) + f"; search "
                      f"{r['search_s']:.1f} s", flush=True)
            continue
        for dp in args.ranks:
            r = study_one(lm, lengths, cfg, dp, args.pp, args.vp, args.slow_rank,
                          whole_space=not args.count_flags_only)
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
