"""Search Megatron's pipeline layouts for the fastest static configuration and for SparseBalance.

The candidates are every split Megatron's own flags build (``layout.candidate_layouts``: the even
split, the embedding/loss accounting, first/last layer counts; each for vp = 1 and, where the
micro-batches allow it, vp = 2 with the interleaved schedule). Each is simulated on the same
global batches (``study.run_study``):

- static: every unit at d0, with Megatron's sequential packing and with token-balanced packing;
  the best (layout, packing) is *the best static configuration* a Megatron user could run;
- SparseBalance: SAB + DST (the runtime's ``plan_dst_from_config``, floors included), on plain
  1F1B layouts (training refuses the interleaved schedule with ``--sparse-balance`` so far). A
  layout qualifies only if its plan keeps the layer-weighted density >= d0 and every stage >= the
  stage floor x d0 (a layout that starves a stage to win is not a win).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..latency.layout import PipelineLayout, candidate_layouts
from .study import StudyConfig, run_study

STATIC_VARIANTS = ("static", "token_balanced")
SPARSE_VARIANT = "sab_dst"


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
                    k: self.row[k] for k in ("imbalance", "bubble_fraction", "mean_density",
                                             "density_per_stage", "min_stage_density")}}


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
        if variant == SPARSE_VARIANT or variant.startswith("dst"):
            ok = (r["mean_density"] >= cfg.density - 1e-9
                  and r["min_stage_density"] >= floor - 1e-9)
        out.append(LayoutChoice(lay, variant, r["step_time_s"], r, ok))
    out.sort(key=lambda c: (not c.qualifies, c.step_time_s))
    return out


def best_layouts(lm, lengths, cfg: StudyConfig, dp: int, *, pp: int,
                 num_layers: Optional[int] = None, vps: Sequence[int] = (1, 2)) -> dict:
    """{"static": [LayoutChoice...], "sparsebalance": [...], "even_static": LayoutChoice}: both
    searches, fastest first, and Megatron's default (even split, sequential packing)."""
    n = int(num_layers or lm.table["model"]["num_layers"])
    static = search_layouts(lm, lengths, cfg, dp, pp=pp, num_layers=n, vps=vps,
                            variants=STATIC_VARIANTS)
    # the runtime does not run the interleaved schedule yet (refused at launch): plain 1F1B only
    sparse = search_layouts(lm, lengths, cfg, dp, pp=pp, num_layers=n, vps=(1,),
                            variants=(SPARSE_VARIANT,))
    even = PipelineLayout.even(n, pp)
    even_static = next(c for c in static if c.layout == even and c.variant == "static")
    return {"static": static, "sparsebalance": sparse, "even_static": even_static}
