"""DST settled in each rank's planner process over a real DP group (2 gloo ranks), its
collectives relayed by the rank's reader thread (``step/relay.py``): every rank ends with the
(densities, report) it settles on its own thread; with rank 1's planner process killed after
its 2nd round, rank 1's training thread drafts the step again, replays the 2 rounds and makes
the rest live beside rank 0's relayed rounds: the same plan on every rank, the same rounds sent."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tests.conftest import LENIENT_DEADLINE_S, spawn

pytestmark = pytest.mark.distributed

WORLD, M, SEQ = 2, 8, 8192


def _drafter(lm):
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    return Drafter(SparseBalanceConfig(sparse_balance=True), lm, SensitivityTracker(),
                   dp=WORLD, capacity=SEQ, attention_layers=lm.layout.attention_layers)


def _worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step import ahead
    from sparsebalance_megatron.megatron.step.ahead import PlannerProcess, PlannerProcessError
    from sparsebalance_megatron.megatron.step.agreement import DPReducer

    # conftest's lenient_draft_deadline, in this rank's process: on a loaded machine the second
    # draft's rounds, waiting on the peer's, read as late before the kill
    ahead.STALL_FLOOR_S = LENIENT_DEADLINE_S

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    steps = corpus_steps(WORLD, M, 0.5, 2, seq=SEQ, pp=2)
    drafter = _drafter(steps.lm)
    proc = PlannerProcess(drafter)
    out = {}
    try:
        for k, kill in ((0, False), (1, rank == 1)):
            draft = drafter.draft(k, 0, steps.segments[k], M, with_dst=False)
            inline = DPReducer(group)
            want = drafter.settle(draft, rank=rank, agree=inline)
            relayed = DPReducer(group)
            pending = proc.submit(k, 0, steps.segments[k], M, with_dst=False,
                                  latency_state=steps.lm.calibration_state(),
                                  tracker_sync=("reset", drafter.tracker.state_dict()),
                                  basis={}, settle=(rank, relayed),
                                  on_round=(lambda n: n == 2 and proc.kill()) if kill else None)
            error = None
            try:
                got = pending.result().agreed
            except PlannerProcessError as e:     # the training thread takes the step over
                error = (e.phase, str(e))
                again = drafter.draft(**pending.request)
                replay = pending.rounds.replaying()
                got = drafter.settle(again, rank=rank, agree=replay)
                error += (replay.replayed,)
            out[k] = dict(want=want, got=got, error=error, sent=(inline.sent, relayed.sent),
                          made=len(pending.rounds.done))
    finally:
        proc.close()
    with open(f"{out_dir}/{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("settle_relay")
    spawn(_worker, WORLD, str(tmp / "rendezvous"), str(tmp), cwd=tmp)
    return [pickle.loads((tmp / f"{r}.pkl").read_bytes()) for r in range(WORLD)]


def _plain(agreed) -> bytes:
    return pickle.dumps((np.asarray(agreed[0]).tolist(), sorted(agreed[1].items())))


def test_the_process_settles_over_the_dp_group_as_the_training_thread_does(runs):
    for run in runs:
        step = run[0]
        assert step["error"] is None and step["made"] >= 3
        assert _plain(step["got"]) == _plain(step["want"])
        inline, relayed = step["sent"]
        assert relayed == inline                  # the same rounds, the same bytes
    # every rank holds the whole plan: the same densities
    assert runs[0][0]["got"][0] == runs[1][0]["got"][0]


@pytest.mark.reliability(area="fault", case="2 gloo ranks: rank 1's planner process killed "
                         "after the 2nd DST round it settles the draft with, rank 0's relaying "
                         "on", expect="rank 1's training thread replays the 2 rounds and makes "
                         "the rest beside rank 0: both ranks' plans as settled in line, the "
                         "same rounds sent once")
def test_a_rank_whose_planner_dies_mid_rounds_resumes_them_beside_its_peer(runs):
    phase, line, replayed = runs[1][1]["error"]
    assert phase == "agreeing" and "ended while settling iteration 2's DST" in line
    assert replayed == 2 and runs[1][1]["made"] == 2 and runs[0][1]["error"] is None
    for run in runs:
        step = run[1]
        assert _plain(step["got"]) == _plain(step["want"])
        inline, relayed = step["sent"]
        assert relayed == inline                  # each round's bytes counted once
    assert runs[0][1]["got"][0] == runs[1][1]["got"][0]
    stand = [run[1]["got"][1]["stand_down"] for run in runs]
    assert stand[0] == stand[1]
