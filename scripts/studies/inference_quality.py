"""Free accuracy at equal step time (issue 84): SmolLM2-135M in Megatron scored on fresh
RULER-style samples under the runtime's own DST plans, against uniform d0, against the uniform
density whose predicted step is DST's, with a positive control and margins fixed by a pilot
(the arms, scores and verdicts: QUALITY.md). Forwards are cached (``--cache``) and split over
processes by ``--jobs N`` (or by hand: ``--shard K/N`` runs, then a run without it for the
summary).

    .venv/bin/python scripts/bench.py inference_quality --quick --json /tmp/iq.json   # smoke
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import smollm2
from . import common
from .common import ROOT, add_pilot_args, check_pilot, parser, write_result

GROUPS = 6                      # every arm's vector: one density per sixth of the layers
LAYOUTS = {"pp3": 3, "pp2": 2}  # pipeline stages (DP --dp, micro-batches --microbatches)
METRICS = ("loss", "answer_nll")        # the verdicts' (lower is better)
SCORES = METRICS + ("exact", "token_accuracy", "kept")
MAIN_SEED_BASE, PILOT_SEED_BASE = 400_000, 500_000
# settings the main run must share with its pilot for the pilot's margin to hold
SAME = ("task", "needles", "lengths", "density", "control_factor", "dp", "microbatches",
        "seq_length", "block_size", "loss_stride", "layers")


def parse_args(argv=None):
    ap = parser(__doc__, "inference_quality")
    ap.add_argument("--samples", type=int, default=None, help="main 60, pilot 16")
    add_pilot_args(ap)
    ap.add_argument("--needles", type=int, default=4, help="keyed needles a sample, all asked")
    ap.add_argument("--density", type=float, default=0.5, help="d0")
    ap.add_argument("--control-factor", type=float, default=0.9)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--seed-base", type=int, default=None,
                    help="the samples' first seed (default: main %d, pilot %d); a confirmatory "
                         "run takes fresh ones" % (MAIN_SEED_BASE, PILOT_SEED_BASE))
    smollm2.add_measure_args(ap, "inference_quality", threads=1, quick_layers=6)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 6 layers, 4 samples of 256-512 tokens, block 16, DP 2 x "
                         "2 micro-batches of 1K (what the test runs; its numbers mean nothing)")
    args = smollm2.parse(ap, argv)
    args.task = "needle_multiquery"          # every documented run's (a setting of SAME)
    if args.quick:
        args.layers, args.lengths, args.samples = 6, [256, 512], args.samples or 4
        args.dp, args.microbatches, args.seq_length = 2, 2, 1024
        args.loss_stride, args.pilot, args.block_size = 4, args.margin_from is None, 16
        args.needles = 2
    if args.samples is None:
        args.samples = 16 if args.pilot else 60
    if args.seed_base is None:
        args.seed_base = PILOT_SEED_BASE if args.pilot else MAIN_SEED_BASE
    elif args.seed_base < 0:
        ap.error(f"--seed-base {args.seed_base}: expected an integer >= 0")
    check_pilot(ap, args)
    if not 0 < args.control_factor < 1 or not 0 < args.density <= 1:
        ap.error(f"--control-factor {args.control_factor} and --density {args.density}: "
                 f"expected in (0, 1)")
    if args.samples < 2 or not 0 < args.lengths[0] <= args.lengths[1]:
        ap.error("--samples >= 2 and --lengths LO <= HI expected")
    if args.cache is None:
        run = "quick" if args.quick else ("pilot" if args.pilot else "main")
        args.cache = os.path.join(ROOT, "runs", "inference_quality", f"{run}.jsonl")
    return args


# ---- samples, plans and arms ---------------------------------------------------------------------

def make_samples(args, encode) -> list:
    import random

    from sparsebalance_megatron.eval import make_sample

    rng = random.Random(args.seed_base)
    return [make_sample(args.task, rng.randint(*args.lengths), round(rng.uniform(0.1, 0.9), 3),
                        args.seed_base + i, encode, num_needles=args.needles)
            for i in range(args.samples)]


def sb_config(args):
    from sparsebalance_megatron.config import SparseBalanceConfig

    return SparseBalanceConfig(sparse_balance=True, density=args.density,
                               block_size=args.block_size, dense_below_tokens="0",
                               raise_headroom="0")


def kept_share(tokens: int, d: float, block_size: int) -> float:
    """The share of one document's causal block pairs the selection keeps at density d (the
    forced sink and diagonal blocks included): the latency model's count."""
    from sparsebalance_megatron.latency.work import attention_work

    return attention_work([tokens], d, block_size) / attention_work([tokens], 1.0, block_size)


