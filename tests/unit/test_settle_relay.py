"""DST settled in the planner process, its collectives relayed by the rank's reader thread
(``step/relay.py``, ``step/pending.py``): the same (densities, report) as settling on the training
thread; a process killed, stopped or late mid-rounds leaves the training thread to draft the
step again and settle it, the rounds already made replayed (the peers saw them) and the rest
made live: the same plan, one set of rounds; a replayed round that differs is refused naming
it. A stand-in DP group (``Mirror``: every rank this one's twin) answers the rounds here; the
real group's, over gloo: tests/distributed/test_relayed_rounds.py."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading

import numpy as np
import pytest

from sparsebalance_megatron.megatron.step.ahead import PlannerProcess, PlannerProcessError
from sparsebalance_megatron.megatron.step.relay import ReplayingReducer, Rounds, signature
from sparsebalance_megatron.policy.dst_rounds import reduce_in_process
from tests.unit.test_plan_ahead import DP, M, _drafter, steps  # noqa: F401  (fixture)

RANK = 1


class Mirror:
    """A DP group of ``DP`` ranks that are all this rank's twins (``DPReducer``'s interface),
    recording the rounds it reduced (their signatures)."""

    def __init__(self, dp: int = DP):
        self.dp, self.made, self.sent = dp, [], []

    def __call__(self, parts):
        self.made.append(signature(parts))
        return reduce_in_process([parts] * self.dp)


def _plain(agreed) -> bytes:
    return pickle.dumps((np.asarray(agreed[0]).tolist(), sorted(agreed[1].items())))


@pytest.fixture(scope="module")
def drafter(steps):
    from sparsebalance_megatron.batching import SensitivityTracker

    return _drafter(copy.deepcopy(steps.lm), SensitivityTracker())


def _in_thread(drafter, steps, k: int):
    """(draft, its settle on this thread, the collectives it made)."""
    draft = drafter.draft(k, 0, steps.segments[k], M, with_dst=False)
    group = Mirror()
    return draft, drafter.settle(draft, rank=RANK, agree=group), group.made


def _submit(proc, drafter, steps, k: int, group, on_round=None):
    return proc.submit(k, 0, steps.segments[k], M, with_dst=False,
                       latency_state=drafter.latency.calibration_state(),
                       tracker_sync=("reset", drafter.tracker.state_dict()), basis={"k": k},
                       settle=(RANK, group), on_round=on_round)


def test_the_process_settles_the_draft_as_the_training_thread_does(steps, drafter,
                                                                   lenient_draft_deadline):
    proc = PlannerProcess(drafter)
    try:
        for k in range(len(steps.segments)):
            draft, want, made = _in_thread(drafter, steps, k)
            group = Mirror()
            pending = _submit(proc, drafter, steps, k, group)
            got = pending.result()
            assert _plain(got.agreed) == _plain(want), f"step {k}"
            assert group.made == made and len(pending.rounds.done) == len(made) >= 3
            assert [sig for sig, _ in pending.rounds.done] == made
            # only the packing the agreed plan commits comes back
            index = want[1]["stand_down"]["packing_index"]
            assert got.packing(index)[0].micro_batches == draft.packing(index)[0].micro_batches
            assert pending.phase == "sending"
    finally:
        proc.close()


def _resume(drafter, steps, k: int, pending):
    """The training thread's takeover: the same request drafted here, settled with the rounds
    the process made replayed first (what ``StepPlanning.join_ahead`` does)."""
    draft = drafter.draft(**pending.request)
    replay = pending.rounds.replaying()
    return drafter.settle(draft, rank=RANK, agree=replay), replay


@pytest.mark.reliability(area="fault", case="the planner process killed (SIGKILL) mid-way "
                         "through the DST rounds it settles the draft with (after its 2nd)",
                         expect="named 'ended while settling'; the training thread drafts the "
                         "step again, replays the 2 rounds made and makes the rest: the same "
                         "plan as settled in line, each collective made once")
def test_a_planner_killed_mid_rounds_leaves_the_rest_to_the_training_thread(steps, drafter):
    k = 1
    _, want, made = _in_thread(drafter, steps, k)
    proc = PlannerProcess(drafter)
    try:
        proc.wait_ready()
        group = Mirror()
        pending = _submit(proc, drafter, steps, k, group,
                          on_round=lambda n: n == 2 and proc.kill())
        with pytest.raises(PlannerProcessError, match=r"ended while settling iteration 2's "
                           r"DST \(its rounds relayed over the DP group\) with signal 9") as e:
            pending.result()
        assert e.value.phase == "agreeing" and len(pending.rounds.done) == 2
        got, replay = _resume(drafter, steps, k, pending)
        assert _plain(got) == _plain(want)
        assert replay.replayed == 2 and group.made == made      # one set of collectives
    finally:
        proc.close()


@pytest.mark.reliability(area="fault", case="the planner process stopped (SIGSTOP) between two "
                         "of the DST rounds it settles the draft with", expect="past its "
                         "deadline after the last round's answer it is named stalled ('no next "
                         "round'), killed; the round made replayed, the rest made on the "
                         "training thread: the same plan")
def test_a_planner_stopped_mid_rounds_is_killed_and_its_rounds_resumed(steps, drafter):
    k = 2
    _, want, made = _in_thread(drafter, steps, k)
    proc = PlannerProcess(drafter, timeout_s=30.0)
    stopped = threading.Event()

    def stop(n):
        if n == 1:
            proc.stop_for_test()
            proc.timeout_s = 0.05                # its deadline from here on: 0.05 s
            stopped.set()
    try:
        proc.wait_ready()
        group = Mirror()
        pending = _submit(proc, drafter, steps, k, group, on_round=stop)
        assert stopped.wait(120)
        with pytest.raises(PlannerProcessError, match=r"stalled: iteration 3's DST rounds: no "
                           r"next round 0.05 s after round 1's answer .*it was stopped \(state "
                           r"T\); killed") as e:
            pending.result()
        assert e.value.phase == "stalled" and proc.proc.poll() == -9
        got, replay = _resume(drafter, steps, k, pending)
        assert _plain(got) == _plain(want) and replay.replayed == 1 and group.made == made
    finally:
        proc.close()


@pytest.mark.reliability(area="fault", case="the planner process late mid-rounds (it runs, its "
                         "next round not asked by its deadline)", expect="the training thread "
                         "takes the step over (the round made replayed); the process's next "
                         "round is answered 'cancel', it stops settling and drafts the next "
                         "step: no round made twice")
def test_a_late_planner_mid_rounds_is_cancelled_and_kept(steps, drafter):
    k = 0
    _, want, made = _in_thread(drafter, steps, k)
    proc = PlannerProcess(drafter, timeout_s=30.0)
    held, release = threading.Event(), threading.Event()

    def hold(n):                                 # the reader holds round 1's answer back
        if n == 1:
            proc.timeout_s = 0.05
            held.set()
            release.wait(120)
    try:
        proc.wait_ready()
        group = Mirror()
        pending = _submit(proc, drafter, steps, k, group, on_round=hold)
        assert held.wait(120)
        with pytest.raises(PlannerProcessError, match=r"is late: iteration 1's DST rounds: no "
                           r"next round .* it runs \(state [RSD]\)") as e:
            pending.result()
        assert e.value.phase == "late" and proc.still_late() is pending
        got, replay = _resume(drafter, steps, k, pending)
        assert _plain(got) == _plain(want) and replay.replayed == 1
        release.set()                            # its round 2 asked: cancelled, not made
        pending._thread.join(120)
        assert not pending._thread.is_alive() and pending._err is not None
        assert proc.still_late() is None and group.made == made and proc.proc.poll() is None
        proc.timeout_s = 30.0
        again = _submit(proc, drafter, steps, k, Mirror()).result()   # it goes on serving
        assert _plain(again.agreed) == _plain(want)
    finally:
        release.set()
        proc.close()


@pytest.mark.reliability(area="fault", case="a replayed DST round that is not the round the "
                         "planner process made (another kind, other keys or sizes)",
                         expect="a RuntimeError naming the round and both requests; nothing "
                         "sent to the group")
def test_a_replayed_round_that_differs_is_refused_naming_it():
    rounds = Rounds(Mirror(2))
    parts = {"sum": {"n": 3, "w": np.ones(4)}, "max": {"t": 1.5}}
    top = {"sum": {}, "max": {"step_s": 2.0}}                    # a step time's maximum
    rows = {"sum": {}, "max": {}, "cat": {"rows": np.ones(3)}}   # a gather of every rank's
    assert rounds.perform(parts)[0] and rounds.perform(top)[0]
    rounds.claimed = True                        # the training thread's claim
    assert rounds.perform(rows) == (False, None)                 # the reader makes no more
    assert rounds.reducer.made == [signature(parts), signature(top)]

    replay = rounds.replaying()
    assert replay(parts) == rounds.done[0][1]
    assert replay({"sum": {}, "max": {"step_s": 9.0}})["step_s"] == 2.0
    assert replay(rows)["rows"].shape == (6,)                    # live from here on
    assert rounds.reducer.made == [signature(parts), signature(top), signature(rows)]
    for bad, what in ((lambda r: r(top), r"round 1 .* it made \(\('sum', \(\('n', 1\), "
                       r"\('w', 4\)\)\), \('max', \(\('t', 1\),\)\)\), the training thread's "
                       r"draft asks \(\('max', \(\('step_s', 1\),\)\),\)"),
                      (lambda r: r({"sum": {"n": 3, "w": np.ones(5)}, "max": {"t": 1.5}}),
                       r"round 1 .*\('w', 4\).*\('w', 5\)"),
                      (lambda r: (r(parts), r(rows)),
                       r"round 2 of this step, replayed .* it made \(\('max', \(\('step_s', 1\),"
                       r"\)\),\), the training thread's draft asks \(\('cat', \(\('rows', 3\),"
                       r"\)\),\)")):
        replay = ReplayingReducer(list(rounds.done), Mirror(2))
        with pytest.raises(RuntimeError, match=what):
            bad(replay)
        assert replay.live.made == []
    with pytest.raises(RuntimeError, match="only once the reader thread has stopped"):
        Rounds(Mirror(2)).replaying()
    with pytest.raises(RuntimeError, match=r"asked a round of float 2.0, not a round's parts"):
        Rounds(Mirror(2)).perform(2.0)


@pytest.mark.reliability(area="fault", case="the planner process's draft late before the first "
                         "DST round it settles with (the step claimed by the training thread "
                         "first)", expect="the process's first round answered 'cancel': no "
                         "round relayed, all made by the training thread; the process drafts "
                         "the next step")
def test_a_draft_claimed_before_its_first_round_is_cancelled_and_settled_here(steps, drafter):
    k = 1
    _, want, made = _in_thread(drafter, steps, k)
    proc = PlannerProcess(drafter, timeout_s=30.0)
    try:
        proc.wait_ready()
        proc.stop_for_test()        # it cannot ask a round before the claim
        group = Mirror()
        pending = _submit(proc, drafter, steps, k, group)
        assert not pending.rounds.claim_when_due(lambda last: 0.0)   # claimed at once
        os.kill(proc.pid, signal.SIGCONT)
        pending._thread.join(120)
        assert not pending._thread.is_alive() and pending._draft is None
        assert pending._err is None and pending.rounds.done == [] and group.made == []
        got, replay = _resume(drafter, steps, k, pending)
        assert _plain(got) == _plain(want) and replay.replayed == 0 and group.made == made
        pending._planner._pending = None         # (result() would have raised it late)
        again = _submit(proc, drafter, steps, k, Mirror()).result()
        assert _plain(again.agreed) == _plain(want)
    finally:
        proc.close()
