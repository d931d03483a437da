"""A batch plan's coverage as the tests check it: every token of every sample in exactly one
segment of the plan, no micro-batch over ``max_tokens``."""

from __future__ import annotations

from typing import Sequence

from sparsebalance_megatron.batching import BatchPlan
from sparsebalance_megatron.batching.plan import checked_segments


def _merged(ranges):
    out = []
    for s, e in sorted(ranges):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def check_plan_covers(plan: BatchPlan, samples: Sequence, max_tokens: int) -> None:
    """AssertionError unless every token of every sample is in exactly one segment of the plan
    and no micro-batch exceeds ``max_tokens`` ."""
    want, got = {}, {}
    for i, s, e in checked_segments(samples):
        want.setdefault(i, []).append((s, e))
    assert len(plan.micro_batches) == plan.dp
    for rank in plan.micro_batches:
        assert len(rank) == plan.num_microbatches, "ranks differ in micro-batch count"
        for mb in rank:
            assert sum(e - s for _, s, e in mb) <= max_tokens, "micro-batch over max_tokens"
            for i, s, e in mb:
                assert e - s <= max_tokens
                got.setdefault(i, []).append((s, e))
    assert set(got) == set(want), "samples missing or invented"
    for i in want:
        n_want = sum(e - s for s, e in want[i])
        n_got = sum(e - s for s, e in got[i])
        assert n_got == n_want, f"sample {i}: {n_got} tokens planned, {n_want} given"
        assert _merged(got[i]) == _merged(want[i]), f"sample {i}: pieces do not tile its ranges"
