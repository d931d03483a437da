"""The studies' per-phase profiler (``PhaseProfile`` of ``scripts/bench.py sab_ranks``): it
charges each call's thread CPU to the innermost phase, patches a function wherever the package
imported it and puts everything back. No timing is asserted: only the accounting."""

import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from studies import sab_ranks  # noqa: E402


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
    with sab_ranks.PhaseProfile(phases) as prof:
        assert b.inner is not inner and a.inner is b.inner      # the alias wrapped too
        c0 = sab_ranks._now()[0]
        b.outer(20000)
        total = sab_ranks._now()[0] - c0
    assert a.inner is inner and b.inner is inner and b.outer is outer
    assert prof.calls == {"outer": 1, "inner": 2, "gone": 0}
    assert prof.absent == [f"{a.__name__}:no_such_function", "no_such_module:f"]
    got = prof.split(total)
    assert set(got) == {"outer", "inner", "gone", "gc", "other"}
    assert all(v >= 0 for k, v in got.items() if k != "other") and got["gone"] == 0
    assert sum(got.values()) == pytest.approx(total, abs=1e-12)
    assert got["other"] >= -1e-6                         # the phases lie inside the call
