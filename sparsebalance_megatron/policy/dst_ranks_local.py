"""The decomposed DST (``dst_ranks``, issue 77) made in one process: every DP rank's part planned
here in turn and the reductions made in-process (sums and maxima, key by key), as the DP group's
all-reduces would make them. The driver of the study (``scripts/bench.py dst_decomposed``) and of
the tests (``tests/unit/test_dst_ranks.py``); it times each rank's own parts by phase.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from .bands import straggler_present
from .costs import UnitCosts, stage_mean_densities, weighted_mean_density
from .critical_path import ROUNDS, refine_plan
from .dst import SPEED_TIE
from .dst_band import DSTPlan, DSTReport
from .dst_ranks import PHASES, Agreed1, RankDST, rank_slice
from .dst_settings import DSTSettings


def _reduce(parts: list, how: str):
    """The caller's all-reduce, in-process: sum or max of every rank's part, key by key."""
    out = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if how == "sum":
            acc = vals[0]
            for v in vals[1:]:
                acc = acc + v
            out[key] = acc
        else:
            out[key] = np.maximum.reduce([np.asarray(v, dtype=np.float64) for v in vals]) \
                if np.ndim(vals[0]) else max(vals)
    return out


def agree1(parts: list) -> Agreed1:
    """AR1's reduction of every rank's ``RankDST.ar1()``."""
    s = _reduce([p["sum"] for p in parts], "sum")
    m = _reduce([p["max"] for p in parts], "max")
    anchors = {"mean": float(s["busy"] / s["busy_n"]), "min": -float(m["busy_min_neg"]),
               "max": float(m["busy_max"])}
    tot_s = s["tot_s"] + s["dense_s"]
    dense = float(s["dense_s"].sum())
    return Agreed1(anchors=anchors, t0=float(m["mk0"]),
                   tot=float(s["tot_s"].sum()) + dense, tot_s=tot_s, dense=dense,
                   dense_s=s["dense_s"], units=int(s["units"]), dp=int(s["ranks"]),
                   mk0_mean=float(s["mk0_sum"]) / int(s["ranks"]))


def plan_dst_decomposed(costs: UnitCosts, sensitivity, settings: DSTSettings, *, quality=None,
                        rank_scale=None, timer=None) -> DSTPlan:
    """The decomposed plan of ``costs`` [dp, m, stages] (module docstring), every rank's part
    made here and the reductions made in-process. At DP 1: ``dst.plan_dst_with_floor``'s plan
    bit for bit. ``timer`` (optional): called as ``timer(rank, seconds)`` with the thread CPU of
    every rank's own parts (its slice excluded), by the ``PHASES`` between the reductions (a
    [6] array: the draft's wall time is their maxima over ranks, summed, plus the
    reductions')."""
    dp = costs.shape[0]
    narrow = straggler_present(rank_scale, settings.tolerance)
    cpu = np.zeros((dp, len(PHASES)))

    def timed(r, phase, f, *args, **kw):
        c0 = time.thread_time()
        out = f(*args, **kw)
        cpu[r, phase] += time.thread_time() - c0
        return out

    slices = [rank_slice(costs, r) for r in range(dp)]
    sens = [None if sensitivity is None else np.asarray(sensitivity)[r:r + 1] for r in range(dp)]
    ranks = [timed(r, 0, lambda r=r: RankDST(slices[r], sens[r], settings, quality=quality,
                                          narrow=narrow)) for r in range(dp)]
    a1 = agree1([timed(r, 0, ranks[r].ar1) for r in range(dp)])
    p2 = [timed(r, 1, ranks[r].cut, a1) for r in range(dp)]
    a2 = {**_reduce([p["sum"] for p in p2], "sum"), **_reduce([p["max"] for p in p2], "max")}
    p3 = [timed(r, 2, ranks[r].raise_, a2) for r in range(dp)]
    a3 = {**_reduce([p["sum"] for p in p3], "sum"), **_reduce([p["max"] for p in p3], "max")}
    ks = {timed(r, 3, ranks[r].choose, a3) for r in range(dp)}
    assert len(ks) == 1, ks                        # every rank keeps the same candidate
    k = ks.pop()
    idx = np.concatenate([rk.plans[k].grid_index for rk in ranks])
    report = ranks[0].chosen_report
    if ranks[0].descend_on:
        if dp == 1:                                 # the one rank's floors are the global ones
            band = DSTPlan(ranks[0].plans[k].densities, report, idx)
            plan = timed(0, 4, refine_plan, band, costs, settings, quality=quality,
                         margin=SPEED_TIE, rounds=ROUNDS)
            _report_cpu(timer, cpu)
            return plan
        agreed = _agree([timed(r, 3, ranks[r].descent_start, a3) for r in range(dp)])  # AR3b
        a4 = _agree([timed(r, 4, ranks[r].probe, agreed) for r in range(dp)])          # AR4
        js = {timed(r, 5, ranks[r].pick, a4) for r in range(dp)}
        assert len(js) == 1, js
        j = js.pop()
        step = float(a4["mk"][j]) if j >= 0 else float("inf")
        base = min(report.step_time_planned_s, report.step_time_static_s)
        if step < base * (1.0 - SPEED_TIE):         # else the band plan, as ``refine_plan``
            idx = np.concatenate([rk.cur[0] for rk in ranks])
            mk = np.array([rk.cur[1] for rk in ranks])
            report = _descended_report(report, costs, idx, mk, quality, settings.d0)
    _report_cpu(timer, cpu)
    return DSTPlan(costs.densities[idx], report, idx)


def _agree(parts: list) -> dict:
    """One reduction of every rank's ``parts``: sums and maxima."""
    return {**_reduce([p["sum"] for p in parts], "sum"),
            **_reduce([p["max"] for p in parts], "max")}


def _report_cpu(timer, cpu):
    if timer is not None:
        for r, c in enumerate(cpu):
            timer(r, c.copy())


def _descended_report(r: DSTReport, costs: UnitCosts, idx, mk: np.ndarray, quality,
                      d0: float) -> DSTReport:
    """The report of the descended plan (the whole plan's numbers: what the study reads; a run
    would ride its sums on the next AR1)."""
    dens = costs.densities[idx]
    w, dense = costs.weights(), costs.dense_work
    step = float(mk.max())
    return replace(
        r, step_time_planned_s=step, speedup=r.step_time_static_s / step,
        imbalance_after=float(mk.max() / mk.mean()) if mk.mean() > 0 else 1.0,
        mean_density=weighted_mean_density(dens, w, dense),
        units_cut=int((idx < costs.index_of(d0)).sum()),
        units_raised=int((idx > costs.index_of(d0)).sum()), ranks_reverted=0,
        density_per_stage=tuple(float(x) for x in stage_mean_densities(dens, w, dense)),
        quality_cost=quality.plan_cost_at(idx, costs.densities) if quality is not None
        else r.quality_cost)
