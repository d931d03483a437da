"""Unit costs over a density grid: the cost interface DST plans against.

A *unit* is one (dp_rank, micro-batch, pipeline stage). The latency model predicts each unit's
forward and backward seconds as a function of its attention density; DST needs that function at
many densities, so it is tabulated once per step on a small grid of densities (multiples of 1/64
between d_min and d_max, plus d0). On the grid, planning is exact table look-ups: no latency-model
calls inside the planning loop.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np

from .. import kernels
from ..kernels import f64
from ..kernels.records import unit_offsets
from ..latency.features import unit_rows
from ..sim.pipeline import pipeline_ranks

GRID_STEP = 1.0 / 64


def density_grid(d0: float, d_min: float, d_max: float) -> np.ndarray:
    """[g] sorted densities: multiples of ``GRID_STEP`` inside [d_min, d_max], plus d_min, d0,
    d_max."""
    check_density_bounds(d0, d_min, d_max)
    step = GRID_STEP
    k0 = int(np.ceil(d_min / step - 1e-9))
    k1 = int(np.floor(d_max / step + 1e-9))
    pts = [k * step for k in range(max(k0, 1), k1 + 1)]
    pts += [d_min, d0, d_max]
    grid = np.unique(np.round(np.asarray(pts, dtype=np.float64), 12))
    return grid[(grid >= d_min - 1e-12) & (grid <= d_max + 1e-12)]


def check_density_bounds(d0: float, d_min: float, d_max: float) -> None:
    """ValueError naming the flag when d0, d_min, d_max are not 0 < d_min <= d0 <= d_max <= 1."""
    for flag, v in (("--sb-density", d0), ("--sb-min-density", d_min),
                    ("--sb-max-density", d_max)):
        if not isinstance(v, (int, float, np.floating)) or not (0.0 < float(v) <= 1.0):
            raise ValueError(f"{flag}={v!r}: expected a number in (0, 1]")
    if not (d_min <= d0 <= d_max):
        raise ValueError(f"--sb-density={d0!r}: expected d_min <= d0 <= d_max with "
                         f"--sb-min-density={d_min!r}, --sb-max-density={d_max!r}")


@dataclass
class UnitCosts:
    """Predicted seconds of every unit at every grid density.

    densities: [g] ascending grid; fwd_s, bwd_s: [dp, m, pp, g] seconds; the stage axis holds the
    pipeline's *virtual* stages (``v = chunk * pipeline_ranks + rank``) when ``pipeline_ranks``
    is given and smaller (Megatron's interleaved schedule), else one stage per rank.
    attn_work: [dp, m, pp] dense attention work of each unit, all its layers together (kept
    block pairs at density 1 x the stage's decoder layers, or anything proportional); the
    weights of every mean density, so a density is weighted by layers x attention work.
    dense_work: optional [dp, m, pp] work (same unit as attn_work) of the documents routed to the
    dense kernel: counted at density 1 in every mean density, whatever the plan (None: no
    routing).
    unit_docs: optional (offsets [dp * m + 1], lengths [docs], tokens [dp * m], sparse [docs])
    of every micro-batch's documents (padding left out): their lengths, each micro-batch's tokens
    and which documents run sparse (the others are routed dense). The quality model weighs a
    unit's loss change by them (``quality_bound.bind_quality``); None: every unit alike.
    kept_grid: optional [dp, m, g] block pairs the attention keeps of each micro-batch at each
    grid density (``UnitFeatures.kept_grid``), non-decreasing along the grid; where two
    densities of a unit keep as many, they keep the same blocks at the same cost. With it a
    plan's densities are its effective ones (``effective_index``); None: taken as given.

    Costs are made non-decreasing in density (a running max over the grid), so that cutting can
    never make a unit slower; a latency table's interpolation noise would otherwise break that.
    """

    densities: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    attn_work: np.ndarray
    pipeline_ranks: Optional[int] = None
    dense_work: Optional[np.ndarray] = None
    kept_grid: Optional[np.ndarray] = None
    unit_docs: Optional[tuple] = None
    # ``effective_index``'s tables by d0's grid index, made on first use
    _effective: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # the tables are already known finite, >= 0 and non-decreasing (``from_latency`` proves it
    # from its inputs, a few thousand numbers, instead of the tables' millions)
    tables_checked: bool = field(default=False, repr=False, compare=False)
    # fwd_s + bwd_s [dp, m, pp, g], given where the maker has it already (``from_latency``'s
    # compiled pass), else made here; and the tables' own formula, where the maker has it:
    # (work [n, g], per_pair [2, stages], fixed [2, n, stages], correction [n, stages],
    # scaled), ``kernels.grid.unit_seconds``' operands, from which the descent computes a unit's
    # seconds (a few small arrays that stay in the cache) instead of reading the tables. Both
    # are kept only with tables_checked (the tables are kept as made, so they stay theirs)
    total_s: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    formula: Optional[tuple] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        g = np.asarray(self.densities, dtype=np.float64)
        if g.ndim != 1 or g.size < 1 or np.any(np.diff(g) <= 0):
            raise ValueError(f"densities must be a strictly increasing [g] grid, got {g!r}")
        if g[0] <= 0 or g[-1] > 1:
            raise ValueError(f"grid densities must lie in (0, 1], got [{g[0]}, {g[-1]}]")
        f = np.asarray(self.fwd_s, dtype=np.float64)
        b = np.asarray(self.bwd_s, dtype=np.float64)
        if f.ndim != 4 or f.shape[-1] != g.size or b.shape != f.shape:
            raise ValueError(f"fwd_s {f.shape} and bwd_s {b.shape} must both be [dp, m, pp, g] "
                             f"with g={g.size}")
        if min(f.shape) < 1:
            raise ValueError(f"fwd_s shape {f.shape}: every axis must be >= 1")
        for name, a in (("fwd_s", f), ("bwd_s", b)) if not self.tables_checked else ():
            lo, hi = a.min(), a.max()                  # NaN propagates into both
            if not (lo >= 0 and hi < np.inf):
                raise ValueError(f"{name} must be finite seconds >= 0 (min={np.nanmin(a)!r})")
        self.pipeline_ranks = pipeline_ranks(self.pipeline_ranks, f.shape[2], "pipeline_ranks")
        self.densities = g
        self.fwd_s = f if self.tables_checked else _non_decreasing(f)
        self.bwd_s = b if self.tables_checked else _non_decreasing(b)
        if not (self.tables_checked and self.total_s is not None
                and self.total_s.shape == f.shape):
            self.total_s = self.fwd_s + self.bwd_s
        if not self.tables_checked:
            self.formula = None
        for name in ("attn_work", "dense_work"):
            if getattr(self, name) is not None:
                w = np.asarray(getattr(self, name), dtype=np.float64)
                if w.shape != f.shape[:3] or np.any(~np.isfinite(w)) or np.any(w < 0):
                    raise ValueError(f"{name} must be [dp, m, pp]={f.shape[:3]} finite >= 0, "
                                     f"got shape {w.shape}")
                setattr(self, name, w)
        if self.kept_grid is not None:
            k = np.asarray(self.kept_grid, dtype=np.float64)
            if k.shape != f.shape[:2] + (g.size,) or not np.all(np.isfinite(k)) \
                    or np.any(np.diff(k, axis=-1) < 0):
                raise ValueError(f"kept_grid must be [dp, m, g]={f.shape[:2] + (g.size,)} "
                                 f"finite and non-decreasing along the grid, got shape {k.shape}")
            self.kept_grid = k

    @property
    def shape(self) -> Tuple[int, int, int]:
        return tuple(self.fwd_s.shape[:3])

    @property
    def vp(self) -> int:
        """Model chunks per pipeline rank (1: no interleaving)."""
        return self.fwd_s.shape[2] // self.pipeline_ranks

    def index_of(self, density: float) -> int:
        """Grid index of a density that is on the grid (ValueError otherwise)."""
        i = int(np.argmin(np.abs(self.densities - density)))
        if abs(self.densities[i] - density) > 1e-9:
            raise ValueError(f"density {density!r} is not on the cost grid "
                             f"[{self.densities[0]}, ..., {self.densities[-1]}]")
        return i

    def grid_index(self, densities) -> np.ndarray:
        """Indices of the nearest grid density at or above each density (the top one above)."""
        d, g = np.asarray(densities, dtype=np.float64), self.densities
        return np.minimum(np.searchsorted(g, d - 1e-12), g.size - 1)

    def effective_index(self, idx: np.ndarray, i0: int) -> np.ndarray:
        """Grid indices ``idx`` [..., dp, m, pp] of plans, each unit moved to the index nearest
        ``i0`` (d0's) that keeps the blocks ``idx`` keeps (``kept_grid``) at the same seconds:
        a raise to the lowest density that keeps its blocks, a cut to the highest, and a move
        that keeps what d0 keeps back to d0 (why: docs/DESIGN.md section 5, issue 62). ``idx``
        itself without ``kept_grid``. A cut moves up only where its seconds are the same (one
        that keeps as many document blocks but less padding saves time: it stays)."""
        idx = np.asarray(idx)
        if self.kept_grid is None:
            return idx
        if i0 not in self._effective:
            near, rows = self._nearest_same_blocks(int(i0))
            whole = None                 # a small slice (a DP rank's): every (unit, index)'s
            if self.fwd_s.size <= 1 << 15:              # answer made once, then one gather
                g = self.densities.size
                every = self._moved(np.arange(g).reshape(g, 1, 1, 1) + np.zeros(
                    self.shape, dtype=np.int64), near, rows)               # [g, dp, m, pp]
                whole = (np.ascontiguousarray(np.moveaxis(every, 0, -1)).reshape(-1),
                         np.arange(0, self.fwd_s.size, g).reshape(self.shape))
            self._effective[i0] = (near, rows, whole)
        near, rows, whole = self._effective[i0]
        return self._moved(idx, near, rows) if whole is None else whole[0].take(whole[1] + idx)

    def _moved(self, idx: np.ndarray, near: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``effective_index`` from ``_nearest_same_blocks``' (a unit's answer: its index's)."""
        to = near.take(rows + idx)                   # [..., dp, m, pp] like idx
        flat_to = to.reshape(-1)
        flat_idx = (idx if idx.shape == to.shape else np.broadcast_to(idx, to.shape)).reshape(-1)
        # a raise comes down as it is (it costs no more); a cut goes up only to the same seconds
        up = np.flatnonzero(flat_to > flat_idx)
        if up.size:
            n = self.fwd_s.size // self.densities.size           # units: dp x m x pp
            unit = (up % n) * self.densities.size                # each one's row, flat
            old, new = flat_idx.take(up), flat_to.take(up)
            differ = np.zeros(up.size, dtype=bool)
            for t in (self.fwd_s, self.bwd_s):
                flat = t.reshape(-1)
                differ |= flat.take(unit + new) != flat.take(unit + old)
            flat_to[up[differ]] = old[differ]
        return to

    def _nearest_same_blocks(self, i0: int) -> tuple:
        """(flat [dp * m * g]: for each (DP rank, micro-batch) and grid index, the index nearest
        ``i0`` that keeps as many blocks, the (DP rank, micro-batch) rows' offsets in it
        [dp, m, 1])."""
        k = self.kept_grid                                          # [dp, m, g]
        g = k.shape[-1]
        at = np.arange(g, dtype=np.int64)
        new = np.ones(k.shape, dtype=bool)                          # a run of equal counts starts
        new[..., 1:] = k[..., 1:] != k[..., :-1]
        first = np.maximum.accumulate(np.where(new, at, 0), axis=-1)
        end = np.ones(k.shape, dtype=bool)                          # ... or ends
        end[..., :-1] = new[..., 1:]
        last = np.minimum.accumulate(np.where(end, at, g - 1)[..., ::-1], axis=-1)[..., ::-1]
        near = np.where(at > i0, np.maximum(first, i0), np.where(at < i0, np.minimum(last, i0), at))
        return np.ascontiguousarray(near, dtype=np.int64).reshape(-1), \
            np.arange(0, near.size, g, dtype=np.int64).reshape(k.shape[:2] + (1,))

    def at(self, idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """fwd_s, bwd_s [dp, m, pp] at grid indices idx [dp, m, pp] (one flat gather each)."""
        i = np.asarray(idx)
        g = self.densities.size
        if i.shape != self.shape or i.dtype.kind not in "iu" or not 0 <= i.min() <= i.max() < g:
            raise IndexError(f"grid indices of shape {i.shape}: expected {self.shape} integers "
                             f"in [0, {g})")
        at = unit_offsets(i.shape, g) + i
        return self.fwd_s.reshape(-1).take(at), self.bwd_s.reshape(-1).take(at)

    @classmethod
    def from_latency(cls, model, mb_doc_lengths, dp: int, num_microbatches: int,
                     densities: np.ndarray, calibrated: bool = True,
                     kept_units=None, rank: Optional[int] = None,
                     rank_units: bool = False) -> "UnitCosts":
        """Tabulate a ``latency.LatencyModel`` for one step on its layout's (virtual) stages.

        mb_doc_lengths: dp * m length arrays, rank-major (``BatchPlan.flat_lengths()``), or a
        ``UnitFeatures`` of them. ``kept_units``: the same units' documents without their padding
        (``BatchPlan.unit_csr()``), whose kept blocks make ``kept_grid`` (padding costs time, but a
        move that keeps only more padding blocks buys nothing; None: the units' own blocks).
        ``rank``: DP rank r's [1, m, stages] costs alone (its units of the dp x m given, or with
        ``rank_units`` the m given are its own), calibrated as rank r. With ``calibrated``, rank r's
        times are scaled by its correction and its pipeline rank's (``correction_grid``: virtual
        stage v runs on pipeline rank v mod pp). attn_work: kept block pairs at density 1 x the
        stage's attention layers (``layout.attention_layers``) of the sparse path's documents,
        ``dense_work`` that of the routed ones (``dense_below_tokens``).
        """
        g = np.asarray(densities, dtype=np.float64)
        m, rows = int(num_microbatches), dp
        if rank is not None:
            if not 0 <= rank < dp:
                raise ValueError(f"rank {rank!r}: expected a DP rank in [0, {dp})")
            if not rank_units:
                mb_doc_lengths = unit_rows(mb_doc_lengths, rank * m, (rank + 1) * m, dp * m)
                kept_units = None if kept_units is None else \
                    unit_rows(kept_units, rank * m, (rank + 1) * m, dp * m)
            rows = 1
        feats = model.unit_features(mb_doc_lengths)
        n, pp = feats.num_units, model.num_stages
        if n != rows * m:
            raise ValueError(f"{n} micro-batches given: expected dp x m = {dp} x {m} = {dp * m}")
        with_dense = feats.work_grid(np.append(g, 1.0))              # [n, g + 1]
        work, dense = np.ascontiguousarray(with_dense[:, :-1]), with_dense[:, -1]
        ranks = model.layout.pp
        corr = model.correction_grid(dp, ranks) if calibrated else np.ones((dp, ranks))
        if rank is not None:
            corr = corr[rank:rank + 1]
        corr = np.repeat(corr, m, axis=0)[:, np.arange(pp) % ranks]  # [n, stages] unit's rank
        terms = [model.unit_terms(feats, s) for s in range(pp)]
        fixed = np.stack([np.stack([t.fwd_fixed_s for t in terms], axis=1),
                          np.stack([t.bwd_fixed_s for t in terms], axis=1)])   # [2, n, stages]
        per_pair = np.asarray([[t.fwd_attn_s_per_pair for t in terms],
                               [t.bwd_attn_s_per_pair for t in terms]], np.float64)
        fb, total = np.empty((2, n, pp, g.size)), np.empty((n, pp, g.size))
        # (work x per_pair + fixed) x correction (x 1.0 is exact: left out), and their total
        formula = (work, f64(per_pair), f64(fixed), f64(corr), not bool(np.all(corr == 1.0)))
        kernels.grid.unit_tables(*formula, fb, total)
        f, b = fb.reshape(2, rows, m, pp, g.size)
        # finite, >= 0 and non-decreasing along the grid when every factor is finite and >= 0
        # and the work is non-decreasing (rounding is monotone); the largest entry is the last
        checked = bool(np.all(work[:, 1:] >= work[:, :-1]) and np.all(work >= 0)
                       and np.all(np.isfinite(corr)) and np.all(corr >= 0)
                       and all(np.all(np.isfinite(x)) and np.all(x >= 0)
                               for x in (fixed, per_pair)) and np.all(np.isfinite(fb[..., -1])))
        dense = dense.reshape(rows, m)
        layers = np.asarray(model.layout.attention_layers, dtype=np.float64)
        routed = None if not model.dense_below_tokens else \
            feats.dense_work.reshape(rows, m)[:, :, None] * layers[None, None, :]
        docs = feats
        if kept_units is not None:
            docs = model.unit_features(kept_units)
            if docs.num_units != n:
                raise ValueError(f"kept_units has {docs.num_units} micro-batches: expected "
                                 f"{n}, those of mb_doc_lengths")
            kept = docs.kept_grid(g)                                 # [n, g] documents only
        else:
            kept = work if feats.work_mode == "kept" else feats.kept_grid(g)
        lengths = np.asarray(docs.lengths, dtype=np.int64)
        unit_docs = (np.asarray(docs.offsets, dtype=np.int64), lengths,
                     np.asarray(docs.tokens, dtype=np.float64),
                     lengths >= max(int(model.dense_below_tokens or 0), 1))
        return cls(g, f, b, dense[:, :, None] * layers[None, None, :],
                   pipeline_ranks=model.layout.pp, dense_work=routed,
                   kept_grid=kept.reshape(rows, m, g.size), unit_docs=unit_docs,
                   tables_checked=checked,
                   total_s=total.reshape(rows, m, pp, g.size), formula=formula)


def _non_decreasing(a: np.ndarray) -> np.ndarray:
    """Running max over the last axis (a itself when it is already non-decreasing: the common
    case, and much cheaper to check than to accumulate)."""
    if a.shape[-1] < 2 or bool(np.all(a[..., 1:] >= a[..., :-1])):
        return a
    return np.maximum.accumulate(a, axis=-1)