def work_mean(tokens: list, values: list, block_size: int) -> float:
    """The mean of per-document ``values`` weighted by each document's causal block pairs (a
    long document counts as its attention work does): how the study weighs kept densities."""
    from sparsebalance_megatron.latency.work import attention_work

    w = [attention_work([int(t)], 1.0, block_size) for t in tokens]
    return float(np.dot(w, values) / np.sum(w))


def study_kept(tokens: list, vectors: list, block_size: int) -> float:
    """Kept density over the study's documents, as planned: per document its groups' mean kept
    share, weighted by attention work (``work_mean``)."""
    return work_mean(tokens, [np.mean([kept_share(t, d, block_size) for d in v])
                              for t, v in zip(tokens, vectors)], block_size)


def matched_density(tokens: list, vectors: list, block_size: int, lo: float) -> float:
    """The uniform density whose study-level kept density is nearest ``vectors``'."""
    return common.matched_uniform(lambda d: study_kept(tokens, [(d,)] * len(tokens), block_size),
                                  study_kept(tokens, vectors, block_size), lo, steps=40)


def arms(args, arch, tokens: list) -> dict:
    """{arm: per sample its group vector}, the layouts' plans (per step what DST did, its
    predicted step, the equal-time density) and the kept densities the plans predict, all
    before any forward."""
    sb = sb_config(args)
    uni = lambda d: [smollm2.regroup([d], GROUPS)] * len(tokens)      # noqa: E731
    out = {"uniform": uni(args.density), "control": uni(args.control_factor * args.density)}
    layouts = {}
    for name in args.layouts:
        got = smollm2.runtime_plans(sb, arch, [t + 1 for t in tokens], dp=args.dp,
                                    microbatches=args.microbatches, pp=LAYOUTS[name],
                                    seq_length=args.seq_length)
        dst = [smollm2.regroup(v, GROUPS) for v in got["stage_densities"]]
        eq = [smollm2.regroup([got["steps"][u[0]]["equal_time_density"]], GROUPS)
              for u in got["unit"]]
        matched = matched_density(tokens, dst, args.block_size, args.density * 0.25)
        out.update({f"dst@{name}": dst, f"eqtime@{name}": eq,
                    f"matched@{name}": uni(matched)})
        layouts[name] = {"stage_layers": got["stage_layers"], "steps": got["steps"],
                         "unit": got["unit"], "matched_density": matched,
                         "stage_densities": got["stage_densities"].tolist()}
    kept = {a: study_kept(tokens, v, args.block_size) for a, v in out.items()}
    return {"vectors": out, "layouts": layouts, "kept_planned": kept}


# ---- the summary and the verdicts ----------------------------------------------------------------

def weighted(diffs, tokens) -> list:
    """Token-weighted paired differences: each sample's times its tokens over the mean tokens,
    so their mean is the token-weighted mean (a training loss's weighting) and the paired t
    bound is that mean's."""
    w = np.asarray(tokens, dtype=np.float64)
    return (np.asarray(diffs, dtype=np.float64) * w / w.mean()).tolist()


