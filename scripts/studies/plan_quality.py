"""The quality model DST plans by, measured and checked on whole plans it has not seen (issue 84):
SmolLM2-135M's held-out loss against the density of each depth group of its layers, per sample
length, fitted convex, its uncertainty by bootstrap; then its predictions of whole plans scored
against measured loss on samples never used to fit it (BENCHMARKS.md, "The quality model";
QUALITY.md). ``--validate --refresh``: the in-run quality refresh's probe measured on fresh
held-out micro-batches, the plans scored by each refreshed model. Every forward is cached
(``--cache``): a run stopped part-way continues where it stopped; ``--jobs N`` splits them over
N processes.

    .venv/bin/python scripts/bench.py plan_quality --calibrate --quick --json /tmp/pq.json  # smoke
"""

from __future__ import annotations

import os
import random

import numpy as np

from sparsebalance_megatron.data.packing import sequential_bins
from sparsebalance_megatron.quality.cost import DEFAULT_QUALITY_COST as DEFAULT_MODEL

from . import smollm2
from .smollm2 import Cache, measure
from .common import ROOT, parser, spearman, write_result

GROUPS = 3                       # depth groups: thirds of the model's layers
# every calibration sample's vectors (one density per group; d0 0.5 is the reference)
CALIBRATION = ([(0.5, 0.5, 0.5)]
               + [tuple(d if g == k else 0.5 for g in range(GROUPS))
                  for k in range(GROUPS) for d in (0.3, 0.4, 0.7, 1.0)]
               + [(d, d, d) for d in (0.3, 0.4, 0.7, 1.0)]
               + [(1.0, 1.0, 0.35), (0.35, 0.7, 0.7), (0.7, 0.35, 1.0)])
CALIBRATION_SEED_BASE = 200_000
VALIDATION_SEED_BASE = 300_000


def parse_args(argv=None):
    ap = parser(__doc__, "plan_quality")
    step = ap.add_mutually_exclusive_group(required=True)
    step.add_argument("--calibrate", action="store_true", help="measure and fit the model")
    step.add_argument("--validate", action="store_true", help="check it on unseen plans")
    ap.add_argument("--samples", type=int, default=None,
                    help="calibration 16, validation 24 (--quick: 3)")
    ap.add_argument("--density", type=float, default=0.5, help="d0, the reference")
    smollm2.add_measure_args(ap, "plan_quality", threads=2, quick_layers=3)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="--validate: the model checked")
    ap.add_argument("--seed", type=int, default=0, help="--validate: the random plans' seed")
    ap.add_argument("--refresh", action="store_true",
                    help="--validate: also measure the in-run quality refresh's probe on fresh "
                         "held-out micro-batches and score the plans by the refreshed models")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 3 layers, 3 samples of 256-512 tokens, block 16")
    args = smollm2.parse(ap, argv)
    # the text kinds, the calibration's cache (--validate refits it without its optional
    # terms) and the refresh's held-out micro-batches of 8K (the runtime's: one a DP rank)
    args.kinds = ["needle_multikey", "text_code", "needle_single", "text_prose"]
    quick = "_quick" if args.quick else ""
    args.calibration_cache = os.path.join(ROOT, "runs", "plan_quality", f"calibrate{quick}.jsonl")
    args.refresh_cache = os.path.join(ROOT, "runs", "plan_quality", f"refresh{quick}.jsonl")
    args.refresh_microbatches = 4
    if args.quick:
        args.layers, args.lengths, args.block_size = 3, [256, 512], 16
        args.samples = args.samples or 3
    if args.samples is None:
        args.samples = 16 if args.calibrate else 24
    step = "calibrate" if args.calibrate else "validate"
    if args.cache is None:
        args.cache = os.path.join(ROOT, "runs", "plan_quality", f"{step}{quick}.jsonl")
    if args.refresh and not args.validate:
        ap.error("--refresh goes with --validate")
    return args


def num_layers(args) -> int:
    return args.layers or smollm2.arch().num_layers


