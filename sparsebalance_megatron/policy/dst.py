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
look-up; a 64 x 16 x 4 plan takes a few milliseconds.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ..config import (ANCHORS, DEFAULT_RAISE_HEADROOM, MAX_RAISE_HEADROOM, RAISE_TARGETS,
                      ConfigError)
from ..sim.pipeline import pipeline_makespan_s
from .bands import band_ladder, pick_band, straggler_present
from .costs import (UnitCosts, check_density_bounds, level_search, stage_mean_densities,
                    weighted_mean_density)
from .critical_path import ROUNDS, refine_plan
from .slack import event_float_s

RAISE_ROUNDS = 5          # halvings of a rank's slack tried before it falls back to cut-only
_REL_EPS = 1e-9           # float slack when comparing makespans
SPEED_TIE = 1e-3          # quality objective: plans within 0.1% of the fastest count as as fast


@dataclass
class DSTReport:
    """What one plan did; every time is predicted by the latency model + 1F1B simulator."""

    step_time_static_s: float    # all units at d0
    step_time_cut_s: float       # after the cut phase (the bottleneck the raise respects)
    step_time_planned_s: float   # final plan
    speedup: float               # static / planned
    imbalance_before: float      # max / mean of per-rank makespans, static plan
    imbalance_after: float       # same, final plan
    anchor_s: float              # anchor over (rank, stage) busy times at d0
    band_s: float                # (1 + p) x anchor
    mean_density_static: float   # work-weighted mean density of the static plan (d0; more
    #                              with routing: routed documents count at density 1)
    mean_density: float          # work-weighted mean density of the final plan
    units_cut: int               # units whose density ended below d0
    units_raised: int            # units whose density ended above d0
    ranks_reverted: int          # ranks whose raise failed verification (kept cut-only)
    tolerance_used: float = float("nan")  # band actually applied (wider under a density floor)
    density_per_stage: tuple = ()         # work-weighted mean density of every stage, final plan
    quality_cost: float = float("nan")    # predicted loss change vs uniform d0 (quality objective)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DSTPlan:
    densities: np.ndarray   # [dp, m, stages] planned density of every unit (virtual stages)
    report: DSTReport


def check_raise_headroom(h: float) -> None:
    """ConfigError naming ``--sb-raise-headroom`` unless h is a number in [0, 0.5]."""
    if not isinstance(h, (int, float)) or h != h or not 0.0 <= h <= MAX_RAISE_HEADROOM:
        raise ConfigError(f"--sb-raise-headroom={h!r}: expected a number in "
                          f"[0, {MAX_RAISE_HEADROOM}]")


def check_anchor_tolerance(anchor: str, tolerance: float) -> None:
    """ConfigError (a ValueError) naming ``--sb-anchor`` / ``--sb-tolerance`` on bad values."""
    if anchor not in ANCHORS:
        raise ConfigError(f"--sb-anchor={anchor!r}: expected one of {', '.join(ANCHORS)}")
    t = tolerance
    if (not isinstance(t, (int, float, np.floating)) or isinstance(t, bool) or t != t
            or t < 0 or t > 10):
        raise ConfigError(f"--sb-tolerance={t!r}: expected a number in [0, 10]")


def _anchor_s(busy_s: np.ndarray, anchor: str) -> float:
    if anchor == "mean":
        return float(busy_s.mean())
    if anchor == "median":
        return float(np.median(busy_s))
    if anchor == "min":
        return float(busy_s.min())
    return float(busy_s.max())


def _unit_base(shape, rows: np.ndarray, g: int) -> np.ndarray:
    """[k, m, pp] offsets of the units of DP ranks ``rows`` in a flat [dp, m, pp, g] table
    (flat unit id x g): "units" below always means these offsets."""
    _, m, pp = shape
    return ((rows[:, None, None] * m + np.arange(m)[None, :, None]) * pp
            + np.arange(pp)[None, None, :]) * g


def _lookup(a: np.ndarray, units: np.ndarray, idx) -> np.ndarray:
    """a[unit, idx] for a [dp, m, pp, g] table, unit offsets (``_unit_base``) and grid indices."""
    return a.reshape(-1)[units + idx]