def pair(rows: list, a: str, b: str, metric: str, by_tokens: bool) -> list:
    d = [r["arms"][a][metric] - r["arms"][b][metric] for r in rows]
    return weighted(d, [r["tokens"] for r in rows]) if by_tokens else d


def summarize(doc: dict, args, margin: dict) -> dict:
    """Per arm the means (token-weighted loss beside the equal-weighted) and kept densities;
    per comparison the paired bounds; the verdicts."""
    from sparsebalance_megatron.eval import verdict as V

    rows = doc["samples"]
    if len(rows) < 2:
        return {}
    names = list(rows[0]["arms"])
    tok = np.asarray([r["tokens"] for r in rows], dtype=np.float64)
    arm_means = {a: {k: float(np.mean([r["arms"][a].get(k, np.nan) for r in rows]))
                     for k in SCORES} for a in names}
    for a in names:
        arm_means[a]["loss_token_weighted"] = float(
            np.dot(tok, [r["arms"][a]["loss"] for r in rows]) / tok.sum())
        # the kept density the kernel reported, weighted as the matched arm is chosen (a
        # per-sample match cannot hold: DST gives samples different densities, the matched
        # arm one)
        arm_means[a]["kept_work_weighted"] = work_mean(
            tok, [r["arms"][a]["kept"] for r in rows], args.block_size)
    out = {"n": len(rows), "arms": arm_means, "comparisons": {}, "verdicts": {}}
    ctl = {m: V.paired_bound(pair(rows, "control", "uniform", m, m == "loss")) for m in METRICS}
    for m in METRICS:
        ctl[m]["detected"] = ctl[m]["lower"] is not None and ctl[m]["lower"] > 0
    out["control"] = ctl
    for lay in args.layouts:
        for ref in ("uniform", "eqtime", "matched"):
            for m in METRICS:
                key = f"{lay}: dst - {ref} ({m}{', token-weighted' if m == 'loss' else ''})"
                d = pair(rows, f"dst@{lay}", ref if ref == "uniform" else f"{ref}@{lay}", m,
                         m == "loss")
                out["comparisons"][key] = V.paired_bound(d)
                if ref == "uniform":
                    out["verdicts"][key] = V.superiority(
                        d, pair(rows, "control", "uniform", m, m == "loss"))
                elif margin.get(m):
                    steps = doc["layouts"][lay]["steps"]
                    # equal time: per sample its step's predicted step, DST's and the
                    # equal-time arm's, over the static plan's (within 0.5%)
                    on = ("predicted step time",
                          [steps[u[0]]["predicted_step_vs_static"] for u in unit(doc, lay)],
                          [steps[u[0]]["equal_time_vs_static"] for u in unit(doc, lay)],
                          0.005) if ref == "eqtime" else (
                        "kept density (work-weighted, as reported by the kernel)",
                        arm_means[f"dst@{lay}"]["kept_work_weighted"],
                        arm_means[f"matched@{lay}"]["kept_work_weighted"], 0.01)
                    out["verdicts"][key] = V.verdict(
                        d, pair(rows, "control", "uniform", m, m == "loss"), margin[m],
                        kept=on[1], kept_reference=on[2], tolerance=on[3], matched_on=on[0])
        d = pair(rows, f"dst@{lay}", "uniform", "loss", False)
        out["comparisons"][f"{lay}: dst - uniform (loss, equal-weighted)"] = V.paired_bound(d)
    return out


def unit(doc: dict, lay: str) -> list:
    """Per scored sample its (step, rank, micro-batch) in layout ``lay``'s plan."""
    return [doc["layouts"][lay]["unit"][r["index"]] for r in doc["samples"]]