def calibrate(args) -> int:
    enc = smollm2.encoder(smollm2.tokenizer())
    samples = smollm2.samples(args.kinds, args.samples, args.lengths, CALIBRATION_SEED_BASE, enc)
    jobs = [(i, v) for i in range(len(samples)) for v in CALIBRATION]
    print(f"{len(samples)} calibration samples x {len(CALIBRATION)} vectors = {len(jobs)} "
          f"forwards (cache {args.cache})", flush=True)
    rows, = measure(args, (jobs, samples, Cache(args.cache)))
    if args.shard[1] > 1:
        print(f"shard {args.shard[0]}/{args.shard[1]} done")
        return 0
    from sparsebalance_megatron.eval import quality_fit

    model, report = quality_fit.fit(rows, d0=args.density, groups=GROUPS,
                                    num_layers=num_layers(args),
                                    model_name=f"SmolLM2-135M ({num_layers(args)} layers, "
                                               f"block {args.block_size})",
                                    text=" + ".join(args.kinds),
                                    block_size=args.block_size, terms=())   # --validate scores them
    if not args.quick:
        model.save(DEFAULT_MODEL)
        print(f"wrote {os.path.relpath(DEFAULT_MODEL, ROOT)}")
    write_result(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                             "vectors": [list(v) for v in CALIBRATION],
                             "model": model.as_dict(), "fit": report, "rows": rows})
    print(quality_fit.summary(report))
    return 0


# ---- the check on plans the model has not seen ---------------------------------------------

MENU = ((0.35, 0.35, 0.35), (0.8, 0.8, 0.8),
        (0.8, 0.5, 0.3), (0.3, 0.5, 0.8), (1.0, 1.0, 0.35), (0.35, 0.35, 1.0),
        (1.0, 0.4), (0.4, 0.8))
REFERENCE = (0.5, 0.5, 0.5)
VALIDATION_SEED_BASE = 300_000
BATCHES = 2
LAYOUTS = (("quality", 3), ("quality", 2), ("density", 3))    # DST's own plans: objective, PP
DP, MICROBATCHES, SEQ = 4, 2, 8192
OLD_MODEL = os.path.join(ROOT, "docs", "results", "quality_cost_smollm2.json")


