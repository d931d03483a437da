"""``continued_quality``'s summary: per-seed metrics, paired bounds, the verdicts, the pilot's
margin and power calculation, and the margin a main run reads from its pilot."""

from __future__ import annotations

from .common import read_pilot

METRICS = ("answer_nll", "heldout_loss")
SHOWN = METRICS + ("token_accuracy", "exact", "train_kept")
# settings a pilot's margin holds for: the main run refuses a pilot that ran with others
SAME = ("density", "control_factor", "needles", "block_size", "num_layers", "hidden_size",
        "heads", "seq_length", "pipeline", "global_batch_size", "continue_lr", "base_steps", "steps",
        "train_docs", "min_doc", "base_min_doc", "heldout", "data_seed", "table")


def per_seed(run: dict, density=None) -> dict:
    """A run's scores at ``density`` (default: its arm's evaluation density)."""
    ev = run["eval"][f"{run['eval_density'] if density is None else density:g}"]
    return {"answer_nll": ev["answer_nll"], "heldout_loss": ev["heldout_loss"],
            "token_accuracy": ev["token_accuracy"], "exact": ev["exact"],
            "train_kept": run["train"].get("doc_kept_density")}


STEP_TOLERANCE = 0.005   # DST's predicted step may be at most 0.5% slower than static's


def equal_time(table: dict, seeds: list, runs: dict, args, margin: dict) -> dict:
    """``sparse_balance`` against ``static`` at a predicted step no slower than static's, both
    scored at d0 (the same held-out condition: what training under DST's plan did to the
    model): per metric the non-inferiority verdict (the arms matched on DST's predicted step
    over static's, a faster one counted as equal) and the superiority reading (free accuracy:
    better where the upper bound is below 0), each with the control."""
    from sparsebalance_megatron.eval import verdict as V

    sb = {s: per_seed(runs["sparse_balance"][s], args.density) for s in seeds}
    ratio = [runs["sparse_balance"][s]["train"].get("predicted_step_vs_static") for s in seeds]
    if any(r is None for r in ratio):
        return {}
    out = {}
    for k in METRICS:
        d = [sb[s][k] - table["static"][s][k] for s in seeds]
        ctl = [table["control"][s][k] - table["static"][s][k] for s in seeds]
        out[k] = {"better": V.superiority(d, ctl), "predicted_step_vs_static": ratio}
        if margin.get(k):
            out[k]["non_inferior"] = V.verdict(
                d, ctl, margin[k], kept=[max(r, 1.0) for r in ratio],
                kept_reference=[1.0] * len(seeds), tolerance=STEP_TOLERANCE,
                matched_on="predicted step time over static's (a faster one as equal)")
    return out


def summarize(doc: dict, args) -> dict:
    """Means per arm, paired per-seed bounds, the verdicts (with a margin), whether static
    holds the task (token accuracy >= 3x chance), and for a pilot the margin and the seeds the
    power calculation asks for."""
    from sparsebalance_megatron.eval import verdict as V

    runs, seeds = doc["runs"], [str(s) for s in args.seeds]
    arms = [a for a in runs if a != "base"]
    table = {a: {s: per_seed(runs[a][s]) for s in seeds} for a in arms}
    means = {a: {k: sum(table[a][s][k] for s in seeds) / len(seeds) for k in SHOWN
                 if all(table[a][s][k] is not None for s in seeds)} for a in arms}
    diffs = {f"{a}-{b}": {k: [table[a][s][k] - table[b][s][k] for s in seeds]
                          for k in SHOWN if k in means[a] and k in means[b]}
             for a, b in doc_pairs(arms)}
    pairs = {p: {k: dict(V.paired_bound(v), per_seed=v) for k, v in d.items()}
             for p, d in diffs.items()}
    chance = doc["chance"]["token_accuracy"]
    out = {"per_seed": table, "means": means, "pairs": pairs,
           "static_holds_task": None if "static" not in means else {
               "token_accuracy": means["static"]["token_accuracy"], "chance": chance,
               "x_chance": means["static"]["token_accuracy"] / chance,
               "held": means["static"]["token_accuracy"] >= 3 * chance}}
    margin = doc.get("margin")
    if margin and "sparse_balance-matched" in diffs and "control-static" in diffs:
        out["verdicts"] = {k: V.verdict(
            diffs["sparse_balance-matched"][k], diffs["control-static"][k], margin[k],
            kept=[table["sparse_balance"][s]["train_kept"] for s in seeds],
            kept_reference=[table["matched"][s]["train_kept"] for s in seeds],
            tolerance=args.match_tolerance) for k in METRICS if margin.get(k)}
    if all(a in arms for a in ("sparse_balance", "static", "control")):
        out["verdicts_equal_time"] = equal_time(table, seeds, runs, args, margin or {})
    if args.pilot and "control-static" in pairs:
        out["margin"], out["seeds_needed"] = {}, {}
        for k in METRICS:
            c = pairs["control-static"][k]
            out["margin"][k] = args.margin_fraction * c["mean"] if c["mean"] > 0 else None
            if c["mean"] > 0 and c["sd"]:
                # the arm comparison's SD is not measured by the pilot: the control's paired SD
                # (two continued runs on the same data order) stands in for it
                out["seeds_needed"][k] = {"control": V.n_needed(c["sd"], c["mean"]),
                                          "non_inferior": V.n_needed(c["sd"], out["margin"][k])}
    return out


