"""A segment's cost for SAB from the latency model: what a document adds to a packed
micro-batch (``latency_sample_cost_fn``, SAB's LPT weight), and the per-stage costs of whole
packed micro-batches (what ``batching.slots`` simulates to place them).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import numpy as np


class LatencyCost:
    """A segment's cost from a ``LatencyModel`` at ``density`` (``latency_sample_cost_fn``):
    callable as a ``CostFn`` (seconds, fwd + bwd summed over the pipeline's virtual stages); with
    the per-stage costs of packed micro-batches SAB's slot arrangement simulates
    (``unit_costs``, ``batching.slots``)."""

    def __init__(self, model, density: float):
        self.full, self.model = model, model.without_call_costs()
        self.density = float(density)
        self.pp, self.num_stages = int(model.pp), int(model.num_stages)
        self.p2p_s = float(model.p2p_s)

    def _terms(self, model, units) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds [n, stages] of n units (lengths per unit, or CSR) at the density,
        their attention work counted once for all stages."""
        feats = model.unit_features(units)
        work = feats.attention_work(self.density)
        f = np.empty((feats.num_units, self.num_stages))
        b = np.empty((feats.num_units, self.num_stages))
        for s in range(self.num_stages):
            t = model.unit_terms(feats, s)
            f[:, s] = t.fwd_fixed_s + t.fwd_attn_s_per_pair * work
            b[:, s] = t.bwd_fixed_s + t.bwd_attn_s_per_pair * work
        return f, b

    def unit_costs(self, units) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds [n, stages] of whole packed micro-batches (lengths per unit, or
        CSR; their padding included), the kernels' calls with them, uncalibrated."""
        return self._terms(self.full, units)

    def scale(self, dp: int) -> np.ndarray:
        """[dp, stages] calibration factor of every (DP rank, virtual stage)."""
        return self.full.correction_grid(dp, self.pp)[:, np.arange(self.num_stages) % self.pp]

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        return self.priced(lengths)[0]

    def priced(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the costs [n] of these lengths (``__call__``), each one's index into the distinct
        lengths [n], the distinct lengths' costs [k]): each distinct length priced once, as the
        time of a micro-batch with it alone minus the empty one's, every virtual stage's,
        without the kernels' per-call costs (a micro-batch pays each call once, whatever its
        documents)."""
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        d, at = distinct_lengths(L)          # a step's 10^5 segments: 10^3 lengths
        f, b = self._terms(self.model, (np.r_[0, np.arange(1, d.size + 1), d.size]
                                        .astype(np.int64), d))
        per = ((f[:-1] - f[-1]) + (b[:-1] - b[-1])).sum(axis=1)
        return per[at], at, per


def distinct_lengths(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of the lengths ``L`` ascending, each length's index into them):
    ``np.unique(L, return_inverse=True)``, through a table of every length up to the longest
    where that is not much longer than ``L`` (no sort)."""
    if L.size == 0 or L.min() < 0 or L.max() > 4 * L.size + 65536:
        return np.unique(L, return_inverse=True)
    seen = np.zeros(int(L.max()) + 1, dtype=bool)
    seen[L] = True
    distinct = np.flatnonzero(seen)
    return distinct, (np.cumsum(seen) - 1)[L]


def latency_sample_cost_fn(model, density: float) -> LatencyCost:
    """SAB's ``CostFn`` from a ``LatencyModel`` at ``density`` (``LatencyCost``: a segment's
    seconds added to a packed micro-batch, ``LatencyCost.priced``)."""
    return LatencyCost(model, density)
