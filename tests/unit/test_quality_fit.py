"""The quality model's fit (eval.quality_fit): non-negative least squares against a brute-force
oracle, and a synthetic measurement made from a known model (curves, length exponent,
interaction) recovered by the fit, its cross-validated choice and its bootstrap; the fitted
model predicts through the planner's one rule (StageQuality.change)."""

import itertools

import numpy as np
import pytest

from sparsebalance_megatron.eval import quality_fit as qf
from sparsebalance_megatron.quality.stages import StageQuality


def test_nnls_is_the_best_non_negative_solution():
    rng = np.random.default_rng(0)
    for case in range(20):
        a = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        x = qf.nnls(a, b)
        assert np.all(x >= 0)
        best = min((np.linalg.norm(a[:, list(s)] @ np.linalg.lstsq(a[:, list(s)], b,
                                                                   rcond=None)[0] - b), s)
                   for k in range(5) for s in itertools.combinations(range(4), k)
                   if k == 0 or np.all(np.linalg.lstsq(a[:, list(s)], b, rcond=None)[0] >= 0))
        assert np.linalg.norm(a @ x - b) <= best[0] + 1e-9


def _synthetic(a_true, beta, gamma, samples=12, noise=0.0, seed=0, d0=0.5):
    rng = np.random.default_rng(seed)
    vectors = ([(d0,) * 3] + [tuple(d if g == k else d0 for g in range(3))
                              for k in range(3) for d in (0.3, 0.4, 0.7, 1.0)]
               + [(d,) * 3 for d in (0.3, 0.4, 0.7, 1.0)]
               + [(1.0, 1.0, 0.35), (0.35, 0.7, 0.7), (0.7, 0.35, 1.0)])
    n_ref = 3000.0
    rows = []
    for i in range(samples):
        length = int(rng.integers(2048, 4096))
        rho = (length / n_ref) ** beta
        base = float(rng.uniform(2, 4))
        for v in vectors:
            s = float((qf.hinges(np.asarray(v)).reshape(-1) @ a_true))
            loss = base + rho * s + gamma * rho * rho * s * s + rng.normal(0, noise)
            rows.append({"sample": f"s{i}", "vector": list(v), "length": length,
                         "tokens": length, "kind": "k", "loss": loss})
    return rows


A_TRUE = np.concatenate([np.array([0.02, 0.01, 0.03, 0.01, 0.0]),
                         np.array([0.03, 0.0, 0.02, 0.02, 0.01]),
                         np.array([0.01, 0.01, 0.01, 0.0, 0.0])])


def test_the_fit_recovers_a_known_model():
    rows = _synthetic(A_TRUE, beta=-1.0, gamma=2.0, samples=10, noise=1e-4)
    model, report = qf.fit(rows, d0=0.5, groups=3, num_layers=30, model_name="m", text="t",
                           block_size=64, replicates=4, betas=(-1.5, -1.0, -0.5, 0.0),
                           gammas=(0.0, 1.0, 2.0, 3.0))
    assert report["length_exponent"] == pytest.approx(-1.0, abs=0.25)
    assert report["interaction"] == pytest.approx(2.0, abs=1.0)
    assert report["cv_rmse"] < 2e-3
    # the fitted model predicts unseen vectors and lengths through the planner's rule
    q = StageQuality.from_cost(model, [10, 10, 10], 0.5)
    rng = np.random.default_rng(9)
    for _ in range(20):
        v = rng.choice([0.35, 0.45, 0.6, 0.8, 1.0], size=3)
        n = int(rng.integers(2048, 4096))
        rho = (n / model.length_ref) ** -1.0
        s, s0 = (float(qf.hinges(np.asarray(x)).reshape(-1) @ A_TRUE) for x in (v, [0.5] * 3))
        want = rho * (s - s0) + 2.0 * rho * rho * (s * s - s0 * s0)
        assert float(q.doc_change(v[None], [n])[0]) == pytest.approx(want, abs=2e-3)
    # the bootstrap's replicates are models of their own, near the fit
    assert len(model.bootstrap) == 4
    for r in model.bootstrap:
        assert abs(r.length_exponent - report["length_exponent"]) <= 0.5


def test_without_a_length_effect_the_extra_terms_buy_nothing():
    """Data with no length effect and no interaction: the terms the search may add do not buy
    cross-validated accuracy beyond the noise (the model without them is as good)."""
    rows = _synthetic(A_TRUE, beta=0.0, gamma=0.0, samples=10, noise=2e-3, seed=3)
    _, report = qf.fit(rows, d0=0.5, groups=3, num_layers=30, model_name="m", text="t",
                       block_size=64, replicates=0, betas=(-1.0, 0.0, 1.0),
                       gammas=(-2.0, 0.0, 2.0))
    v = report["variants"]
    assert v["neither"]["cv_rmse"] <= v["length and interaction"]["cv_rmse"] * 1.05
    assert v["neither"]["cv_rmse"] < 4e-3               # the noise, 2e-3, and the fit's own error


def test_rows_without_their_uniform_d0_row_are_refused():
    rows = [r for r in _synthetic(A_TRUE, 0.0, 0.0, samples=3) if r["vector"] != [0.5] * 3]
    with pytest.raises(ValueError, match="0 samples with a uniform-d0 row"):
        qf.fit(rows, d0=0.5, groups=3, num_layers=30, model_name="m", text="t", block_size=64)
