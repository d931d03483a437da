"""scripts/bench.py hybrid_cp: Megatron's hybrid-CP scheduler, timed by a cost function."""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    sys.path.insert(0, str(REPO / "scripts"))     # the runner's studies package
    return importlib.import_module("studies.hybrid_cp")


def _tokens_over_gpus(n, k):
    return n / k


def test_short_documents_run_side_by_side(bench):
    r = bench.hybrid_step_s([1000, 1000], 2, 4096, _tokens_over_gpus)
    assert r["step_s"] == 1000 and r["utilisation"] == 1.0


def test_a_long_document_gets_a_larger_cp_group(bench):
    seen = []

    def cost(n, k):
        seen.append((n, k))
        return n / k

    r = bench.hybrid_step_s([8000], 2, 4096, cost)
    assert (8000, 2) in seen and r["step_s"] == 4000


def test_every_token_is_scheduled_once(bench):
    lengths = np.random.default_rng(0).integers(16, 9000, 200).tolist()
    r = bench.hybrid_step_s(lengths, 8, 4096, _tokens_over_gpus)
    # cost n / k on k GPUs: the GPU-seconds are the tokens, whatever the placement
    np.testing.assert_allclose(r["utilisation"] * r["step_s"] * 8, sum(lengths))
    assert r["step_s"] >= sum(lengths) / 8 and r["subsamples"] == 200