def plans(lengths: list, seed: int = 0) -> list:
    """The checked plans, from the samples' lengths alone: (name, {sample: vector})."""
    rng = random.Random(seed)
    out = []
    n = len(lengths)
    for b in range(BATCHES):
        idx = list(range(b * n // BATCHES, (b + 1) * n // BATCHES))
        mbs = [[idx[j] for j in mb] for mb in sequential_bins([lengths[i] for i in idx], SEQ)]
        for v in MENU:                                              # every micro-batch alike
            out.append((f"b{b} all {v}", {i: v for mb in mbs for i in mb}))
        mean_len = [np.mean([lengths[i] for i in mb]) for mb in mbs]
        long = [mb for mb, x in zip(mbs, mean_len) if x >= np.median(mean_len)]
        short = [mb for mb, x in zip(mbs, mean_len) if x < np.median(mean_len)]
        pairs = [((0.35,) * 3, (0.8,) * 3), ((0.8,) * 3, (0.35,) * 3),
                 ((0.35,) * 3, REFERENCE), (REFERENCE, (0.35,) * 3),
                 ((1.0, 1.0, 0.35), (0.35,) * 3), ((0.35,) * 3, (1.0, 1.0, 0.35)),
                 ((0.3, 0.5, 0.8), (0.8, 0.5, 0.3)), ((1.0, 0.4), (0.4, 0.8))]
        for a, c in pairs:                          # density moved between long and short
            plan = {i: a for mb in long for i in mb}
            plan.update({i: c for mb in short for i in mb})
            out.append((f"b{b} long {a} short {c}", plan))
        for r in range(8):                          # each micro-batch its own menu vector
            plan = {}
            for mb in mbs:
                v = MENU[rng.randrange(len(MENU))]
                plan.update({i: v for i in mb})
            out.append((f"b{b} random {r}", plan))
    return out


def dst_plans(args, a, lengths: list) -> list:
    """DST's own plans of each batch: (name, {sample: its micro-batch's stage vector})."""
    from sparsebalance_megatron.config import SparseBalanceConfig

    out, n = [], len(lengths)
    for objective, pp in LAYOUTS:
        sb = SparseBalanceConfig(sparse_balance=True, density=args.density,
                                 block_size=args.block_size, dense_below_tokens="0",
                                 raise_headroom="0", dst_objective=objective,
                                 quality_cost=args.model)
        for b in range(BATCHES):
            idx = list(range(b * n // BATCHES, (b + 1) * n // BATCHES))
            got = smollm2.runtime_plans(sb, a, [lengths[i] + 1 for i in idx], dp=DP,
                                        microbatches=MICROBATCHES, pp=pp, seq_length=SEQ)
            plan = {i: tuple(round(float(x), 6) for x in got["stage_densities"][j])
                    for j, i in enumerate(idx)}
            out.append((f"b{b} DST {objective} PP {pp}", plan, got["steps"]))
    return out


def predictor(cost, d0: float, layers: int):
    """predict(vector, length) -> the model's per-token change against uniform d0."""
    from sparsebalance_megatron.quality.stages import StageQuality

    def predict(vec, length):
        q = StageQuality.from_cost(cost, [layers / len(vec)] * len(vec), d0)
        return float(q.doc_change(np.asarray([vec], dtype=np.float64), [length])[0])

    def spread(vec, length):
        q = StageQuality.from_cost(cost, [layers / len(vec)] * len(vec), d0)
        reps = [float(q.doc_change(np.asarray([vec]), [length], r)[0])
                for r in range(len(cost.bootstrap))]
        return reps

    return predict, spread


def score_plans(checked: list, rows: dict, samples: list, models: dict) -> list:
    """Per plan: measured change (token-weighted) and its SE, each model's prediction."""
    out = []
    for name, plan, *steps in checked:
        ids = sorted(plan)
        w = np.array([smollm2.tokens(samples[i]) for i in ids], dtype=np.float64)
        d = np.array([rows[i, plan[i]]["loss"] - rows[i, REFERENCE]["loss"] for i in ids])
        mean = float(np.dot(w, d) / w.sum())
        se = float(np.sqrt(np.sum(w ** 2 * (d - mean) ** 2) / w.sum() ** 2
                           * len(ids) / max(len(ids) - 1, 1)))
        row = {"plan": name, "samples": len(ids), "measured": mean, "se": se,
               "kept": float(np.dot(w, [rows[i, plan[i]]["kept"] for i in ids]) / w.sum()),
               "predicted": {}}
        for key, (predict, spread) in models.items():
            p = [predict(plan[i], samples[i].length) for i in ids]
            row["predicted"][key] = float(np.dot(w, p) / w.sum())
            if spread is not None:
                reps = np.array([spread(plan[i], samples[i].length) for i in ids])   # [n, B]
                if reps.size:
                    row["uncertainty"] = float((w @ reps / w.sum()).std(ddof=1))
        if steps:
            row["dst_steps"] = steps[0]
        out.append(row)
    return out


def refreshed_models(path: str, found: dict, d0: float, layers: int) -> dict:
    """{name: (predict, None)} of the model at ``path`` refreshed by each of ``found``'s scales,
    as a run plans with them (``scaled_quality_cost``)."""
    from sparsebalance_megatron.quality.refresh import scaled_quality_cost

    return {name: (predictor(scaled_quality_cost(path, tuple(float(x) for x in s)), d0,
                             layers)[0], None) for name, s in found.items()}


def metrics(scored: list, key: str) -> dict:
    """Spearman of predicted against measured, and the sign rule on the clear plans."""
    pred = np.array([r["predicted"][key] for r in scored])
    meas = np.array([r["measured"] for r in scored])
    se = np.array([r["se"] for r in scored])
    clear = np.abs(meas) > 2 * se
    right = np.sign(pred[clear]) == np.sign(meas[clear])
    rho = spearman(pred, meas) if len(scored) > 2 else float("nan")
    return {"plans": len(scored), "spearman": rho, "pearson": float(np.corrcoef(pred, meas)[0, 1]),
            "mae": float(np.mean(np.abs(pred - meas))), "clear": int(clear.sum()),
            "sign_right": int(right.sum()),
            "sign_right_share": float(right.mean()) if clear.any() else float("nan")}


# ---- the in-run refresh, measured on the trained model ---------------------------------------

REFRESH_SEED_BASE = 400_000
QUICK_SEQ = 1024                 # --quick's micro-batches (its samples are 256-512 tokens)


def refresh_vectors(d0: float, groups: int = GROUPS) -> list:
    """The probe's passes as group vectors: uniform d0, then each group alone at
    ``probe_tested(d0)`` (the runtime's order)."""
    t = probe_tested(d0)
    return [(float(d0),) * groups] + [tuple(t if g == k else float(d0) for g in range(groups))
                                      for k in range(groups)]


def held_out_bins(lengths: list, count: int, seq: int = SEQ) -> list:
    """The first ``count`` micro-batches (sample indices) by the fill rule, each closed (the
    next sample did not fit): the runtime's held-out micro-batches, one a DP rank."""
    bins = sequential_bins(lengths, seq)
    if len(bins) <= count:
        raise ValueError(f"{len(lengths)} samples fill {len(bins)} micro-batches: {count} "
                         f"closed ones need more")
    return bins[:count]


def probe_tested(d0: float) -> float:
    """The probe's density: ``probe_density(d0)`` at the runtime's ratio."""
    from sparsebalance_megatron.quality.refresh import probe_density

    return round(probe_density(d0), 6)


def probe_refresh(cost, d0: float, docs: list, stride: int) -> dict:
    """The refresh the runtime would make of the measured documents: ``docs`` one per document,
    (its length, [rows of the passes of ``refresh_vectors``] with ``loss`` and ``tokens``),
    through the probe's ``pass_stats`` and ``changes`` and the policy's ``refresh_scales``."""
    from sparsebalance_megatron.megatron.step.quality_probe import changes, pass_stats
    from sparsebalance_megatron.quality.refresh import (predicted_changes, refresh_scales,
                                                               shrink_weight)

    g = len(cost.groups)
    per_pass = []
    for k in range(g + 1):
        scored = np.array([len(range(0, rows[k]["tokens"], stride)) for _, rows in docs],
                          dtype=np.float64)
        loss = np.array([rows[k]["loss"] for _, rows in docs], dtype=np.float64)
        per_pass.append(np.stack([loss * scored, scored], axis=1))
    change, se, base_loss = changes(pass_stats(per_pass), g)
    lengths = np.array([n for n, _ in docs], dtype=np.float64)
    tested = [probe_tested(d0)] * g
    predicted = predicted_changes(cost, d0, tested, lengths, lengths)
    scales = refresh_scales(cost, d0, tested, change, se, lengths=lengths, tokens=lengths)
    return {"documents": len(docs), "tokens": int(lengths.sum()), "held_out_loss": base_loss,
            "tested_density": tested[0], "measured": change.tolist(), "se": se.tolist(),
            "predicted": predicted.tolist(), "ratio": (change / predicted).tolist(),
            "weight": shrink_weight(change, se).tolist(),
            "scales": scales.tolist()}


def refresh_counts(n: int) -> list:
    """The micro-batch counts reported: 1, 2, 4, ... below ``n``, and ``n``."""
    return [k for k in (1, 2, 4, 8, 16, 32) if k < n] + [n]


def refresh_task(args) -> tuple:
    """--refresh: the probe's forwards on fresh held-out micro-batches, micro-batch by
    micro-batch (a run stopped part-way has the first ones whole): ``(jobs, samples, cache)``
    for ``measure``, the micro-batches (lists of sample indices) and the documents' lengths."""
    enc = smollm2.encoder(smollm2.tokenizer())
    seq = QUICK_SEQ if args.quick else SEQ
    n = (seq // args.lengths[0] + 1) * (args.refresh_microbatches + 1)
    samples = smollm2.samples(args.kinds, n, args.lengths, REFRESH_SEED_BASE, enc)
    lengths = [smollm2.tokens(s) + 1 for s in samples]      # a document: prompt + answer
    bins = held_out_bins(lengths, args.refresh_microbatches, seq)
    vectors = refresh_vectors(args.density)
    jobs = [(i, v) for mb in bins for i in mb for v in vectors]
    print(f"refresh: {len(bins)} held-out micro-batches of {sum(map(len, bins))} documents, "
          f"{len(jobs)} forwards (cache {args.refresh_cache})", flush=True)
    return (jobs, samples, Cache(args.refresh_cache)), bins, lengths


def refresh_report(args, cost, task: tuple, bins: list, lengths: list, got: list) -> tuple:
    """The refreshes made of the first 1, 2, 4, ... held-out micro-batches' forwards ``got``
    (``task``'s rows): (the report [per count of micro-batches], {name: scales})."""
    jobs, samples, _ = task
    vectors = refresh_vectors(args.density)
    rows = {(i, tuple(v)): r for (i, v), r in zip(jobs, got)}
    report, found = [], {}
    for k in refresh_counts(len(bins)):
        docs = [(lengths[i], [rows[i, v] for v in vectors]) for mb in bins[:k] for i in mb]
        r = {"microbatches": k, **probe_refresh(cost, args.density, docs, args.loss_stride),
             "samples": [smollm2.key(samples[i]) for mb in bins[:k] for i in mb]}
        report.append(r)
        found[f"refreshed on {k} held-out micro-batch{'es' if k > 1 else ''}"] = r["scales"]
        print(f"refresh on {k} micro-batch(es), {r['documents']} documents: measured "
              f"{_fmt(r['measured'])} +- {_fmt(r['se'])}, predicted {_fmt(r['predicted'])}; "
              f"scales {_fmt(r['scales'])}", flush=True)
    return report, found


def _fmt(values) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in values) + "]"


def validate(args) -> int:
    from sparsebalance_megatron.eval import quality_fit
    from sparsebalance_megatron.quality.cost import QualityCost

    enc = smollm2.encoder(smollm2.tokenizer())
    samples = smollm2.samples(args.kinds, args.samples, args.lengths, VALIDATION_SEED_BASE, enc)
    lengths = [smollm2.tokens(s) for s in samples]
    checked = plans(lengths, seed=args.seed)
    own = [] if args.quick else dst_plans(args, smollm2.arch(), lengths)
    vectors = {REFERENCE, *MENU, *{v for _, p, _ in own for v in p.values()}}
    jobs = [(i, v) for i in range(len(samples)) for v in sorted(vectors)
            if v in (REFERENCE, *MENU) or any(p.get(i) == v for _, p, _ in own)]
    print(f"{len(samples)} held-out samples, {len(checked) + len(own)} plans, {len(jobs)} "
          f"forwards (cache {args.cache})", flush=True)
    refresh, bins, doc_lengths = refresh_task(args) if args.refresh else (None, None, None)
    got, *refresh_got = measure(args, (jobs, samples, Cache(args.cache)),
                                *([refresh] if refresh else []))
    if args.shard[1] > 1:
        print(f"shard {args.shard[0]}/{args.shard[1]} done")
        return 0
    rows = {(i, tuple(v)): r for (i, v), r in zip(jobs, got)}
    layers = num_layers(args)
    model = QualityCost.load(args.model)
    models = {"fitted": predictor(model, args.density, layers)}
    refreshed = {}
    if args.refresh:
        report, refreshed = refresh_report(args, model, refresh, bins, doc_lengths,
                                            refresh_got[0])
        models.update(refreshed_models(args.model, refreshed, args.density, layers))
    calib = [r for r in Cache(args.calibration_cache).rows.values()] \
        if os.path.exists(args.calibration_cache) else []
    if calib:                       # the same measurement fitted with the optional terms
        for terms in (("length",), ("interaction",), ("length", "interaction")):
            variant, _ = quality_fit.fit(calib, d0=args.density, groups=GROUPS,
                                         num_layers=layers, model_name="", text="",
                                         block_size=args.block_size, replicates=0, terms=terms)
            models["with " + " and ".join(terms)] = (
                predictor(variant, args.density, layers)[0], None)
    if os.path.exists(OLD_MODEL):
        models["essay windows, one group at a time (before)"] = (
            predictor(QualityCost.load(OLD_MODEL), args.density, layers)[0], None)
    scored = score_plans(checked + own, rows, samples, models)
    result = {k: metrics(scored, k) for k in models}
    moves = [r for r in scored if " all " not in r["plan"]]     # density moved between units
    result_moves = {k: metrics(moves, k) for k in models}
    dst_only = [r for r in scored if "dst_steps" in r]
    for r in scored:
        if "uncertainty" in r:
            r["within"] = bool(abs(r["predicted"]["fitted"] - r["measured"]) <= 2 * np.hypot(
                r["se"], r["uncertainty"]))
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json"},
           "menu": [list(v) for v in MENU], "calibration_vectors": [list(v) for v in CALIBRATION],
           "metrics": result, "metrics_moves_only": result_moves,
           "dst_plans": [{k: r[k] for k in ("plan", "measured", "se", "predicted", "dst_steps")}
                         for r in dst_only],
           "coverage_2sd": float(np.mean([r["within"] for r in scored if "within" in r]))
           if any("within" in r for r in scored) else None,
           "plans": scored, "rows": got}
    if args.refresh:
        doc["refresh"] = {"seed_base": REFRESH_SEED_BASE, "by_microbatches": report,
                          "launch_model": "fitted", "models": refreshed}
    write_result(args.json, doc)
    for k, m in result.items():
        print(f"{k}: Spearman {m['spearman']:.3f} over {m['plans']} plans, sign right "
              f"{m['sign_right']}/{m['clear']} clear ones, MAE {m['mae']:.4f}")
    for r in dst_only:
        print(f"{r['plan']}: measured {r['measured']:+.4f} (SE {r['se']:.4f}), predicted "
              f"{r['predicted']['fitted']:+.4f}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.calibrate:
        return calibrate(args)
    return validate(args)