def _perm_along_m(order: np.ndarray):
    """Fancy-index tuple that reorders a [k, m, pp] array along m by order [k, m, pp]."""
    k, m, pp = order.shape
    return (np.arange(k)[:, None, None], order, np.arange(pp)[None, None, :])


def _highest_index_within(t_grid, units, thr, lo, hi):
    """Per unit: the highest grid index i in [lo, hi] with t(i) <= thr (lo if none); costs are
    non-decreasing in density (``UnitCosts`` makes them so)."""
    return level_search(np.broadcast_to(lo, units.shape), np.broadcast_to(hi, units.shape),
                         lambda i: _lookup(t_grid, units, i) <= thr)


def _cut(t_grid, units, cur_i, excess_s, order, i_min):
    """Lower densities until each (rank, stage) sheds ``excess_s`` [k, pp] seconds, taking the
    micro-batches in ``order`` [k, m, pp] (least sensitive first), each at most down to d_min.

    t_grid [dp, m, pp, g] seconds; units [k, m, pp] flat unit ids; cur_i [k, m, pp] grid indices.
    """
    t_cur = _lookup(t_grid, units, cur_i)                        # [k, m, pp]
    save_full = t_cur - _lookup(t_grid, units, i_min)
    perm = _perm_along_m(order)
    save_sorted = save_full[perm]
    cum_before = np.empty_like(save_full)
    cum_before[perm] = np.cumsum(save_sorted, axis=1) - save_sorted
    need = excess_s[:, None, :] - cum_before                       # seconds still to shed
    active = (need > 0) & (save_full > 0)
    new_i = cur_i.copy()
    new_i[active] = _highest_index_within(t_grid, units[active], (t_cur - need)[active],
                                          i_min, cur_i[active])
    return new_i


def _raise(t_grid, units, cur_i, slack_s, cap_s, order, i_max):
    """Raise densities while each (rank, stage) stays within ``slack_s`` [k, pp] extra seconds
    and each unit within its own float ``cap_s`` [k, m, pp], micro-batches in ``order`` (most
    sensitive first), each at most up to d_max."""
    t_cur = _lookup(t_grid, units, cur_i)
    gain_full = np.minimum(_lookup(t_grid, units, i_max) - t_cur, cap_s)
    perm = _perm_along_m(order)
    gain_sorted = gain_full[perm]
    cum_before = np.empty_like(gain_full)
    cum_before[perm] = np.cumsum(gain_sorted, axis=1) - gain_sorted
    room = np.minimum(slack_s[:, None, :] - cum_before, cap_s)
    active = (room > 0) & (gain_full > 0)
    new_i = cur_i.copy()
    new_i[active] = _highest_index_within(t_grid, units[active], (t_cur + room)[active],
                                          cur_i[active], i_max)
    return new_i


_FILL_ITERS = 12          # bisection steps on log(lambda) in [-20, 20] (quality water-filling)


def _water_fill(t_grid, units, best_index, b, lo, hi, limit_s):
    """Quality water-filling of every (row, stage): each unit u takes the highest grid index in
    [lo_u, hi_u] whose marginal quality gain per unit of density, ``marg[u, i]`` (non-increasing
    in i: the cost is convex), is still worth its attention seconds, ``>= lambda x b_u``; lambda,
    per (row, stage), is the smallest that keeps the summed unit seconds within ``limit_s``
    [k, pp] (found by bisection on log lambda). So density goes where it buys the most quality
    per second: cuts fall first on units that save much time for little quality, raises go
    first to low densities on cheap units, and no unit is starved while another is spared.

    best_index(x) -> [k, m, pp]: per unit the highest grid index whose marginal gain is >= x
    (x [k, m, pp]); b [k, m, pp] attention seconds per unit of density; lo, hi [k, m, pp] grid
    index bounds. Where even the largest lambda (every unit at lo) exceeds the limit, every
    unit is at lo."""
    def at(log_lam):
        return np.clip(best_index(np.exp(log_lam)[:, None, :] * b), lo, hi)

    def total(idx):
        return _lookup(t_grid, units, idx).sum(axis=1)

    shape = limit_s.shape
    lo_l, hi_l = np.full(shape, -20.0), np.full(shape, 20.0)
    for _ in range(_FILL_ITERS):
        mid = (lo_l + hi_l) / 2
        fits = total(at(mid)) <= limit_s
        hi_l = np.where(fits, mid, hi_l)
        lo_l = np.where(fits, lo_l, mid)
    free = total(hi) <= limit_s                                  # everything fits: no lambda
    # A piecewise-linear cost has equal marginal gains along a segment, so units cross it
    # together at one lambda; between the last lambda that does not fit and the first that does,
    # the units that move stop at one common density level, the highest that fits.
    fit, over = at(hi_l), at(lo_l)

    def level(L):
        return np.maximum(fit, np.minimum(over, L[:, None, :]))

    L = level_search(fit.min(axis=1), over.max(axis=1),
                      lambda L: total(level(L)) <= limit_s)
    return np.where(free[:, None, :], hi, level(L))


