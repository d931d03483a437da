"""Search Megatron's pipeline layouts for the fastest static configuration and for SparseBalance.

The candidates are every split Megatron's own flags build (``layout.candidate_layouts``: the even
split, the embedding/loss accounting, first/last layer counts; each for vp = 1 and, where the
micro-batches allow it, vp = 2 with the interleaved schedule). Each is simulated on the same
global batches (``study.run_study``):

- static: every unit at d0, with Megatron's sequential packing and with token-balanced packing;
  the best (layout, packing) is *the best static configuration* a Megatron user could run;
- accuracy: SAB + DST raising up to the static plan's step time (``--sb-raise-to static``): of
  the layouts no slower than the best static configuration, the one with the lowest predicted
  LM-loss change under the quality objective (the default), the highest layer-weighted density
  under the density objective;
- SparseBalance: SAB + DST (the runtime's ``plan_dst_from_config``, floors included), on the same
  layouts, the interleaved schedule included (DST plans every model chunk). A layout qualifies
  only if its plan keeps the layer-weighted density >= d0 and every stage >= the stage floor x d0
  (a layout that starves a stage to win is not a win).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from ..latency.layout import LayoutError, PipelineLayout, candidate_layouts
from .study import StudyConfig, packing_of, run_study

STATIC_VARIANTS = ("static", "token_balanced")
DENSE_VARIANT = "dense"
SPARSE_VARIANT = "sab_dst"
ACCURACY_VARIANT = "sab_dst_acc"


@dataclass
class LayoutChoice:
    """One simulated (layout, variant)."""

    layout: PipelineLayout
    variant: str
    step_time_s: float
    row: dict = field(repr=False)
    qualifies: bool = True   # SparseBalance runs: densities meet d0 and the stage floor

    @property
    def flags(self) -> list[str]:
        return self.layout.megatron_flags()

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "describe": self.layout.describe(),
                "variant": self.variant, "step_time_s": self.step_time_s,
                "megatron_flags": self.flags, "qualifies": self.qualifies, **{
                    k: self.row.get(k) for k in ("imbalance", "bubble_fraction", "mean_density",
                                                 "density_per_stage", "min_stage_density",
                                                 "predicted_loss")}}


def _name(variant: str, lay: PipelineLayout) -> str:
    return f"{variant}@{lay.describe()}"


def search_layouts(lm, lengths, cfg: StudyConfig, dp: int, *, pp: int,
                   num_layers: Optional[int] = None, vps: Sequence[int] = (1, 2),
                   variants: Sequence[str] = STATIC_VARIANTS,
                   candidates: Optional[Sequence[PipelineLayout]] = None) -> list[LayoutChoice]:
    """Every (candidate layout, variant) simulated; fastest first (qualifying runs first)."""
    n = int(num_layers or lm.table["model"]["num_layers"])
    if candidates is None:
        candidates = [c for c in candidate_layouts(n, pp, vps)
                      if c.vp == 1 or cfg.microbatches >= pp]
    if not candidates:
        raise ValueError(f"no pipeline layout of {n} layers over pp={pp} with vp in "
                         f"{list(vps)} (the interleaved schedule needs >= pp micro-batches)")
    runs = {_name(v, c): (v, c) for c in candidates for v in variants}
    rows = run_study(dp, cfg, lm, lengths, runs)
    floor = cfg.policy().stage_density_floor * cfg.density
    out = []
    for name, (variant, lay) in runs.items():
        r = rows[name]
        ok = True
        if variant.startswith(SPARSE_VARIANT) or variant.startswith("dst"):
            ok = (r["mean_density"] >= cfg.density - 1e-9
                  and r["min_stage_density"] >= floor - 1e-9)
        out.append(LayoutChoice(lay, variant, r["step_time_s"], r, ok))
    out.sort(key=lambda c: (not c.qualifies, c.step_time_s))
    return out


def stand_down_config(cfg: StudyConfig, best_static: LayoutChoice) -> StudyConfig:
    """``cfg`` whose SAB runs stand down to the packing of the best static configuration
    (``--sb-stand-down``, issue 27: the baseline a run must not lose to is what the user would
    run without SparseBalance); unchanged when the stand-down is off."""
    if cfg.policy().stand_down == "off":
        return cfg
    return replace(cfg, stand_down=packing_of(best_static.variant))


def best_layouts(lm, lengths, cfg: StudyConfig, dp: int, *, pp: int,
                 num_layers: Optional[int] = None, vps: Sequence[int] = (1, 2)) -> dict:
    """{"static": [...], "dense": [...], "sparsebalance": [...], "accuracy": [...],
    "even_static": choice}.

    The SparseBalance searches stand down to the best static configuration's packing
    (``stand_down_config``).
    static / dense / sparsebalance: the searches, fastest first (dense: every layout with dense
    attention, what a user without the plugin runs today); accuracy: SAB + DST raising to the
    static plan's step time (``--sb-raise-to static``) on every layout whose step is no slower
    than the best static configuration's, best first (the "free accuracy" choice: lowest
    predicted loss under the quality objective, densest under the density objective);
    even_static: Megatron's default (even split, sequential packing; None when num_layers is
    not divisible by pp)."""
    n = int(num_layers or lm.table["model"]["num_layers"])
    static = search_layouts(lm, lengths, cfg, dp, pp=pp, num_layers=n, vps=vps,
                            variants=STATIC_VARIANTS)
    dense = search_layouts(lm, lengths, cfg, dp, pp=pp, num_layers=n, vps=vps,
                           variants=(DENSE_VARIANT,))
    sb_cfg = stand_down_config(cfg, static[0])
    sparse = search_layouts(lm, lengths, sb_cfg, dp, pp=pp, num_layers=n, vps=vps,
                            variants=(SPARSE_VARIANT,))
    acc = search_layouts(lm, lengths, sb_cfg, dp, pp=pp, num_layers=n, vps=vps,
                         variants=(ACCURACY_VARIANT,))
    limit = static[0].step_time_s * (1 + 1e-9)
    acc = [c for c in acc if c.qualifies and c.step_time_s <= limit]
    if cfg.policy().dst_objective == "quality" and all("predicted_loss" in c.row for c in acc):
        acc.sort(key=lambda c: (c.row["predicted_loss"], c.step_time_s))
    else:
        acc.sort(key=lambda c: (-c.row["mean_density"], c.step_time_s))
    try:
        even = PipelineLayout.even(n, pp)
    except LayoutError:
        even = None        # Megatron's default needs num_layers divisible by pp
    even_static = next((c for c in static if c.layout == even and c.variant == "static"), None)
    return {"static": static, "dense": dense, "sparsebalance": sparse, "accuracy": acc,
            "even_static": even_static}


LAYOUT_GAP_WARN = 1.05
"""The runtime warns when its layout's static step is predicted this much slower than the best."""


