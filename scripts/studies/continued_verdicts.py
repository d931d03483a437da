"""The continued-training study's summary (``continued_quality``): per-seed scores, paired
bounds, the verdicts at each reading (``READINGS``), the pilot's margin and power calculation,
and the margin a main run reads from its pilot. Pure reading of the study's JSON document: it
trains and scores nothing."""

from __future__ import annotations

from . import common

DST_ARMS = ("sparse_balance", "refresh")
METRICS = ("answer_nll", "heldout_loss")


def reading_key(reading) -> str:
    """The name of an evaluation ``reading``: a uniform density (``0.5``) or one density per
    decoder layer (``layers 0.6012/0.4981/0.4421``)."""
    if isinstance(reading, (int, float)):
        return f"{reading:g}"
    return "layers " + "/".join(f"{float(d):.4f}" for d in reading)


# the summary: per-seed metrics, paired bounds, the verdicts, the pilot's margin and power
# calculation, and the margin a main run reads from its pilot
SHOWN = METRICS + ("token_accuracy", "exact", "train_kept")
# settings a pilot's margin holds for: the main run refuses a pilot that ran with others
SAME = ("density", "control_factor", "needles", "block_size", "num_layers", "hidden_size",
        "heads", "seq_length", "pipeline", "global_batch_size", "continue_lr", "base_steps", "steps",
        "train_docs", "min_doc", "base_min_doc", "heldout", "data_seed", "table")


def per_seed(run: dict, reading=None) -> dict:
    """A run's scores at ``reading`` (a density or a ``reading_key``; default: its arm's
    evaluation density)."""
    key = reading if isinstance(reading, str) else reading_key(
        run["eval_density"] if reading is None else reading)
    ev = run["eval"][key]
    return {"answer_nll": ev["answer_nll"], "heldout_loss": ev["heldout_loss"],
            "token_accuracy": ev["token_accuracy"], "exact": ev["exact"],
            "train_kept": run["train"].get("doc_kept_density"), "eval_kept": ev.get("kept")}


STEP_TOLERANCE = 0.005   # DST's predicted step may be at most 0.5% slower than static's
# the verdicts beside the matched one: group -> name -> (arm, its reading, against, its reading,
# matched on). A reading: "d0", "1" (dense) or "profile" (the run's trained per-layer densities
# scaled to d0's kept work; a static run reads its seed's DST profile); matched on "step" (the
# first arm's predicted step over static's no slower than the second's) or "kept" (the kept
# density the attention reported at evaluation)
READINGS = {
    # what training under DST's plan did, both read at d0 ("equal_time": the group is its row)
    "verdicts_equal_time": {"equal_time": ("sparse_balance", "d0", "static", "d0", "step")},
    # each network read as it trained at equal attention work, both at DST's profile, both dense
    "verdicts_as_trained": {
        "trained_profile_at_d0_work": ("sparse_balance", "profile", "static", "d0", "kept"),
        "both_at_dsts_profile": ("sparse_balance", "profile", "static", "profile", "kept"),
        "dense": ("sparse_balance", "1", "static", "1", "kept")},
    # the quality model refreshed from the network in training, against the launch-time model
    "verdicts_refresh": {
        "at_d0": ("refresh", "d0", "sparse_balance", "d0", "step"),
        "as_trained_at_d0_work": ("refresh", "profile", "sparse_balance", "profile", "step")}}


def reading_of(run: dict, how: str, args):
    """``run``'s evaluation key read ``how`` (a ``READINGS`` reading); None if not scored."""
    key = {"d0": reading_key(args.density), "1": "1"}.get(how) or (
        reading_key(run["equal_work_profile"]) if "equal_work_profile" in run else None)
    return key if key in run["eval"] else None


def compared(seeds: list, runs: dict, args, margin: dict, arm: str, how: str, other: str,
             other_how: str, matched: str) -> dict:
    """Per metric, ``arm`` read ``how`` minus ``other`` read ``other_how``, paired by seed: the
    superiority reading (free accuracy: better where the upper bound is below 0) and, with a
    margin, the non-inferiority verdict matched as ``READINGS`` says (a faster step counted as
    equal), each with the control (each control run at its own density against static at d0).
    {} where a run lacks the reading or a DST run its predicted step."""
    from sparsebalance_megatron.eval import verdict as V

    keys = [[reading_of(runs[a][s], h, args) for s in seeds] for a, h in ((arm, how),
                                                                          (other, other_how))]
    if None in keys[0] + keys[1]:
        return {}
    a, b = ({s: per_seed(runs[x][s], k) for s, k in zip(seeds, ks)}
            for x, ks in zip((arm, other), keys))
    ctl = {s: (per_seed(runs["control"][s]), per_seed(runs["static"][s])) for s in seeds}
    if matched == "step":
        kept, ref = ([runs[x][s]["train"].get("predicted_step_vs_static") if x in DST_ARMS
                      else 1.0 for s in seeds] for x in (arm, other))
        how_matched = dict(tolerance=STEP_TOLERANCE, at_most=True, matched_on=(
            f"predicted step time over {other if other in DST_ARMS else 'static'}'s, no slower"))
        if None in kept + ref:
            return {}
    else:
        kept, ref = ([x[s]["eval_kept"] for s in seeds] for x in (a, b))
        how_matched = dict(tolerance=args.match_tolerance, matched_on="kept density at evaluation")
    out = {}
    for k in METRICS:
        d = [a[s][k] - b[s][k] for s in seeds]
        c = [ctl[s][0][k] - ctl[s][1][k] for s in seeds]
        out[k] = {"better": V.superiority(d, c)}
        if matched == "step":
            out[k]["predicted_step_vs_static"] = kept
        if margin.get(k):
            out[k]["non_inferior"] = V.verdict(d, c, margin[k], kept=kept, kept_reference=ref,
                                               **how_matched)
    return out


