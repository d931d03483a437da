"""Offline checks of a profiled latency table (and its held-out evaluation): no device needed
(grid MAPE, leave-one-mix-out and held-out MAPE of the model's fit, priced or not, and the
repeats' spread; BENCHMARKS.md, the latency model on the GPU)."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from sparsebalance_megatron.latency import LatencyModel, read_table
from sparsebalance_megatron.latency.crossover import table_crossover
from sparsebalance_megatron.latency.features import FEATURES, MODEL_FEATURES, UnitFeatures
from sparsebalance_megatron.latency.fit import fit_nonneg
from sparsebalance_megatron.latency.table import measured_kinds

from .common import parser, write_result


FEW = 4
"""Sequences of a micro-batch in the regime the end-to-end runs train (documents of 8K+)."""


class Fitter:
    """The model's fit on the table's rows of one kind."""

    def __init__(self, table: dict):
        att = table["attention"]
        self.args = (att["block_size"], att["sink_blocks"], att["local_blocks"],
                     att.get("work", "kept"), int(att.get("query_chunk_blocks", 16)),
                     table_crossover(table))
        # a table whose grid was routed fits the dense kernel's own coefficient, as the model
        self.features = MODEL_FEATURES if self.args[-1] else FEATURES

    def design(self, rows):
        f = UnitFeatures.build([r["doc_lengths"] for r in rows], *self.args)
        return f.matrix(np.asarray([r["density"] for r in rows], dtype=np.float64), self.features)

    def fit(self, rows):
        x = self.design(rows)
        return {p: fit_nonneg(x, np.asarray([r[p + "_s"] for r in rows])) for p in ("fwd", "bwd")}

    def predict(self, coef, rows):
        x = self.design(rows)
        return x @ coef["fwd"], x @ coef["bwd"]


def _errors(pred, meas):
    return np.abs(pred - meas) / meas


def evaluate(table: dict, held: list) -> dict:
    """Grid, leave-one-mix-out and held-out errors (fwd + bwd) over the pipeline's kinds."""
    fitter = Fitter(table)
    grid_err, cv_err, held_err, coefs = [], [], [], {}
    for kind in measured_kinds(table):
        rows = [m for m in table["measurements"] if m["kind"] == kind]
        meas = np.array([m["fwd_s"] + m["bwd_s"] for m in rows])
        coef = fitter.fit(rows)
        coefs[kind] = {p: c.tolist() for p, c in coef.items()}
        f, b = fitter.predict(coef, rows)
        keys = [tuple(m["doc_lengths"]) for m in rows]
        cv = np.zeros(len(rows))
        for k in dict.fromkeys(keys):
            out = [i for i, kk in enumerate(keys) if kk == k]
            c = fitter.fit([m for m, kk in zip(rows, keys) if kk != k])
            pf, pb = fitter.predict(c, [rows[i] for i in out])
            cv[out] = _errors(pf + pb, meas[out])
        if kind in table["pipeline"]["stage_kinds"]:     # pp=2's middle stage only feeds layouts
            grid_err.append(_errors(f + b, meas))
            cv_err.append(cv)
        hrows = [r for r in held if r.get("kind", kind) == kind]
        if hrows:
            for r in hrows:
                r.setdefault("fwd_s", r["measured_fwd_s"])
                r.setdefault("bwd_s", r["measured_s"] - r["measured_fwd_s"])
            pf, pb = fitter.predict(coef, hrows)
            held_err.append((pf + pb - np.array([r["measured_s"] for r in hrows]))
                            / np.array([r["measured_s"] for r in hrows]))
    g, c = np.concatenate(grid_err), np.concatenate(cv_err)
    out = {"features": "model", "grid_mape": float(g.mean()),
           "cv_mape": float(c.mean()), "cv_max": float(c.max()), "coefficients": coefs,
           "cv_mape_few": _few(c, [m for k in measured_kinds(table)            # grid_err's
                                   if k in table["pipeline"]["stage_kinds"]
                                   for m in table["measurements"] if m["kind"] == k])}
    if held_err:
        h = np.concatenate(held_err)
        out.update(heldout_mape=float(np.abs(h).mean()), heldout_max=float(np.abs(h).max()),
                   heldout_signed=[float(v) for v in h],
                   heldout_mape_few=_few(np.abs(h), held))
    return out


