"""After an attention kernel fell back on some rank (``megatron/step/fallback_sync.py``): every rank
adopts the furthest fallback of the step's gather, the latency model is re-priced by the table's
timing of the two kernels (the sparse kernel's terms scaled, nothing else), rank 0 says it; a rank's
planner process, whose copy of the model is the old one, is restarted."""

from __future__ import annotations

import copy
import types
from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance_megatron.batching import SensitivityTracker
from sparsebalance_megatron.latency.model import LatencyModel
from sparsebalance_megatron.latency.shape import ModelShape
from sparsebalance_megatron.megatron.model.backend_fallback import BackendFallback
from sparsebalance_megatron.megatron.step import fallback_sync
from sparsebalance_megatron.megatron.step.fallback_sync import follow, reported, reprice
from sparsebalance_megatron.megatron.step.planning import PlannerFailures, StepPlanning
from tests.unit.test_plan_ahead import M, _drafter, _plain, steps  # noqa: F401  (fixture)

SHAPE = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, seq_length=4096, pp=2)
UNITS = [[4096], [1024, 1024, 2048], [512] * 8]


@pytest.fixture(autouse=True)
def _auto_measured(monkeypatch):
    from sparsebalance_megatron.attention import api

    monkeypatch.setattr(api, "_AUTO_MEASURED", {})


def test_reprice_scales_the_sparse_kernels_terms_alone():
    lm = LatencyModel.analytic(SHAPE, pp=2)
    before = copy.deepcopy(lm)
    f = before.unit_features(UNITS)
    old = [before.unit_terms(f, s) for s in range(2)]
    reprice(lm, 1.5)
    g = lm.unit_features(UNITS)
    for s, t in enumerate(old):
        new = lm.unit_terms(g, s)
        assert new.attn_s_per_pair == pytest.approx(1.5 * t.attn_s_per_pair)
        # the fixed part grows by half its selection and sparse-call terms, never shrinks
        assert np.all(new.fixed_s >= t.fixed_s) and np.any(new.fixed_s > t.fixed_s)
    tokens = 1     # MODEL_FEATURES.index("tokens"): untouched
    for k in lm.coef:
        for p in ("fwd", "bwd"):
            assert lm.coef[k][p][tokens] == before.coef[k][p][tokens]
            assert np.shares_memory(lm.coef[k][p], lm._coef_full[k][p])


def _cb(seconds, own_failure: bool):
    lm = LatencyModel.analytic(SHAPE, pp=2)
    lm.table = dict(lm.table, attention=dict(lm.table["attention"], backend_choice={
        "chosen": "fa4", "seconds": seconds}))
    budget = SimpleNamespace(attention_backend="fa4", fallback=BackendFallback(),
                             set_backend=lambda b: setattr(budget, "attention_backend", b))
    if own_failure:
        budget.fallback.events.append({"from": "fa4", "to": "triton", "shape": "", "error": ""})
        budget.attention_backend = "triton"
    return SimpleNamespace(budget=budget, latency=lm, _process=None, device="cpu",
                           sb=SimpleNamespace(attention_backend="auto"))


def test_every_rank_follows_the_furthest_fallback_and_reprices_alike(monkeypatch):
    said = []
    monkeypatch.setattr(fallback_sync.comm, "say", said.append)
    secs = {"fa4": 1.0e-3, "triton": 1.5e-3, "flex": 2.0e-3}
    ranks = [_cb(secs, own_failure=r == 1) for r in range(2)]
    assert [reported(cb.budget) for cb in ranks] == [0, 2]     # triton: CHAIN[1], + 1
    furthest = max(reported(cb.budget) for cb in ranks)         # the gather's max
    for cb in ranks:
        got = follow(cb, furthest, iteration=1)
        assert got == {"from": "fa4", "to": "triton", "factor": 1.5}
        assert cb.budget.attention_backend == "triton"
        assert follow(cb, furthest, iteration=2) is None        # once
    a, b = (cb.latency.unit_terms(cb.latency.unit_features(UNITS), 0) for cb in ranks)
    assert a.attn_s_per_pair == b.attn_s_per_pair               # the ranks' models agree
    assert said[0] == ("warning: attention kernel fallback: every rank runs triton from "
                       "iteration 3 on (it replaces fa4, which failed on a rank: its warning "
                       "above); the latency model re-priced x1.50 (the table's profile: fa4 "
                       "1.00 ms, triton 1.50 ms)")
    assert follow(_cb(secs, False), 0, iteration=1) is None     # no fallback anywhere


def test_a_table_that_did_not_time_both_kernels_leaves_the_model(monkeypatch):
    said = []
    monkeypatch.setattr(fallback_sync.comm, "say", said.append)
    cb = _cb({"fa4": 1e-3}, own_failure=True)
    coef = copy.deepcopy(cb.latency.coef)
    assert follow(cb, 2, iteration=4)["factor"] is None
    assert all(np.array_equal(coef[k][p], cb.latency.coef[k][p]) for k in coef for p in coef[k])
    assert "not re-priced: the latency table did not time both kernels" in said[0]


def test_a_fallback_restarts_the_planner_process_with_the_repriced_model(
        monkeypatch, steps, lenient_draft_deadline):
    """``follow`` on a rank with a real planner process (``StepPlanning._start_process``, a fresh
    interpreter): the calibration a draft request carries does not carry the re-pricing, so only
    a new process drafts for the kernel that runs; it takes the next drafts once ready
    (``_planner_up``, ``restarting``; tests/unit/test_planner_faults.py)."""
    monkeypatch.setattr(fallback_sync.comm, "say", lambda line: None)
    lm = copy.deepcopy(steps.lm)
    lm.table = dict(lm.table, attention=dict(lm.table["attention"], backend_choice={
        "chosen": "fa4", "seconds": {"fa4": 1.0e-3, "triton": 1.5e-3}}))
    drafter = _drafter(lm, SensitivityTracker())
    budget = SimpleNamespace(attention_backend="triton", fallback=BackendFallback())
    budget.fallback.events.append({"from": "fa4", "to": "triton", "shape": "", "error": ""})
    cb = SimpleNamespace(budget=budget, latency=lm, device="cpu", _process=None,
                         _failures=PlannerFailures(), drafter=lambda: drafter,
                         sb=SimpleNamespace(attention_backend="auto", planner_timeout=30.0),
                         args=SimpleNamespace(distributed_timeout_minutes=None))
    for name in ("_start_process", "close_planner", "_planner_timeout_s"):
        setattr(cb, name, types.MethodType(getattr(StepPlanning, name), cb))
    segs = steps.segments[0]

    def draft(process):
        return process.submit(1, 0, segs, M, with_dst=True, tracker_sync=None, basis={},
                              latency_state=lm.calibration_state()).result()

    cb._start_process()
    old = cb._process
    try:
        before = draft(old)
        assert follow(cb, 2, iteration=0)["factor"] == 1.5
        new = cb._process
        assert new is not old and old.proc.poll() is not None      # the old one ended
        assert cb._failures.restarting and cb._failures.count == 0  # a restart, no failure
        after = draft(new)
        assert _plain(after) == _plain(drafter.draft(1, 0, segs, M, with_dst=True))
        assert _plain(after) != _plain(before)                      # the re-pricing moved it
    finally:
        old.close()
        cb.close_planner()
