"""SAB's candidate ranks agreed without gathering the makespans (``batching.span_select``): every
rank's rounds, driven in lockstep with in-process reductions, end with ``slots.candidates`` of
every rank's makespan (the brute-force oracle: the sort of all of them), ties, equal makespans
and values a few ulps apart included; the rounds' parts are the same size at any DP."""

import numpy as np
import pytest

from sparsebalance_megatron.batching import span_select
from sparsebalance_megatron.batching.slots import candidate_count, candidates
from sparsebalance_megatron.megatron.step.agreement import drive
from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

K = candidate_count()


def _agree(span):
    """Every rank's candidates (``dst_rounds.plan_rounds_in_process``), and the sizes (floats)
    of rank 0's parts, round by round."""
    dp, sizes = len(span), []

    def logged(rounds):                  # rank 0's parts measured on their way
        parts = next(rounds)
        while True:
            sizes.append(sum(np.asarray(v).size for op in ("sum", "max")
                             for v in parts[op].values()))
            assert len(sizes) <= 64, "no agreement in 64 rounds"
            agreed = yield parts
            try:
                parts = rounds.send(agreed)
            except StopIteration as done:
                return done.value

    gens = [span_select.candidate_rounds(float(span[r]), r, dp, K) for r in range(dp)]
    if dp <= 2 * K:                      # no round: every rank a candidate
        return [drive(g, None) for g in gens], sizes
    return plan_rounds_in_process([logged(gens[0])] + gens[1:]), sizes


def _spans(kind: int, dp: int, rng) -> np.ndarray:
    return [lambda: rng.uniform(1, 2, dp), lambda: np.full(dp, 1.5),
            lambda: rng.choice([1.0, 1.25, 1.5], dp),
            lambda: 1 + 1e-15 * rng.integers(0, 3, dp),           # a few ulps apart
            lambda: np.round(rng.lognormal(0, 0.05, dp), 3),
            lambda: np.r_[np.full(max(dp - 3, 0), 2.0), [1.0, 3.0, 2.0 + 1e-12]][:dp]][kind]()


@pytest.mark.parametrize("kind", range(6))
def test_every_rank_agrees_the_candidates_of_all_makespans(kind):
    rng = np.random.default_rng(kind)
    for dp in (1, 38, 39, 40, 77, 300, 1000):
        span = _spans(kind, dp, rng)
        got, sizes = _agree(span)
        want = candidates(span)
        assert all(np.array_equal(g, want) for g in got), (kind, dp)
        assert (not sizes) == (dp <= 2 * K)
        assert len(sizes) <= 10, sizes


def test_the_rounds_do_not_grow_with_dp():
    """A round's part is 2 floats (the range), 3 x BINS an end refined (a refinement) or
    3 x SLOTS (a gather), at DP 300 as at DP 4,096; the rounds' count stays small."""
    rng = np.random.default_rng(7)
    allowed = {2, 3 * span_select.BINS, 6 * span_select.BINS, 3 * span_select.SLOTS}
    for dp in (300, 4096):
        span = rng.lognormal(0, 0.05, dp)
        got, sizes = _agree(span)
        assert np.array_equal(got[0], candidates(span))
        assert set(sizes) <= allowed and len(sizes) <= 7, sizes