def _few(err, rows):
    """Mean of ``err`` over the rows of at most ``FEW`` sequences (None: no such row)."""
    few = [e for e, r in zip(err, rows) if len(r["doc_lengths"]) <= FEW]
    return float(np.mean(few)) if few else None


def evaluate_model(table: dict, held: list, name: str) -> dict:
    """``evaluate``'s grid, leave-one-mix-out and held-out errors of ``LatencyModel.fit`` itself
    (priced where the table carries a price): the model as the runtime fits it."""
    def fit(rows):
        return LatencyModel.fit(dict(table, measurements=rows))

    kinds = table["pipeline"]["stage_kinds"]
    rows = [m for m in table["measurements"] if m["kind"] in kinds]
    whole = fit(table["measurements"])

    def err(model, rs):
        meas = np.array([r["fwd_s"] + r["bwd_s"] if "fwd_s" in r else r["measured_s"]
                         for r in rs])
        pred = np.array([model.predict(r["doc_lengths"], r["density"],
                                       kinds.index(r.get("kind", kinds[0]))) for r in rs])
        return (pred - meas) / meas
    keys = [(m["kind"], tuple(m["doc_lengths"])) for m in rows]
    cv = np.zeros(len(rows))
    for k in dict.fromkeys(keys):
        out = [i for i, kk in enumerate(keys) if kk == k]
        model = fit([m for m in table["measurements"]
                     if (m["kind"], tuple(m["doc_lengths"])) != k])
        cv[out] = np.abs(err(model, [rows[i] for i in out]))
    g = np.abs(err(whole, rows))
    res = {"features": name, "grid_mape": float(g.mean()), "cv_mape": float(cv.mean()),
           "cv_max": float(cv.max()), "cv_mape_few": _few(cv, rows),
           "coefficients": whole.table["coefficients"],
           "call_coefficients": whole.table.get("call_coefficients")}
    if held:
        h = err(whole, held)
        res.update(heldout_mape=float(np.abs(h).mean()), heldout_max=float(np.abs(h).max()),
                   heldout_signed=[float(v) for v in h], heldout_mape_few=_few(np.abs(h), held))
    return res


def repeat_spread(table: dict) -> Optional[float]:
    """Mean over the grid of |a pass's fwd+bwd - the point's median| / median."""
    out = []
    for m in table["measurements"]:
        s = np.asarray(m.get("samples_s") or [], dtype=np.float64)
        if s.ndim == 2 and s.shape[0] >= 2:
            tot = s.sum(axis=1)
            out += list(np.abs(tot - np.median(tot)) / np.median(tot))
    return float(np.mean(out)) if out else None


def price_heldout(kernel_table: dict, backend: str, shape: str) -> dict:
    """The sparse call price's own held-out error: fitted on a kernel table's whole-call rows of
    ``backend`` at ``shape`` (one document and packed micro-batches, ``sparse_call.price_rows``)
    with one density left out at a time, each left-out row's fwd and bwd against its passes."""
    from sparsebalance_megatron.latency.sparse_call import fit_price, price_rows

    rows = [r for r in price_rows(kernel_table["rows"], shape) if r["backend"] == backend]
    whole = fit_price(rows, backend, "kernel table", shape=shape)
    errs = {"fwd": [], "bwd": [], "call": []}
    for d in sorted({r["density"] for r in rows}):
        price = fit_price([r for r in rows if r["density"] != d], backend, "kernel table",
                          shape=shape)
        for r in (r for r in rows if r["density"] == d):
            ms = price.pass_ms(r["tokens"], r["kept"])
            for p in ("fwd", "bwd"):
                errs[p].append(abs(ms[p] - r[p + "_ms"]) / r[p + "_ms"])
            errs["call"].append(abs(ms["fwd"] + ms["bwd"] - r["ms"]) / r["ms"])
    return {"backend": backend, "shape": shape, "rows": len(rows),
            "cases": sorted({r["case"] for r in rows}), "price": whole.as_dict(),
            **{f"lodo_mape_{p}": float(np.mean(v)) for p, v in errs.items()},
            **{f"lodo_max_{p}": float(np.max(v)) for p, v in errs.items()}}


