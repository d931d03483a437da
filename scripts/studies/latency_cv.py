"""Offline checks of a profiled latency table (and its held-out evaluation): no device needed.

    python scripts/bench.py latency_cv --table T.json [--eval E.json] [--json out.json]

For every stage kind, fitted as ``LatencyModel.fit`` fits (relative least squares, work
coefficients >= 0), it reports:

- the fit: grid MAPE, leave-one-mix-out cross-validation (every density of one document mix left
  out at a time: how well the grid predicts a mix it has not seen) and, with ``--eval`` (the JSON
  of ``scripts/bench.py latency_eval``), the held-out MAPE of the refit model; the same for the
  model plus each candidate feature of ``CANDIDATES`` (computed here from the documents, not part
  of the model), so a new term is judged by cross-validation and held-out rows together;
- drift between the repeats: each pass over the grid against the median of the other passes,
  forward and backward. Repeats are passes over the whole grid, so a change of state in the
  middle of the profile (a recompiled kernel, a throttled clock) shows as a first pass that
  differs from the rest on the points measured before the change;
- held-out rows whose documents equal a grid mix, against that mix's grid times interpolated in
  attention work to the row's density: a held-out micro-batch and the same grid micro-batch
  should take the same time. Measured in another state they do not, and no model of the grid
  can predict them.

The H100 table of docs/benchmarks/attention-gpu.md "GPU latency model (H100)"
(docs/results/latency_table_h100_full_run3.json with latency_eval_h100_full_run3.json) shows
both: its first pass timed the backward of the 16K-token points 8-17% lower until the grid's first
8K-token micro-batch, and the held-out 16K document matches that first pass, not the rest of
the grid.
"""

from __future__ import annotations

import json

import numpy as np

from sparsebalance_megatron.latency import LatencyModel, read_table
from sparsebalance_megatron.latency.crossover import table_crossover
from sparsebalance_megatron.latency.features import FEATURES, MODEL_FEATURES, UnitFeatures
from sparsebalance_megatron.latency.model import fit_nonneg
from sparsebalance_megatron.latency.table import measured_kinds

from .common import parser, write_result


