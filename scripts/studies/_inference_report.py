"""``inference_quality``'s summary: per-arm means and kept densities, paired bounds, the
verdicts; the pilot's margin, the n the power calculation asks for and the GPU form's size; the
margin a main run reads from its pilot."""

from __future__ import annotations

import json

import numpy as np

from .inference_quality import ARMS, METRICS, PAIRS, SCORES, latency_model


def summarize(doc: dict, args, margin=None) -> dict:
    """Per arm the means and kept densities; per pair the paired bound; the verdicts."""
    from sparsebalance_megatron.eval import verdict as V
    from sparsebalance_megatron.latency.work import attention_work

    rows = doc["samples"]
    if len(rows) < 2:
        return {}
    w = np.asarray([attention_work([r["tokens"]], 1.0, args.block_size) for r in rows])
    arms = {a: {k: float(np.mean([r["arms"][a][k] for r in rows])) for k in SCORES}
            for a in ARMS}
    for a in ARMS:
        arms[a]["kept"] = float(np.dot(w, [r["arms"][a]["kept"] for r in rows]) / w.sum())
    diff = {f"{a}-{b}": {k: [r["arms"][a][k] - r["arms"][b][k] for r in rows] for k in SCORES}
            for a, b in PAIRS}
    pairs = {p: {k: V.paired_bound(v) for k, v in d.items()} for p, d in diff.items()}
    out = {"n": len(rows), "arms": arms, "pairs": pairs}
    margin = margin or {}
    out["verdicts"] = {k: V.verdict(diff["dst-matched"][k], diff["control-uniform"][k],
                                    margin[k], kept=arms["dst"]["kept"],
                                    kept_reference=arms["matched"]["kept"],
                                    tolerance=args.match_tolerance)
                       for k in METRICS if margin.get(k)}
    return out


def pilot_plan(summary: dict, args, arch, sample_s: float) -> dict:
    """The margin (``--margin-fraction`` of the control's harm, per metric) and the n the power
    calculation asks for: the control detected and an equal arm found non-inferior, each at 80%
    power, from the pilot's SDs."""
    from sparsebalance_megatron.eval import verdict as V

    out = {"margin": {}, "n_needed": {}}
    for k in METRICS:
        ctl, cmp = summary["pairs"]["control-uniform"][k], summary["pairs"]["dst-matched"][k]
        harm = ctl["mean"]
        out["margin"][k] = args.margin_fraction * harm if harm > 0 else None
        if harm > 0 and ctl["sd"] and cmp["sd"]:
            out["n_needed"][k] = {"control": V.n_needed(ctl["sd"], harm),
                                  "non_inferior": V.n_needed(cmp["sd"], out["margin"][k])}
    out["gpu_form"] = gpu_form_size(summary, args, arch)
    out["seconds_per_sample"] = sample_s
    out["samples_in_2h"] = int(7200 / sample_s) if sample_s else None
    return out


def gpu_form_size(summary: dict, args, arch, call_s: float = 420.0, setup_s: float = 150.0,
                  slack: float = 2.0) -> dict:
    """The GPU form's power calculation (issue 73 item 5): per length (16K, 32K), the samples
    one device call of ``call_s`` holds after ``setup_s`` of loading, each arm's forward priced
    by the analytic H100 table of this model (times ``slack``: the torch path is not TE), and
    what that n detects with the pilot's SDs (assumed to hold at these lengths) against the n
    the margin and the control ask for."""
    from sparsebalance_megatron.eval import verdict as V

    out = {"call_s": call_s, "setup_s": setup_s, "slack": slack, "lengths": {}}
    for length in (16384, 32768):
        lm = latency_model(args, arch, seq_length=length, pp=1)
        dens = [args.density, 0.65, 0.65, 0.65, args.control_factor * args.density, 1.0]
        sample_s = slack * sum(lm.predict_fwd_bwd([length], d, 0)[0] for d in dens)
        n = int((call_s - setup_s) / sample_s)
        row = {"sample_s": sample_s, "samples": n}
        for k in METRICS:
            cmp = summary["pairs"]["dst-matched"][k]
            if cmp["sd"]:
                row[f"{k}_detectable"] = V.detectable_effect(cmp["sd"], n)
        out["lengths"][str(length)] = row
    return out


SAME = ("tasks", "lengths", "density", "control_factor", "dp", "microbatches", "pp",
        "seq_length", "block_size", "loss_stride", "layers", "match_tolerance")


def read_margin(args, ignore=()) -> dict:
    """The pilot's margin, refused if the pilot is not one or ran in another setting
    (``ignore``: settings the caller may change, recorded as changed: the GPU form's lengths)."""
    with open(args.margin_from) as f:
        pilot = json.load(f)
    if not (pilot.get("config") or {}).get("pilot") or not pilot.get("margin"):
        raise SystemExit(f"error: --margin-from {args.margin_from}: not a pilot's JSON with a "
                         f"margin (run --pilot first)")
    differ = [k for k in SAME if k not in ignore and pilot["config"].get(k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"error: --margin-from {args.margin_from}: the pilot ran with other "
                         f"{', '.join(differ)}: a margin holds for the setting it was fixed in")
    return {"margin": pilot["margin"], "margin_source": {
        "path": args.margin_from, "commit": pilot.get("commit"), "n": pilot["summary"]["n"],
        "control_harm": {k: pilot["summary"]["pairs"]["control-uniform"][k]["mean"]
                         for k in METRICS}, "fraction": pilot["config"]["margin_fraction"],
        **({"changed_since_pilot": {k: [pilot["config"].get(k), getattr(args, k)] for k in ignore
                                    if pilot["config"].get(k) != getattr(args, k)}}
           if ignore else {})}}
