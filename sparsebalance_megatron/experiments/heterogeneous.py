"""Heterogeneous ranks in the simulated study (issue 27): one GPU a few percent slower, as thermal
throttling or a bad link makes it.

A slow rank is ``R:FACTOR``: GPU ``R`` takes ``FACTOR`` times the predicted compute time of every
unit it runs (1.10: 10% slower). ``R`` is Megatron's global rank at TP = CP = 1 under its default
rank order (tp-cp-ep-dp-pp): ``R = dp_rank + dp * pipeline_rank``; with PP = 1 it is the DP rank.
With context parallelism the slow GPU holds back its whole CP group (every layer's all-to-all
waits for it), so ``R`` names the group's (DP rank, pipeline rank) the same way. The pipeline
simulator then waits for it like for any other unit, and the step for the slowest DP replica.

What the planner sees: the study hands DST the scaled costs, the state the runtime reaches once
its per-(DP rank, pipeline rank) calibration (``latency.calibration``) has learned the factor
(a few steps: see ``CALIBRATION_CLIP``'s note). Point-to-point latencies are not scaled.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_SLOWDOWN = 100.0


@dataclass(frozen=True)
class SlowRank:
    """One GPU that computes ``factor`` times slower than the latency model predicts."""

    rank: int
    """Megatron's global rank at TP = CP = 1: dp_rank + dp * pipeline_rank."""
    factor: float
    """Compute-time multiplier, in [1, ``MAX_SLOWDOWN``]."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) \
                or self.rank < 0:
            raise ValueError(f"--slow-rank {self.rank}:{self.factor}: rank {self.rank!r}: "
                             f"expected an integer >= 0")
        f = float(self.factor)
        if not (1.0 <= f <= MAX_SLOWDOWN):
            raise ValueError(f"--slow-rank {self.rank}:{self.factor}: factor {self.factor!r}: "
                             f"expected a number in [1, {MAX_SLOWDOWN:g}] (1.1: 10% slower)")

    def describe(self) -> str:
        return f"{self.rank}:{self.factor:g}"


def parse_slow_rank(text: str) -> SlowRank:
    """``"R:FACTOR"`` (e.g. ``"3:1.1"``) -> SlowRank; ValueError naming the text otherwise."""
    rank, sep, factor = str(text).partition(":")
    try:
        if not sep:
            raise ValueError
        r, f = int(rank), float(factor)
    except ValueError:
        raise ValueError(f"--slow-rank {text!r}: expected RANK:FACTOR, e.g. 3:1.1 (global rank "
                         f"3 takes 1.1x the predicted compute time)") from None
    return SlowRank(r, f)


def rank_scale(slow: Sequence[SlowRank], dp: int, pp: int) -> np.ndarray:
    """[dp, pp] compute-time factor of every (DP rank, pipeline rank); 1 where not slow."""
    scale = np.ones((int(dp), int(pp)))
    for s in slow:
        if s.rank >= dp * pp:
            raise ValueError(f"--slow-rank {s.describe()}: rank {s.rank} is not one of the "
                             f"{dp * pp} ranks of DP={dp} x PP={pp} (R = dp_rank + dp x "
                             f"pipeline_rank)")
        scale[s.rank % dp, s.rank // dp] *= float(s.factor)
    return scale


def scale_costs(costs, slow: Sequence[SlowRank]):
    """A ``UnitCosts`` whose units on the slow GPUs take their factor times longer (virtual
    stage v of an interleaved layout runs on pipeline rank v mod pp)."""
    from ..policy import UnitCosts

    if not slow:
        return costs
    dp, _, nv = costs.shape
    pp = costs.pipeline_ranks
    s = rank_scale(slow, dp, pp)[:, None, np.arange(nv) % pp, None]     # [dp, 1, nv, 1]
    return UnitCosts(costs.densities, costs.fwd_s * s, costs.bwd_s * s, costs.attn_work,
                     pipeline_ranks=pp, dense_work=costs.dense_work, kept_grid=costs.kept_grid)
