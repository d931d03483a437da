"""One DP rank's DST bands: the candidates' plans, steps 1-4 of the rule (docs/DESIGN.md
section 5: ``band_pass``, ``cut_rows``, ``raise_rows``, ``plan_reports``), every candidate
band's copy of the rows stacked in one pass (``band_pass``; the moves and their simulation are
``kernels.band``'s, compiled), so K candidates cost far less than K passes. Between the phases
the DP ranks agree the anchor, the static step and every cut step (``dst_ranks``); the band
search (``bands.band_search``) replays on the agreed verdicts of these plans.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from .. import kernels
from ..kernels.records import Fill, Tables, unit_offsets
from ..sim.pipeline import event_graph
from .costs import UnitCosts
from .density_means import WeightTotals, weighted_mean_density

SPEED_TIE = 1e-3          # plans within 0.1% of the fastest count as as fast
RAISE_ROUNDS = 5          # halvings of a rank's slack tried before it falls back to cut-only
FILL_ITERS = 12           # bisection steps on log(lambda) in [-20, 20] (quality water-filling)


@dataclass
class DSTReport:
    """What one plan did; every time is predicted by the latency model + 1F1B simulator."""

    step_time_static_s: float    # all units at d0
    step_time_cut_s: float       # after the cut phase (the bottleneck the raise respects)
    step_time_planned_s: float   # final plan
    speedup: float               # static / planned
    imbalance_before: float      # max / mean of per-rank makespans, static plan
    imbalance_after: float       # same, final plan
    mean_density_static: float   # work-weighted mean density of the static plan (d0; more
    #                              with routing: routed documents count at density 1)
    mean_density: float          # work-weighted mean density of the final plan
    units_cut: int               # units whose density ended below d0
    units_raised: int            # units whose density ended above d0
    ranks_reverted: int          # ranks whose raise failed verification (kept cut-only)
    tolerance_used: float = float("nan")  # band actually applied (wider under a density floor)
    density_per_stage: tuple = ()         # work-weighted mean density of every stage, final plan
    quality_cost: float = float("nan")    # predicted loss change vs uniform d0 (quality objective)
    quality_sd: float = float("nan")      # its uncertainty (the quality model's bootstrap)
    exchange_rate: float = float("nan")   # nats per token 1% of the step was worth (the rule's)
    adopted: str = ""                     # quality objective: "dst", or "no_cuts" where the
    #                                       cuts did not pay at --sb-exchange-rate

    def as_dict(self) -> dict:
        return asdict(self)

    def meets(self, mean_floor: float, stage_floor: float, quality: bool = True) -> bool:
        """The plan's mean and every stage's density at their floors (each less 1e-12) and,
        with ``quality``, no predicted loss against uniform d0."""
        return (self.mean_density >= mean_floor - 1e-12
                and min(self.density_per_stage) >= stage_floor - 1e-12
                and not (quality and self.quality_cost > 1e-12))


@dataclass
class DSTPlan:
    densities: np.ndarray   # [dp, m, stages] planned density of every unit (virtual stages)
    report: DSTReport
    grid_index: np.ndarray  # the densities' indices on the costs' grid


@dataclass
class RowsPass:
    """One pass over k candidates: the costs, the rows (candidate c x dp + rank: every
    candidate's copy of the rank), which rows water-fill, the compiled pass
    (``kernels.band.BandPass``), the grid indices of d0, d_min and d_max and the static plan
    (every unit at d0): its makespans [dp] and busy seconds [dp, pp]."""

    costs: UnitCosts
    k: int
    wrow: np.ndarray                         # [k * dp] rows cut and raised by water-filling
    fused: object
    bounds: tuple
    mk0: Optional[np.ndarray] = None
    busy0: Optional[np.ndarray] = None

    @property
    def dp(self) -> int:
        return self.costs.shape[0]


def band_pass(costs, sensitivity, bounds, k: int, water, quality, p2p_s: float) -> RowsPass:
    """The pass's rows, its compiled pass and its static plan. The load units are (dp rank,
    pipeline rank). With the interleaved schedule a rank runs vp model chunks: its units are
    then the (micro-batch, chunk) pairs, so every array is [rows, m * vp, pp] (the same memory
    as [rows, m, nv], since v = chunk * pp + rank)."""
    dp, m, nv = costs.shape
    pp, vp = costs.pipeline_ranks, costs.vp
    slots = m * vp
    t_grid = costs.total_s                                          # [dp, m, nv, g]
    sens = broadcast_sensitivity(sensitivity, (dp, m, nv)).reshape(dp, slots, pp)
    ib = tuple(costs.index_of(d) for d in bounds)
    _, i_min, i_max = ib
    rank_units = unit_offsets((dp, slots, pp), t_grid.shape[-1])    # [dp, slots, pp]
    fill = ()
    if water.any():
        # the water-filling's gain tables and the units' seconds per unit of density
        span = costs.densities[i_max] - costs.densities[i_min]
        # (a unit's seconds per unit of density over its quality weight: the fill compares
        # marginal quality per second, and a unit's quality weighs by its documents)
        weight = np.repeat(quality.unit_scale(), vp, axis=1)[:, :, None]     # [dp, slots, 1]
        t = t_grid.reshape(-1)
        fill = (gain_fill(quality.stage.marginal_gain(costs.densities), slots, pp, vp),
                ((t.take(rank_units + i_max) - t.take(rank_units + i_min)) / span
                 / np.maximum(weight, 1e-300)) if span > 0 else np.zeros(rank_units.shape))
    fused = kernels.band.BandPass(
        Tables.of(costs.fwd_s, costs.bwd_s, t_grid), event_graph(m, pp, vp).record(p2p_s),
        rank_units, sens, *fill)
    ps = RowsPass(costs, k, np.repeat(water, dp), fused, ib)
    _, ps.mk0, _, _, ps.busy0 = uniform_cut(ps, ib[0])
    return ps


def uniform_cut(ps: RowsPass, i: int) -> tuple:
    """The ranks' plan with every unit at grid index ``i``, as ``cut_rows``' second part (a cut
    of nothing): (grid indices, makespans [dp], durations, earliest finishes, busy seconds)."""
    units, dp = ps.fused.rows.units, ps.dp
    return ps.fused.cut(
        np.full(units.shape, i), np.zeros((dp, units.shape[2])), np.full(dp, np.inf),
        np.zeros(dp, dtype=bool), ps.bounds[1], FILL_ITERS)


def cut_rows(ps: RowsPass, candidates, bands) -> tuple:
    """Step 2: every row's load units above its band cut (``kernels.band.cut_rows``): least
    sensitive micro-batch first (stable sort: ties keep micro-batch order), or by
    water-filling: (the cut's step time per candidate [k], (grid indices, makespans, event
    durations and earliest finishes, busy seconds))."""
    k, dp = ps.k, ps.dp
    i0, i_min, _ = ps.bounds
    band = np.where([a == "max" for a, _ in candidates], np.inf, bands)   # max: never cut
    cut = ps.fused.cut(np.full((k * dp,) + ps.fused.rows.units.shape[1:], i0), ps.busy0,
                       np.repeat(band, dp), ps.wrow, i_min, FILL_ITERS)
    step1 = cut[1].reshape(k, dp).max(axis=1)                       # [k]
    return step1, cut


def raise_rows(ps: RowsPass, cut, step0: float, step1, raise_headroom: float,
               raise_to: str) -> tuple:
    """Step 3: every row raised below the new bottleneck, most sensitive first (or by
    water-filling), checked with the simulator; a rank that overshoots is re-planned alone
    with half the slack, then a quarter, ... (ranks are independent pipelines), and one that
    clears none keeps its cut. Returns (grid indices, makespans, reverted) [k * dp]."""
    k, dp, fused = ps.k, ps.dp, ps.fused
    _, i_min, i_max = ps.bounds
    idx_cut, mk1, dur1, ef1, busy1 = cut
    targets = (np.full(k, step0) if raise_to == "static" else step1) * (1.0 - raise_headroom)
    target = np.repeat(targets, dp)                                 # [k * dp] T1'
    overhead = mk1 - busy1.max(axis=1)                              # fill/drain
    slack_full = np.maximum(target[:, None] - overhead[:, None] - busy1, 0.0)
    cap_full = fused.floats(dur1, ef1, target)
    idx, mk_final = idx_cut.copy(), mk1.copy()
    reverted = np.zeros(k * dp, dtype=bool)
    limit = kernels.descent.raise_limit(target, mk1)                # [k * dp]
    ranks = np.flatnonzero((slack_full.max(axis=1) > 0) & (cap_full.max(axis=(1, 2)) > 0))
    if not (i_max > i_min and ranks.size):
        return idx, mk_final, reverted
    # The rows with the whole slack, then the overshooting ones again with half the slack, a
    # quarter, ...: a row keeps the largest alpha that clears (most clear at once, so only the
    # rows still over are re-planned); one that clears none keeps its cut-only densities.
    for alpha in 0.5 ** np.arange(RAISE_ROUNDS + 1):
        if not ranks.size:
            break
        trial, mk = fused.raise_try(idx_cut, cap_full, slack_full, ranks,
                                    np.full(ranks.size, alpha), ps.wrow, i_max, FILL_ITERS)
        ok = mk <= limit[ranks]
        idx[ranks[ok]], mk_final[ranks[ok]] = trial[ok], mk[ok]
        ranks = ranks[~ok]
    reverted[ranks] = True
    return idx, mk_final, reverted


def plan_reports(ps: RowsPass, candidates, d0: float, steps: tuple, raised: tuple) -> tuple:
    """Step 4: every candidate's plan and report, from the steps (static step time, cut step
    times [k]) and the raise (grid indices, makespans, reverted); and their parts of AR3 but
    the quality's (``dst_ranks.RankDST.raise_``)."""
    costs, k, dp, mk0 = ps.costs, ps.k, ps.dp, ps.mk0
    step0, step1 = steps
    idx, mk_final, reverted = raised
    _, m, nv = costs.shape
    i0 = ps.bounds[0]
    # every unit at its effective density: a move that keeps no other block is none, and
    # counts as none in the floors (the same seconds, so the makespans stand)
    idx_c = costs.effective_index(idx.reshape(k, dp, m, nv), i0)
    mk_c = mk_final.reshape(k, dp)
    imb0 = float(mk0.max() / mk0.mean()) if mk0.mean() > 0 else 1.0
    dens_c = costs.densities[idx_c]
    mean_c, stage_c, kept_s = _density_stats(dens_c, costs.attn_work, costs.dense_work)
    mean_static = float(d0) if costs.dense_work is None else weighted_mean_density(
        np.full(dens_c.shape[1:], float(d0)), costs.attn_work, costs.dense_work)
    flat_c = idx_c.reshape(k, -1)
    counts = np.stack([(flat_c < i0).sum(axis=1), (flat_c > i0).sum(axis=1),
                       reverted.reshape(k, dp).sum(axis=1)], axis=1).astype(np.int64)
    # every candidate's makespans' max and mean at once (a row's mean is numpy's over the same
    # elements in the same order as the row's own: the same floats)
    mk_top = mk_c.max(axis=1)
    step1_c = np.asarray(step1, dtype=np.float64).reshape(k).tolist()
    plans = []
    for c, (top, mean_mk, n, (_, tolerance)) in enumerate(zip(
            mk_top.tolist(), mk_c.mean(axis=1).tolist(), counts.tolist(), candidates)):
        report = DSTReport(
            step_time_static_s=step0, step_time_cut_s=step1_c[c], imbalance_before=imb0,
            mean_density_static=mean_static, ranks_reverted=n[2],
            tolerance_used=float(tolerance),
            **step_fields(step0, top, mean_mk, mean_c[c], stage_c[c], n))
        plans.append(DSTPlan(dens_c[c], report, idx_c[c]))
    return plans, {"sum": {"kept_s": kept_s, "plain_s": dens_c.sum(axis=(1, 2)),
                           "mk_sum": mk_c.sum(axis=1), "counts": counts}, "max": {"mk": mk_top}}


