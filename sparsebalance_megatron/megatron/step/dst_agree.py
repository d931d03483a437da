"""The decomposed DST's reductions over a data-parallel group (issue 77): ``DPReducer`` turns one
round of ``policy.dst_rounds.rank_rounds`` (a rank's sums and maxima) into at most two
all-reduces of one float64 vector each, so a rank sends and receives the same few kilobytes a
round whatever the DP size, and ``plan_rank`` drives a rank's rounds with it. The do-no-harm
rule's step times are its maxima (``max``), and the committed plan's rows are gathered
(``gather``: [DP, m x stages + ...] floats, what rank 0's broadcast of the whole plan moved
before; the plan's consumers read every rank's rows).

Every rank of a DP rank's pipeline (and its TP/CP peers) plans the same rounds on the same slice,
so the reductions may run over any of the DP groups Megatron lays out: each holds one rank of
every DP rank. The group must be one no other thread uses meanwhile (a dedicated gloo group where
the rounds run beside training). In a run the planner process settles the draft and the rank's
reader thread makes each of its calls with a ``DPReducer`` (``step/relay.py``), which the training
thread resumes where it takes the step over: ``sent`` counts each round once, wherever made. A round's keys, shapes and dtypes are the same on every rank;
integers travel as float64, exact below 2**53.
"""

from __future__ import annotations

import numpy as np
import torch

from ...policy.dst_rounds import Parts, RankPlan, rank_rounds, run_rounds
from ..runtime import comm


class DPReducer:
    """The DP group's reduction of one round's parts (``__call__``); ``sent``: the bytes of
    each round's vectors (what a ring moves per rank grows with them, not with the group's
    size)."""

    def __init__(self, group):
        self.group = group
        self.sent: list[int] = []

    def __call__(self, parts: Parts) -> dict:
        self.sent.append(0)
        out = {}
        for op in ("sum", "max"):
            part = parts[op]
            if not part:
                continue
            keys = sorted(part)
            flat = [np.asarray(part[k]).reshape(-1) for k in keys]
            vec = torch.from_numpy(np.concatenate([f.astype(np.float64) for f in flat]))
            self.sent[-1] += vec.numel() * 8
            got = comm.all_reduce_tensor(vec, self.group, op).numpy()
            pos = 0
            for k, f in zip(keys, flat):
                out[k] = _like(part[k], got[pos:pos + f.size])
                pos += f.size
        for k, value in sorted(parts.get("cat", {}).items()):   # every rank's, in DP order
            out[k] = self.gather(value).reshape(-1)
        return out


    def max(self, x: float) -> float:
        """The group's maximum of ``x`` (a step time this rank predicted for its pipeline)."""
        self.sent.append(8)
        return float(comm.all_reduce_tensor(torch.tensor([float(x)], dtype=torch.float64),
                                            self.group, "max")[0])

    def gather(self, row: np.ndarray) -> np.ndarray:
        """[DP, len(row)]: every DP rank's ``row`` (the same length on every rank), in the
        group's rank order (DP order)."""
        row = np.asarray(row, dtype=np.float64).reshape(-1)
        self.sent.append(row.size * 8)
        return comm.all_gather_tensor(torch.from_numpy(row), self.group).numpy()


def _like(value, flat: np.ndarray):
    """``flat`` (float64) in ``value``'s shape and type: a Python int or float for a scalar,
    an array of its dtype otherwise."""
    if np.ndim(value) == 0:
        return int(flat[0]) if isinstance(value, (int, np.integer)) else float(flat[0])
    arr = np.asarray(value)
    return flat.reshape(arr.shape).astype(arr.dtype, copy=False)


def plan_rank(costs, sensitivity, settings, group, *, quality=None,
              narrow: bool = False) -> tuple[RankPlan, DPReducer]:
    """This rank's decomposed DST plan (``costs``: its DP rank's [1, m, stages] slice), the
    rounds reduced over ``group``; with the reducer (its rounds' bytes)."""
    reducer = DPReducer(group)
    plan = run_rounds(rank_rounds(costs, sensitivity, settings, quality=quality,
                                  narrow=narrow), reducer)
    return plan, reducer
