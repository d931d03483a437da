"""SAB's candidate ranks agreed without gathering the makespans (``batching.span_select``): every
rank's rounds, driven in lockstep with in-process reductions, end with ``slots.candidates`` of
every rank's makespan (the brute-force oracle: the sort of all of them), ties, equal makespans
and values a few ulps apart included; the rounds' parts are the same size at any DP."""

import numpy as np
import pytest

from sparsebalance_megatron.batching import span_select
from sparsebalance_megatron.batching.slots import candidate_count, candidates
from sparsebalance_megatron.policy.dst_rounds import reduce_in_process

K = candidate_count()


def _agree(span):
    """Every rank's candidates, and the sizes (floats) of rank 0's parts, round by round."""
    dp = len(span)
    gens = [span_select.candidate_rounds(float(span[r]), r, dp, K) for r in range(dp)]
    sizes = []
    try:
        parts = [next(g) for g in gens]
    except StopIteration as done:          # DP <= 2k: no round
        return [done.value] * dp, sizes
    for _ in range(64):
        sizes.append(sum(np.asarray(v).size for op in ("sum", "max")
                         for v in parts[0][op].values()))
        agreed = reduce_in_process(parts)
        out, nxt = [], []
        for g in gens:
            try:
                nxt.append(g.send(agreed))
            except StopIteration as done:
                out.append(done.value)
        if out:
            assert not nxt, "the ranks' rounds disagree"
            return out, sizes
        parts = nxt
    raise AssertionError("no agreement in 64 rounds")


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
    """A round's part is 2 floats (the range), 6 x BINS (a refinement) or 3 x SLOTS (a gather),
    at DP 300 as at DP 4,096; the rounds' count stays small."""
    rng = np.random.default_rng(7)
    allowed = {2, 6 * span_select.BINS, 3 * span_select.SLOTS}
    for dp in (300, 4096):
        span = rng.lognormal(0, 0.05, dp)
        got, sizes = _agree(span)
        assert np.array_equal(got[0], candidates(span))
        assert set(sizes) <= allowed and len(sizes) <= 7, sizes
