"""The plugin's own per-step cost in every simulated step time (issue 44): given measured cost
JSONs, a run's net step time is its gross step plus exactly the named costs at its flags, the
baselines pay nothing, and do no harm compares net times (``NetGate``)."""

import json

import numpy as np
import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.experiments import StudyConfig, run_study
from sparsebalance_megatron.experiments.plugin_cost import (AheadCost, ControlPlaneCost,
                                                            PlannerCost, PluginCost, Shape,
                                                            refresh_s)
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.experiments.net_gate import NetGate
from sparsebalance_megatron.policy.stand_down import StepChoice, PackingOutcome

# planner_cost's JSON at 4 DP x 2 micro-batches x PP2 (vp 1: 2 stages), 8K tokens
PLANNER = {"dst_objective": "quality", "dst_descent": "critical_path", "steps": {"best": {
    "shape": "4 DP x 2 micro-batches x PP2, 8192 tokens", "layout": "2/2",
    "parts_ms": {"sab_plan": 3.0, "features + UnitCosts.from_latency": 2.0,
                 "sensitivity + DST": 10.0, "after the step: busy_s + unit_work": 1.0},
    "plan_ahead": {"join_wait_ms": 0.5, "after_step_ms": 1.5}}}}
CONTROL = {"rows": [{"world_size": 4, "microbatches": 4, "gather_ms": 1.0, "broadcast_ms": 0.5},
                    {"world_size": 8, "microbatches": 4, "gather_ms": 3.0, "broadcast_ms": 0.7},
                    {"world_size": 8, "microbatches": 16, "gather_ms": 9.0,
                     "broadcast_ms": 2.0}]}


def _scaled(planner: dict, factor: float) -> dict:
    out = json.loads(json.dumps(planner))
    step = out["steps"]["best"]
    step["parts_ms"] = {k: v * factor for k, v in step["parts_ms"].items()}
    step["plan_ahead"] = {k: v * factor for k, v in step["plan_ahead"].items()}
    return out


def _cost(tmp_path, planner=PLANNER, control=CONTROL) -> PluginCost:
    (tmp_path / "planner_cost_quality_descent.json").write_text(json.dumps(planner))
    (tmp_path / "control_plane.json").write_text(json.dumps(control))
    return PluginCost.from_results("quality", "critical_path", results=str(tmp_path))


def test_the_charge_is_the_named_measurements_scaled_to_the_row(tmp_path):
    cost = _cost(tmp_path)
    assert cost.planner.shape == Shape(4, 2, 2, 2, 8192)
    same = Shape(dp=4, microbatches=4, pp=2, virtual_stages=2, seq_length=8192)   # 8 ranks
    ch = cost.charge(same, sab=True, dst=True, planner="inline", stand_down=True)
    # packing x2 (tokens), features and DST x2 (units) x2 (both candidate packings, DST on both:
    # --sb-stand-down-compare planned, the default)
    assert ch.parts_ms == pytest.approx({"planning": 3.0 * 2 + (2.0 + 10.0) * 2 * 2,
                                         "gather": 3.0, "broadcast": 0.7,
                                         "calibration": 1.0 * 2})
    assert ch.plan_s == pytest.approx(sum(ch.parts_ms.values()) * 1e-3)
    assert "stand-down on (planned)" in ch.flags
    once = cost.charge(same, sab=True, dst=True, planner="inline", stand_down=True,
                       compare="static")     # DST x1: the packing the static plans chose
    assert once.parts_ms["planning"] == pytest.approx(3.0 * 2 + (2.0 * 2 + 10.0) * 2)
    assert "stand-down on (static)" in once.flags
    with pytest.raises(ValueError, match="compare='both': expected one of"):
        cost.charge(same, sab=True, dst=True, planner="inline", stand_down=True,
                    compare="both")
    # a file from before --sb-planner measured a thread ahead: it prices both ahead forms
    thread = cost.charge(same, sab=True, dst=True, planner="thread", stand_down=True)
    assert thread.parts_ms["planning"] == 0.5 and thread.parts_ms["calibration"] == 3.0
    assert "priced by" not in thread.source
    ahead = cost.charge(same, sab=True, dst=True, planner="process", stand_down=True)
    assert ahead.parts_ms == thread.parts_ms
    assert "--sb-planner process priced by the thread planner's measurement" in ahead.source
    no_dst = cost.charge(same, sab=True, dst=False, planner="inline", stand_down=False)
    assert no_dst.parts_ms["planning"] == pytest.approx(3.0 * 2 + 2.0 * 2)
    assert no_dst.parts_ms["broadcast"] == 0.0
    assert cost.charge(same, sab=False, dst=False, planner="inline", stand_down=True) is None
    assert "--sb-planner inline" in ch.flags and "8 ranks" in ch.flags
    with pytest.raises(ValueError, match="planner='ahead': expected one of"):
        cost.charge(same, sab=True, dst=True, planner="ahead", stand_down=True)
    assert "--sb-dst-objective quality" in ch.flags
    assert "planner_cost_quality_descent.json" in ch.source and "control_plane.json" in ch.source


