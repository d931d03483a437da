"""Fitting the planner's quality model (``quality.cost``) to measured losses, offline
(``scripts/bench.py plan_quality --calibrate``; the planner only reads the fitted file).

A measurement row is one sample scored with one density per depth group (``vector``): its
held-out loss, length and tokens. Against the same sample at uniform d0, the model says

    y = rho (S(v) - S(v0)) + gamma rho^2 (S(v)^2 - S(v0)^2),   rho = (n / n_ref) ** beta,

with each group's curve a non-negative sum of hinges ``max(t - d, 0)`` at ``KNOTS`` (convex,
non-increasing, zero at density 1). For fixed (beta, gamma) the curves are a non-negative least
squares problem (the interaction's factor taken from the previous iterate: ``ITERATIONS``
rounds), so (beta, gamma) are searched on a grid and chosen by cross-validation over samples
(``FOLDS`` folds: a sample's rows are never fitted and scored together). Token-weighted: a
sample weighs by its tokens. The uncertainty: ``REPLICATES`` refits on samples drawn with
replacement, each with its own (beta, gamma).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import numpy as np

from ..quality.cost import GroupCost, QualityCost, Replicate

KNOTS = (0.35, 0.4, 0.5, 0.7, 1.0)
BETAS = tuple(np.round(np.arange(-2.5, 1.01, 0.25), 4))
GAMMAS = tuple(np.round(np.arange(-4.0, 4.01, 0.5), 4))
ITERATIONS = 8
FOLDS = 6
REPLICATES = 32


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """x >= 0 minimising |a x - b| (Lawson and Hanson's active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-12 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max() + 1.0))
    for _ in range(iters):
        if passive.all() or not np.any(w[~passive] > tol):
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def hinges(d: np.ndarray) -> np.ndarray:
    """[..., K] max(t - d, 0) for every knot t."""
    return np.maximum(np.asarray(KNOTS)[None, :] - np.asarray(d, dtype=np.float64)[..., None],
                      0.0)


class Data:
    """The rows as arrays: per row its sample, group vector, loss; per sample length, tokens and
    its loss at uniform d0 (every other row is paired with it)."""

    def __init__(self, rows: list, d0: float, groups: int):
        ref = {r["sample"]: r for r in rows if all(abs(x - d0) < 1e-9 for x in r["vector"])}
        if len(ref) < 2:
            raise ValueError(f"{len(ref)} samples with a uniform-d0 row: expected >= 2")
        keep = [r for r in rows if r["sample"] in ref and r is not ref[r["sample"]]]
        names = sorted(ref)
        index = {s: i for i, s in enumerate(names)}
        self.sample = np.array([index[r["sample"]] for r in keep])
        self.vector = np.array([r["vector"] for r in keep], dtype=np.float64)   # [R, G]
        if self.vector.shape[1:] != (groups,):
            raise ValueError(f"vectors of {self.vector.shape[1:]} groups: expected {groups}")
        self.y = np.array([r["loss"] - ref[r["sample"]]["loss"] for r in keep])
        self.length = np.array([ref[s]["length"] for s in names], dtype=np.float64)
        self.tokens = np.array([ref[s]["tokens"] for s in names], dtype=np.float64)
        self.kind = [ref[s]["kind"] for s in names]
        self.d0, self.groups = d0, groups
        # [R, G * K] each row's hinge features against d0
        h = hinges(self.vector) - hinges(np.full(groups, d0))[None]
        self.x = h.reshape(len(keep), -1)
        self.h0 = hinges(np.full(groups, d0)).reshape(-1)                    # [G * K]

    @property
    def samples(self) -> int:
        return self.length.size


def fit_curves(data: Data, rows: np.ndarray, beta: float, gamma: float, n_ref: float
               ) -> np.ndarray:
    """[G * K] hinge coefficients fitted on ``rows`` at (beta, gamma)."""
    rho = (data.length[data.sample[rows]] / n_ref) ** beta
    w = np.sqrt(data.tokens[data.sample[rows]])
    x, y = data.x[rows], data.y[rows]
    a = np.zeros(x.shape[1])
    for _ in range(ITERATIONS if gamma else 1):
        diff, s0 = x @ a, float(data.h0 @ a)
        mult = rho + gamma * rho * rho * (diff + 2.0 * s0)
        a = nnls(x * (mult * w)[:, None], y * w)
    return a


def predict(data: Data, rows: np.ndarray, a: np.ndarray, beta: float, gamma: float,
            n_ref: float) -> np.ndarray:
    rho = (data.length[data.sample[rows]] / n_ref) ** beta
    diff, s0 = data.x[rows] @ a, float(data.h0 @ a)
    return rho * diff + gamma * rho * rho * diff * (diff + 2.0 * s0)


def weighted_rmse(data: Data, rows: np.ndarray, pred: np.ndarray) -> float:
    w = data.tokens[data.sample[rows]]
    return float(np.sqrt(np.sum(w * (data.y[rows] - pred) ** 2) / np.sum(w)))


def cross_validate(data: Data, beta: float, gamma: float, n_ref: float,
                   samples: np.ndarray | None = None) -> float:
    """Token-weighted RMSE of rows predicted by a fit that never saw their sample (``FOLDS``
    folds over ``samples``, all by default)."""
    samples = np.arange(data.samples) if samples is None else samples
    folds = np.array_split(samples, min(FOLDS, samples.size))
    preds, rows_all = [], []
    for held in folds:
        train = np.flatnonzero(np.isin(data.sample, samples) & ~np.isin(data.sample, held))
        test = np.flatnonzero(np.isin(data.sample, held))
        a = fit_curves(data, train, beta, gamma, n_ref)
        preds.append(predict(data, test, a, beta, gamma, n_ref))
        rows_all.append(test)
    rows = np.concatenate(rows_all)
    return weighted_rmse(data, rows, np.concatenate(preds))


def search(data: Data, n_ref: float, samples: np.ndarray | None = None, betas=BETAS,
           gammas=GAMMAS) -> tuple:
    """(beta, gamma, its CV error, every variant's) chosen by cross-validation: the grid's best,
    and the best without the length term (beta 0), without the interaction (gamma 0) and with
    neither, for the report."""
    cv = {(b, g): cross_validate(data, b, g, n_ref, samples) for b in betas for g in gammas}
    best = min(cv, key=lambda k: (cv[k], abs(k[0]) + abs(k[1])))   # ties: the simpler
    variants = {"length and interaction": (best, cv[best])}
    for name, keep in (("no interaction", lambda k: k[1] == 0),
                       ("no length term", lambda k: k[0] == 0),
                       ("neither", lambda k: k == (0.0, 0.0))):
        if any(keep(k) for k in cv):
            variants[name] = min(((k, v) for k, v in cv.items() if keep(k)),
                                 key=lambda kv: kv[1])
    return best[0], best[1], cv[best], variants


TERMS = ("length", "interaction")


def fit(rows: list, *, d0: float, groups: int, num_layers: int, model_name: str, text: str,
        block_size: int, replicates: int = REPLICATES, seed: int = 0, betas=BETAS,
        gammas=GAMMAS, terms=TERMS) -> tuple:
    """(``QualityCost``, report) of the measurement rows (module docstring) of a model of
    ``num_layers`` layers in ``groups`` depth groups; ``betas``, ``gammas``: the grids searched
    (one value: fixed); ``terms``: which of the length term and the interaction the model keeps
    (the report's cross-validation covers all of them either way)."""
    data = Data(rows, d0, groups)
    if data.samples < 2:
        raise ValueError(f"{data.samples} samples with a uniform-d0 row: expected >= 2")
    if not set(terms) <= set(TERMS):
        raise ValueError(f"terms={terms!r}: expected a subset of {TERMS}")
    n_ref = float(np.exp(np.mean(np.log(data.length))))
    _, _, _, variants = search(data, n_ref, betas=betas, gammas=gammas)
    name = {("interaction", "length"): "length and interaction", ("length",): "no interaction",
            ("interaction",): "no length term", (): "neither"}[tuple(sorted(terms))]
    (beta, gamma), cv = variants[name]
    betas = betas if "length" in terms else (0.0,)
    gammas = gammas if "interaction" in terms else (0.0,)
    all_rows = np.arange(data.y.size)
    a = fit_curves(data, all_rows, beta, gamma, n_ref)
    rng = np.random.default_rng(seed)
    reps, rep_params = [], []
    small = (tuple(b for b in betas if abs(b - beta) <= 0.5),
             tuple(g for g in gammas if abs(g - gamma) <= 1.0))
    for _ in range(replicates):
        draw = rng.integers(0, data.samples, data.samples)
        rows_b = np.concatenate([np.flatnonzero(data.sample == s) for s in draw])
        # the replicate's own (beta, gamma): the in-sample best near the fit's (a refit of the
        # whole grid's CV per replicate costs 30x for the same spread)
        best = min(((b, g) for b in small[0] for g in small[1]),
                   key=lambda bg: weighted_rmse(data, rows_b, predict(
                       data, rows_b, fit_curves(data, rows_b, *bg, n_ref), *bg, n_ref)))
        a_b = fit_curves(data, rows_b, *best, n_ref)
        reps.append(Replicate(float(best[0]), float(best[1]), tuple(
            _knot_costs(a_b[g * len(KNOTS):(g + 1) * len(KNOTS)]) for g in range(groups))))
        rep_params.append(best)
    per_group = [a[g * len(KNOTS):(g + 1) * len(KNOTS)] for g in range(groups)]
    group_list = [GroupCost((g / groups, (g + 1) / groups),
                            (g * num_layers // groups + 1, (g + 1) * num_layers // groups),
                            np.asarray(KNOTS), _knot_costs(per_group[g])) for g in range(groups)]
    pred = predict(data, all_rows, a, beta, gamma, n_ref)
    resid = data.y - pred
    report = {
        "samples": data.samples, "rows": int(data.y.size), "length_ref": n_ref,
        "length_exponent": float(beta), "interaction": float(gamma),
        "cv_rmse": cv, "in_sample_rmse": weighted_rmse(data, all_rows, pred),
        "variants": {k: {"length_exponent": float(v[0][0]), "interaction": float(v[0][1]),
                         "cv_rmse": float(v[1])} for k, v in variants.items()},
        "residual_sd": float(resid.std(ddof=1)),
        "replicate_params": [list(map(float, p)) for p in rep_params],
        "curves": {f"group {g}": dict(zip(map(str, KNOTS), _knot_costs(per_group[g]).tolist()))
                   for g in range(groups)},
        "by_kind": {k: {"rows": int(np.sum([data.kind[s] == k for s in data.sample])),
                        "rmse": float(np.sqrt(np.mean(resid[[data.kind[s] == k
                                                             for s in data.sample]] ** 2)))}
                    for k in sorted(set(data.kind))},
    }
    ref_loss = float(np.average([r["loss"] for r in rows if all(
        abs(x - d0) < 1e-9 for x in r["vector"])]))
    model = QualityCost(model_name, float(d0), ref_loss, data.samples,
                        int(round(float(data.tokens.mean()))), text, tuple(group_list), n_ref,
                        float(beta), float(gamma), tuple(reps),
                        length_range=(float(data.length.min()), float(data.length.max())),
                        fit={k: report[k] for k in ("cv_rmse", "in_sample_rmse", "variants",
                                                    "residual_sd")} | {"block_size": block_size})
    return model, report


def _knot_costs(a: np.ndarray) -> np.ndarray:
    """A group's cost at ``KNOTS`` from its hinge coefficients (convex, non-increasing, 0 at the
    last knot)."""
    return hinges(np.asarray(KNOTS)) @ a


def summary(report: dict) -> str:
    lines = [f"{report['samples']} samples, {report['rows']} rows: length exponent "
             f"{report['length_exponent']:+.2f} (n_ref {report['length_ref']:.0f}), interaction "
             f"{report['interaction']:+.2f}; CV RMSE {report['cv_rmse']:.4f} (in sample "
             f"{report['in_sample_rmse']:.4f})"]
    for k, v in report["variants"].items():
        lines.append(f"  {k}: beta {v['length_exponent']:+.2f} gamma {v['interaction']:+.2f} "
                     f"CV RMSE {v['cv_rmse']:.4f}")
    for k, v in report["curves"].items():
        lines.append(f"  {k}: " + " ".join(f"{d}:{c:.4f}" for d, c in v.items()))
    return "\n".join(lines)