def step_fields(t0: float, step: float, mean_mk: float, mean, stage, counts) -> dict:
    """A plan's ``DSTReport`` fields from its step, its makespans' mean, its mean and per-stage
    densities and its units (cut, raised, ...): every report's, a rank's own and the DP
    group's agreed (``dst_ranks.agreed_report``). ``t0``: the static plan's step."""
    return dict(step_time_planned_s=step, speedup=t0 / step if step > 0 else 1.0,
                imbalance_after=step / mean_mk if mean_mk > 0 else 1.0,
                mean_density=float(mean), density_per_stage=tuple(float(x) for x in stage),
                units_cut=int(counts[0]), units_raised=int(counts[1]))


def _density_stats(dens: np.ndarray, weights: np.ndarray, dense_work) -> tuple:
    """The mean and per-stage (a tuple of floats) work-weighted densities (``WeightTotals``) of
    every candidate's densities ``dens`` [k, dp, m, pp] in one pass, and its kept work by stage:
    each sum is numpy's over the same elements in the same order as one candidate's alone (a
    [k, ...] sum over the trailing axes sums each candidate as a call sums its array)."""
    k = dens.shape[0]
    totals = WeightTotals(weights, dense_work)
    kept_all = dens * totals.w
    mean = [totals.mean(x, lambda c=c: float(dens[c].reshape(-1).mean()))
            for c, x in enumerate(kept_all.reshape(k, -1).sum(axis=1).tolist())]
    kept_s = kept_all.sum(axis=(1, 2))
    stage = totals.stage(kept_s, lambda: dens.mean(axis=(1, 2)))
    return mean, [tuple(row) for row in stage.tolist()], kept_s