def main(argv=None) -> int:
    p = parser(__doc__, "latency_cv")
    p.add_argument("--table", required=True, help="a profiled latency table (JSON)")
    p.add_argument("--eval", help="held-out rows: the JSON of scripts/bench.py latency_eval")
    p.add_argument("--kernel-table", help="a device kernel table (attention_gpu's JSON) "
                   "whose price of the table's backend at its head shape prices the sparse call")
    args = p.parse_args(argv)

    table = read_table(args.table)
    held = json.load(open(args.eval, encoding="utf-8"))["rows"] if args.eval else []
    base = evaluate(table, held)
    ref = LatencyModel.fit(table)          # the script's fit is the model's fit
    for kind, c in base["coefficients"].items():
        for part in ("fwd", "bwd"):
            assert np.allclose(c[part][:len(FEATURES)], ref.coef[kind][part], rtol=1e-9,
                               atol=0), (kind, part)
    results = [base]
    price = None
    if args.kernel_table:
        from sparsebalance_megatron.latency.sparse_call import attach_price, fit_price, price_rows
        kt = json.load(open(args.kernel_table, encoding="utf-8"))
        m = table["model"]
        shape = (f"{m['num_attention_heads']}/{m.get('num_query_groups') or m['num_attention_heads']}"
                 f"/{m.get('kv_channels') or m['hidden_size'] // m['num_attention_heads']}")
        backend = (table["attention"].get("backend_choice") or {}).get("chosen") or \
            table["attention"].get("backend")
        try:
            price = price_heldout(kt, backend, shape)
            priced = attach_price(table, fit_price(price_rows(kt["rows"], shape), backend,
                                                   args.kernel_table, shape=shape))
        except ValueError as e:
            p.error(f"--kernel-table {args.kernel_table}: {e}")
        results.append(evaluate_model(priced, held, f"priced ({backend} {shape})"))
    few = lambda v: "" if v is None else f"{100 * v:6.2f}%"   # noqa: E731
    print(f"{'features':32s} {'grid':>6s} {'LOMO-CV':>8s} {'CV max':>7s} {'CV few':>7s} "
          f"{'held-out':>9s} {'max':>6s} {'few':>7s}")
    for r in results:
        h = (f"{100 * r['heldout_mape']:8.2f}% {100 * r['heldout_max']:5.1f}% "
             f"{few(r.get('heldout_mape_few'))}" if "heldout_mape" in r else "")
        print(f"{r['features']:32s} {100 * r['grid_mape']:5.2f}% {100 * r['cv_mape']:7.2f}% "
              f"{100 * r['cv_max']:6.1f}% {few(r.get('cv_mape_few')):>7s} {h}")
    spread = repeat_spread(table)
    if spread is not None:
        print(f"repeats: each pass {100 * spread:.1f}% from its point's median, on average")
    if price:
        print(f"price ({price['backend']} {price['shape']}, {price['rows']} rows: "
              f"{', '.join(price['cases'])}), each density left out: fwd "
              f"{100 * price['lodo_mape_fwd']:.1f}%, bwd {100 * price['lodo_mape_bwd']:.1f}%, "
              f"call {100 * price['lodo_mape_call']:.1f}% (max {100 * price['lodo_max_call']:.1f}%)")
    if args.json:
        write_result(args.json, {
            "table": args.table, "eval": args.eval, "kernel_table": args.kernel_table,
            "fits": results, "repeat_spread": spread, "price": price})
    return 0
