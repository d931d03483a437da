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

from typing import NamedTuple

import numpy as np

from .. import kernels
from ..kernels.records import NO_START, Tables
from ..sim.pipeline import event_graph
from .costs import UnitCosts
from .dst_settings import DSTSettings

ROUNDS = 8                                   # descent rounds per plan
ETA_START, ETA_MAX, ETA_MIN = 0.02, 0.1, 1e-3   # step-time reduction asked of a round
NEUTRAL_DENSITY = 1.0                        # the descent's mean-density floor, x d0


class DescentSetup(NamedTuple):
    """What every descent on one costs object within [i_min, i_max] makes first
    (``descent_setup``): the event graph, its record with the p2p latency, the cost tables'
    record, the round's phases (``kernels.descent.Round``), every unit's seconds at d_min
    (flat) and every unit's offset in the flat tables ([dp, m, nv]). A caller that descends
    many times on the same costs (``dst_probes``: a rank's ~25 descents and its fills) makes
    it once and passes it to each ``descend_at``."""

    graph: object
    record: object
    tables: Tables
    rnd: object
    t_min: np.ndarray
    base: np.ndarray

    def simulate(self, idx: np.ndarray) -> tuple:
        """(the ``kernels.descent.Plan``, makespans [dp]) of the plan at grid indices ``idx``
        [dp, m, nv] (``UnitCosts.at``'s gathers, ``EventGraph``'s simulation)."""
        at = self.base + idx
        f, b = self.tables.fwd.take(at), self.tables.bwd.take(at)
        dur = self.graph.durations(f, b)
        ef = np.empty(dur.shape)
        kernels.graph.earliest_finish(self.record, dur, np.arange(dur.shape[1]), ef, NO_START)
        return self.rnd.plan(dur, ef, f, b, idx), self.graph.makespan(ef)


def descent_setup(costs: UnitCosts, i_min: int, i_max: int, p2p_s: float) -> DescentSetup:
    """``DescentSetup`` of ``costs``, the bounds and the p2p latency."""
    _, m, nv = costs.shape
    graph = event_graph(m, costs.pipeline_ranks, nv // costs.pipeline_ranks)
    tables = Tables.of(costs.fwd_s, costs.bwd_s, costs.total_s, costs.formula)
    record = graph.record(p2p_s)
    rnd = kernels.descent.Round(record, tables, costs.shape, i_min, i_max)
    t_min = np.ascontiguousarray(costs.total_s[..., i_min]).reshape(-1)
    g = costs.densities.size
    base = np.arange(0, t_min.size * g, g).reshape(costs.shape)
    return DescentSetup(graph, record, tables, rnd, t_min, base)


def descend_at(setup: DescentSetup, idx: np.ndarray, raise_headroom: float, meets_at,
               floors_at=None, goal: float = 0.0):
    """Critical-path descent from the plan at grid indices ``idx`` [dp, m, nv] on the costs,
    bounds and p2p latency of ``setup`` (``descent_setup``; module docstring; each round's
    phases ``kernels.descent.Round``'s), ``ROUNDS`` rounds at most:
    (grid indices, predicted step time s) of the best plan found, ``idx`` itself if none is
    faster. ``meets_at(idx)``: whether a plan keeps the floors; ``floors_at(idx)`` (optional):
    a part of it no raise can break (true of every plan at or above a plan that passes, as
    mean-density floors are), so a round whose largest raise fails it is given up unsimulated.
    Only what a round can change is searched and simulated (a unit off every path longer than
    T' keeps its density; a DP rank none of whose units moves keeps its simulation). ``goal``:
    no round asks for a step below it, and the descent stops there (0: none)."""
    rnd, t_min = setup.rnd, setup.t_min
    rnd.plan_changed()                  # a fresh round: no pick or look-up of another plan
    plan, mk = setup.simulate(idx)
    step, eta = float(mk.max()), ETA_START
    for _ in range(ROUNDS):
        if eta < ETA_MIN or step <= goal:
            break
        target = max(step * (1.0 - eta), goal)
        # cut: every unit on a path longer than T' sheds a fraction of its cuttable time
        fits, shed = rnd.cut(plan, t_min, target)
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
        if new_step < step * (1 - 1e-9) and meets_at(new_idx):
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
