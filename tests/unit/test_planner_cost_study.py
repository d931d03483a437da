"""The planner_cost study's plan-ahead part (``scripts/bench.py planner_cost``) prices one DP rank
as a run makes it: the rank's own draft settled by the runtime's planner (a process, or a
thread) through ``settle=(rank, group)``, the group standing in from every rank's settle made
in lockstep (``drafts.group_record``); the rank's plan must be the group's, and a planner
that is not (a round beyond the group's, another plan) stops the study. No timing is
asserted."""

import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from studies import drafts, planner_cost  # noqa: E402

DP, M, SEQ = 4, 4, 8192


@pytest.fixture(scope="module")
def corpus():
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps

    sb = SparseBalanceConfig(sparse_balance=True)
    return sb, corpus_steps(DP, M, sb.density, 3, seq=SEQ, layout="best", pp=4)


def _overlap(corpus, planner, ranks):
    import copy

    sb, c = corpus
    return planner_cost.plan_ahead_overlap(copy.deepcopy(c.lm), sb, DP, M, SEQ, c.segments,
                                           0.02, planner, ranks)


@pytest.mark.usefixtures("lenient_draft_deadline")    # a loaded machine's slow draft: not late
@pytest.mark.parametrize("planner", ["process", "thread"])
def test_a_ranks_plan_ahead_is_its_own_draft_settled_with_the_group(corpus, planner):
    ranks = [1, 3, 0]
    got = _overlap(corpus, planner, ranks)
    assert got["planner"] == planner and got["per_rank"] and got["ranks"] == ranks
    assert len(got["rounds"]) == 3 and min(got["rounds"]) >= 3      # the settle's rounds
    assert got["critical_path_ms"] == pytest.approx(
        got["handoff_ms"] + got["join_wait_ms"] + got["after_step_ms"])
    assert got["after_step_ms"] > 0 and got["own_draft_cpu_ms"] > 0
    if planner == "thread":                 # nothing read back or relayed off the thread
        assert got["reader_ms"] == got["relayed_rounds_wall_ms"] == 0.0


@pytest.mark.parametrize("tamper,refused", [
    ("short", "asked a round its DP group did not make"),
    ("other plan", r"step 0, rank 0: the planner's settle is not the group's \(\d+ of \d+")])
def test_a_planner_that_is_not_its_groups_is_refused(corpus, monkeypatch, tamper, refused):
    """The stand-in group answers the rounds the group made for the step priced, and the
    rank's plan is checked against the group's: a planner asking a round beyond them (here:
    the group's last round left out) or committing another plan than the group's for the rank
    (here: the group's densities halved) stops the study."""
    real = drafts.group_record

    def tampered(drafter, k, segs, m, rank):
        record, settled = real(drafter, k, segs, m, rank)
        if tamper == "short":
            return record[:-1], settled
        return record, [(np.asarray(d) / 2, report) for d, report in settled]

    monkeypatch.setattr(planner_cost, "group_record", tampered)
    with pytest.raises((SystemExit, RuntimeError), match=refused):
        _overlap(corpus, "thread", [0, 1, 2])