def readings(group: str, seeds: list, runs: dict, args, margin: dict) -> dict:
    """``READINGS[group]``'s comparisons that every seed's runs can make."""
    got = {name: compared(seeds, runs, args, margin, *spec)
           for name, spec in READINGS[group].items() if spec[0] in runs and spec[2] in runs}
    got = {name: v for name, v in got.items() if v}
    return got.get("equal_time", {}) if group == "verdicts_equal_time" else got


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
             for a, b in PAIRS if a in arms and b in arms}
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
        for group in READINGS if "refresh" in arms else list(READINGS)[:2]:
            out[group] = readings(group, seeds, runs, args, margin or {})
    if args.pilot and "control-static" in pairs:
        out["margin"], out["seeds_needed"] = {}, {}
        for k in METRICS:
            c = pairs["control-static"][k]
            # the arm comparison's SD is not measured by the pilot: the control's paired SD
            # (two continued runs on the same data order) stands in for it
            out["margin"][k], need = common.pilot_margin(args, c["mean"], c["sd"], c["sd"])
            if need:
                out["seeds_needed"][k] = need
    return out


# the paired comparisons the summary reports, (arm, against)
PAIRS = (("sparse_balance", "matched"), ("control", "static"), ("sab", "static"),
         ("sparse_balance", "sab"), ("sparse_balance", "static"), ("matched", "static"),
         ("refresh", "sparse_balance"))


def read_margin(args) -> dict:
    """The pilot's margin, refused if the pilot is not one or ran with other settings."""
    return common.read_margin(
        args, SAME, before={"pipeline": 1}, seeds=lambda p: p["config"]["seeds"],
        control_harm=lambda p: {k: p["pairs"]["control-static"][k]["mean"] for k in METRICS})


def print_summary(doc: dict) -> None:
    from sparsebalance_megatron.eval.verdict import one_line

    def bound(v: dict, f: str) -> str:
        return f"{v['mean']:{f}}" + ("" if v["upper"] is None else
                                     f" [{v['lower']:{f}}, {v['upper']:{f}}]")
    print("\n| arm | eval density | " + " | ".join(SHOWN) + " |\n|---|---:|" + "---:|" * len(SHOWN))
    for a, m in doc["means"].items():
        print(f"| {a} | {doc['arms'][a]['eval_density']:.4f} | "
              + " | ".join(f"{m[k]:.4f}" if k in m else "-" for k in SHOWN) + " |")
    for p, ms in doc["pairs"].items():
        print(f"{p}: " + ", ".join(f"{k} {bound(v, '+.4f')}" for k, v in ms.items()
                                   if k in METRICS + ("train_kept",)))
    if doc.get("static_holds_task"):
        h = doc["static_holds_task"]
        print(f"static holds the task: token accuracy {h['token_accuracy']:.3f} = "
              f"{h['x_chance']:.1f}x chance ({'held' if h['held'] else 'NOT held'})")
    for k, v in (doc.get("verdicts") or {}).items():
        print(f"verdict {k}: {one_line(v)}")
    for group, label in (("verdicts_equal_time", "equal step time"),
                         ("verdicts_as_trained", "read"), ("verdicts_refresh", "read")):
        rows = doc.get(group) or {}
        for name, ms in ({"": rows} if group == "verdicts_equal_time" else rows).items():
            arm, _, other, *_ = READINGS[group][name or "equal_time"]
            for k, v in ms.items():
                print(f"{' '.join(filter(None, (label, name.replace('_', ' '))))}, "
                      f"{arm} - {other}, {k}: "
                      f"{v['better']['verdict']} {bound(v['better'], '+.5f')}"
                      + (f"; {one_line(v['non_inferior'])}" if "non_inferior" in v else ""))
    if doc.get("margin") and doc["config"]["pilot"]:
        print(f"margin fixed: {doc['margin']}; seeds needed: {doc.get('seeds_needed')}")
