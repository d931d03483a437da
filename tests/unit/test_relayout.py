"""A resume on another layout (``megatron/step/relayout.py``): what of the saved balancer state
applies to the new layout is kept, the rest dropped, and one line says which. The same runs in
Megatron's resume at PP=2 x DP=2 with 2 virtual stages, resumed on DP 1, PP 1 and without virtual
stages: tests/distributed/test_sparse_balance_run.py."""

from __future__ import annotations

from sparsebalance_megatron.megatron.step.relayout import layout_record, relayout

LATENCY = {"corrections": {"0": 1.1, "1": 2.9}, "errors": [0.1, 0.2, 0.05, 0.3],
           "stage_corrections": {"0,0": 0.9, "0,1": 1.1, "1,0": 1.2, "1,1": 0.8}}
SAVED = {"version": 1, "iteration": 3, "latency": LATENCY, "sensitivity": {"docs": [1]},
         "stand_down": {"dst": 1}, "layout": layout_record(2, 2, 2, 2),
         "ahead_basis": {"latency": LATENCY, "sensitivity": {"docs": []}}}


def test_the_same_layout_changes_nothing():
    state, line = relayout(SAVED, layout_record(2, 2, 2, 2))
    assert state is SAVED and line is None


def test_dp_2_to_1_keeps_dp_rank_0s_calibration_and_drops_rank_1s():
    state, line = relayout(SAVED, layout_record(1, 2, 2, 4))
    assert state["latency"] == {"corrections": {"0": 1.1}, "errors": LATENCY["errors"],
                                "stage_corrections": {"0,0": 0.9, "0,1": 1.1}}
    assert state["ahead_basis"]["latency"] == state["latency"]          # the basis alike
    assert state["sensitivity"] == SAVED["sensitivity"] and state["stand_down"] == {"dst": 1}
    assert SAVED["latency"] is LATENCY and len(LATENCY["corrections"]) == 2   # not changed
    assert line == ("resuming on another layout (saved on DP 2 x PP 2, 2 virtual stages per "
                    "pipeline rank, 2 micro-batches per step; now DP 1 x PP 2, 2 virtual stages "
                    "per pipeline rank, 4 micro-batches per step): the balancer keeps the "
                    "sensitivities, the stand-down counts and the calibration of DP rank(s) 0 "
                    "and its recent errors; drops the calibration of DP rank(s) 1 (gone: 1 "
                    "factor(s), 2 stage factor(s))")


def test_pp_2_to_1_or_vpp_on_to_off_drops_the_calibration():
    for now in (layout_record(2, 1, 1, 2), layout_record(2, 2, 1, 2)):
        state, line = relayout(SAVED, now)
        assert state["latency"] == {"corrections": {}, "errors": []}
        assert state["ahead_basis"]["latency"] == {"corrections": {}, "errors": []}
        assert state["sensitivity"] == SAVED["sensitivity"]
        assert line.endswith("the balancer keeps the sensitivities and the stand-down counts; "
                             "drops the whole latency calibration (2 DP rank factor(s), 4 stage "
                             "factor(s), 4 recent error(s): another pipeline)"), line


def test_more_dp_ranks_or_micro_batches_keep_everything():
    state, line = relayout(SAVED, layout_record(4, 2, 2, 1))
    assert state["latency"] == LATENCY                # new DP ranks start at 1: nothing to drop
    assert "drops nothing" in line and "DP rank(s) 0, 1" in line


def test_a_state_without_its_layout_is_read_by_its_calibration():
    old = {k: v for k, v in SAVED.items() if k != "layout"}
    state, line = relayout(old, layout_record(1, 2, 2, 4))   # saved on DP 2 (ranks 0 and 1)
    assert state["latency"]["corrections"] == {"0": 1.1} and "DP 2 x PP 2" in line
    state, line = relayout(old, layout_record(2, 2, 2, 4))   # DP as saved: nothing to say
    assert line is None


def test_a_run_without_a_latency_model_names_only_what_it_has():
    state, line = relayout(SAVED, layout_record(2, 1, 1, 2), latency=False)
    assert line.endswith("keeps the sensitivities and the stand-down counts; drops nothing")
