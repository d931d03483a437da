"""Dynamic sparsity tuning (DST), one attention density per (dp_rank, micro-batch, stage), as
the rounds one DP rank takes (docs/DESIGN.md section 6; ``dst_ranks`` says why it decomposes):
``rank_rounds`` is a generator that yields the rank's parts of each reduction and is sent back
what the DP group agreed; it holds no loop of its own. Whoever reduces drives it
(``plan_rounds_in_process`` and ``plan_dst`` in one process, a run's
``megatron/step/agreement.py`` over the group), so a rank's plan does not depend on who did.

The protocol: each yield is ``{"sum": {key: value}, "max": {key: value}}`` (floats, ints or
float/int arrays; the same keys and shapes on every rank of a round), and what is sent back is
one dict of every key, sums summed and maxima taken over the DP ranks; an optional ``"cat"``
part is gathered (every rank's array, in rank order). ``group_max`` and ``gathered`` are single
rounds for the step's other agreements; ``planned_rounds`` is a candidate packing's DST plan as
the do-no-harm race reads it.

The rounds: AR1 (the static plans), AR2 (every candidate's cut), AR3 (every candidate's raise),
then with the descent AR3b (its start) and AR4 (its probes), and where a probe is kept AR5 (its
report's sums and its quality under the model's replicates). The quality rule's replicates of
the band search's kept row and of the no-cut row ride AR3b, or without the descent AR3q. At DP
1 the rounds are the same and every reduction is the identity; no round grows with DP.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Optional

import numpy as np

from .agreed_stats import straggler_present
from .costs import UnitCosts
from .dst_band import SPEED_TIE, DSTPlan, DSTReport
from .dst_ranks import PHASES, Agreed1, RankDST, agreed_report, rank_slice
from .dst_settings import DSTSettings

Parts = dict          # {"sum": {key: value}, "max": {key: value}}: one rank's part of a round


@dataclass
class RankPlan:
    """A rank's decomposed plan: its own units' grid indices [1, m, stages] and the step's
    report (the agreed numbers, every rank's alike)."""

    grid_index: np.ndarray
    report: DSTReport
    candidate: int                 # the band search's kept candidate (every rank's alike)
    probe: int                     # the descent's kept probe (-1: none, or no descent)
    cpu_s: np.ndarray              # [len(PHASES)] the rank's thread CPU by phase


def rank_rounds(costs, sensitivity, settings: DSTSettings, *, quality=None,
                narrow: bool = False) -> Generator[Parts, dict, RankPlan]:
    """The rank's rounds (module docstring). ``costs``: the rank's [1, m, stages] slice
    (``dst_ranks.rank_slice``); ``sensitivity``: its rows; ``narrow``: the agreed slow-GPU
    verdict."""
    cpu = np.zeros(len(PHASES))

    def timed(phase, f, *args, **kw):
        c0 = time.thread_time()
        out = f(*args, **kw)
        cpu[phase] += time.thread_time() - c0
        return out

    rk = timed(0, RankDST, costs, sensitivity, settings, quality=quality, narrow=narrow)
    a1 = Agreed1((yield timed(0, rk.ar1)))
    a2 = yield timed(1, rk.cut, a1)
    a3 = yield timed(2, rk.raise_, a2)
    k = timed(3, rk.choose, a3)
    idx, report, j = rk.plans[k].grid_index, rk.chosen_report, -1
    if quality is not None and not rk.descend_on:               # AR3q
        replicates, free_replicates = (yield timed(3, rk.replicate_parts))["quality_b"]
    if rk.descend_on:
        start = yield timed(3, rk.descent_start, a3)            # AR3b
        if quality is not None:
            replicates, free_replicates = start["quality_b"]
        a4 = yield timed(4, rk.probes.probe, start, a1)         # AR4
        j = timed(5, rk.probes.best, a4, a1, float(start["mk"]))
        step = float(a4["mk"][j]) if j >= 0 else float("inf")
        if step < min(report.step_time_planned_s, report.step_time_static_s) * (1.0 - SPEED_TIE):
            idx = rk.probes.plans[j][0]
            a5 = yield timed(5, report_parts, rk, rk.probes.plans[j])   # AR5: its report's sums
            report = agreed_report(report, a1, a5, ranks_reverted=0, quality_cost=float(
                a5["quality"]) / a1.tokens if quality is not None else report.quality_cost)
            replicates = a5["quality_b"]
        else:                            # the band plan
            j = -1
    if quality is not None:              # do the cuts pay for themselves?
        idx, report, free = timed(5, rk.adopt, idx, report, replicates, free_replicates, a3)
        if free >= 0:
            k, j = free, -1
    return RankPlan(idx, report, k, j, cpu)


def report_parts(rk: RankDST, plan: tuple) -> Parts:
    """AR5: the rank's part of the report of the descent's kept ``plan`` (its grid indices,
    makespan, kept work by stage and quality sum): kept and plain density by stage, the quality
    sum, its makespan (sum, for the mean; max, the step) and the units cut and raised."""
    idx, mk, kept_s, q = plan
    i0 = rk.ps.bounds[0]
    dens = rk.costs.densities[idx]
    counts = np.array([(idx < i0).sum(), (idx > i0).sum()], dtype=np.int64)
    qb = np.zeros(0) if rk.quality is None else \
        rk.quality.replicate_sums_at(idx, rk.costs.densities)
    return {"sum": {"kept_s": kept_s, "plain_s": dens.sum(axis=(0, 1)), "quality": q,
                    "quality_b": qb, "mk_sum": mk, "counts": counts},
            "max": {"mk": mk}}


def reduce_in_process(parts: list) -> dict:
    """The DP group's reduction of every rank's ``parts`` made in one process: sums (in rank
    order) and maxima, key by key."""
    out = {}
    for key in parts[0]["sum"]:
        acc = parts[0]["sum"][key]
        for p in parts[1:]:
            acc = acc + p["sum"][key]
        out[key] = acc
    for key in parts[0]["max"]:
        vals = [p["max"][key] for p in parts]
        out[key] = np.maximum.reduce([np.asarray(v, dtype=np.float64) for v in vals]) \
            if np.ndim(vals[0]) else max(vals)
    for key in parts[0].get("cat", ()):
        out[key] = np.concatenate([np.asarray(p["cat"][key]).reshape(-1) for p in parts])
    return out


def plan_rounds_in_process(rounds: list) -> list:
    """Every rank's generator driven in lockstep, the reductions in-process: what each returns
    (a ``RankPlan``, an agreement, ...), in rank order (a generator may end before its first
    round)."""
    agreed = None                       # a fresh generator's first send: next()
    while True:
        out, nxt = [], []
        for g in rounds:
            try:
                nxt.append(g.send(agreed))
            except StopIteration as done:
                out.append(done.value)
        if out:
            if nxt:
                raise RuntimeError(f"the ranks' rounds disagree: {len(out)} ended where "
                                   f"{len(nxt)} yielded another part")
            return out
        agreed = reduce_in_process(nxt)


def plan_dst(costs: UnitCosts, sensitivity: Optional[np.ndarray], settings: DSTSettings, *,
             quality=None, rank_scale=None) -> DSTPlan:
    """DST's plan of ``costs`` [dp, m, stages] (docs/DESIGN.md section 5), every DP rank's
    rounds made here and their reductions made in-process, as the DP group makes them in a run.

    ``sensitivity``: [dp, m] or [dp, m, stages], higher = loses more accuracy when sparsified
    (None: all equal); ``quality``: the quality objective's ``StageQuality`` (None: the density
    objective); ``rank_scale``: the calibration's [dp, pp] factors (a slow GPU gets narrower
    bands, ``agreed_stats.straggler_present``)."""
    dp = costs.shape[0]
    narrow = straggler_present(rank_scale, settings.tolerance)
    sens = [None if sensitivity is None else np.asarray(sensitivity)[r:r + 1] for r in range(dp)]
    plans = plan_rounds_in_process([rank_rounds(rank_slice(costs, r), sens[r], settings,
                                                quality=quality, narrow=narrow)
                                    for r in range(dp)])
    agreed = {(p.candidate, p.probe) for p in plans}
    assert len(agreed) == 1, agreed                 # every rank keeps the same plan
    idx = np.concatenate([p.grid_index for p in plans])
    return DSTPlan(costs.densities[idx], plans[0].report, idx)


def planned_rounds(costs, sensitivity, settings: DSTSettings, *, quality=None,
                   narrow: bool = False) -> Generator[Parts, dict, tuple]:
    """``rank_rounds``' plan as the do-no-harm race reads a candidate's
    (``stand_down.choice_rounds``): (its densities [1, m, stages], the ``RankPlan``);
    ``sensitivity``: a callable of no arguments (``batching.LazySensitivity``), asked only once
    the race drives this candidate."""
    plan = yield from rank_rounds(costs, sensitivity(), settings, quality=quality,
                                  narrow=narrow)
    return costs.densities[plan.grid_index], plan


def group_max(value: float) -> Generator[Parts, dict, float]:
    """One round: the DP group's maximum of ``value`` (a step time a rank predicted from its
    own units; ``value`` itself where one process holds the whole step's)."""
    return (yield {"sum": {}, "max": {"step_s": value}})["step_s"]


def gathered(row) -> Generator[Parts, dict, np.ndarray]:
    """One round: [DP, len(row)] every DP rank's float64 ``row`` (the same length on every
    rank), in DP order."""
    row = np.asarray(row, dtype=np.float64).reshape(-1)
    return (yield {"sum": {}, "max": {}, "cat": {"rows": row}})["rows"].reshape(-1, row.size)
