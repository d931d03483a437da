"""Search Megatron's pipeline layouts for the fastest static configuration and for SparseBalance.

The candidates are the whole ``--pipeline-model-parallel-layout`` space (issue 27: uneven
virtual chunks, empty and LM-head-only stages, vp 1-4 where the micro-batches allow the
interleaved schedule), searched per packing and vp by ``layout_space.search_space`` (exhaustive
where small, else local search from every split Megatron's count flags build, with a proven
lower bound), under an optional device-memory limit; the winners of every search are simulated
on the same global batches (``study.run_study``):

- static: every unit at d0, with Megatron's sequential packing, with token-balanced packing and
  with Megatron's dp_balanced packer (``batching.dp_balanced``); the best (layout, packing) is
  *the best static configuration* a Megatron user could run;
- dense: dense attention with each packing (sequential, token-balanced, dp_balanced, SAB by the
  dense kernel's costs: ``--sb-batching`` alone), each searched on its own layouts; the best
  (layout, packing) is *the best dense configuration*;
- accuracy: SAB + DST raising up to the static plan's step time (``--sb-raise-to static``): of
  the layouts no slower than the best static configuration, the one with the lowest predicted
  LM-loss change under the quality objective (the default), the highest layer-weighted density
  under the density objective;
- SparseBalance: SAB + DST (the runtime's ``plan_dst``, floors included), on the same
  layouts, the interleaved schedule included (DST plans every model chunk). A layout qualifies
  only if its plan keeps the layer-weighted density of the sparse path's documents >= d0 (a
  routed document counts 1.0 in every run alike and must not pay for cuts elsewhere) and every
  stage >= the stage floor x d0 (a layout that starves a stage to win is not a win).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from ..latency.layout import LayoutError, PipelineLayout, candidate_layouts
from .study import STAND_DOWN_PACKINGS, StudyConfig, packing_of, run_study

STATIC_VARIANTS = ("static", "token_balanced", "dp_balanced")
DENSE_VARIANT = "dense"
DENSE_PACKINGS = {"dense": "sequential", "dense_token_balanced": "token_balanced",
                  "dense_dp_balanced": "dp_balanced", "dense_sab": "sab_dense"}
"""The dense variants the dense search runs, and the packing each one's layouts are searched
with."""
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
    floor = cfg.sb.stage_density_floor * cfg.sb.density
    out = []
    for name, (variant, lay) in runs.items():
        r = rows[name]
        if r.get("refused"):    # a step Megatron cannot run on this layout: not a candidate
            continue
        ok = True
        if variant.startswith(SPARSE_VARIANT) or variant.startswith("dst"):
            # the sparse path's documents at d0 or above: with routing a routed document is
            # dense work in every run alike, so it must not make up for density cut elsewhere
            # (NaN: every document routed dense, no sparse path to keep)
            sd = r.get("sparse_density", np.nan)
            ok = ((r["mean_density"] if np.isnan(sd) else sd) >= cfg.sb.density - 1e-9
                  and r["min_stage_density"] >= floor - 1e-9)
        out.append(LayoutChoice(lay, variant, r["step_time_s"], r, ok))
    out.sort(key=lambda c: (not c.qualifies, c.step_time_s))
    return out


def stand_down_config(cfg: StudyConfig, best_static: LayoutChoice,
                      static: Sequence[LayoutChoice] = (),
                      dense: Sequence[LayoutChoice] = ()) -> StudyConfig:
    """``cfg`` whose SAB runs stand down to the packing of the best static configuration
    (``--sb-stand-down``, issue 27: the baseline a run must not lose to is what the user would
    run without SparseBalance), and whose dense_sab runs to the best dense one's (Megatron's
    dp_balanced included: the runtime commits its packing with its own micro-batch count); where
    that packing is none the runtime packs, the fastest of ``static`` (``dense``) whose packing
    it can. Unchanged when the stand-down is off."""
    if cfg.sb.stand_down == "off":
        return cfg

    def runtime_packing(choices):
        return next((packing_of(c.variant) for c in choices
                     if packing_of(c.variant) in STAND_DOWN_PACKINGS), None)

    out = cfg.with_flags(stand_down=runtime_packing([best_static, *static]) or "sequential")
    if dense:
        out = replace(out, dense_stand_down=runtime_packing(dense) or "sequential")
    return out


def best_layouts(lm, lengths, cfg: StudyConfig, dp: int, *, pp: int,
                 num_layers: Optional[int] = None, vps: Sequence[int] = (1, 2),
                 device_memory_gib: Optional[float] = None, whole_space: bool = True,
                 shortlist: int = 4, progress: Optional[Callable[[str], None]] = None,
                 dense_packings: Sequence[str] = tuple(DENSE_PACKINGS),
                 dense_only: bool = False) -> dict:
    """{"static": [...], "dense": [...], "sparsebalance": [...], "accuracy": [...],
    "even_static": choice, "plain_static": choice, "space": {...}, "excluded_memory": int}.

    The SparseBalance searches stand down to the best static configuration's packing
    (``stand_down_config``).
    static / dense / sparsebalance: the searches, fastest first (dense: every layout with dense
    attention and each of ``dense_packings``, keys of ``DENSE_PACKINGS``: what a user without
    the plugin runs today, and ``dense_sab``, standing down to the fastest dense packing the
    runtime can pack); accuracy: SAB + DST raising to the
    static plan's step time (``--sb-raise-to static``) on every layout whose step is no slower
    than the best static configuration's, best first (the "free accuracy" choice: lowest
    predicted loss under the quality objective, densest under the density objective);
    even_static: Megatron's default (even split, sequential packing; None when num_layers is
    not divisible by pp); plain_static: the best static run with Megatron's sequential packing
    (no plugin at all; the best static may need the plugin's token-balanced packing).
    dense_only: the same layout-space searches and the same dense runs (each dense packing on
    every shortlisted layout, so its rows are the full search's), without the static, SparseBalance
    and accuracy runs (static, sparsebalance and accuracy empty, even_static and plain_static
    None): the packers' comparison at a fraction of the cost.

    whole_space (issue 27): the layouts are the whole ``--pipeline-model-parallel-layout`` space
    (``layout_space.search_space`` per packing and vp, the count-flag layouts among its starts);
    the best ``shortlist`` of every (packing, vp) search, the dense one and SAB's at d0 included,
    are then run through the study, so the static rows are the space's best and SparseBalance's
    layout is chosen from the winners of every packing. ``space`` records every search (best,
    proven lower bound, gap, evaluations, layouts over the memory limit). Without it: the
    count-flag layouts only (the search before issue 27).
    device_memory_gib: layouts whose fullest rank is estimated over it (``latency.memory``, at
    ``cfg.seq_length`` tokens per micro-batch) are never chosen; ``excluded_memory`` counts them.
    progress: called with one line as each part of the search starts and ends (a long search
    is not silent: ``sparsebalance-layout`` prints them to stderr).
    """
    from .layout_space import StepEvaluator, packed_features, search_space

    say = progress or (lambda line: None)

    n = int(num_layers or lm.table["model"]["num_layers"])
    vps = [v for v in vps if v == 1 or cfg.microbatches >= pp]
    if device_memory_gib is None:
        device_memory_gib = cfg.device_memory_gib
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise ValueError(f"--device-memory-gib {device_memory_gib!r}: expected a number of "
                         f"GiB > 0")
    fits, excluded = None, set()
    if device_memory_gib is not None:
        from ..latency.memory import MemoryModel
        mm = MemoryModel.from_table_model(lm.table["model"])

        def fits(lay):
            return mm.peak_gib(lay, cfg.seq_length, cfg.microbatches) <= device_memory_gib
    space = {}
    if whole_space:
        cands, dense_cands = {}, {}
        dense_lm = lm.with_routing(1 << 40)
        for key, model, packing, d in (("static", lm, "sequential", cfg.sb.density),
                                       ("token_balanced", lm, "token_balanced", cfg.sb.density),
                                       ("dp_balanced", lm, "dp_balanced", cfg.sb.density),
                                       ("sab", lm, "sab", cfg.sb.density),
                                       *((v, dense_lm, DENSE_PACKINGS[v], 1.0)
                                         for v in dense_packings)):
            evs = {}
            space[key] = {}
            for vp in vps:
                # dp_balanced under VPP: Megatron's packer makes a multiple of dp x pp groups
                group = pp if packing == "dp_balanced" and vp > 1 else None
                if group not in evs:
                    say(f"packing {cfg.steps} global batches ({packing}"
                        f"{f', groups of dp x {group}' if group else ''}) for the {key} "
                        f"layout search")
                    evs[group] = StepEvaluator(
                        model, packed_features(model, lengths, cfg, dp, packing, group), dp,
                        cfg.microbatches, d, arrange=packing in ("sab", "sab_dense"))
                ev = evs[group]
                say(f"searching the {key} layouts, vp={vp}")
                res = search_space(ev, n, pp, vp, fits=fits)
                say(f"searched the {key} layouts, vp={vp}: {res.evaluated} simulated, best "
                    f"{res.best_s:.3f} s" if res.ranked else
                    f"searched the {key} layouts, vp={vp}: Megatron's interleaved schedule "
                    f"refuses {list(res.refused_microbatches)} micro-batches"
                    if res.refused_microbatches else
                    f"searched the {key} layouts, vp={vp}: none fits")
                space[key][vp] = res
                # the dense packings' winners are the dense search's alone
                into = dense_cands if key in DENSE_PACKINGS else cands
                for _, lay in res.ranked[:shortlist]:
                    into.setdefault(lay.layers + (lay.pp,), lay)
        excluded_n = max((r.excluded_memory for per in space.values() for r in per.values()),
                         default=0)
        candidates = list(cands.values())
        dense_candidates = list({**cands, **dense_cands}.values())
    else:
        candidates = [c for c in candidate_layouts(n, pp, vps)]
        if fits is not None:
            excluded = {c.layers for c in candidates if not fits(c)}
            candidates = [c for c in candidates if c.layers not in excluded]
        excluded_n = len(excluded)
        dense_candidates = candidates
    if not candidates:
        raise LayoutError(f"no pipeline layout of {n} layers over pp={pp} x vp {list(vps)} "
                          f"fits --device-memory-gib {device_memory_gib}: raise it, or use more "
                          f"pipeline stages or shorter micro-batches")
    kw = dict(pp=pp, num_layers=n, vps=vps, candidates=candidates)
    c = len(candidates)
    static = []
    if not dense_only:
        say(f"simulating {c} layouts x {len(STATIC_VARIANTS)} static packings")
        static = search_layouts(lm, lengths, cfg, dp, variants=STATIC_VARIANTS, **kw)
    bad = [v for v in dense_packings if v not in DENSE_PACKINGS]
    if bad or not dense_packings:
        raise ValueError(f"dense_packings {list(dense_packings)}: expected some of "
                         f"{list(DENSE_PACKINGS)}")
    say(f"simulating {len(dense_candidates)} layouts with dense attention x "
        f"{len(dense_packings)} packings")
    dkw = {**kw, "candidates": dense_candidates}
    dense = search_layouts(lm, lengths, cfg, dp, variants=tuple(
        v for v in dense_packings if v != "dense_sab"), **dkw) \
        if set(dense_packings) - {"dense_sab"} else []
    # dense_sab: to the best dense
    sb_cfg = stand_down_config(cfg, static[0] if static else dense[0], static, dense)
    if "dense_sab" in dense_packings:
        dense = sorted(dense + search_layouts(lm, lengths, sb_cfg, dp, variants=("dense_sab",),
                                              **dkw), key=lambda c: c.step_time_s)
    if dense_only:
        return {"static": [], "dense": dense, "sparsebalance": [], "accuracy": [],
                "even_static": None, "plain_static": None, "excluded_memory": excluded_n,
                "space": {k: {vp: r.as_dict() for vp, r in per.items()}
                          for k, per in space.items()},
                "static_lower_bound_s": None, "static_optimum_proven": False}
    say(f"simulating {c} layouts with SparseBalance (SAB + DST)")
    sparse = search_layouts(lm, lengths, sb_cfg, dp, variants=(SPARSE_VARIANT,), **kw)
    say(f"simulating {c} layouts with SparseBalance raising to the static step time")
    acc = search_layouts(lm, lengths, sb_cfg, dp, variants=(ACCURACY_VARIANT,), **kw)
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
    even_static = None
    if even is not None:
        even_static = search_layouts(lm, lengths, cfg, dp, variants=("static",),
                                     candidates=[even], **{k: v for k, v in kw.items()
                                                           if k != "candidates"})[0]
    plain = next((c for c in static if c.variant == "static"), None)
    return {"static": static, "dense": dense, "sparsebalance": sparse, "accuracy": acc,
            "even_static": even_static, "plain_static": plain, "excluded_memory": excluded_n,
            "space": {k: {vp: r.as_dict() for vp, r in per.items()} for k, per in space.items()},
            "static_lower_bound_s": min((r.lower_bound_s for k in STATIC_KEYS
                                         for r in space.get(k, {}).values()
                                         if r.lower_bound_s is not None), default=None),
            "static_optimum_proven": bool(space) and all(
                r.exact for k in STATIC_KEYS for r in space.get(k, {}).values())}


STATIC_KEYS = ("static", "token_balanced")


LAYOUT_GAP_WARN = 1.05
"""The runtime warns when its layout's static step is predicted this much slower than the best."""


def layout_gap(lm, mb_doc_lengths, dp: int, num_microbatches: int, layout: PipelineLayout,
               density: float) -> tuple[float, PipelineLayout]:
    """(configured / best predicted static step time, the best layout) for one packed step at
    ``density``: the runtime's start-up check. The layouts: those Megatron's count flags build
    for ``layout``'s model and pp, then a short local search through the whole layout-string
    space (``layout_space.search_space``: one layer moved at a time, at most 200 more layouts),
    for vp 1, the run's vp, and 2 where the step has >= pp micro-batches, as Megatron's
    interleaved schedule needs (``LayoutError`` when the table cannot predict them)."""
    from .layout_space import StepEvaluator, search_space

    ev = StepEvaluator(lm, [lm.unit_features(mb_doc_lengths)], dp, num_microbatches, density)
    mine = ev.step_s(layout)
    best, best_s = layout, mine
    vps = {1, layout.vp} | ({2} if num_microbatches >= layout.pp else set())
    for vp in sorted(vps):
        res = search_space(ev, layout.num_layers, layout.pp, vp, local_starts=2,
                           max_evaluations=200, enumerate_limit=0)
        if res.ranked and res.best_s < best_s * (1 - 1e-9):
            best_s, best = res.ranked[0]
    return (mine / best_s if best_s > 0 else 1.0), best
