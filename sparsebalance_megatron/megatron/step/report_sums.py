"""The step report's figures as fixed-size sums over the data-parallel group (issue 77): each DP
rank holds only its own micro-batches, so ``rank_parts`` makes its sums and maxima (work,
kept work and kept pairs per stage, tokens, its density and busy seconds),
``StepExchange.reduce`` adds them over the group (one all-reduce of a vector whose size
depends on the stages, not on the DP size), and ``step_figures`` makes the record's figures of
them: the work-weighted means of ``policy/density_means.py`` (``WeightTotals.of_sums``).

Every density figure is weighted by attention work, and documents routed to the dense kernel
(shorter than the run's routing threshold) count at density 1 in it: they keep every block.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...config import SparseBalanceConfig


def step_features(batch, sb: SparseBalanceConfig, dense_below_tokens: int = 0, units=None):
    """The ``UnitFeatures`` of the step's micro-batches with the attention's block parameters
    and routing: ``units`` (the latency model's features of the step, built by the planner)
    where they were built with the same parameters, else built here."""
    from ...latency.features import UnitFeatures

    want = (sb.block_size, sb.sink_blocks, sb.local_blocks, "kept", 16, dense_below_tokens)
    if isinstance(units, UnitFeatures) and (
            units.block_size, units.sink_blocks, units.local_blocks, units.work_mode,
            units.query_chunk_blocks, units.dense_below_tokens) == want:
        return units
    return UnitFeatures.build(batch.unit_csr(with_padding=True), *want)


def unit_work(batch, sb: SparseBalanceConfig, dense_below_tokens: int = 0, units=None
              ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """([dp, m] dense attention work (kept block pairs at density 1) of every micro-batch's
    documents on the sparse path: the weight of its planned density in every density figure (a
    stage's layers all run at that density); [dp, m] that of its documents routed dense
    (shorter than ``dense_below_tokens``), which count at density 1, or None without routing).
    ``units``: the step's features if already built (``step_features``)."""
    feats = step_features(batch, sb, dense_below_tokens, units)
    shape = (batch.dp, batch.num_microbatches)
    return (feats.attention_work(1.0).reshape(shape),
            feats.dense_work.reshape(shape) if dense_below_tokens else None)


def kept_work(batch, sb: SparseBalanceConfig, densities: np.ndarray,
              dense_below_tokens: int = 0, units=None) -> np.ndarray:
    """[dp, m, stages] kept block pairs of every unit's documents on the sparse path at the
    unit's planned density (``densities`` [dp, m, stages]): the count the selection keeps
    (``latency/work.py``'s kept rule: ``ceil(density x causal blocks)`` per query block, never
    fewer than its sink, local and diagonal blocks). ``units`` as in ``unit_work``."""
    feats = step_features(batch, sb, dense_below_tokens, units)
    d = np.asarray(densities, dtype=np.float64)
    return np.stack([feats.attention_work(d[:, :, s].reshape(-1)).reshape(d.shape[:2])
                     for s in range(d.shape[2])], axis=2)


def document_tokens(batch, doc_positions: Optional[np.ndarray]) -> int:
    """Positions of the step's documents (tokens and EOD), per-document padding (context
    parallelism) left out; ``doc_positions[d]`` = document d's tokens + 1 (None: count the
    segments whole)."""
    segs = batch.segment_array()
    if doc_positions is None or not segs.size:
        return int((segs[:, 2] - segs[:, 1]).sum())
    return int((np.minimum(segs[:, 2], doc_positions[segs[:, 0]]) - segs[:, 1]).sum())


def rank_parts(batch, sb: SparseBalanceConfig, densities: Optional[np.ndarray], *,
               layers=None, attention_layers=None, dense_below_tokens: int = 0,
               doc_positions: Optional[np.ndarray] = None, units=None,
               busy: Optional[float] = None, calibration: Optional[tuple] = None,
               kept_curve_grid: Optional[np.ndarray] = None) -> dict:
    """One DP rank's parts of the step's figures, ``{"sum": ..., "max": ...}`` for
    ``StepExchange.reduce`` (the DP group's sums and maxima: a fixed size whatever the DP size;
    ``step_figures`` reads them). ``batch``: the rank's one-row plan; ``densities`` [1, m,
    stages]: its row of the plan (None: no plan); ``busy``: its measured busy seconds (None: not
    reported; NaN: untimed). Sums: ``tokens`` (``document_tokens``), ``positions`` (padding
    included), ``ranks`` (1) and ``units`` (m); with a plan, per stage, the kept work
    ``kept_s`` (density x weight), the weights ``work_s`` (attention work at density 1 x the
    stage's attention layers, ``layers`` / ``attention_layers`` as in ``step_record``) and the
    plain densities ``plain_s`` (the mean where every weight is 0), the routed work ``dense``
    (density 1, per layer: x attention layers in the means) and the kept pairs ``pairs``
    (``kept_work`` x attention layers); maxima: the rank's density (work-weighted over its
    units and stages) as ``density_max`` and negated as ``density_neg_min``, its busy seconds
    (``busy_max``; ``busy_missing``: 1 where a rank has none); ``calibration``: (its latency
    model's relative error this step, NaN: none; its factor) of its own pipeline, summed
    (``cal_err``, ``cal_n``) and as the factors' range (``cal_max``, ``cal_neg_min``);
    ``kept_curve_grid``: the kept pairs of the rank's documents (one layer) at every density
    of that grid, ``kept_curve`` (``eval_profile.py``). Pair and token counts are integers,
    exact in float64."""
    from ...policy.density_means import WeightTotals

    feats = step_features(batch, sb, dense_below_tokens, units)
    out = {"sum": {"tokens": document_tokens(batch, doc_positions), "ranks": 1,
                   "positions": int(batch.packed_lengths().sum()),
                   "units": batch.num_microbatches}, "max": {}}
    if densities is not None:
        d = np.asarray(densities, dtype=np.float64)[0]                    # [m, stages]
        att = _attention_layers(d.shape[1], layers, attention_layers)[1]
        work, dense = unit_work(batch, sb, dense_below_tokens, feats)
        w = work[0][:, None] * att[None, :]
        kept_s, work_s = (d * w).sum(axis=0), w.sum(axis=0)
        routed = None if dense is None else float(dense.sum())
        mine = WeightTotals.of_sums(work_s, None if dense is None else routed * att).mean(
            float(kept_s.sum()), lambda: float(d.mean()))
        pairs = kept_work(batch, sb, d[None], dense_below_tokens, feats)[0] * att[None, :]
        out["sum"].update(kept_s=kept_s, work_s=work_s, plain_s=d.sum(axis=0),
                          pairs=float(pairs.sum()), dense=routed or 0.0)
        out["max"].update(density_max=mine, density_neg_min=-mine)
        if kept_curve_grid is not None:
            out["sum"]["kept_curve"] = feats.kept_grid(kept_curve_grid).sum(axis=0)
    if busy is not None:
        ok = bool(np.isfinite(busy))
        out["sum"]["busy"] = float(busy) if ok else 0.0
        out["max"].update(busy_max=float(busy) if ok else 0.0, busy_missing=float(not ok))
    if calibration is not None:
        err, factor = (float(x) for x in calibration)
        ok = bool(np.isfinite(err))
        out["sum"].update(cal_err=err if ok else 0.0, cal_n=float(ok))
        out["max"].update(cal_max=factor, cal_neg_min=-factor)
    return out


def _attention_layers(stages: int, layers=None, attention_layers=None) -> tuple:
    """([stages] decoder layers, [stages] attention layers) per stage (None: 1 each; attention
    layers: every decoder layer)."""
    lay = np.ones(stages) if layers is None else np.asarray(layers, dtype=np.float64)
    return lay, lay if attention_layers is None else np.asarray(attention_layers, np.float64)


def summed_parts(parts: list) -> dict:
    """Every DP rank's ``rank_parts`` summed and maximised in one process, as
    ``StepExchange.reduce`` makes them over the group (a whole plan held in one process)."""
    return {k: np.sum([p["sum"][k] for p in parts], axis=0) for k in parts[0]["sum"]} | {
        k: np.max([p["max"][k] for p in parts], axis=0) for k in parts[0]["max"]}


def step_figures(total: dict, *, layers=None, attention_layers=None) -> dict:
    """The record's figures of the whole step from ``total``, the DP group's sums and maxima
    of every rank's ``rank_parts``: ``tokens``, ``positions``; with a plan the work-weighted
    mean density (``mean_density``), per stage (``density_per_stage``), the DP ranks' least and
    greatest (``density_rank_min`` / ``_max``) and the kept density (``kept_density``: kept
    pairs / causal pairs, routed documents keeping all); with busy seconds from every rank
    ``busy_max_s``, ``busy_mean_s`` and ``measured_imbalance`` (max / mean); with the ranks'
    calibration the mean ``latency_error`` and the factors' ``calibration_min`` / ``_max``. The
    means are
    ``density_means.WeightTotals``' of the summed weights (routed work 0 without routing):
    those of the whole [dp, m, stages] arrays (``weighted_mean_density``,
    ``WeightTotals.stage``) to float rounding (the weights' sums are integers, exact)."""
    from ...policy.density_means import WeightTotals

    rec = {"tokens": int(total["tokens"]), "positions": int(total["positions"])}
    if "kept_s" in total:
        kept_s, plain_s = (np.asarray(total[k], dtype=np.float64) for k in ("kept_s", "plain_s"))
        units, nv = float(total["units"]), kept_s.size
        lay, att = _attention_layers(nv, layers, attention_layers)
        t = WeightTotals.of_sums(total["work_s"], float(total["dense"]) * att)
        rec.update(budgets_consistent=True,
                   mean_density=t.mean(float(kept_s.sum()),
                                       lambda: float(plain_s.sum()) / (units * nv)),
                   layers_per_stage=[int(x) for x in lay],
                   attention_layers_per_stage=[int(x) for x in att],
                   density_per_stage=[float(x) for x in t.stage(kept_s, lambda: plain_s / units)],
                   density_rank_min=-float(total["density_neg_min"]),
                   density_rank_max=float(total["density_max"]))
        if t.tot > 0:             # kept pairs / causal pairs; routed documents keep every pair
            rec["kept_density"] = (float(total["pairs"]) + t.dense) / t.tot
    if "busy" in total and not total["busy_missing"]:
        mean = float(total["busy"]) / float(total["ranks"])
        rec.update(busy_max_s=float(total["busy_max"]), busy_mean_s=mean,
                   measured_imbalance=float(total["busy_max"]) / max(mean, 1e-12))
    if "cal_n" in total:
        n = float(total["cal_n"])
        rec.update(latency_error=float(total["cal_err"]) / n if n else None,
                   calibration_min=-float(total["cal_neg_min"]),
                   calibration_max=float(total["cal_max"]))
    return rec
