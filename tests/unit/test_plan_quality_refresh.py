"""``plan_quality --validate --refresh``'s wiring without SmolLM2 (issue 84): the probe's passes
move the layers the runtime moves, its held-out micro-batches are closed bins of the fill rule,
fake forwards go through the probe's statistics and the policy's rule as a run's would (a
measurement equal to the model's prediction keeps the launch-time model; one twice as large in
one group doubles that group's curve), and the plans are scored by the refreshed model."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from studies import plan_quality as pq  # noqa: E402
from studies import smollm2  # noqa: E402

from sparsebalance_megatron.quality.cost import QualityCost  # noqa: E402
from sparsebalance_megatron.quality.refresh import (  # noqa: E402
    group_of_layer, predicted_changes, probe_density, scaled)

D0, LAYERS, STRIDE = 0.5, 30, 4
LENGTHS = [2100, 3000, 4000, 2500, 3300]


def shipped() -> QualityCost:
    return QualityCost.load(pq.DEFAULT_MODEL)


def fake_docs(per_token_change, lengths=LENGTHS, seed=0, noise=0.0):
    """Documents as ``probe_refresh`` reads them: each pass's mean loss over the strided
    positions, pass k + 1 ``per_token_change[k]`` (+ noise) above the first."""
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        base = float(rng.uniform(2.0, 3.5))
        rows = [{"loss": base, "tokens": n - 1}]
        rows += [{"loss": base + c + float(rng.normal(0.0, noise)), "tokens": n - 1}
                 for c in per_token_change]
        docs.append((n, rows))
    return docs


def test_the_probes_passes_move_the_layers_the_runtime_moves():
    cost = shipped()
    vectors = pq.refresh_vectors(D0)
    t = probe_density(D0)
    assert vectors[0] == (D0,) * pq.GROUPS and len(vectors) == pq.GROUPS + 1
    for g, vec in enumerate(vectors[1:]):
        # the study's per-layer densities of the vector are the runtime's pass of group g
        # (``QualityProbe``: the layers whose ``group_of_layer`` is g at probe_density(d0))
        want = [t if group_of_layer(cost, n, LAYERS) == g else D0 for n in range(1, LAYERS + 1)]
        assert smollm2.layer_densities(vec, LAYERS) == pytest.approx(want)


def test_held_out_micro_batches_are_the_fill_rules_first_closed_bins():
    lengths = [3000, 4000, 2000, 5000, 3500, 4100, 2000]
    assert pq.held_out_bins(lengths, 2) == [[0, 1], [2, 3]]
    assert pq.held_out_bins(lengths, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="closed ones need more"):
        pq.held_out_bins(lengths, 4)           # the fourth bin could still take a sample
    assert pq.refresh_counts(4) == [1, 2, 4] and pq.refresh_counts(3) == [1, 2, 3]
    assert pq.refresh_counts(1) == [1]


def test_a_measurement_equal_to_the_prediction_keeps_the_launch_time_model():
    cost = shipped()
    t = [probe_density(D0)] * pq.GROUPS
    p = predicted_changes(cost, D0, t, LENGTHS, LENGTHS)
    got = pq.probe_refresh(cost, D0, fake_docs(p), STRIDE)
    assert got["measured"] == pytest.approx(p.tolist(), rel=1e-9)
    assert got["se"] == pytest.approx([0.0] * pq.GROUPS, abs=1e-9)      # sums' rounding
    assert got["scales"] == pytest.approx([1.0] * pq.GROUPS, rel=1e-9)
    launch = pq.predictor(cost, D0, LAYERS)[0]
    fresh = pq.refreshed_models(pq.DEFAULT_MODEL, {"r": got["scales"]}, D0, LAYERS)["r"][0]
    for vec in pq.MENU:
        assert fresh(vec, 3000) == pytest.approx(launch(vec, 3000), rel=1e-9, abs=1e-15)


def test_a_known_scale_reproduces_the_scaled_prediction_in_the_plans_scores():
    cost = shipped()
    t = [probe_density(D0)] * pq.GROUPS
    p = predicted_changes(cost, D0, t, LENGTHS, LENGTHS)
    got = pq.probe_refresh(cost, D0, fake_docs(p * [2.0, 1.0, 1.0]), STRIDE)
    assert got["scales"] == pytest.approx([2.0, 1.0, 1.0], rel=1e-9)
    assert got["ratio"] == pytest.approx([2.0, 1.0, 1.0], rel=1e-9)
    models = {"fitted": (pq.predictor(cost, D0, LAYERS)[0], None),
              **pq.refreshed_models(pq.DEFAULT_MODEL, {"refreshed": got["scales"]}, D0, LAYERS),
              "by hand": (pq.predictor(scaled(cost, [2.0, 1.0, 1.0]), D0, LAYERS)[0], None)}
    # two samples, each plan moves them to vectors; fake measured losses
    samples = [SimpleNamespace(input_ids=[0] * 2999, answer_ids=[0], length=3000),
               SimpleNamespace(input_ids=[0] * 1999, answer_ids=[0, 0], length=2000)]
    vecs = [pq.REFERENCE, (0.35, 0.5, 0.5), (0.5, 0.35, 0.5), (0.35, 0.5, 0.8)]
    rows = {(i, v): {"loss": 3.0 + 0.01 * k + 0.001 * i, "kept": v[0]}
            for i in range(2) for k, v in enumerate(vecs)}
    checked = [(f"plan {k}", {0: v, 1: vecs[(k + 1) % len(vecs)]}) for k, v in enumerate(vecs)]
    scored = pq.score_plans(checked, rows, samples, models)
    for r in scored:
        assert r["predicted"]["refreshed"] == pytest.approx(r["predicted"]["by hand"], abs=1e-15)
    only_first = pq.score_plans([("g0", {0: vecs[1], 1: vecs[1]})], rows, samples, models)[0]
    assert only_first["predicted"]["refreshed"] == pytest.approx(
        2.0 * only_first["predicted"]["fitted"], rel=1e-9)
    only_second = pq.score_plans([("g1", {0: vecs[2], 1: vecs[2]})], rows, samples, models)[0]
    assert only_second["predicted"]["refreshed"] == pytest.approx(
        only_second["predicted"]["fitted"], rel=1e-9)
    m = pq.metrics(scored, "refreshed")
    assert m["plans"] == len(checked) and np.isfinite(m["mae"])


def test_noisy_documents_give_the_probes_ratio_estimator_error_and_a_shrunk_scale():
    cost = shipped()
    t = [probe_density(D0)] * pq.GROUPS
    p = predicted_changes(cost, D0, t, LENGTHS, LENGTHS)
    docs = fake_docs(3.0 * p, noise=0.01, seed=4)
    got = pq.probe_refresh(cost, D0, docs, STRIDE)
    scored = np.array([len(range(0, rows[0]["tokens"], STRIDE)) for _, rows in docs], float)
    for g in range(pq.GROUPS):
        diff = np.array([(rows[g + 1]["loss"] - rows[0]["loss"]) for _, rows in docs]) * scored
        c = diff.sum() / scored.sum()
        se = np.sqrt(((diff - c * scored) ** 2).sum() * len(docs) / (len(docs) - 1)) \
            / scored.sum()
        assert got["measured"][g] == pytest.approx(c) and got["se"][g] == pytest.approx(se)
        w = c * c / (c * c + se * se)
        assert got["weight"][g] == pytest.approx(w)
        assert got["scales"][g] == pytest.approx(np.clip(c / p[g], 0.25, 4.0) ** w)
