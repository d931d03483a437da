"""--sb-plan-ahead's planner thread: the draft comes back to the training thread, and so does
an error raised while drafting (a bad batch must stop the run, not vanish with the thread)."""

from __future__ import annotations

import threading

import pytest

from sparsebalance_megatron.megatron.step.planning import Draft, Planner


def test_planner_returns_the_draft_with_its_basis():
    seen = []

    def draft():
        seen.append(threading.current_thread().name)
        return Draft(iteration=3, first_bin=12, batch=None, units=None, payload=None)

    out = Planner(draft, basis={"latency": {"errors": [0.1]}}).result()
    assert (out.iteration, out.first_bin) == (3, 12)
    assert out.basis == {"latency": {"errors": [0.1]}}
    assert seen == ["sparsebalance-planner"]


def test_planner_reraises_the_drafts_error_on_the_caller():
    def draft():
        raise ValueError("sample 7: 40000 tokens, expected <= 32768")

    with pytest.raises(ValueError, match="sample 7: 40000 tokens"):
        Planner(draft, basis={}).result()