# the paired comparisons the summary reports, (arm, against)
PAIRS = (("sparse_balance", "matched"), ("control", "static"), ("sab", "static"),
         ("sparse_balance", "sab"), ("sparse_balance", "static"), ("matched", "static"))


def doc_pairs(arms: list) -> list:
    return [(a, b) for a, b in PAIRS if a in arms and b in arms]


def read_margin(args) -> dict:
    """The pilot's margin, refused if the pilot is not one or ran with other settings."""
    pilot = read_pilot(args.margin_from, SAME, args, before={"pipeline": 1})
    return {"margin": pilot["margin"], "margin_source": {
        "path": args.margin_from, "commit": pilot.get("commit"),
        "seeds": pilot["config"]["seeds"], "fraction": pilot["config"]["margin_fraction"],
        "control_harm": {k: pilot["pairs"]["control-static"][k]["mean"] for k in METRICS}}}


def print_summary(doc: dict) -> None:
    from sparsebalance_megatron.eval.verdict import one_line

    print("\n| arm | eval density | " + " | ".join(SHOWN) + " |")
    print("|---|---:|" + "---:|" * len(SHOWN))
    for a, m in doc["means"].items():
        print(f"| {a} | {doc['arms'][a]['eval_density']:.4f} | "
              + " | ".join(f"{m[k]:.4f}" if k in m else "-" for k in SHOWN) + " |")
    for p, ms in doc["pairs"].items():
        print(f"{p}: " + ", ".join(
            f"{k} {v['mean']:+.4f}" + ("" if v["upper"] is None else
                                       f" [{v['lower']:+.4f}, {v['upper']:+.4f}]")
            for k, v in ms.items() if k in METRICS + ("train_kept",)))
    if doc.get("static_holds_task"):
        h = doc["static_holds_task"]
        print(f"static holds the task: token accuracy {h['token_accuracy']:.3f} = "
              f"{h['x_chance']:.1f}x chance ({'held' if h['held'] else 'NOT held'})")
    for k, v in (doc.get("verdicts") or {}).items():
        print(f"verdict {k}: {one_line(v)}")
    for k, v in (doc.get("verdicts_equal_time") or {}).items():
        b = v["better"]
        print(f"equal step time, sparse_balance - static at d0, {k}: {b['verdict']} "
              f"{b['mean']:+.5f}" + ("" if b["upper"] is None else
                                     f" [{b['lower']:+.5f}, {b['upper']:+.5f}]")
              + (f"; {one_line(v['non_inferior'])}" if "non_inferior" in v else ""))
    if doc.get("margin") and doc["config"]["pilot"]:
        print(f"margin fixed: {doc['margin']}; seeds needed: {doc.get('seeds_needed')}")