def layout_gap(lm, mb_doc_lengths, dp: int, num_microbatches: int, layout: PipelineLayout,
               density: float) -> tuple[float, PipelineLayout]:
    """(configured / best predicted static step time, the best layout) for one packed step at
    ``density``, over the layouts Megatron's flags build for ``layout``'s model and pp (vp 1,
    and 2 where the step has >= pp micro-batches, as Megatron's interleaved schedule needs; the
    runtime's start-up check; ``LayoutError`` when the table cannot predict them)."""
    import numpy as np

    from ..policy import UnitCosts
    from ..sim.pipeline import pipeline_makespan_s

    feats = lm.unit_features(mb_doc_lengths)
    grid = np.asarray([float(density)])

    def step_s(lay):
        c = UnitCosts.from_latency(lm.with_layout(lay), feats, dp, num_microbatches, grid)
        return float(pipeline_makespan_s(c.fwd_s[..., 0], c.bwd_s[..., 0], lm.p2p_s,
                                         pp=lay.pp).max())

    mine = step_s(layout)
    best, best_s = layout, mine
    vps = (1, 2) if num_microbatches >= layout.pp else (1,)
    for cand in candidate_layouts(layout.num_layers, layout.pp, vps):
        t = step_s(cand)
        if t < best_s * (1 - 1e-9):
            best, best_s = cand, t
    return (mine / best_s if best_s > 0 else 1.0), best