def gain_fill(marg: np.ndarray, slots: int, pp: int, vp: int) -> Fill:
    """Quality water-filling's gain tables (``kernels.band.water_fill``) for units laid
    [slots, pp]: per unit the highest grid index whose marginal quality gain ``marg[v, i]``
    ([nv, g], non-increasing in i, +inf at 0) is >= x is found by one search over the stages'
    negated tables laid end to end, each shifted into its own band (``flat``), a unit's key
    shifted into its stage's (virtual stage v = chunk x pp + rank; slot = micro-batch x vp +
    chunk) and its answer less its stage's first entry."""
    nv, g = marg.shape
    neg = -np.asarray(marg, dtype=np.float64)                  # ascending, -inf at 0
    finite = neg[np.isfinite(neg)]
    low = (float(finite.min()) if finite.size else 0.0) - 1.0   # below every entry
    high = max(float(finite.max()) if finite.size else 0.0, 0.0) + 0.5
    width = high - low + 1.0
    flat = (np.clip(neg, low, None) + np.arange(nv)[:, None] * width).reshape(-1)
    stage = (np.arange(slots) % vp)[:, None] * pp + np.arange(pp)[None, :]
    return Fill.of(flat, stage * width, stage * g + 1, low, high)


def broadcast_sensitivity(sensitivity, shape) -> np.ndarray:
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
