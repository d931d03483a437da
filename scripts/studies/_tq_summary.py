"""``trained_quality``'s summary: per-arm means over seeds, paired differences with 95% t
intervals, the documents' densities per arm, and whether the arms' kept densities match."""

from __future__ import annotations

import math

from sparsebalance_megatron.eval.verdict import t_quantile

PAIRS = (("sparse_balance", "static"), ("dst_density", "static"),
         ("sparse_balance", "dst_density"), ("static", "dense"), ("sparse_balance", "dense"))


def metrics_of(run: dict) -> dict:
    """The flat metrics a pair compares: the primary evaluation's and the training's."""
    p = run["eval"][run["primary"]]
    out = {"heldout_loss": p["heldout_loss"], "accuracy": p["accuracy"],
           "token_accuracy": p["token_accuracy"],
           "doc_kept_density": kept_of(run["train"])}
    out.update({f"accuracy@depth{k}": v["accuracy"] for k, v in p["accuracy_by_depth"].items()})
    return out


def kept_of(train: dict) -> float:
    """A run's kept density of its documents (padding left out: ``document_densities``); 1
    for a dense run."""
    return train.get("doc_kept_density", 1.0)


def density_rows(runs: dict, seeds: list) -> list:
    """Per arm, means over seeds of the documents' planned, kept and d0-kept densities, and the
    DST moves summed over seeds, with how many kept no other block of a document."""
    out = []
    for arm, per in runs.items():
        tr = [per[str(s)]["train"] for s in seeds]
        if "doc_kept_density" not in tr[0]:
            continue
        row = {"arm": arm, **{k: None if tr[0][k] is None else sum(t[k] for t in tr) / len(tr)
                              for k in ("doc_planned_density", "doc_kept_density",
                                        "doc_kept_d0_density", "mean_planned_density",
                                        "mean_kept_density")}}
        row.update({k: sum(t["dst_moves"][k] for t in tr) for k in tr[0]["dst_moves"]})
        row.update({k: sum(t[k] for t in tr) / len(tr) for k in (
            "plans_as_recorded", "dst_plans", "predicted_step_vs_static") if k in tr[0]})
        out.append(row)
    return out


def print_densities(rows: list) -> None:
    print("\n| arm | planned | kept | kept at d0 | kept - at d0 | with padding: planned / kept "
          "| raised (kept no block) | cut (kept no block) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        padded = "-" if r["mean_kept_density"] is None else \
            f"{r['mean_planned_density']:.4f} / {r['mean_kept_density']:.4f}"
        print(f"| {r['arm']} | {r['doc_planned_density']:.4f} | {r['doc_kept_density']:.4f} | "
              f"{r['doc_kept_d0_density']:.4f} | "
              f"{r['doc_kept_density'] - r['doc_kept_d0_density']:+.4f} | "
              f"{padded} | "
              f"{r['raised']} ({r['raised_keeping_no_block']}) | "
              f"{r['cut']} ({r['cut_keeping_no_block']}) |")
    for r in rows:
        if "plans_as_recorded" in r:
            print(f"{r['arm']}: predicted step / static {r['predicted_step_vs_static']:.4f}, "
                  f"plans as recorded {r['plans_as_recorded']:.0f} of {r['dst_plans']:.0f} "
                  f"a seed")


def interval(xs: list) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return {"mean": mean, "n": n, "ci95": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = t_quantile(0.975, n - 1)
    half = t * sd / math.sqrt(n)
    return {"mean": mean, "n": n, "sd": sd, "ci95": [mean - half, mean + half]}


def paired(runs: dict, seeds: list) -> dict:
    out = {}
    for a, b in PAIRS:
        if a not in runs or b not in runs:
            continue
        per = {}
        for s in seeds:
            ma, mb = metrics_of(runs[a][s]), metrics_of(runs[b][s])
            for k in ma:
                per.setdefault(k, []).append(ma[k] - mb[k])
        out[f"{a}-{b}"] = {k: {**interval(v), "per_seed": v} for k, v in per.items()}
    return out


def density_match(runs: dict, seeds: list, tol: float) -> dict:
    if "static" not in runs:
        return {}
    ref = {s: kept_of(runs["static"][s]["train"]) for s in seeds}
    out = {}
    for arm in runs:
        if arm in ("static", "dense"):
            continue
        gaps = [kept_of(runs[arm][s]["train"]) - ref[s] for s in seeds]
        out[arm] = {"kept_minus_static": gaps, "matched": all(abs(g) <= tol for g in gaps)}
    return out


def print_table(doc: dict) -> None:
    runs, seeds = doc["runs"], doc["config"]["seeds"]
    depths = [f"{d:g}" for d in doc["config"]["depths"]]
    print("\n| arm | eval density | held-out loss | accuracy | "
          + " | ".join(f"acc @{d}" for d in depths)
          + " | train kept density (documents) | DST steps cut / raised |")
    print("|---|---:|---:|---:|" + "---:|" * len(depths) + "---:|---:|")
    for arm, per in runs.items():
        ms = [metrics_of(per[str(s)]) for s in seeds]
        tr = [per[str(s)]["train"] for s in seeds]

        def m(k):
            return sum(x[k] for x in ms) / len(ms)
        print(f"| {arm} | {per[str(seeds[0])]['primary']} | {m('heldout_loss'):.4f} | "
              f"{m('accuracy'):.3f} | " + " | ".join(f"{m('accuracy@depth' + d):.2f}"
                                                     for d in depths)
              + f" | {sum(kept_of(t) for t in tr) / len(tr):.3f} | "
              f"{sum(t['dst_steps_cut'] for t in tr)} / {sum(t['dst_steps_raised'] for t in tr)}"
              f" |")
    print(f"(means over seeds {seeds}; DST steps summed over seeds)\n")
    for pair, ms in doc["paired"].items():
        print(f"{pair}: " + ", ".join(
            f"{k} {v['mean']:+.4f}" + (f" [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"
                                       if v["ci95"] else "")
            for k, v in ms.items() if k in ("heldout_loss", "accuracy", "doc_kept_density")))
    print_densities(doc.get("densities") or [])
