"""A rank's agreement of a step with the other DP ranks (issue 77): the one driver of every round
a step makes (``drive``) and the DP group's reductions (``DPReducer``).

The pure floors state each agreement as a generator of rounds, and nothing more: DST's
(``policy.dst_rounds.rank_rounds``), the slow-GPU verdict and the raise headroom
(``policy.agreed_stats.agreed_rounds``) and SAB's packing (``batching.sab_rounds``). Each yield
is the rank's part of one reduction (``{"sum": ..., "max": ..., "cat": ...}``, the protocol of
``policy.dst_rounds``) and is sent back what the group agreed. ``drive`` runs such a generator
to its end with a reducer, one call a round: ``DPReducer`` in a run, the planner process's
``RelayReducer`` and the training thread's ``ReplayingReducer`` (``step/relay.py``), or a test's
stand-in group. A step's whole settle is one such generator (``Drafter.settle_rounds``: SAB's
packing, the agreed statistics, the do-no-harm race's step times and DST's rounds,
``policy.stand_down.choice_rounds``, and the committed rows' gather), so the pure floors never
call back up into the step. The studies and the tests drive every rank's generators in lockstep
in one process (``policy.dst_rounds.plan_rounds_in_process``): the same rounds, so a rank's
plan does not depend on who reduced its parts.

``DPReducer`` turns one round into at most two all-reduces of one float64 vector each, so a rank
sends and receives the same few kilobytes a round whatever the DP size; a round's ``cat`` part
is all-gathered (the committed plan's rows, [DP, m x stages + ...] floats; the agreed
statistics' exact values). Every rank of a DP rank's
pipeline (and its TP/CP peers) makes the same rounds on the same slice, so the reductions may
run over any of the DP groups Megatron lays out: each holds one rank of every DP rank. The group
must be one no other thread uses meanwhile (a dedicated gloo group where the rounds run beside
training). ``sent`` counts each round once, wherever made. A round's keys, shapes and dtypes
are the same on every rank; integers travel as float64, exact below 2**53.

Numpy only where it is imported: torch and ``runtime.comm`` are loaded by ``DPReducer`` when it
reduces (the planner process drives its rounds through this module and holds no group).
"""

from __future__ import annotations

from typing import Callable, Generator, TypeVar

import numpy as np

from ...policy.dst_rounds import Parts, RankPlan, rank_rounds

T = TypeVar("T")


def drive(rounds: Generator[Parts, dict, T], reduce: Callable[[Parts], dict]) -> T:
    """What the rank's generator ``rounds`` returns, each of its parts reduced by ``reduce``
    (a ``DPReducer``, or any callable of a round's parts: collective) and the agreed dict sent
    back; a generator that ends before its first round is never reduced."""
    try:
        parts = next(rounds)
        while True:
            parts = rounds.send(reduce(parts))
    except StopIteration as done:
        return done.value
    finally:                    # a round that raised (a cancelled relay): the generator's
        rounds.close()          # blocks (the cost tables' lease) end here, not when collected


class DPReducer:
    """The DP group's reduction of one round's parts (``__call__``); ``sent``: the bytes of
    each round's vectors (what a ring moves per rank grows with them, not with the group's
    size)."""

    def __init__(self, group):
        self.group = group
        self.sent: list[int] = []

    def __call__(self, parts: Parts) -> dict:
        import torch            # here, not at the top: the module docstring's last paragraph

        from ..runtime import comm

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
            row = np.asarray(value, dtype=np.float64).reshape(-1)
            self.sent[-1] += row.size * 8
            out[k] = comm.all_gather_tensor(torch.from_numpy(row), self.group).numpy().reshape(-1)
        return out


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
    plan = drive(rank_rounds(costs, sensitivity, settings, quality=quality, narrow=narrow),
                 reducer)
    return plan, reducer