def test_the_control_plane_is_interpolated_in_world_size_and_scaled_by_microbatches():
    cp = ControlPlaneCost("x", sorted([(4, 4, 1.0, 0.5), (8, 4, 3.0, 0.7), (8, 16, 9.0, 2.0)]))
    assert cp.at(4, 4) == (1.0, 0.5)
    assert cp.at(6, 4) == pytest.approx((2.0, 0.6))
    assert cp.at(16, 4) == pytest.approx((7.0, 1.1))        # the last segment's slope
    assert cp.at(8, 8) == pytest.approx((6.0, 1.4))         # nearest m (4 and 16 tie: 4) x 2
    assert cp.at(8, 32) == pytest.approx((18.0, 4.0))       # nearest m 16, x 2


def test_a_bad_measurement_is_refused_naming_what_is_missing(tmp_path):
    bad = json.loads(json.dumps(PLANNER))
    del bad["steps"]["best"]["parts_ms"]["sensitivity + DST"]
    (tmp_path / "p.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"parts_ms lacks \['sensitivity \+ DST'\]"):
        PlannerCost.load(str(tmp_path / "p.json"))
    with pytest.raises(FileNotFoundError, match="no control-plane measurement"):
        (tmp_path / "planner_cost_quality_descent.json").write_text(json.dumps(PLANNER))
        PluginCost.from_results("quality", "critical_path", results=str(tmp_path))


def test_a_ranks_measurement_scales_with_the_ranks_own_units_and_tokens(tmp_path):
    # planner_cost's per-rank result: one DP rank's own draft, settle and after-step work
    rank = json.loads(json.dumps(PLANNER))
    rank["steps"]["best"]["per_rank"] = True
    rank["steps"]["best"]["plan_ahead"]["handoff_ms"] = 0.2
    cost = _cost(tmp_path, planner=rank)
    assert cost.planner.per_rank
    whole = PlannerCost.load(str(tmp_path / "planner_cost_quality_descent.json"))
    whole.per_rank = False                 # the same figures read as the whole batch's
    wide = Shape(dp=16, microbatches=2, pp=2, virtual_stages=2, seq_length=8192)   # DP x 4
    inline = cost.charge(wide, sab=True, dst=True, planner="inline", stand_down=True)
    # a rank's parts do not grow with DP: packing once, features and DST x2 (both packings)
    assert inline.parts_ms["planning"] == pytest.approx(3.0 + (2.0 + 10.0) * 2)
    assert inline.parts_ms["calibration"] == pytest.approx(1.0)
    assert "one DP rank" in inline.source
    assert whole.scale(wide) == {"units": 4.0, "tokens": 4.0, "handoff": 4.0}
    ahead = cost.charge(wide, sab=True, dst=True, planner="process", stand_down=True)
    # the join wait as measured, the handoff (the global batch's segments) x4, after-step x1
    assert ahead.parts_ms["planning"] == pytest.approx(0.5 + 0.2 * 4)
    assert ahead.parts_ms["calibration"] == pytest.approx(1.5)
    # twice the micro-batches and stages: the rank's tokens x2 (packing), its units x4
    deep = Shape(dp=4, microbatches=4, pp=2, virtual_stages=4, seq_length=8192)
    assert cost.planner.scale(deep) == {"units": 4.0, "tokens": 2.0, "handoff": 2.0}
    ch = cost.charge(deep, sab=True, dst=True, planner="inline", stand_down=True)
    assert ch.parts_ms["planning"] == pytest.approx(3.0 * 2 + (2.0 + 10.0) * 2 * 4)
    assert ch.parts_ms["calibration"] == pytest.approx(1.0 * 4)


def _study(cost, steps=3, **kw):
    lm = LatencyModel.analytic(ModelShape(num_layers=4, seq_length=8192), pp=2)
    lengths = np.random.default_rng(0).integers(200, 8000, size=300)
    cfg = StudyConfig(microbatches=4, seq_length=8192, steps=steps, plugin_cost=cost,
                      sb=SparseBalanceConfig(sparse_balance=True, **kw))
    runs = {"static": ("static", None), "sab_dst": ("sab_dst", None), "dst": ("dst", None),
            "dense_sab": ("dense_sab", None), "dense": ("dense", None)}
    return run_study(2, cfg, lm, lengths, runs, baseline="static")


def test_net_step_time_is_gross_plus_the_named_costs(tmp_path):
    # a cheap planner (a thousandth of the figures above) and control plane: plans pay
    cost = _cost(tmp_path, planner=_scaled(PLANNER, 1e-3), control={"rows": [
        dict(r, gather_ms=r["gather_ms"] * 1e-3, broadcast_ms=r["broadcast_ms"] * 1e-3)
        for r in CONTROL["rows"]]})
    gross = _study(None)
    rows = _study(cost, planner="inline")
    shape = Shape(dp=2, microbatches=4, pp=2, virtual_stages=2, seq_length=8192)
    for name in ("static", "dense"):            # the baselines pay nothing
        r = rows[name]
        assert r["step_time_net_s"] == r["step_time_s"] and r["plugin_cost_ms"] == 0.0
    for name, sab, dst in (("sab_dst", True, True), ("dst", False, True),
                           ("dense_sab", True, False)):
        r = rows[name]
        ch = cost.charge(shape, sab=sab, dst=dst, planner="inline", stand_down=True)
        assert r["net_stood_down"] == 0.0          # a healthy run: every step plans
        assert r["step_time_s"] == gross[name]["step_time_s"]          # gross unchanged
        assert r["plugin_cost_ms"] == pytest.approx(ch.plan_s * 1e3, rel=1e-12)
        assert r["step_time_net_s"] == pytest.approx(r["step_time_s"] + ch.plan_s, rel=1e-12)
        assert r["speedup_vs_static_net"] == pytest.approx(
            rows["static"]["step_time_s"] / r["step_time_net_s"], rel=1e-12)
        assert r["plugin_cost_parts_ms"] == pytest.approx(ch.parts_ms)
        assert r["plugin_flags"] == ch.flags and r["plugin_cost_source"] == ch.source
    ahead = _study(cost)["sab_dst"]                # the default: --sb-planner process
    assert ahead["plugin_cost_ms"] < rows["sab_dst"]["plugin_cost_ms"]
    assert "--sb-planner process" in ahead["plugin_flags"]


def test_the_quality_refresh_is_charged_to_the_runs_that_plan_dst(tmp_path):
    """--sb-quality-refresh-interval N: K x (1 + groups) forward passes of a micro-batch
    through the pipeline every N steps (K: --sb-quality-refresh-microbatches, default 1),
    charged to the DST runs only, on top of their other parts."""
    from sparsebalance_megatron.policy.costs import UnitCosts

    fwd = np.zeros((2, 3, 2, 2))
    fwd[..., 0] = np.arange(12).reshape(2, 3, 2) * 0.01     # at d0 = 0.5: stage sums 0.01..0.21
    costs = UnitCosts(np.array([0.5, 1.0]), fwd + np.array([0.0, 1.0]), np.ones((2, 3, 2, 2)),
                      np.ones((2, 3, 2)))
    assert refresh_s(costs, 0.5, 4, 3) == pytest.approx(4 * 0.11 / 4)   # mean stage sum 0.11
    assert refresh_s(costs, 0.5, 0, 3) == 0.0
    assert refresh_s(costs, 0.5, 4, 3, 5) == pytest.approx(5 * 4 * 0.11 / 4)
    assert refresh_s(costs, 0.5, 0, 3, 5) == 0.0
    cost = _cost(tmp_path, planner=_scaled(PLANNER, 1e-3))
    plain = _study(cost, planner="inline")
    fresh = _study(cost, planner="inline", quality_refresh_interval=2)
    for name in ("sab_dst", "dst"):
        a, b = plain[name], fresh[name]
        assert "quality_refresh" not in a["plugin_cost_parts_ms"]
        r = b["plugin_cost_parts_ms"]["quality_refresh"]
        assert r > 0 and b["plugin_cost_ms"] == pytest.approx(a["plugin_cost_ms"] + r)
        assert b["step_time_s"] == a["step_time_s"]          # the plans are the same
    for name in ("static", "dense_sab", "dense"):
        assert fresh[name]["plugin_cost_ms"] == plain[name]["plugin_cost_ms"]
    # three held-out micro-batches per refresh: three times the passes, nothing else changes
    more = _study(cost, planner="inline", quality_refresh_interval=2,
                  quality_refresh_microbatches=3)
    for name in ("sab_dst", "dst"):
        r, r3 = (x[name]["plugin_cost_parts_ms"] for x in (fresh, more))
        assert r3["quality_refresh"] == pytest.approx(3 * r["quality_refresh"])
        assert more[name]["plugin_cost_ms"] == pytest.approx(
            fresh[name]["plugin_cost_ms"] + 2 * r["quality_refresh"])
        assert more[name]["step_time_s"] == fresh[name]["step_time_s"]


def test_do_no_harm_compares_net_times(tmp_path):
    """A plugin whose cost no plan can pay stands down without planning after its first step:
    the baseline packing at d0, run as the static baseline (nothing paid)."""
    costly = json.loads(json.dumps(PLANNER))
    costly["steps"]["best"]["parts_ms"]["sensitivity + DST"] = 1e6        # 1,000 s
    cost = _cost(tmp_path, planner=costly)
    rows = _study(cost, planner="inline")
    static = rows["static"]
    for name in ("sab_dst", "dst"):
        r = rows[name]
        assert r["net_stood_down"] == pytest.approx(2 / 3)
        # the first step paid all of it (4 ranks: gather 1 ms), steps 2 and 3 nothing
        parts = r["plugin_cost_parts_ms"]
        assert parts["gather"] == pytest.approx(1.0 / 3)
        assert parts["broadcast"] == pytest.approx(0.5 / 3)
        assert r["plugin_cost_ms"] == pytest.approx(sum(parts.values()))
        assert parts["planning"] > 1e6 / 3
    # the stood-down steps are the static baseline's (DST on sequential packing: the static
    # run's steps 2 and 3), the first DST's own
    first = _study(None, steps=1)
    assert 3 * rows["dst"]["step_time_s"] == pytest.approx(
        first["dst"]["step_time_s"] + 3 * static["step_time_s"] - first["static"]["step_time_s"],
        rel=1e-12)
    # without the gate (stand-down off: the ablation, one candidate packing) every step pays
    # the 1,000 s; with it the first step pays 2,000 s (DST on both packings) and no other, or
    # 1,000 s with DST on the packing the static plans chose (--sb-stand-down-compare static)
    off = _study(cost, stand_down="off", planner="inline")["sab_dst"]
    assert "net_stood_down" not in off
    assert off["plugin_cost_parts_ms"]["planning"] == pytest.approx(1e6, rel=1e-3)
    assert rows["sab_dst"]["plugin_cost_parts_ms"]["planning"] == pytest.approx(2e6 / 3,
                                                                               rel=1e-3)
    once = _study(cost, planner="inline", stand_down_compare="static")["sab_dst"]
    assert once["plugin_cost_parts_ms"]["planning"] == pytest.approx(1e6 / 3, rel=1e-3)
    assert once["net_stood_down"] == pytest.approx(2 / 3)
    assert static["step_time_net_s"] == static["step_time_s"]


def _choice(baseline_s, step_s):
    out = PackingOutcome(np.zeros((1, 1, 1)), step_s, baseline_s, step_s, False)
    return StepChoice(0, out, None, [step_s], baseline_s)


def test_the_net_gate_plans_while_plans_pay_and_probes_when_they_do_not():
    gate = NetGate(probe_every=3, max_probe_every=6)
    assert gate.plans()                                   # the first step plans
    assert gate.planned(_choice(1.0, 0.9), 0.05) == pytest.approx(0.05)
    assert gate.plans()                                   # it paid: plan again
    gate.planned(_choice(1.0, 0.99), 0.05)                # gained 0.01, cost 0.05
    assert not gate.plans()
    gate.skip()
    assert not gate.plans()
    gate.skip()
    assert gate.plans()                                   # the third step probes
    assert (gate.stood_down, gate.steps) == (2, 4)
    gate.planned(_choice(1.0, 0.99), 0.05)                # the probe did not pay: wait 6
    for _ in range(5):
        assert not gate.plans()
        gate.skip()
    assert gate.plans()
    gate.planned(_choice(1.0, 0.99), 0.05)                # capped at max_probe_every
    assert gate.wait == 6
    gate.planned(_choice(1.0, 0.5), 0.05)                 # pays again: back to planning
    assert gate.plans() and gate.wait == 3
    with pytest.raises(ValueError, match="probe_every=0"):
        NetGate(probe_every=0)


def test_a_measurement_with_explicit_fields_and_a_planner_process_reads_the_same(tmp_path):
    """planner_cost's fields by name (dp, microbatches, pp, virtual_stages, seq_length), and a
    planner process's pipe counted with the join wait."""
    new = json.loads(json.dumps(PLANNER))
    step = new["steps"]["best"]
    step.update(dp=4, microbatches=2, pp=2, virtual_stages=4, seq_length=8192,
                shape="another description", layout="[1+1]/[1+1]")
    step["plan_ahead"].update(handoff_ms=0.25, planner="process")
    (tmp_path / "p.json").write_text(json.dumps(new))
    got = PlannerCost.load(str(tmp_path / "p.json"))
    assert got.shape == Shape(4, 2, 2, 4, 8192)
    assert got.ahead == {"process": AheadCost(0.25, 0.5, 1.5)}
    assert got.draft_ms is None and got.draft_scale() == 1.0


def test_the_planner_studys_draft_prices_inline_planning_and_each_ahead_form(tmp_path):
    """planner_cost as --sb-planner writes it: the whole draft scales the in-line parts (so SAB +
    DST with both candidates costs the draft at the measured shape), each ahead form is priced by
    its own measurement, the handoff scales with the units and the join wait does not."""
    new = json.loads(json.dumps(PLANNER))
    new["planner"] = "process"
    step = new["steps"]["best"]
    step.update(draft_ms=54.0, candidates=2)   # no dst_candidates: DST on both, as measured
                                               # before the flag: 3 + 2 x (2 + 10) = 27: x2
    step["plan_ahead"].update(handoff_ms=0.2, planner="process")
    step["plan_ahead_thread"] = {"planner": "thread", "join_wait_ms": 7.0, "handoff_ms": 0.0,
                                 "after_step_ms": 1.0}
    cost = _cost(tmp_path, planner=new)
    assert cost.planner.draft_scale() == pytest.approx(2.0)
    measured = Shape(dp=4, microbatches=2, pp=2, virtual_stages=2, seq_length=8192)
    inline = cost.charge(measured, sab=True, dst=True, planner="inline", stand_down=True)
    assert inline.parts_ms["planning"] == pytest.approx(54.0)
    # --sb-stand-down-compare static plans DST once: the draft less one DST part, same scale
    once = cost.charge(measured, sab=True, dst=True, planner="inline", stand_down=True,
                       compare="static")
    assert once.parts_ms["planning"] == pytest.approx(54.0 - 2.0 * 10.0)
    # a file measured with 'static' says so: its draft spent DST once
    step.update(draft_ms=34.0, dst_candidates=1)      # parts: 3 + 2 x 2 + 10 = 17: x2
    now = _cost(tmp_path, planner=new)
    assert now.planner.draft_scale() == pytest.approx(2.0)
    assert now.charge(measured, sab=True, dst=True, planner="inline", stand_down=True,
                      compare="static").parts_ms["planning"] == pytest.approx(34.0)
    twice = Shape(dp=8, microbatches=2, pp=2, virtual_stages=2, seq_length=8192)   # 2x units
    proc = cost.charge(twice, sab=True, dst=True, planner="process", stand_down=True)
    assert proc.parts_ms["planning"] == pytest.approx(0.5 + 0.2 * 2)
    assert proc.parts_ms["calibration"] == pytest.approx(1.5 * 2)
    thread = cost.charge(twice, sab=True, dst=True, planner="thread", stand_down=True)
    assert thread.parts_ms["planning"] == pytest.approx(7.0)
    assert "priced by" not in proc.source + thread.source
