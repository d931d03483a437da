"""The DST band machinery run over every DP rank at once (one process, no reductions): the
oracle the tests hold the planner's per-rank rounds against ("the same code run another way").

``band_plans``: the plans of several (anchor, tolerance) candidates in one pass over all rows of
the costs (``dst_band``'s phases in order); ``band_plan``: one band's; ``central_plan``: the band
search over those plans (the planner's band plan at every DP, bit for bit); ``central_descent``:
the critical-path descent over every rank at once from it, the step the planner's per-rank
probes are held against."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sparsebalance_megatron.policy.bands import band_search
from sparsebalance_megatron.policy.critical_path import descend_at, descent_floors, descent_round
from sparsebalance_megatron.policy.density_means import WeightTotals, weighted_mean_density
from sparsebalance_megatron.policy.dst_band import (SPEED_TIE, band_pass, cut_rows, plan_reports,
                                                     raise_rows)
from sparsebalance_megatron.policy.dst_settings import DSTSettings


def plan_cost_at(quality, idx, grid) -> float:
    """The per-token loss change against uniform d0 of the plan at grid indices ``idx`` (a
    ``BoundQuality``'s, as the central planner read it)."""
    return float(quality.sums_at(idx, grid)) / quality.tokens


def stage_mean_densities(densities, weights, dense_weights=None) -> np.ndarray:
    """[pp] work-weighted mean density of every (virtual) pipeline stage of a plan's densities
    [dp, m, pp] (``dense_weights``: work of documents routed dense, at density 1): the
    per-stage floor's rule (``WeightTotals.stage``) on one whole plan."""
    d, w = np.asarray(densities, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    return WeightTotals(w, dense_weights).stage((d * w).sum(axis=(0, 1)),
                                                lambda: d.mean(axis=(0, 1)))


def band_plans(costs, sensitivity, settings: DSTSettings, candidates, quality=None,
               water=None) -> list:
    """Every candidate's plan, all DP ranks' rows in one pass (``quality``: bound to
    ``costs``; ``water``: which candidates water-fill, all of them with ``quality``); the
    anchor over every rank's static busy seconds (``max``: the largest, never cut)."""
    s, k = settings, len(candidates)
    water = np.array([quality is not None] * k if water is None else water, dtype=bool)
    ps = band_pass(costs, sensitivity, (s.d0, s.d_min, s.d_max), k, water, quality, s.p2p_s)
    step0 = float(ps.mk0.max())
    anchors = np.array([float(np.mean(ps.busy0) if a == "mean" else np.max(ps.busy0))
                        for a, _ in candidates])
    bands = np.array([(1.0 + t) for _, t in candidates]) * anchors
    step1, cut = cut_rows(ps, candidates, bands)
    raised = raise_rows(ps, cut, step0, step1, s.raise_headroom, s.raise_to)
    plans, _ = plan_reports(ps, candidates, s.d0, (step0, step1), raised)
    if quality is not None:
        for p, w in zip(plans, water):
            if w:
                p.report.quality_cost = plan_cost_at(quality, p.grid_index, costs.densities)
    return plans


def band_plan(costs, sensitivity, d0, d_min, d_max, anchor="mean", tolerance=0.1, p2p_s=0.0,
              raise_headroom=0.0, raise_to="bottleneck"):
    """One band's plan (steps 1-4 of the rule) over every DP rank."""
    settings = DSTSettings(d0, d_min, d_max, anchor=anchor, tolerance=tolerance, p2p_s=p2p_s,
                           raise_headroom=raise_headroom, raise_to=raise_to)
    return band_plans(costs, sensitivity, settings, [(anchor, tolerance)])[0]


def central_plan(costs, sensitivity, settings: DSTSettings, quality=None, narrow=False,
                 objectives=None):
    """The band search over all ranks' rows at once (``quality``: bound to ``costs``). With the quality objective and no descent
    both objectives search and the quality cost chooses within ``SPEED_TIE`` of the faster, as
    the planner's rounds do (``objectives``: [water-fills?] of the searches to run instead;
    the last one's plan is returned). Without the planner's last rule (``RankDST.adopt``)."""
    s = settings
    descend = s.descent and s.raise_to == "bottleneck" and s.anchor != "max" \
        and s.density_floor > 0
    both = quality is not None and not descend and objectives is None
    found = []
    for water in objectives or ([False, True] if both else [quality is not None]):
        guard = (lambda p: quality.plan_cost(p.densities)) if both and not water else None
        found.append(band_search(
            s, lambda cands: band_plans(costs, sensitivity, s, cands, quality if water else None),
            narrow=narrow, quality=quality if water else None, guard=guard))
    plan = found[-1]
    if both:
        ordered, filled = found
        ordered.report.quality_cost = plan_cost_at(quality, ordered.grid_index, costs.densities)
        fair = [p for p in (filled, ordered) if not p.report.quality_cost > 1e-12] or [filled]
        fastest = min(p.report.step_time_planned_s for p in fair)
        plan = min((p for p in fair if p.report.step_time_planned_s
                    <= fastest * (1.0 + SPEED_TIE)), key=lambda p: p.report.quality_cost)
    return plan


def central_descent(plan, costs, settings: DSTSettings, quality=None) -> np.ndarray:
    """The densities of the critical-path descent over every rank at once from ``plan``
    (``central_plan``'s; ``quality``: bound to ``costs``): ``descend_at`` on the whole plan, a
    round kept only where the whole plan meets the descent's floors as the density functions
    and ``plan_cost`` weigh it, from the band plan where it meets them and is no slower than
    static, else from static; ``plan``'s own where the descent is not faster by more than
    ``SPEED_TIE``. The reference the planner's per-rank probes are held against."""
    s, r = settings, plan.report
    floor, stage_floor = descent_floors(s)
    w, dense = costs.attn_work, costs.dense_work
    i0, i_min, i_max = (costs.index_of(d) for d in (s.d0, s.d_min, s.d_max))

    def meets(d):
        return (weighted_mean_density(d, w, dense) >= floor - 1e-12
                and stage_mean_densities(d, w, dense).min() >= stage_floor - 1e-12
                and (quality is None
                     or plan_cost_at(quality, costs.grid_index(d), costs.densities) <= 1e-12))

    start = plan.densities
    if r.step_time_planned_s > r.step_time_static_s or not meets(start):
        start = np.full(costs.shape, float(s.d0))
    idx, step = descend_at(descent_round(costs, i_min, i_max, s.p2p_s), costs.grid_index(start),
                           s.raise_headroom,
                           lambda i: meets(costs.densities[costs.effective_index(i, i0)]))
    if not step < min(r.step_time_planned_s, r.step_time_static_s) * (1.0 - SPEED_TIE):
        return plan.densities
    return costs.densities[costs.effective_index(idx, i0)]


def rule_free(settings: DSTSettings) -> DSTSettings:
    """``settings`` with a speed worth any loss the model allows: the quality objective's last
    rule (``RankDST.adopt``) then keeps the plan the search and the descent made wherever it
    predicts no loss (what a comparison with ``central_plan`` isolates)."""
    return replace(settings, exchange_rate=1e9)


def without_adoption(report):
    """A report without the fields the last rule adds (to compare with ``central_plan``'s;
    the fields' own defaults, so that NaN is the same object)."""
    fields = type(report).__dataclass_fields__
    return replace(report, **{k: fields[k].default for k in ("quality_sd", "adopted",
                                                                      "exchange_rate")})
