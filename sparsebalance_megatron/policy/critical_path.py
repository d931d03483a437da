"""Critical-path descent: a DST candidate that shortens the pipeline's longest path, not its
busiest stage (docs/DESIGN.md section 5, "Critical-path descent"). A round cuts every unit on a
path longer than (1 - eta) x the step by one of ``CUT_FRACTIONS`` of its cuttable time and
raises every unit by one of ``RAISE_FRACTIONS`` of its float before (1 - h) x that target
(``kernels.descent``, compiled); it is kept only if the step got faster and the floors (with
``NEUTRAL_DENSITY``: the descent spends no density) and quality rule hold, else eta halves. Each
DP rank descends toward agreed probe steps (``dst_probes``), at DP 1 as above it.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..kernels.records import Tables
from ..kernels.slack import slower
from ..sim.pipeline import event_graph
from .costs import UnitCosts
from .dst_settings import DSTSettings

ROUNDS = 8                                   # descent rounds per plan
ETA_START, ETA_MAX, ETA_MIN = 0.02, 0.1, 1e-3   # step-time reduction asked of a round
NEUTRAL_DENSITY = 1.0                        # the descent's mean-density floor, x d0


def descent_round(costs: UnitCosts, i_min: int, i_max: int, p2p_s: float):
    """The descent's compiled round (``kernels.descent.Round``) on ``costs`` within grid indices
    [i_min, i_max], with p2p latency ``p2p_s``."""
    graph = event_graph(costs.shape[1], costs.pipeline_ranks, costs.vp).record(p2p_s)
    tables = Tables.of(costs.fwd_s, costs.bwd_s, costs.total_s, costs.formula)
    return kernels.descent.Round(graph, tables, costs.shape, i_min, i_max)


def descend_at(rnd, idx: np.ndarray, raise_headroom: float, meets_at,
               floors_at=None, goal: float = 0.0):
    """Critical-path descent from the plan at grid indices ``idx`` [dp, m, nv] on the costs,
    bounds and p2p latency of ``rnd`` (``descent_round``; module docstring), ``ROUNDS`` rounds
    at most: (grid indices, predicted step time s) of the best plan found, ``idx`` itself if
    none is faster. ``meets_at(idx)``: whether a plan keeps the floors; ``floors_at(idx)``
    (optional): a part of it no raise can break (true of every plan at or above a plan that
    passes, as mean-density floors are), so a round whose largest raise fails it is given up
    unsimulated.
    Only what a round can change is searched and simulated (a unit off every path longer than
    T' keeps its density; a DP rank none of whose units moves keeps its simulation). ``goal``:
    no round asks for a step below it, and the descent stops there (0: none)."""
    rnd.plan_changed()                  # a fresh round: no pick or look-up of another plan
    plan, mk = rnd.simulate(idx)
    step, eta = float(mk.max()), ETA_START
    for _ in range(ROUNDS):
        if eta < ETA_MIN or step <= goal:
            break
        target = max(step * (1.0 - eta), goal)
        # cut: every unit on a path longer than T' sheds a fraction of its cuttable time
        fits, shed = rnd.cut(plan, target)
        if not fits.all():                                           # T' out of reach: ask less
            eta /= 2
            continue
        # raise: every unit grows by a fraction of its float at (1 - h) x T'
        deadline = target * (1.0 - raise_headroom)
        cut = rnd.after_cut(plan, mk, shed, deadline)
        if floors_at is not None:       # the round's best plan is below it: nothing will do
            top = cut.plan.idx.copy()
            top[cut.up] = cut.first
            if not floors_at(top.reshape(idx.shape)):
                eta /= 2
                continue
        new, mk_new = rnd.raise_fit(cut, deadline)
        new_step, new_idx = float(mk_new.max()), new.idx.reshape(idx.shape)
        if slower(step, new_step) and meets_at(new_idx):          # the new plan is faster
            rnd.plan_changed(new.idx == plan.idx)
            idx, plan, step, mk = new_idx, new, new_step, mk_new
            eta = min(eta * 1.5, ETA_MAX)
        else:
            eta /= 2
    return idx, step


def descent_floors(settings: DSTSettings) -> tuple:
    """The descent's (mean, stage) density floors: max(density_floor, ``NEUTRAL_DENSITY``) x d0
    and stage_density_floor x d0."""
    return (max(float(settings.density_floor), NEUTRAL_DENSITY) * settings.d0,
            settings.stage_density_floor * settings.d0)