def _gain_index(marg: np.ndarray, slots: int, pp: int, vp: int):
    """best_index(x) -> [k, slots, pp]: per unit, the highest grid index whose marginal quality
    gain ``marg[v, i]`` ([nv, g], non-increasing in i, +inf at 0) is >= x [k, slots, pp], where
    a unit's virtual stage is v = chunk x pp + rank (slot = micro-batch x vp + chunk). One
    searchsorted over the stages' tables laid end to end, each shifted into its own band (a call
    per stage costs more than the search)."""
    nv, g = marg.shape
    neg = -np.asarray(marg, dtype=np.float64)                      # ascending, -inf at 0
    finite = neg[np.isfinite(neg)]
    low = (float(finite.min()) if finite.size else 0.0) - 1.0      # below every finite entry
    high = max(float(finite.max()) if finite.size else 0.0, 0.0) + 0.5
    width = high - low + 1.0
    flat = (np.clip(neg, low, None) + np.arange(nv)[:, None] * width).reshape(-1)
    stage = (np.arange(slots) % vp)[:, None] * pp + np.arange(pp)[None, :]   # [slots, pp]
    shift, first = stage * width, stage * g

    def best_index(x):
        q = np.clip(-x, low, high) + shift
        return np.searchsorted(flat, q, side="right") - 1 - first

    return best_index


