"""The planner's per-phase profile (``scripts/bench.py planner_phases``): the profiler charges
each call's thread CPU to the innermost phase, patches a function wherever the package imported
it and puts everything back, and the study's phases of a tiny draft add up to the draft. No
timing is asserted: only the accounting."""

import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from studies import _phases, planner_phases  # noqa: E402


@pytest.fixture
def toy(monkeypatch):
    """Two modules of the package: ``inner`` defined in one, imported by name into the other."""
    a = types.ModuleType("sparsebalance_megatron._toy_phases_a")
    b = types.ModuleType("sparsebalance_megatron._toy_phases_b")

    def inner(n):
        return sum(i * i for i in range(n))

    def outer(n):
        return b.inner(n) + b.inner(n)      # the alias, as `from .a import inner` calls it

    a.inner, b.inner, b.outer = inner, inner, outer
    monkeypatch.setitem(sys.modules, a.__name__, a)
    monkeypatch.setitem(sys.modules, b.__name__, b)
    return a, b, inner, outer


def test_inner_calls_are_charged_to_their_own_phase_and_the_wrappers_go_away(toy):
    a, b, inner, outer = toy
    phases = [("outer", [f"{b.__name__}:outer"]), ("inner", [f"{a.__name__}:inner"]),
              ("gone", [f"{a.__name__}:no_such_function", "no_such_module:f"])]
    with _phases.PhaseProfile(phases) as prof:
        assert b.inner is not inner and a.inner is b.inner      # the alias wrapped too
        c0 = _phases._now()[0]
        b.outer(20000)
        total = _phases._now()[0] - c0
    assert a.inner is inner and b.inner is inner and b.outer is outer
    assert prof.calls == {"outer": 1, "inner": 2, "gone": 0}
    assert prof.absent == [f"{a.__name__}:no_such_function", "no_such_module:f"]
    got = prof.split(total)
    assert set(got) == {"outer", "inner", "gone", "gc", "other"}
    assert all(v >= 0 for k, v in got.items() if k != "other") and got["gone"] == 0
    assert sum(got.values()) == pytest.approx(total, abs=1e-12)
    assert got["other"] >= -1e-6                         # the phases lie inside the call


def test_a_tiny_draft_is_split_into_phases_that_add_up_to_it():
    q = planner_phases.measure(2, 4, 2, runs=2, budget_s=60.0, seq=8192)
    keys = {k for k, _, _ in planner_phases.DRAFT_PHASES} | {"gc", "other"}
    assert q["runs"] == 2 and len(q["steps"]) == 2
    # the public entry points the study is built on are in the tree, and each was called
    entry = ["batching.packing:sab_plan", "policy.costs:UnitCosts.from_latency",
             "latency.model:LatencyModel.unit_features", "policy.dst:plan_dst_from_config"]
    assert not {planner_phases.P + e for e in entry} & set(q["absent"])
    for s in q["steps"]:
        assert set(s["phases_s"]) == keys
        assert sum(s["phases_s"].values()) == pytest.approx(s["draft_s"], abs=1e-9)
        assert all(v >= 0 for k, v in s["phases_s"].items() if k != "other")
        assert s["phases_s"]["other"] >= -1e-6
        assert min(s["calls"][k] for k in ("sab.rest", "features", "unit_costs",
                                           "dst.setup")) >= 1
        assert 0 <= s["after_s"] and sum(s["after_phases_s"].values()) == pytest.approx(
            s["after_s"], abs=1e-9)
        assert all(b > 0 for b in s["serial_bytes"].values())
    assert q["min"]["draft_s"] <= q["median"]["draft_s"]
    g = q["gather_bytes_per_rank"]
    assert 0 < g["1"] < g["4"] < g["8"]
    fits = planner_phases.growth([q, dict(q, dp=4)])     # two DPs, the same figures: flat
    assert fits["draft"]["exponent"] == pytest.approx(0.0, abs=1e-9)