def pilot_plan(summary: dict, args) -> dict:
    """The margins (``--margin-fraction`` of the control's harm, per metric) and the n the
    power calculation asks for: the control detected, and DST found non-inferior to the
    equal-time arm, each at 80% power, from the pilot's SDs."""
    out = {"margin": {}, "n_needed": {}}
    lay = args.layouts[0]
    for m in METRICS:
        ctl = summary["control"][m]
        cmp = summary["comparisons"][f"{lay}: dst - eqtime ({m}"
                                     f"{', token-weighted' if m == 'loss' else ''})"]
        out["margin"][m], need = common.pilot_margin(args, ctl["mean"], ctl["sd"], cmp["sd"])
        if need:
            out["n_needed"][m] = need
    return out


def read_margin(args) -> dict:
    """The pilot's margins, refused if the pilot is not one, ran in another setting, or scored
    any of this run's samples (seeds ``seed_base`` .. + ``samples``)."""
    out = common.read_margin(
        args, SAME, n=lambda p: p["summary"]["n"],
        control_harm=lambda p: {m: p["summary"]["control"][m]["mean"] for m in METRICS},
        seeds=lambda p: [p["config"]["seed_base"], p["config"]["seed_base"]
                         + p["config"]["samples"]])
    lo, hi = out["margin_source"]["seeds"]
    if lo < args.seed_base + args.samples and args.seed_base < hi:
        raise SystemExit(f"--seed-base {args.seed_base} with --samples {args.samples}: the "
                         f"pilot {args.margin_from} scored seeds {lo}-{hi - 1}; expected seeds "
                         f"it never used")
    return out


# ---- the run -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    fixed = read_margin(args) if args.margin_from else {}         # before any forward
    enc = smollm2.encoder(smollm2.tokenizer())
    samples = make_samples(args, enc)
    tokens = [smollm2.tokens(s) for s in samples]
    a = smollm2.arch(args.layers)
    planned = arms(args, a, tokens)
    vectors = planned["vectors"]
    names = list(vectors)
    jobs = list(dict.fromkeys((i, vectors[n][i]) for i in range(len(samples)) for n in names))
    print(f"{len(samples)} samples, {len(names)} arms, {len(jobs)} forwards; " + "; ".join(
        f"{lay}: " + ", ".join(f"step {k}: cut {s['units_cut']} raised {s['units_raised']} "
                               f"{s['adopted'] or ''} pred {s['predicted_step_vs_static']:.4f}"
                               f" eq {s['equal_time_density']:.3f}"
                               for k, s in enumerate(p["steps"]))
        for lay, p in planned["layouts"].items()), flush=True)
    got, = smollm2.measure(args, (jobs, samples, smollm2.Cache(args.cache)))
    if args.shard[1] > 1:
        print(f"shard {args.shard[0]}/{args.shard[1]} done")
        return 0
    row = dict(zip(jobs, got))
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json"}, **fixed,
           "arms": {n: sorted({v for v in vectors[n]}) for n in names},
           "layouts": planned["layouts"], "kept_density_planned": planned["kept_planned"],
           "samples": []}
    for i, s in enumerate(samples):
        doc["samples"].append({
            "index": i, "task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed,
            "tokens": tokens[i], "vectors": {n: list(vectors[n][i]) for n in names},
            "arms": {n: {k: row[i, vectors[n][i]].get(k) for k in SCORES}
                     for n in names}})
    doc["summary"] = summarize(doc, args, (fixed.get("margin") or {}))
    if args.pilot:
        doc.update(pilot_plan(doc["summary"], args))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.json, doc)
    from sparsebalance_megatron.eval.verdict import one_line
    for k, v in doc["summary"].get("verdicts", {}).items():
        print(f"{k}: " + (one_line(v) if "comparison" in v else
                          f"{v['verdict']}: {v['mean']:+.4f} [{v['lower']:+.4f}, "
                          f"{v['upper']:+.4f}]"))
    for m, c in doc["summary"].get("control", {}).items():
        print(f"control - uniform ({m}): {c['mean']:+.4f} (lower {c['lower']:+.4f}, "
              f"{'detected' if c['detected'] else 'not detected'})")
    if args.pilot:
        print(f"margins {doc['margin']}, n needed {doc['n_needed']}")
    return 0
