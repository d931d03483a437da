"""Dynamic sparsity tuning (DST): plan one attention density per (dp_rank, micro-batch, stage).

The rule (docs/DESIGN.md section 5, issue 4):

1. Static plan: every unit at d0; simulate the 1F1B step (``sim.pipeline``) -> step time T0.
2. Anchor over the *load units* at d0: a load unit is one (dp rank, pipeline stage) and its time
   is the stage's busy seconds over the step, sum over micro-batches of fwd+bwd. Why this unit:
   DP ranks wait for each other at the gradient all-reduce, so a rank's whole step is what waits;
   within a rank, stage s runs its micro-batches back to back, so the pipeline's steady state runs
   at the pace of its busiest stage, and the makespan is about (busiest stage's busy time) + fill
   and drain. A single heavy micro-batch on a light rank sets nothing: cutting it would lose
   accuracy for no step time. Anchoring over (rank, stage) balances both axes the paper balances,
   DP ranks and pipeline stages (the last stage carries the LM head and loss).
   ``mean`` | ``median`` | ``min`` over all dp x pp load units; ``max`` = the largest, i.e. never cut.
3. Cut: every load unit above (1 + p) x anchor has its micro-batches' densities on that stage
   lowered, least sensitive micro-batch first, each down to d_min at most, until the stage's busy
   time is inside the band (or everything is at d_min). Cutting only lowers unit times, and a
   1F1B makespan is a longest path with fixed event order, so the step time can only shrink.
4. Raise (bubble filling): simulate again -> the new bottleneck T1, and the raise target
   T1' = (1 - h) x T1, where the headroom h (``--sb-raise-headroom``) is about the latency
   model's relative error: a rank raised exactly to T1 becomes the straggler whenever it is
   under-predicted, so on a noisy device filling every bubble to the brim costs step time. On
   every rank, every stage's busy time may grow up to T1' - (that rank's fill/drain overhead)
   (each unit within its 1F1B float before T1'); densities rise most sensitive micro-batch
   first, each up to d_max. The proxy is checked with the simulator: a rank whose makespan would
   exceed T1' (or, for a rank already above T1' such as the bottleneck rank of a pipeline, would
   grow at all) gets half of its slack and is re-planned (a few rounds), and falls back to its
   cut-only densities if it still exceeds. So the planned step time never exceeds T1, which
   never exceeds T0. This is where cheap stages (first stage, light ranks) turn bubbles into
   density. With ``--sb-raise-to static`` the target is (1 - h) x T0 instead: the cuts still
   take the stragglers down, and everything balancing saved is spent on density, so the step
   ends no slower than static sparse attention (the accuracy-first use of DST).

Costs come as ``UnitCosts`` (a density grid), so every step of the rule is a vectorised table
look-up; a 64 x 16 x 4 plan takes a few milliseconds. Where it is: one band's plan (steps 1-4)
in ``dst_band.py`` (its moves compiled in ``kernels.band``); here the band search under the density
floors, the quality objective, and the entry from the config (``plan_dst_from_config``).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import DEFAULT_RAISE_HEADROOM  # noqa: F401 (re-exported)
from .bands import band_ladder, pick_band, straggler_present
from .costs import UnitCosts, check_anchor_tolerance  # noqa: F401 (re-exported)
from .critical_path import ROUNDS, refine_plan
from .dst_band import (BandCache, DSTPlan, DSTReport, plan_dst,  # noqa: F401
                       plan_dst_candidates)
from .dst_settings import DSTSettings

SPEED_TIE = 1e-3          # quality objective: plans within 0.1% of the fastest count as as fast


def plan_dst_with_floor(costs: UnitCosts, sensitivity: Optional[np.ndarray],
                        settings: DSTSettings, *, quality=None, rank_scale=None) -> DSTPlan:
    """``plan_dst`` by ``settings`` (a ``DSTSettings``), but the plan keeps its work-weighted mean
    density >= density_floor x d0 and every pipeline stage's work-weighted density >=
    stage_density_floor x d0.

    When the cuts of the tolerance band would take more attention budget than the raises give
    back (e.g. a stage made heavy by the LM head, whose units can only be cut), or concentrate the
    cuts on one stage, the band is widened: fewer units are cut. The widest band cuts nothing (the
    ``max`` anchor), whose plan only raises, so a plan meeting both floors always exists; every
    candidate is a ``plan_dst`` plan, so the predicted step time never exceeds the static plan's.
    Among the candidates that meet the floors the fastest is kept (usually the narrowest band that
    meets them), then replaced by its critical-path descent (``policy.critical_path``;
    ``descent``, ``--sb-dst-descent``; only under a density floor, which bounds its cuts, and not
    with the ``max`` anchor or raise target ``static``) where it meets the floors and is faster.
    ``rank_scale`` ([dp, pp] calibrated compute-time factors): where one GPU is persistently slow
    (``policy.bands``: it sits inside the band otherwise), narrower bands
    (p/2, p/4, 0) are planned in the first pass too, one kept only if it meets the floors and
    quality and is clearly faster. The band is searched between ``tolerance`` and 10 in
    ``search_steps // 2`` rounds, each one batched pass (``plan_dst_candidates``) of 3
    tolerances spaced geometrically inside the interval where the floors start to hold (the
    first pass also plans the no-cut plan): 4^rounds sub-intervals, as fine as ``2 x rounds``
    bisection steps in half the passes. The resolution matters: near the floor, speed falls
    steeply as the band widens (a 5^2 grid instead of 4^3 lost 4% of the step at 64 DP x 16 x
    PP4, before the descent), and the descent, which spends no density, does not make up a
    straggler's cut a coarser band search missed (2 rounds left a 3x-slow GPU uncut in most
    steps of a real PP 2 x DP 2 run, ``tests/distributed/test_hybrid_run.py``). The static plan's
    simulation is shared by the passes (and by both objectives' plans), and the two objectives'
    searches run in lock-step, each pass of one the same ``plan_dst_candidates`` call as the
    other's (``_search_bands``).

    ``quality`` (a ``policy.quality.StageQuality``: ``--sb-dst-objective quality``): cuts and
    raises by quality water-filling (where density buys the most predicted quality per second),
    and a plan must also not lose predicted quality against uniform d0 (its raises pay its cuts
    back under the measured convex cost); the fastest plan that does is kept. Water-filling
    places each phase's cuts and raises best, but the two phases interact through the pipeline's
    floats (a cut spread over many micro-batches can leave less room to raise elsewhere), so the
    density objective's plan competes too: of the two, the one with the lower predicted quality
    cost among those within ``SPEED_TIE`` of the faster one's step time is returned.

    Where the descent refines the plan (``descent``, the default flags), the band plan is where
    it starts, and with ``quality`` the water-filling search runs alone (the density
    objective's plan does not compete): half the band search. On the net studies (BENCHMARKS.md,
    "The planner's own cost") ``sab_dst`` was as fast or faster in every row but one.
    """
    static = BandCache()                    # the static plan's simulation, shared by all passes
    s = settings
    descend = s.descent and s.raise_to == "bottleneck" and s.anchor != "max" \
        and s.density_floor > 0
    narrow = straggler_present(rank_scale, s.tolerance)
    searches = [] if quality is not None and descend else \
        [(_band_search(s, narrow=narrow, guard=quality), False)]   # the density objective's
    if quality is not None:
        searches.append((_band_search(s, narrow=narrow, quality=quality), True))
    ordered, *filled = _search_bands(costs, sensitivity, s, searches, static=static,
                                     quality=quality)
    if filled:                              # both objectives: the quality cost chooses
        filled = filled[0]
        ordered.report.quality_cost = ordered.quality_cost(quality, costs.densities)
        fair = [p for p in (filled, ordered) if not p.report.quality_cost > 1e-12] or [filled]
        fastest = min(p.report.step_time_planned_s for p in fair)
        ordered = min((p for p in fair if p.report.step_time_planned_s
                       <= fastest * (1.0 + SPEED_TIE)), key=lambda p: p.report.quality_cost)
    return refine_plan(ordered, costs, s, quality=quality, margin=SPEED_TIE,
                       rounds=ROUNDS if descend else 0)


def _plan_with_floor(costs: UnitCosts, sensitivity: Optional[np.ndarray],
                     settings: DSTSettings, *, static: BandCache, narrow: bool = False,
                     quality=None, guard=None) -> DSTPlan:
    """``plan_dst_with_floor`` for one objective (``quality`` None: density order); ``static``:
    the ``cache`` of ``plan_dst_candidates`` (the same costs); ``guard``: the quality
    cost a narrower band's density-order plan must not lose against (``policy.bands``)."""
    search = _band_search(settings, narrow=narrow, quality=quality, guard=guard)
    return _search_bands(costs, sensitivity, settings, [(search, quality is not None)],
                         static=static, quality=quality)[0]


def _search_bands(costs: UnitCosts, sensitivity, settings: DSTSettings, searches: list, *,
                  static: BandCache, quality) -> list:
    """The plans of ``searches`` ((``_band_search`` generator, whether it water-fills by
    ``quality``) pairs), run in lock-step: every round's candidates of all of them are rows of
    one ``plan_dst_candidates`` pass (a row's plan does not depend on the others', so each
    search gets the plans it would get alone, in half the passes for two)."""
    pending, out = {}, [None] * len(searches)
    for i, (search, _) in enumerate(searches):
        pending[i] = next(search)
    while pending:
        owner = [i for i, cands in pending.items() for _ in cands]
        found = plan_dst_candidates(costs, sensitivity, settings,
                                    [c for cands in pending.values() for c in cands],
                                    cache=static, quality=quality,
                                    water=[searches[i][1] for i in owner])
        for i in list(pending):
            mine = [p for p, o in zip(found, owner) if o == i]
            if searches[i][1]:
                for p in mine:
                    p.report.quality_cost = p.quality_cost(quality, costs.densities)
            try:
                pending[i] = searches[i][0].send(mine)
            except StopIteration as done:
                out[i] = done.value
                del pending[i]
    return out


def _band_search(settings: DSTSettings, *, narrow: bool = False, quality=None, guard=None):
    """``_plan_with_floor``'s band search as a generator: it yields each pass's candidates,
    is sent their plans (quality costs set for the quality objective) and returns the plan
    kept (``_search_bands`` drives it)."""
    anchor, tolerance = settings.anchor, settings.tolerance
    density_floor, stage_density_floor = settings.density_floor, settings.stage_density_floor
    floor = density_floor * settings.d0 - 1e-12
    stage_floor = stage_density_floor * settings.d0 - 1e-12

    def meets(p: DSTPlan) -> bool:
        r = p.report
        return (r.mean_density >= floor and min(r.density_per_stage) >= stage_floor
                and not r.quality_cost > 1e-12)

    best, *narrower = yield (band_ladder(anchor, tolerance) if narrow
                             else [(anchor, tolerance)])
    if guard is not None and quality is None:       # a narrower band must not lose quality
        for p in narrower:
            p.report.quality_cost = guard.plan_cost(p.densities)
    ok = [p for p in narrower if meets(p)]
    if (density_floor <= 0 and stage_density_floor <= 0 and quality is None) \
            or anchor == "max" \
            or meets(best):
        return pick_band([best] + ok)
    lo, hi = max(float(tolerance), 1e-3), 10.0
    per_round = 3
    for rnd in range(max(settings.search_steps // 2, 1)):
        ts = lo * (hi / lo) ** (np.arange(1, per_round + 1) / (per_round + 1))
        cands = [(anchor, float(t)) for t in ts]
        found = yield ([("max", tolerance)] if rnd == 0 else []) + cands
        if rnd == 0:
            ok.append(found.pop(0))                                  # no cuts: always meets
        hits = [i for i, p in enumerate(found) if meets(p)]
        ok += [found[i] for i in hits]
        if hits:
            lo, hi = (float(ts[hits[0] - 1]) if hits[0] > 0 else lo), float(ts[hits[0]])
        else:
            lo = float(ts[-1])
    return min(ok, key=lambda p: p.report.step_time_planned_s)


def static_plan(costs: UnitCosts, d0: float) -> np.ndarray:
    """[dp, m, pp] all at d0 (the baseline DST is compared with)."""
    return np.full(costs.shape, float(d0))


def plan_dst_from_config(config, costs: UnitCosts, sensitivity: Optional[np.ndarray],
                         p2p_s: float = 0.0, raise_headroom: Optional[float] = None,
                         stage_layers=None, rank_scale=None) -> DSTPlan:
    """``plan_dst_with_floor`` with d0, bounds, anchor, tolerance, the mean-density floor
    (``--sb-density-floor``), the per-stage floor (``--sb-stage-density-floor``), the raise
    target (``--sb-raise-to``) and the raise headroom from a ``SparseBalanceConfig``
    (``DSTSettings.from_config``); the
    costs must be tabulated on ``density_grid(config.density, config.min_density,
    config.max_density)``. ``raise_headroom`` overrides the config's (the runtime passes the
    measured error when the config says 'auto'; 'auto' without one is
    ``DEFAULT_RAISE_HEADROOM``). With ``--sb-dst-objective quality`` (the default),
    ``stage_layers`` (the decoder layers of every (virtual) stage of the costs) maps the quality
    cost onto the stages: without it the call raises ``ValueError`` (no silent fall-back to the
    density objective); ``dst_objective="density"`` needs none. ``rank_scale``: the
    calibration's [dp, pp] factors (``correction_grid``; narrower bands for a slow GPU)."""
    settings, quality = dst_inputs(config, costs.shape[2], p2p_s, raise_headroom, stage_layers)
    return plan_dst_with_floor(costs, sensitivity, settings, quality=quality,
                               rank_scale=rank_scale)


def dst_inputs(config, stages: int, p2p_s: float = 0.0, raise_headroom: Optional[float] = None,
               stage_layers=None) -> tuple:
    """(``DSTSettings``, the quality objective's ``StageQuality`` or None) of a
    ``SparseBalanceConfig`` for costs of ``stages`` (virtual) stages (``plan_dst_from_config``
    says what each argument means)."""
    quality = None
    if config.dst_objective == "quality":
        from .quality import StageQuality, load_quality_cost
        if stage_layers is None or len(stage_layers) != stages:
            raise ValueError(f"--sb-dst-objective quality (the default) needs the decoder "
                             f"layers of each of the {stages} stages, got "
                             f"{stage_layers!r}; pass stage_layers, or plan with "
                             f"--sb-dst-objective density, which needs none")
        quality = StageQuality.from_cost(load_quality_cost(config.quality_cost), stage_layers,
                                         config.density)
    return DSTSettings.from_config(config, p2p_s=p2p_s, raise_headroom=raise_headroom), quality