def longest_sequence_blocks(rows, block_size):
    """Blocks of the micro-batch's longest sequence. The flex backward runs one program per key
    block and KV group over the query blocks that keep it; a document's sink block is kept by
    all of its query blocks, so the longest program grows with the longest document whatever
    the density."""
    return np.array([float(-(-max(r["doc_lengths"]) // block_size)) for r in rows])


def dense_pairs(rows, block_size):
    """Causal block pairs at density 1 (a density-independent quadratic attention cost)."""
    out = []
    for r in rows:
        nb = -(-np.asarray(r["doc_lengths"], dtype=np.int64) // block_size)
        out.append(float((nb * (nb + 1) // 2).sum()))
    return np.array(out)


CANDIDATES = {"longest_sequence_blocks": longest_sequence_blocks, "dense_pairs": dense_pairs}


class Fitter:
    """The model's fit on the table's rows of one kind, with optional extra feature columns."""

    def __init__(self, table: dict):
        att = table["attention"]
        self.args = (att["block_size"], att["sink_blocks"], att["local_blocks"],
                     att.get("work", "kept"), int(att.get("query_chunk_blocks", 16)),
                     table_crossover(table))
        # a table whose grid was routed fits the dense kernel's own coefficient, as the model
        self.features = MODEL_FEATURES if self.args[-1] else FEATURES

    def design(self, rows, extras=()):
        f = UnitFeatures.build([r["doc_lengths"] for r in rows], *self.args)
        x = f.matrix(np.asarray([r["density"] for r in rows], dtype=np.float64), self.features)
        cols = [CANDIDATES[e](rows, self.args[0]) for e in extras]
        return np.column_stack([x] + cols) if cols else x

    def fit(self, rows, extras=()):
        x = self.design(rows, extras)
        return {p: fit_nonneg(x, np.asarray([r[p + "_s"] for r in rows])) for p in ("fwd", "bwd")}

    def predict(self, coef, rows, extras=()):
        x = self.design(rows, extras)
        return x @ coef["fwd"], x @ coef["bwd"]


def _errors(pred, meas):
    return np.abs(pred - meas) / meas


def evaluate(table: dict, held: list, extras=()) -> dict:
    """Grid, leave-one-mix-out and held-out errors (fwd + bwd) over the pipeline's kinds."""
    fitter = Fitter(table)
    grid_err, cv_err, held_err, coefs = [], [], [], {}
    for kind in measured_kinds(table):
        rows = [m for m in table["measurements"] if m["kind"] == kind]
        meas = np.array([m["fwd_s"] + m["bwd_s"] for m in rows])
        coef = fitter.fit(rows, extras)
        coefs[kind] = {p: c.tolist() for p, c in coef.items()}
        f, b = fitter.predict(coef, rows, extras)
        keys = [tuple(m["doc_lengths"]) for m in rows]
        cv = np.zeros(len(rows))
        for k in dict.fromkeys(keys):
            out = [i for i, kk in enumerate(keys) if kk == k]
            c = fitter.fit([m for m, kk in zip(rows, keys) if kk != k], extras)
            pf, pb = fitter.predict(c, [rows[i] for i in out], extras)
            cv[out] = _errors(pf + pb, meas[out])
        if kind in table["pipeline"]["stage_kinds"]:     # pp=2's middle stage only feeds layouts
            grid_err.append(_errors(f + b, meas))
            cv_err.append(cv)
        hrows = [r for r in held if r.get("kind", kind) == kind]
        if hrows:
            for r in hrows:
                r.setdefault("fwd_s", r["measured_fwd_s"])
                r.setdefault("bwd_s", r["measured_s"] - r["measured_fwd_s"])
            pf, pb = fitter.predict(coef, hrows, extras)
            held_err.append((pf + pb - np.array([r["measured_s"] for r in hrows]))
                            / np.array([r["measured_s"] for r in hrows]))
    g, c = np.concatenate(grid_err), np.concatenate(cv_err)
    out = {"features": "+".join(("model",) + tuple(extras)), "grid_mape": float(g.mean()),
           "cv_mape": float(c.mean()), "cv_max": float(c.max()), "coefficients": coefs}
    if held_err:
        h = np.concatenate(held_err)
        out.update(heldout_mape=float(np.abs(h).mean()), heldout_max=float(np.abs(h).max()),
                   heldout_signed=[float(v) for v in h])
    return out


def pass_drift(table: dict) -> list[dict]:
    """Per grid point (profile order, per kind): each pass / median of the other passes."""
    out = []
    for i, m in enumerate(table["measurements"]):
        s = np.asarray(m.get("samples_s") or [], dtype=np.float64)
        if s.ndim != 2 or s.shape[0] < 3:
            continue
        tot = s.sum(axis=1)
        ratio = {p: [float(v[j] / np.median(np.delete(v, j))) for j in range(len(v))]
                 for p, v in (("fwd", s[:, 0]), ("bwd", s[:, 1]), ("total", tot))}
        out.append({"index": i, "kind": m["kind"], "docs": len(m["doc_lengths"]),
                    "tokens": int(sum(m["doc_lengths"])), "density": m["density"], **ratio})
    return out


def change_point(table: dict, part: str = "bwd", min_run: int = 3) -> dict | None:
    """The one split of the samples in time order (passes over the grid, each in grid order)
    into two levels of sample / the point's median over passes that most reduces the absolute
    deviation from the levels (an L1 change point); None without samples. A state change during
    the profile gives a clear split: before it, the points differ from their own medians by
    ``before`` - 1 (``gain``: the share of the deviation the split explains)."""
    rows = [m for m in table["measurements"] if m.get("samples_s")]
    if not rows:
        return None
    s = np.asarray([m["samples_s"] for m in rows], dtype=np.float64)     # [points, passes, 2]
    v = s[:, :, 0] if part == "fwd" else s[:, :, 1] if part == "bwd" else s.sum(axis=2)
    r = (v / np.median(v, axis=1, keepdims=True)).T.reshape(-1)          # time order
    def dev(x):
        return float(np.abs(x - np.median(x)).sum())

    whole, best = dev(r), None
    for t in range(min_run, r.size - min_run + 1):
        cost = dev(r[:t]) + dev(r[t:])
        if best is None or cost < best[1]:
            best = (t, cost)
    t, cost = best
    n = len(rows)
    return {"part": part, "split_pass": t // n, "split_point": t % n, "samples_before": t,
            "before": float(np.median(r[:t])), "after": float(np.median(r[t:])),
            "gain": 1.0 - cost / whole if whole > 0 else 0.0}


def same_mix_check(table: dict, held: list) -> list[dict]:
    """Held-out rows whose documents equal a grid mix of the same kind: measured against the
    grid's times of that mix interpolated in attention work (first pass and all passes)."""
    fitter = Fitter(table)
    out = []
    for r in held:
        kind = r.get("kind", "only")
        grid = sorted((m for m in table["measurements"]
                       if m["kind"] == kind and m["doc_lengths"] == r["doc_lengths"]),
                      key=lambda m: m["density"])
        if len(grid) < 2:
            continue
        work = fitter.design(grid)[:, 2]
        w = float(fitter.design([r])[0, 2])
        row = {"kind": kind, "docs": len(r["doc_lengths"]), "density": r["density"],
               "held_fwd_s": r["measured_fwd_s"],
               "held_bwd_s": r["measured_s"] - r["measured_fwd_s"],
               "grid_fwd_s": float(np.interp(w, work, [m["fwd_s"] for m in grid])),
               "grid_bwd_s": float(np.interp(w, work, [m["bwd_s"] for m in grid]))}
        if all(m.get("samples_s") for m in grid):
            for j, part in enumerate(("fwd", "bwd")):
                row[f"grid_pass0_{part}_s"] = float(
                    np.interp(w, work, [m["samples_s"][0][j] for m in grid]))
        out.append(row)
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "latency_cv")
    p.add_argument("--table", required=True, help="a profiled latency table (JSON)")
    p.add_argument("--eval", help="held-out rows: the JSON of scripts/bench.py latency_eval")
    args = p.parse_args(argv)

    table = read_table(args.table)
    held = json.load(open(args.eval, encoding="utf-8"))["rows"] if args.eval else []
    base = evaluate(table, held)
    ref = LatencyModel.fit(table)          # the script's fit is the model's fit
    for kind, c in base["coefficients"].items():
        for part in ("fwd", "bwd"):
            assert np.allclose(c[part][:len(FEATURES)], ref.coef[kind][part], rtol=1e-9,
                               atol=0), (kind, part)
    results = [base] + [evaluate(table, held, (name,)) for name in CANDIDATES]
    print(f"{'features':32s} {'grid':>6s} {'LOMO-CV':>8s} {'CV max':>7s} {'held-out':>9s} "
          f"{'max':>6s}")
    for r in results:
        h = (f"{100 * r['heldout_mape']:8.2f}% {100 * r['heldout_max']:5.1f}%"
             if "heldout_mape" in r else "")
        print(f"{r['features']:32s} {100 * r['grid_mape']:5.2f}% {100 * r['cv_mape']:7.2f}% "
              f"{100 * r['cv_max']:6.1f}% {h}")
    drift = pass_drift(table)
    if drift:
        n = len(drift[0]["bwd"])
        print("\npass drift: median over the grid of each pass / median of the other passes")
        for part in ("fwd", "bwd", "total"):
            med = [float(np.median([d[part][j] for d in drift])) for j in range(n)]
            print(f"  {part:5s} " + " ".join(f"{v:.3f}" for v in med))
        cps = [change_point(table, part) for part in ("fwd", "bwd", "total")]
        print("  change point (samples in time order / their point's median over passes):")
        for cp in cps:
            m = table["measurements"][cp["split_point"]]
            print(f"    {cp['part']:5s} {cp['samples_before']:4d} samples at {cp['before']:.3f}, "
                  f"then {cp['after']:.3f} (explains {100 * cp['gain']:.0f}% of the "
                  f"deviation), from pass {cp['split_pass']} point "
                  f"{cp['split_point']} ({len(m['doc_lengths'])} docs, "
                  f"{sum(m['doc_lengths'])} tokens, d={m['density']:g})")
    same = same_mix_check(table, held)
    if same:
        print("\nheld-out rows equal to a grid mix (ms): held-out | grid median"
              + (" | grid first pass" if "grid_pass0_bwd_s" in same[0] else ""))
        for s in same:
            extra = (f" | {1e3 * s['grid_pass0_fwd_s']:6.1f} {1e3 * s['grid_pass0_bwd_s']:6.1f}"
                     if "grid_pass0_bwd_s" in s else "")
            print(f"  {s['kind']:6s} {s['docs']:3d} docs d={s['density']:.3f}  fwd bwd "
                  f"{1e3 * s['held_fwd_s']:6.1f} {1e3 * s['held_bwd_s']:6.1f} | "
                  f"{1e3 * s['grid_fwd_s']:6.1f} {1e3 * s['grid_bwd_s']:6.1f}{extra}")
    if args.json:
        write_result(args.json, {
            "table": args.table, "eval": args.eval, "fits": results, "pass_drift": drift,
            "change_points": [change_point(table, p) for p in ("fwd", "bwd", "total")]
            if drift else [], "same_mix": same})
    return 0
