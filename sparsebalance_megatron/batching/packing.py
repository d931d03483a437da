"""Sparsity-aware batching (SAB) and the two baselines it is compared with (the rules:
docs/DESIGN.md section 6): ``sequential_plan`` (Megatron's fill, ``data/packing.sequential_pack``),
``token_balanced_plan`` and ``sab_plan``; each a ``BatchPlan`` of ``dp x num_microbatches``
micro-batches of at most ``max_tokens`` tokens from one global batch, ties in cost broken by a
permutation drawn from ``seed``. ``sab_assignment`` stops before the packing
(``batching.assignment``).

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from ..data.packing import check_bin_count
from .. import kernels
from .assignment import SABAssignment, sensitivity_key
from .plan import (BatchingError, BatchPlan, check_fits, check_int, check_long_sample_policy,
                   check_rank, checked_segments, finish_plan, split_long)
from .segments import take_runs
from .latency_cost import LatencyCost, latency_sample_cost_fn  # noqa: F401 (re-exported)
from .sensitivity import SensitivityTracker

CostFn = Callable[[np.ndarray], np.ndarray]   # [n] segment lengths -> [n] seconds


def prepare_samples(samples, dp, m, max_tokens, long_sample_policy):
    """(the segments' [n, 3] int64 array, their sizes [n], samples split), checked."""
    for name, v in (("dp", dp), ("num_microbatches", m), ("max_tokens", max_tokens)):
        check_int(name, v)
    arr = checked_segments(samples).array       # checked once for the step: only read here
    check_long_sample_policy(long_sample_policy)
    sizes = arr[:, 2] - arr[:, 1]
    n_split = 0
    if sizes.size and int(sizes.max()) > max_tokens:
        arr, n_split = split_long(arr, max_tokens, long_sample_policy)
        sizes = arr[:, 2] - arr[:, 1]
    check_fits(sizes, dp, m, max_tokens)
    return arr, sizes, n_split


def sample_costs(sizes: np.ndarray, cost_fn: Optional[CostFn]) -> tuple:
    """(each segment's cost [n], its tokens without ``cost_fn``; where ``cost_fn`` is a
    ``LatencyCost``, (each segment's index into the distinct sizes [n], their costs [k]): the
    distinct sizes priced once, ranked once (``assignment.cost_ranks``); else None)."""
    priced = None
    if cost_fn is None:
        return sizes.astype(np.float64), None
    if type(cost_fn) is LatencyCost:
        c, at, per = cost_fn.priced(sizes)          # every cost one of per's, each of those one
        priced = (at, per)
    else:
        c = np.asarray(cost_fn(sizes), dtype=np.float64).reshape(-1)
    if c.shape != sizes.shape or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"sample cost function returned {c.shape} values (finite >= 0 "
                         f"expected, one per segment: {sizes.size})")
    return c, priced


def sequential_plan(samples, *, dp: int, num_microbatches: int, max_tokens: int,
                    long_sample_policy: str = "split", rank: Optional[int] = None) -> BatchPlan:
    """Megatron's default packing: ``sequential_pack``'s bins (fill in order, a new bin when the
    next segment does not fit; bin k x dp + r is rank r's micro-batch k) as rows of the
    segments' array, each rank's tokens its cost (whole numbers: exact in any order). ``rank``:
    DP rank r's row alone, as a one-row plan (the whole plan's ``row_plan(r)``)."""
    if rank is not None:
        check_rank(rank, dp)
    arr, sizes, n_split = prepare_samples(samples, dp, num_microbatches, max_tokens,
                                          long_sample_policy)
    m = num_microbatches
    try:                                  # Megatron's fill rule, as sequential_pack applies it
        starts = kernels.packing.sequential_starts(sizes, max_tokens)
        check_bin_count(len(starts), sizes, max_tokens, dp, m)
    except ValueError as e:
        raise BatchingError(f"sequential packing: {e}") from None
    # rank r's bins r, dp + r, ...; past the last, an empty one (bin ``starts.size``)
    bins = np.minimum(np.arange(dp)[:, None] + dp * np.arange(m), starts.size)
    n = sizes.size
    items, counts = take_runs(np.arange(n), np.diff(np.r_[starts, n, n]),
                              bins if rank is None else bins[rank:rank + 1])
    return finish_plan(items, counts, "sequential", max_tokens, n_split, False, arr,
                       sizes.astype(np.float64))


def token_balanced_plan(samples, *, dp: int, num_microbatches: int, max_tokens: int,
                        long_sample_policy: str = "split", seed: int = 0) -> BatchPlan:
    """Length-aware baseline: balance token counts over ranks and micro-batches (each rank's
    cost: its tokens)."""
    arr, sizes, n_split = prepare_samples(samples, dp, num_microbatches, max_tokens,
                                          long_sample_policy)
    tokens = sizes.astype(np.float64)
    u = SABAssignment(arr, sizes, n_split, tokens, dp=dp, m=num_microbatches,
                      max_tokens=max_tokens, seed=seed,
                      key=lambda ids, lengths: np.zeros(lengths.size)).units()
    if not u.fits:              # Megatron's sequential bins, as they are (each rank's tokens)
        seq = sequential_plan(arr, dp=dp, num_microbatches=num_microbatches,
                              max_tokens=max_tokens)
        return replace(seq, method="token_balanced", num_split_samples=n_split, fallback=True)
    return finish_plan(u.items, u.counts, "token_balanced", max_tokens, n_split, False, arr,
                       tokens)


def sab_plan(samples, **kw) -> BatchPlan:
    """Sparsity-aware batching of one global batch: ``sab_assignment(samples, **kw).plan()``."""
    return sab_assignment(samples, **kw).plan()


def sab_assignment(samples, *, dp: int, num_microbatches: int, max_tokens: int,
                   cost_fn: Optional[CostFn] = None,
                   sensitivity: Optional[SensitivityTracker | Callable] = None,
                   long_sample_policy: str = "split", seed: int = 0, length_multiple: int = 0,
                   arrange: bool = True) -> SABAssignment:
    """``sab_plan``'s assignment of the segments to the DP ranks, before any rank packs its
    micro-batches (``assignment.SABAssignment``; ``plan()`` packs every rank's).

    samples: (sample_id, start, end) segments, or a [n] array of lengths; cost_fn: segment
    lengths -> predicted seconds (``latency_sample_cost_fn``; None = tokens, which reduces SAB to
    token balancing); sensitivity: a ``SensitivityTracker`` (or a callable (ids, lengths) -> [n]
    that prices each segment alone) whose estimates group the micro-batches; None = the length
    prior; length_multiple: the plan's ``length_multiple`` (``--sb-microbatch-multiple``: the
    padding its micro-batches are priced with); arrange: with a ``LatencyCost``, choose the
    micro-batches' slots and swap whole micro-batches between ranks on the simulated pipeline
    (``batching.slots``; False: cheapest micro-batches first and last, the others as cut).
    """
    arr, sizes, n_split = prepare_samples(samples, dp, num_microbatches, max_tokens,
                                          long_sample_policy)
    cost, priced = sample_costs(sizes, cost_fn)
    return SABAssignment(arr, sizes, n_split, cost, dp=dp, m=num_microbatches,
                         max_tokens=max_tokens, seed=seed, key=sensitivity_key(sensitivity),
                         cost_fn=cost_fn, arrange=arrange, length_multiple=length_multiple,
                         priced=priced)
