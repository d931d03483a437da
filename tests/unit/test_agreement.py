"""A step's agreement is one exchange the step owns (``megatron/step/agreement.py``): the pure
floors state every round as a generator (SAB's packing, the agreed calibration statistics,
DST's rank rounds, the do-no-harm race's step times, the committed rows) and the step's one
driver reduces them. So while a rank settles its draft no function of ``policy/`` or
``batching/`` calls into the adapter or the DP group (a callback that would climb back up a
floor), and every collective is one call of the group, made by ``drive``."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from sparsebalance_megatron.megatron.step.agreement import drive
from sparsebalance_megatron.policy.dst_rounds import reduce_in_process
from tests.unit.test_plan_ahead import DP, M, _drafter, steps  # noqa: F401  (fixture)

PKG = Path(__file__).resolve().parents[2] / "sparsebalance_megatron"
PURE = tuple(str(PKG / d) for d in ("policy", "batching"))
UP = (str(PKG / "megatron"), __file__)


class Twins:
    """A DP group of ``DP`` ranks that are all this rank's twins: one kind of call."""

    def __call__(self, parts):
        return reduce_in_process([parts] * DP)


def test_a_settle_never_calls_back_up_from_the_pure_floors(steps):
    from sparsebalance_megatron.batching import SensitivityTracker

    drafter = _drafter(copy.deepcopy(steps.lm), SensitivityTracker())
    for k in range(len(steps.segments)):
        draft = drafter.draft(k, 0, steps.segments[k], M, with_dst=False)
        climbs, made = Counter(), Counter()

        def watch(frame, event, arg):
            if event != "call":
                return
            callee = frame.f_code.co_filename
            if callee == __file__:
                made[frame.f_code.co_name] += 1
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            if caller.startswith(PURE) and callee.startswith(UP):
                climbs[f"{caller} -> {frame.f_code.co_name}"] += 1
        sys.setprofile(watch)
        try:
            densities, report = drafter.settle(draft, rank=1, agree=Twins())
        finally:
            sys.setprofile(None)
        assert not climbs, dict(climbs)
        # DST's rounds, the race's maxima and the rows' gather: every one a call of the group
        assert set(made) == {"__call__"} and made["__call__"] >= 8, dict(made)
        assert np.shape(densities) == (DP, M, 2) and report["stand_down"] is not None


def test_a_generator_that_needs_no_round_is_never_reduced():
    def none():
        return "agreed alone"
        yield  # noqa: a generator of no rounds

    assert drive(none(), None) == "agreed alone"


def test_a_race_estimates_only_the_sensitivities_of_the_packings_dst_plans(steps, monkeypatch):
    """With ``--sb-stand-down-compare static`` the race plans SAB's packing with DST and runs
    the baseline static: the baseline's unit sensitivities are never estimated (a rank
    planning its own units estimated every candidate's before the race: 2 a step)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.batching import sensitivity as S

    real, calls = S.unit_sensitivity, []

    def counted(batch, tracker):
        calls.append(batch)
        return real(batch, tracker)
    monkeypatch.setattr(S, "unit_sensitivity", counted)
    drafter = _drafter(copy.deepcopy(steps.lm), SensitivityTracker(),
                       stand_down_compare="static")
    raced = 0
    for k in range(len(steps.segments)):
        draft = drafter.draft(k, 0, steps.segments[k], M, with_dst=False)
        calls.clear()
        _, report = drafter.settle(draft, rank=1, agree=Twins())
        raced += len(report["stand_down"]["predicted_step_s"]) > 1
        assert len(calls) == 1, (k, len(calls))            # SAB's packing, the one DST plans
    assert raced, "no step raced two packings: the test checks nothing"