def _broadcast_sensitivity(sensitivity, shape) -> np.ndarray:
    dp, m, pp = shape
    if sensitivity is None:
        return np.zeros(shape)
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.shape == (dp, m):
        s = np.broadcast_to(s[:, :, None], shape)
    if s.shape != shape:
        raise ValueError(f"sensitivity must be [dp, m]={(dp, m)} or [dp, m, pp]={shape}, "
                         f"got {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("sensitivity must be finite")
    return s


def plan_dst(costs: UnitCosts, sensitivity: Optional[np.ndarray], d0: float, d_min: float,
             d_max: float, anchor: str = "mean", tolerance: float = 0.1,
             p2p_s: float = 0.0, raise_headroom: float = 0.0,
             raise_to: str = "bottleneck") -> DSTPlan:
    """Plan densities [dp, m, pp] for one step.

    costs: predicted fwd/bwd seconds of every unit over a density grid that contains d0, d_min
    and d_max (``density_grid``); sensitivity: [dp, m] or [dp, m, pp], higher = loses more
    accuracy when sparsified (mean over a micro-batch's samples), None = all equal;
    raise_headroom: h in [0, 0.5], raises stop at (1 - h) x the raise target; raise_to: the
    target, the cut plan's step time (``bottleneck``) or the static plan's (``static``: what
    balancing saved is spent on density instead of speed).
    """
    return plan_dst_candidates(costs, sensitivity, d0, d_min, d_max, [(anchor, tolerance)],
                               p2p_s, raise_headroom, raise_to)[0]


def plan_dst_candidates(costs: UnitCosts, sensitivity: Optional[np.ndarray], d0: float,
                        d_min: float, d_max: float, candidates, p2p_s: float = 0.0,
                        raise_headroom: float = 0.0, raise_to: str = "bottleneck",
                        _static: Optional[dict] = None, quality=None) -> list[DSTPlan]:
    """``plan_dst`` for every (anchor, tolerance) of ``candidates``, in one pass: the candidates'
    copies of the DP ranks are stacked as rows of the same vectorised cut, raise and simulator
    calls (a plan's rows never interact with another candidate's), so K plans cost far less than
    K calls. ``_static``: a dict the caller keeps between passes over the same costs (the static
    plan's simulation is computed once). ``quality`` (a ``policy.quality.StageQuality``): cuts
    and raises by quality water-filling (``_water_fill``) instead of sensitivity order."""
    for anchor, tolerance in candidates:
        check_anchor_tolerance(anchor, tolerance)
    check_raise_headroom(raise_headroom)
    if raise_to not in RAISE_TARGETS:
        raise ConfigError(f"--sb-raise-to={raise_to!r}: expected one of {', '.join(RAISE_TARGETS)}")
    check_density_bounds(d0, d_min, d_max)
    dp, m, nv = costs.shape
    # The load units are (dp rank, pipeline rank). With the interleaved schedule a rank runs vp
    # model chunks: its units are then the (micro-batch, chunk) pairs, so every array below is
    # [rows, m * vp, pp] (the same memory as [rows, m, nv], since v = chunk * pp + rank).
    pp, vp = costs.pipeline_ranks, costs.vp
    slots = m * vp
    k = len(candidates)
    sens = _broadcast_sensitivity(sensitivity, (dp, m, nv)).reshape(dp, slots, pp)
    i0, i_min, i_max = costs.index_of(d0), costs.index_of(d_min), costs.index_of(d_max)
    t_grid = costs.total_s                                          # [dp, m, nv, g]
    weights = costs.weights()

    rank_units = _unit_base((dp, slots, pp), np.arange(dp), t_grid.shape[-1])  # [dp, m*vp, pp]
    # row = candidate c x dp + rank: every candidate's copy of the step
    all_units = np.tile(rank_units, (k, 1, 1))                      # [k * dp, m * vp, pp]
    if quality is not None:
        best_index = _gain_index(quality.marginal_gain(costs.densities), slots, pp, vp)
        span = costs.densities[i_max] - costs.densities[i_min]
        b_rows = np.tile(((_lookup(t_grid, rank_units, i_max) - _lookup(t_grid, rank_units, i_min))
                          / span) if span > 0 else np.zeros(rank_units.shape), (k, 1, 1))

    def simulate(units, idx):
        """(makespan [rows], fwd, bwd [rows, m * vp, pp]) of the rows' units at grid idx."""
        f, b = _lookup(costs.fwd_s, units, idx), _lookup(costs.bwd_s, units, idx)
        n = f.shape[0]
        return pipeline_makespan_s(f.reshape(n, m, nv), b.reshape(n, m, nv), p2p_s,
                                   pp=pp), f, b

    def per_candidate(x):
        return np.asarray(x).reshape(k, dp)

    # 1. static plan (the same for every candidate)
    idx0 = np.full((dp, slots, pp), i0, dtype=np.int64)
    if _static is not None and "mk0" in _static:
        mk0, t0 = _static["mk0"], _static["t0"]
    else:
        mk0, f0, b0 = simulate(rank_units, idx0)
        t0 = f0 + b0
        if _static is not None:
            _static.update(mk0=mk0, t0=t0)
    step0 = float(mk0.max())
    busy0 = t0.sum(axis=1)                                          # [dp, pp]
    anchors = np.array([_anchor_s(busy0, a) for a, _ in candidates])
    bands = np.array([(1.0 + t) for _, t in candidates]) * anchors  # [k]

    # 2. cut stragglers, least sensitive first (stable sort: ties keep micro-batch order)
    excess = np.tile(busy0, (k, 1)) - np.repeat(bands, dp)[:, None]  # [k * dp, pp]
    cuts = np.array([a != "max" for a, _ in candidates])
    excess[~np.repeat(cuts, dp)] = 0.0
    idx_start = np.tile(idx0, (k, 1, 1))
    if np.any(excess > 0):
        if quality is not None:
            base_s = _lookup(t_grid, all_units, idx_start).sum(axis=1)
            idx_cut = _water_fill(t_grid, all_units, best_index, b_rows,
                                  np.full_like(idx_start, i_min),
                                  idx_start, np.where(excess > 0, base_s - excess, np.inf))
        else:
            order = np.tile(np.argsort(sens, axis=1, kind="stable"), (k, 1, 1))
            idx_cut = _cut(t_grid, all_units, idx_start, np.maximum(excess, 0.0), order, i_min)
        mk1, f1, b1 = simulate(all_units, idx_cut)
    else:
        idx_cut, mk1 = idx_start, np.tile(mk0, k)
        f1, b1 = _lookup(costs.fwd_s, all_units, idx_cut), _lookup(costs.bwd_s, all_units, idx_cut)
    t1 = f1 + b1
    step1 = per_candidate(mk1).max(axis=1)                          # [k]

    # 3. raise below the new bottleneck, most sensitive first; verify with the simulator.
    #    Ranks are independent pipelines, so a rank that overshoots is re-planned alone.
    targets = (np.full(k, step0) if raise_to == "static" else step1) * (1.0 - raise_headroom)
    target = np.repeat(targets, dp)                                 # [k * dp] T1'
    busy1 = t1.sum(axis=1)                                          # [k * dp, pp]
    overhead = mk1 - busy1.max(axis=1)                              # fill/drain
    slack_full = np.maximum(target[:, None] - overhead[:, None] - busy1, 0.0)
    float_f, float_b = event_float_s(f1.reshape(k * dp, m, nv), b1.reshape(k * dp, m, nv),
                                     target, p2p_s, pp=pp)
    cap_full = np.maximum(np.minimum(float_f, float_b), 0.0).reshape(k * dp, slots, pp)
    idx, mk_final = idx_cut.copy(), mk1.copy()
    reverted = np.zeros(k * dp, dtype=bool)
    # A rank may grow up to T1'; one already above it (the bottleneck rank itself, in a pipeline)
    # may only fill stages off its critical path, whose slack above is already short by h x T1.
    limit = np.maximum(target, mk1) * (1.0 + _REL_EPS) + 1e-15      # [k * dp]
    ranks = np.flatnonzero((slack_full.max(axis=1) > 0) & (cap_full.max(axis=(1, 2)) > 0))
    if i_max > i_min and ranks.size:
        order = np.tile(np.argsort(-sens, axis=1, kind="stable"), (k, 1, 1))

        def try_raise(rows, alpha):
            """Raise rows ``rows`` with slack x alpha; accept those the simulator clears."""
            units = all_units[rows]
            if quality is not None:
                cur = idx_cut[rows]
                t_cur = _lookup(t_grid, units, cur)
                top = _highest_index_within(t_grid, units, t_cur + alpha[:, None, None] *
                                            cap_full[rows], cur, i_max)
                trial = _water_fill(t_grid, units, best_index, b_rows[rows], cur, top,
                                    t_cur.sum(axis=1) + alpha[:, None] * slack_full[rows])
            else:
                trial = _raise(t_grid, units, idx_cut[rows], alpha[:, None] * slack_full[rows],
                               alpha[:, None, None] * cap_full[rows], order[rows], i_max)
            mk, _, _ = simulate(units, trial)
            return trial, mk, mk <= limit[rows]

        trial, mk, ok = try_raise(ranks, np.ones(ranks.size))
        idx[ranks[ok]], mk_final[ranks[ok]] = trial[ok], mk[ok]
        ranks = ranks[~ok]
        if ranks.size:
            # All shrunken slacks of the overshooting rows in one simulator call:
            # rows = rank x alpha (0.5, 0.25, ...); keep the largest alpha that clears.
            alphas = 0.5 ** np.arange(1, RAISE_ROUNDS + 1)
            rows = np.repeat(ranks, alphas.size)
            trial, mk, ok = try_raise(rows, np.tile(alphas, ranks.size))
            ok = ok.reshape(ranks.size, alphas.size)
            for j, r in enumerate(ranks.tolist()):
                hits = np.flatnonzero(ok[j])
                if hits.size:
                    h = j * alphas.size + hits[0]
                    idx[r], mk_final[r] = trial[h], mk[h]
                else:
                    reverted[r] = True

    plans = []
    mk_c, idx_c, rev_c = per_candidate(mk_final), idx.reshape(k, dp, slots, pp), \
        per_candidate(reverted)
    imb0 = float(mk0.max() / mk0.mean()) if mk0.mean() > 0 else 1.0
    for c, (_, tolerance) in enumerate(candidates):
        mk_end = mk_c[c]
        dens = costs.densities[idx_c[c]].reshape(dp, m, nv)
        report = DSTReport(
            step_time_static_s=step0, step_time_cut_s=float(step1[c]),
            step_time_planned_s=float(mk_end.max()),
            speedup=step0 / float(mk_end.max()) if mk_end.max() > 0 else 1.0,
            imbalance_before=imb0,
            imbalance_after=float(mk_end.max() / mk_end.mean()) if mk_end.mean() > 0 else 1.0,
            anchor_s=float(anchors[c]), band_s=float(bands[c]),
            mean_density_static=float(d0) if costs.dense_work is None else
            weighted_mean_density(np.full(dens.shape, float(d0)), weights, costs.dense_work),
            mean_density=weighted_mean_density(dens, weights, costs.dense_work),
            units_cut=int((idx_c[c] < i0).sum()), units_raised=int((idx_c[c] > i0).sum()),
            ranks_reverted=int(rev_c[c].sum()), tolerance_used=float(tolerance),
            density_per_stage=tuple(float(x) for x in stage_mean_densities(dens, weights,
                                                                            costs.dense_work)))
        plans.append(DSTPlan(dens, report))
    return plans


def plan_dst_with_floor(costs: UnitCosts, sensitivity: Optional[np.ndarray], d0: float,
                        d_min: float, d_max: float, anchor: str = "mean",
                        tolerance: float = 0.1, p2p_s: float = 0.0,
                        density_floor: float = 0.0, search_steps: int = 6,
                        raise_headroom: float = 0.0,
                        stage_density_floor: float = 0.0,
                        raise_to: str = "bottleneck", quality=None,
                        rank_scale=None, descent: bool = True) -> DSTPlan:
    """``plan_dst``, but the plan keeps its work-weighted mean density >= density_floor x d0 and
    every pipeline stage's work-weighted density >= stage_density_floor x d0.

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
    quality and is clearly faster. The band is searched between ``tolerance`` and 10 in ``search_steps // 2``
    rounds, each one batched pass (``plan_dst_candidates``) of 3 tolerances spaced geometrically
    inside the interval where the floors start to hold (the first pass also plans the no-cut
    plan): 4^rounds sub-intervals, as fine as ``2 x rounds`` bisection steps in half the passes.
    The resolution matters: near the floor, speed falls steeply as the band widens (a 5^2 grid
    instead of 4^3 lost 4% of the step at 64 DP x 16 x PP4). The static plan's simulation is
    shared by the passes (and by both objectives' plans).

    ``quality`` (a ``policy.quality.StageQuality``: ``--sb-dst-objective quality``): cuts and
    raises by quality water-filling (where density buys the most predicted quality per second),
    and a plan must also not lose predicted quality against uniform d0 (its raises pay its cuts
    back under the measured convex cost); the fastest plan that does is kept. Water-filling
    places each phase's cuts and raises best, but the two phases interact through the pipeline's
    floats (a cut spread over many micro-batches can leave less room to raise elsewhere), so the
    density objective's plan competes too: of the two, the one with the lower predicted quality
    cost among those within ``SPEED_TIE`` of the faster one's step time is returned.
    """
    kw = dict(anchor=anchor, tolerance=tolerance, p2p_s=p2p_s, density_floor=density_floor,
              search_steps=search_steps, raise_headroom=raise_headroom,
              stage_density_floor=stage_density_floor, raise_to=raise_to,
              static={},                    # the static plan's simulation, shared by all passes
              narrow=straggler_present(rank_scale, tolerance))
    ordered = _plan_with_floor(costs, sensitivity, d0, d_min, d_max, guard=quality, **kw)
    if quality is not None:
        filled = _plan_with_floor(costs, sensitivity, d0, d_min, d_max, quality=quality, **kw)
        ordered.report.quality_cost = quality.plan_cost(ordered.densities)
        fair = [p for p in (filled, ordered) if not p.report.quality_cost > 1e-12] or [filled]
        fastest = min(p.report.step_time_planned_s for p in fair)
        ordered = min((p for p in fair if p.report.step_time_planned_s
                       <= fastest * (1.0 + SPEED_TIE)), key=lambda p: p.report.quality_cost)
    descend = descent and raise_to == "bottleneck" and anchor != "max" and density_floor > 0
    return refine_plan(ordered, costs, d0, d_min, d_max, p2p_s, density_floor=density_floor,
                       stage_density_floor=stage_density_floor, raise_headroom=raise_headroom,
                       quality=quality, margin=SPEED_TIE, rounds=ROUNDS if descend else 0)


def _plan_with_floor(costs: UnitCosts, sensitivity: Optional[np.ndarray], d0: float,
                     d_min: float, d_max: float, *, anchor: str, tolerance: float,
                     p2p_s: float, density_floor: float, search_steps: int,
                     raise_headroom: float, stage_density_floor: float, raise_to: str,
                     static: dict, narrow: bool = False, quality=None, guard=None) -> DSTPlan:
    """``plan_dst_with_floor`` for one objective (``quality`` None: density order); ``static``:
    the ``_static`` cache of ``plan_dst_candidates`` (the same costs); ``guard``: the quality
    cost a narrower band's density-order plan must not lose against (``policy.bands``)."""

    def plans(cands):
        found = plan_dst_candidates(costs, sensitivity, d0, d_min, d_max, cands, p2p_s,
                                    raise_headroom, raise_to, _static=static, quality=quality)
        if quality is not None:
            for p in found:
                p.report.quality_cost = quality.plan_cost(p.densities)
        return found

    floor = density_floor * d0 - 1e-12
    stage_floor = stage_density_floor * d0 - 1e-12

    def meets(p: DSTPlan) -> bool:
        r = p.report
        return (r.mean_density >= floor and min(r.density_per_stage) >= stage_floor
                and not r.quality_cost > 1e-12)

    best, *narrower = plans(band_ladder(anchor, tolerance) if narrow else [(anchor, tolerance)])
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
    for rnd in range(max(search_steps // 2, 1)):
        ts = lo * (hi / lo) ** (np.arange(1, per_round + 1) / (per_round + 1))
        cands = [(anchor, float(t)) for t in ts]
        found = plans(([("max", tolerance)] if rnd == 0 else []) + cands)
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
    target (``--sb-raise-to``) and the raise headroom from a ``SparseBalanceConfig``; the
    costs must be tabulated on ``density_grid(config.density, config.min_density,
    config.max_density)``. ``raise_headroom`` overrides the config's (the runtime passes the
    measured error when the config says 'auto'; 'auto' without one is
    ``DEFAULT_RAISE_HEADROOM``). With ``--sb-dst-objective quality`` (the default),
    ``stage_layers`` (the decoder layers of every (virtual) stage of the costs) maps the quality
    cost onto the stages: without it the call raises ``ValueError`` (no silent fall-back to the
    density objective); ``dst_objective="density"`` needs none. ``rank_scale``: the
    calibration's [dp, pp] factors (``correction_grid``; narrower bands for a slow GPU)."""
    if raise_headroom is None:
        raise_headroom = config.raise_headroom_value
    if raise_headroom is None:
        raise_headroom = DEFAULT_RAISE_HEADROOM
    quality = None
    if config.dst_objective == "quality":
        from .quality import StageQuality, load_quality_cost
        if stage_layers is None or len(stage_layers) != costs.shape[2]:
            raise ValueError(f"--sb-dst-objective quality (the default) needs the decoder "
                             f"layers of each of the {costs.shape[2]} stages, got "
                             f"{stage_layers!r}; pass stage_layers, or plan with "
                             f"--sb-dst-objective density, which needs none")
        quality = StageQuality.from_cost(load_quality_cost(config.quality_cost), stage_layers,
                                         config.density)
    return plan_dst_with_floor(
        costs, sensitivity, config.density, config.min_density, config.max_density,
        anchor=config.anchor, tolerance=config.tolerance, p2p_s=p2p_s,
        density_floor=config.density_floor, raise_headroom=raise_headroom,
        stage_density_floor=config.stage_density_floor, raise_to=config.raise_to,
        quality=quality, rank_scale=rank_scale, descent=config.dst_descent != "off")
