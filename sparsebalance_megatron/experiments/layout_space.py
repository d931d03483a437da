"""The whole pipeline-layout space: a search that scales past enumeration, with a proven bound.

A layout is any split of ``num_layers`` decoder layers over ``pp x vp`` virtual stages (vp 1-4),
empty stages and an embedding-only first or LM-head-only last stage included: everything
``--pipeline-model-parallel-layout`` expresses (``PipelineLayout.megatron_flags`` writes the
string). At 24-64 layers, pp up to 8 and vp up to 4 the compositions cannot be enumerated, so:

- ``StepEvaluator``: the static step time of a layout (mean over the study's global batches of
  the simulated makespan, 1F1B or interleaved 1F1B for vp > 1, every unit at d0) on the batches
  packed once, with a stage's costs cached per (stage kind, layers): the study's own numbers
  (``run_study``'s static rows), milliseconds per layout;
- ``search_space``: where a vp's layouts number at most ``enumerate_limit`` (pp=4, vp=1 at 24
  layers: 2,925) all of them are simulated and the best is the optimum; else every start (the layouts Megatron's count flags build, ``candidate_layouts``,
  so nothing the old search found is lost) is evaluated, then a local search from the best
  ``local_starts`` of them moves one layer at a time between virtual stages (neighbours: adjacent
  stages, the same rank's other chunks, and the first and last stages) while the step improves;
- ``lower_bound_s``: a proven lower bound on the step time of every layout of a vp, so the output
  states the optimality gap (best found / bound - 1). Per step and DP rank, every rank r works
  ``W_r`` seconds, cannot start before micro-batch 0's forward reached its first stage and ends
  no earlier than micro-batch m-1's backward leaving it (both schedules start with micro-batch
  0 on chunk 0 and end with the last one's chunk-0 backward): ``T >= max_r (pre_r + W_r +
  post_r)``. A stage's time is affine in its layers (``LatencyModel.with_layout``; clamped work
  coefficients only raise it), so for vp = 1 a dynamic program over the stages' prefix sums
  minimises this bound exactly over all splits; for vp > 1 the fill terms keep only the
  embedding's part (chunk-0 stages may be empty) and the program runs over the ranks' layer
  totals. The bound ignores the bubbles inside the steady state, so the gap it proves is an
  upper bound on the true one;
- a memory limit (``device_memory_gib``, ``latency.memory``): a layout whose fullest rank is
  estimated over it is never evaluated, and the number of such layouts met is reported.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..batching.slots import arrange_slots
from ..latency.layout import LayoutError, PipelineLayout, candidate_layouts
from ..policy import UnitCosts
from ..sim.pipeline import interleaved_refusal, pipeline_makespan_s


def packed_features(lm, lengths, cfg, dp: int, packing: str,
                    vpp_group: Optional[int] = None) -> list:
    """Unit features of every step's micro-batches under ``packing`` (sequential,
    token_balanced, dp_balanced, sab, or sab_dense: SAB by the dense kernel's costs), cut exactly
    as ``study.run_study`` cuts and packs them. ``vpp_group``: dp_balanced's
    ``microbatch_group_size_per_vp_stage`` (Megatron passes pp under VPP)."""
    from ..batching import (SensitivityTracker, dp_balanced_plan, latency_sample_cost_fn,
                            sab_plan, sequential_plan, token_balanced_plan)
    from ..data import GlobalBatchSampler

    m, cap = cfg.microbatches, cfg.seq_length
    sampler = GlobalBatchSampler(lengths, capacity=cap, dp=dp, num_microbatches=m,
                                 seed=cfg.seed, long_sample_policy="split")
    out = []
    for _ in range(cfg.steps):
        segs = sampler.next_global_batch()
        if packing == "sequential":
            plan = sequential_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap)
        elif packing == "token_balanced":
            plan = token_balanced_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                       seed=cfg.seed)
        elif packing in ("sab", "sab_dense"):
            cost_fn = latency_sample_cost_fn(lm, cfg.sb.density) if packing == "sab" else \
                latency_sample_cost_fn(lm.all_dense(), 1.0)
            plan = sab_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap, cost_fn=cost_fn,
                            sensitivity=SensitivityTracker(), seed=cfg.seed,
                            length_multiple=cfg.microbatch_multiple)
        elif packing == "dp_balanced":
            plan = dp_balanced_plan(segs, dp=dp, num_microbatches=m, max_tokens=cap,
                                    empty_groups=True,
                                    microbatch_group_size_per_vp_stage=vpp_group)
        else:
            raise ValueError(f"packing {packing!r}: expected sequential, token_balanced, "
                             f"dp_balanced, sab or sab_dense")
        plan = plan.with_length_multiple(cfg.microbatch_multiple or plan.length_multiple)
        out.append(lm.unit_features(plan.flat_lengths(with_padding=True)))
    return out


class StepEvaluator:
    """Static step time (every unit at ``density``) of any layout on fixed packed batches (a
    step's micro-batch count is its features' units / dp: Megatron's dp_balanced varies it).
    With ``arrange`` (SAB's packings) the micro-batches run in the slots SAB would give them on
    that layout (``batching.slots.arrange_slots``: SAB arranges them on the run's own pipeline),
    and no lower bound is claimed (its fill terms assume the packed first and last
    micro-batches, and swaps move work between ranks)."""

    def __init__(self, lm, feats: list, dp: int, num_microbatches: int, density: float,
                 arrange: bool = False):
        self.lm, self.feats, self.dp, self.m = lm, feats, int(dp), int(num_microbatches)
        self.arrange = bool(arrange)
        self.grid = np.asarray([float(density)])
        self._cols: dict = {}       # (step, kind, layers) -> (fwd [dp, m], bwd [dp, m])
        self._steps: dict = {}      # (pp, layers) -> mean step seconds
        self.evaluations = 0

    def _costs(self, lay: PipelineLayout, step: int):
        keys = [(step, k, n) for k, n in zip(lay.kinds(), lay.layers)]
        if any(k not in self._cols for k in keys):
            c = UnitCosts.from_latency(self.lm.with_layout(lay), self.feats[step], self.dp,
                                       self.feats[step].num_units // self.dp, self.grid)
            for v, k in enumerate(keys):
                self._cols.setdefault(k, (c.fwd_s[:, :, v, 0].copy(), c.bwd_s[:, :, v, 0].copy()))
        f = np.stack([self._cols[k][0] for k in keys], axis=-1)     # [dp, m, nv]
        b = np.stack([self._cols[k][1] for k in keys], axis=-1)
        return f, b

    def microbatches(self, step: int) -> int:
        """Micro-batches per DP rank in ``step`` (dp_balanced's count varies by step)."""
        return self.feats[step].num_units // self.dp

    def step_s(self, lay: PipelineLayout) -> float:
        key = (lay.pp, lay.layers)
        if key not in self._steps:
            tot = 0.0
            for s in range(len(self.feats)):
                f, b = self._costs(lay, s)
                if self.arrange:
                    tot += float(arrange_slots(f, b, self.lm.p2p_s, pp=lay.pp)[1].max())
                    continue
                tot += float(pipeline_makespan_s(f, b, self.lm.p2p_s,
                                                 pp=lay.pp if lay.vp > 1 else None).max())
            self._steps[key] = tot / len(self.feats)
            self.evaluations += 1
        return self._steps[key]

    # --- the bound ------------------------------------------------------------------------
    def _affine(self, pp: int, vp: int, step: int):
        """Per unit: (fwd, bwd) seconds per layer [dp, m] and intercepts of the first, middle
        and last stage kinds, or None when the stage time is not affine in its layers."""
        nv = pp * vp
        n = max(self.lm.table_layout.layers) + 1     # above every table stage: no clamping
        cols = [self._costs(PipelineLayout(pp, vp, (n + i,) * nv), step) for i in range(3)]
        slope = [cols[1][p] - cols[0][p] for p in (0, 1)]            # [dp, m, nv] each
        if not all(np.allclose(cols[2][p] - cols[1][p], slope[p], rtol=1e-9, atol=1e-12)
                   for p in (0, 1)):
            return None
        if not all(np.allclose(slope[p], slope[p][:, :, :1], rtol=1e-9, atol=1e-12)
                   for p in (0, 1)):
            return None
        per_layer = [slope[p][:, :, 0] for p in (0, 1)]
        icpt = [cols[0][p] - n * slope[p] for p in (0, 1)]           # [dp, m, nv]
        return per_layer, icpt

    def lower_bound_s(self, num_layers: int, pp: int, vp: int) -> Optional[float]:
        """A proven lower bound on ``step_s`` of every layout of ``num_layers`` over pp x vp
        (module docstring); None when the latency model's stage time is not affine, or the
        micro-batches are arranged per layout."""
        if self.arrange:
            return None
        nv, p2p, total = pp * vp, float(self.lm.p2p_s), 0.0
        for s in range(len(self.feats)):
            aff = self._affine(pp, vp, s)
            if aff is None:
                return None
            (lf, lb), (fi, bi) = aff
            work_per_layer = (lf + lb).sum(axis=1)                   # [dp]
            icpt = (fi + bi).sum(axis=1)                             # [dp, nv]
            a = np.stack([icpt[:, [c * pp + r for c in range(vp)]].sum(axis=1)
                          for r in range(pp)], axis=1)               # [dp, pp]
            fill = np.zeros_like(a)                                  # pre + post intercepts
            for r in range(1, pp):
                fill[:, r] = (fi[:, 0, :r].sum(axis=1) + bi[:, -1, :r].sum(axis=1)
                              + 2 * r * p2p)
            prefix = (lf[:, 0] + lb[:, -1]) if vp == 1 else np.zeros(self.dp)   # [dp]
            total += _min_max_split(a + fill, work_per_layer, prefix, num_layers)
        return total / len(self.feats)


def _min_max_split(base: np.ndarray, per_layer: np.ndarray, prefix: np.ndarray, n: int) -> float:
    """min over integer k_0..k_{pp-1} >= 0 summing to n of max_r max_d (base[d, r] +
    k_r * per_layer[d] + (k_0 + ... + k_{r-1}) * prefix[d]): a dynamic program over the
    ranks with the layers placed so far as its state."""
    pp = base.shape[1]
    ks = np.arange(n + 1)
    best = np.full(n + 1, np.inf)     # best[S]: ranks r.. holding n - S layers, S before them
    best[n] = 0.0
    for r in range(pp - 1, -1, -1):
        new = np.full(n + 1, np.inf)
        for s in range(n + 1):
            k = ks[: n - s + 1]                                      # layers of rank r
            g = (base[:, r][:, None] + k[None, :] * per_layer[:, None]
                 + s * prefix[:, None]).max(axis=0)                  # [k]
            new[s] = float(np.min(np.maximum(g, best[s + k])))
        best = new
        if r == 0:
            return float(best[0])
    return float(best[0])


@dataclass
class SpaceSearch:
    """One vp's search: the layouts evaluated, fastest first, and what bounds them."""

    vp: int
    ranked: list = field(repr=False)      # [(step seconds, PipelineLayout)], fastest first
    lower_bound_s: Optional[float]
    starts: int
    excluded_memory: int
    exact: bool = False
    """Every layout of this vp was simulated: the best is the optimum (gap 0)."""
    evaluated: int = 0
    refused_microbatches: tuple = ()
    """Micro-batch counts of the packing's steps that Megatron's interleaved schedule refuses
    at this vp (``sim.pipeline.interleaved_refusal``): then nothing is searched."""

    def as_dict(self) -> dict:
        return {"vp": self.vp, "best_s": self.best_s, "best": self.ranked[0][1].describe()
                if self.ranked else None, "lower_bound_s": self.lower_bound_s,
                "gap_vs_bound": self.gap, "exact": self.exact, "starts": self.starts,
                "evaluated": self.evaluated, "excluded_memory": self.excluded_memory,
                "refused_microbatches": list(self.refused_microbatches)}

    @property
    def best_s(self) -> float:
        return self.ranked[0][0] if self.ranked else float("inf")

    @property
    def gap(self) -> Optional[float]:
        """Best found / proven lower bound - 1 (an upper bound on the true optimality gap; 0
        when the search was exhaustive)."""
        if self.exact and self.ranked:
            return 0.0
        if self.lower_bound_s is None or not self.ranked or self.lower_bound_s <= 0:
            return None
        return self.best_s / self.lower_bound_s - 1.0


def neighbours(lay: PipelineLayout) -> list:
    """Layouts one decoder layer away: moved between adjacent virtual stages, between chunks of
    the same rank, or to/from the first and last stages."""
    nv, pp, out, seen = lay.num_stages, lay.pp, [], set()
    for i in range(nv):
        if lay.layers[i] == 0:
            continue
        for j in {i - 1, i + 1, i - pp, i + pp, 0, nv - 1}:
            if j == i or not 0 <= j < nv:
                continue
            layers = list(lay.layers)
            layers[i] -= 1
            layers[j] += 1
            if tuple(layers) not in seen:
                seen.add(tuple(layers))
                out.append(PipelineLayout(lay.pp, lay.vp, tuple(layers)))
    return out


def search_space(ev: StepEvaluator, num_layers: int, pp: int, vp: int, *,
                 fits: Optional[Callable[[PipelineLayout], bool]] = None,
                 starts: Optional[Sequence[PipelineLayout]] = None, local_starts: int = 4,
                 max_evaluations: int = 600, enumerate_limit: int = 3000) -> SpaceSearch:
    """The layouts of one vp: all of them when there are at most ``enumerate_limit`` (then the
    best is the optimum: ``exact``); else every start, then a best-improvement local search from
    the best ``local_starts`` (one layer moved at a time) until no neighbour is faster or
    ``max_evaluations`` layouts were simulated. ``fits``: the memory check."""
    if vp > 1 and ev.m < pp:
        raise LayoutError(f"vp={vp} needs >= pp={pp} micro-batches per step (Megatron's "
                          f"interleaved schedule), got {ev.m}")
    refused = sorted({ev.microbatches(s) for s in range(len(ev.feats))
                      if vp > 1 and interleaved_refusal(ev.microbatches(s), pp)})
    if refused:   # a packing with a variable micro-batch count (dp_balanced) Megatron cannot
        # interleave: no layout of this vp runs it
        return SpaceSearch(vp, [], None, 0, 0, refused_microbatches=tuple(refused))
    if starts is None:
        starts = [c for c in candidate_layouts(num_layers, pp, (vp,)) if c.vp == vp]
    nv = pp * vp
    exact = math.comb(num_layers + nv - 1, nv - 1) <= enumerate_limit
    if exact:
        starts = [PipelineLayout(pp, vp, c) for c in compositions(num_layers, nv)]
    excluded: set = set()
    scored: dict = {}

    def score(lay):
        if lay.layers in scored or lay.layers in excluded:
            return scored.get(lay.layers)
        if fits is not None and not fits(lay):
            excluded.add(lay.layers)
            return None
        scored[lay.layers] = (ev.step_s(lay), lay)
        return scored[lay.layers]

    for lay in starts:
        score(lay)
    seeds = sorted(scored.values(), key=lambda x: x[0])[:local_starts]
    budget = len(scored) + max_evaluations
    for t, cur in ([] if exact else seeds):
        while len(scored) < budget:
            cand = [x for x in map(score, neighbours(cur)) if x is not None]
            nxt = min(cand, key=lambda x: x[0], default=None)
            if nxt is None or nxt[0] >= t * (1 - 1e-12):
                break
            t, cur = nxt
    ranked = sorted(scored.values(), key=lambda x: (x[0], x[1].layers))
    return SpaceSearch(vp, ranked, ev.lower_bound_s(num_layers, pp, vp), len(starts),
                       len(excluded), exact, len(scored))


def compositions(n: int, parts: int):
    """Every tuple of ``parts`` integers >= 0 summing to ``n``."""
    if parts == 1:
        yield (n,)
        return
    for k in range(n + 1):
        for rest in compositions(n - k, parts - 1):
            yield (k,) + rest
