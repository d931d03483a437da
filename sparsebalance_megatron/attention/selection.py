"""Budgeted key-block selection: cheap block scores -> estimated mass shares -> kept blocks.

For every query block of every document and every key/value head (GQA group) this picks the key
blocks the sparse kernels will compute. Key blocks are scored causally and inside the document
only; a softmax over the key blocks turns scores into an estimated attention-mass share.
Estimators (pluggable, ``ESTIMATORS``):

- ``maxkey`` (default): mean-pooled query block . every key, max over the keys of each key block
  (cost ~ 1/block_size of dense attention); on CUDA one Triton kernel (``maxkey_triton``), else
  PyTorch over chunks of query blocks planned once per micro-batch;
- ``pooled``: mean-pooled query block . mean-pooled key block (cheaper, less accurate).

GQA: shares are computed per query head and averaged over the query heads of a group, so one
selection serves the group. The diagonal block, the first ``sink_blocks`` blocks of the document
and ``local_blocks`` blocks before the diagonal are always kept; the rest is filled by density
(top-k, k = ceil(density * available), ``kept_count``) or by an estimated-mass threshold clipped
to [min_density, max_density]; a threshold of 1.0 keeps every allowed block up to max_density.
Selection is never differentiated.

Robust to what the scores cannot be trusted with: shares are sanitised before ranking (NaN -> 0,
clamped to [0, 1], 0 outside the causal in-document blocks), so a NaN or inf in q or k can
neither displace a forced block (ranked by index-derived offsets above any share) nor bring in
a future or other-document block (ranked below every allowed block).

No device value is read back on the host here: the kept-count bounds that size the tensors come
from the layout and the density on the host (``kept_bounds``, once per micro-batch and density).
Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from .blocks import BlockLayout

# Elements of the largest score tensor built at once by the PyTorch maxkey (bounds its memory).
_SCORE_BUDGET = 1 << 25
# Relative tolerance of the kept count: a density within 1e-6 (relative to 1) above m / available
# keeps m blocks. It absorbs float64 noise (ceil(0.7 * 10) = 8) and float32 storage (a float32
# 0.3 is 0.30000001: ceil(3.0000001) would keep 4 of 10 where the float 0.3 keeps 3), and is
# far below any density step a plan uses.
_DENSITY_RTOL = 1e-6


SELECTION_RANGE = "sparsebalance::selection"


def selection_range():
    """A profiler range ``SELECTION_RANGE`` around a layer's selection and lists while a profiler
    records (traces attribute the kernels inside to them); else nothing (~15 us of host saved)."""
    return (torch.profiler.record_function(SELECTION_RANGE)
            if torch._C._autograd._profiler_enabled() else contextlib.nullcontext())


@dataclass
class KeptBounds:
    """Host-side bounds of the kept count of every query block (over KV groups).

    ``lo[i] <= kv_num[g, i] <= hi[i]``; equal in ``density`` mode, where the count depends only
    on the layout and the density. ``kmax = max(hi)`` sizes ``kv_indices``."""

    lo: np.ndarray
    hi: np.ndarray
    memo: dict = field(default_factory=dict, repr=False)

    @property
    def kmax(self) -> int:
        return int(self.hi.max())


@dataclass
class BlockSelection:
    """Kept key blocks of every (KV head, query block), plus per-document statistics.

    ``kv_indices[g, i, :kv_num[g, i]]`` are the global key-block indices kept for query block
    ``i`` and KV head ``g`` (all in the same document, at or before ``i``). Slot 0 is always the
    diagonal block ``i``; slots past ``kv_num`` also hold ``i`` and must be ignored.
    """

    layout: BlockLayout
    kv_indices: torch.Tensor    # [ng, NB, K] long, K = bounds.kmax
    kv_num: torch.Tensor        # [ng, NB] long
    shares: torch.Tensor        # [ng, NB, NB] float32 estimated mass share (0 where not allowed)
    density_kept: torch.Tensor  # [ndoc] float32: kept blocks / causal blocks
    recall: torch.Tensor        # [ndoc] float32: estimated mass share of the kept blocks
    bounds: Optional[KeptBounds] = None

    def block_mask(self) -> torch.Tensor:
        """[ng, NB, NB] bool: True where key block j is kept for query block i."""
        ng, nb, kmax = self.kv_indices.shape
        valid = torch.arange(kmax, device=self.kv_num.device) < self.kv_num[..., None]
        mask = torch.zeros(ng, nb, nb, dtype=torch.bool, device=self.kv_num.device)
        mask.scatter_(2, self.kv_indices, valid)
        # padding slots point at the diagonal, which is always kept: scatter of False there is
        # overwritten only if it came last, so set the diagonal explicitly.
        mask.diagonal(dim1=1, dim2=2).fill_(True)
        return mask


def forced_blocks(layout: BlockLayout, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """[NB, NB] bool: always-kept blocks (diagonal, document sinks, local window)."""
    key = ("forced", sink_blocks, local_blocks)
    if key not in layout.memo:
        loc = layout.block_local
        kb_local = loc[None, :]
        forced = (kb_local < sink_blocks) | (kb_local >= loc[:, None] - local_blocks)
        layout.memo[key] = forced & layout.allowed()
    return layout.memo[key]


def kept_count(frac, avail):
    """``ceil((frac - _DENSITY_RTOL) * avail)`` in float64: the one rounding of a density (or a
    density bound) to a block count, on the host (``avail`` a numpy array -> int64 array) and on
    the device (``avail`` a tensor -> long tensor) with the same arithmetic, so the host-side
    bounds and the device counts agree, and a density gives the same count whether it arrives
    as a Python float or a float32/float64 tensor."""
    if isinstance(avail, torch.Tensor):
        return torch.ceil((frac - _DENSITY_RTOL) * avail.double()).long()
    frac = np.asarray(frac, dtype=np.float64)
    return np.ceil((frac - _DENSITY_RTOL) * avail.astype(np.float64)).astype(np.int64)


def kept_bounds(layout: BlockLayout, density_host: List[float], *, sink_blocks: int = 1,
                local_blocks: int = 0, selection_mode: str = "density",
                min_density: float = 0.125, max_density: float = 1.0) -> KeptBounds:
    """Bounds of the kept count per query block, from the layout and density on the host.

    Computed once per micro-batch and density (memoised on the layout); the device formulas in
    ``select_from_shares`` give counts inside them (exactly them in ``density`` mode).
    """
    key = ("bounds", tuple(density_host), sink_blocks, local_blocks, selection_mode,
           min_density, max_density)
    if key in layout.memo:
        return layout.memo[key]
    loc = layout.block_local_host.astype(np.int64)
    avail = loc + 1
    # forced = sinks [0, min(sink, l+1)) U window [max(0, l - local), l]
    sink = np.minimum(sink_blocks, avail)
    win_lo = np.maximum(0, loc - local_blocks)
    n_forced = (loc - win_lo + 1) + sink - np.maximum(0, sink - win_lo)
    if selection_mode == "density":
        dens = np.asarray(density_host, dtype=np.float64)[
            np.repeat(np.arange(layout.num_docs), np.diff(layout.doc_block_start))]
        k = np.maximum(kept_count(dens, avail), 1)
        lo = hi = np.minimum(np.maximum(k, n_forced), avail)
    else:
        lo = np.minimum(np.maximum(kept_count(min_density, avail), n_forced), avail)
        hi = np.minimum(np.maximum(kept_count(max_density, avail), n_forced), avail)
    out = KeptBounds(lo, hi)
    layout.memo[key] = out
    return out


def block_query_sums(q_blk: torch.Tensor) -> torch.Tensor:
    """q_blk [ng, NB, rep, B, hn] (zeros in padding) -> sum over each block's tokens
    [ng, NB, rep, hn] float32 (the estimators divide by the real length)."""
    return q_blk.sum(dim=3, dtype=torch.float32)


def query_block_sums_padded(q_pad: torch.Tensor, layout: BlockLayout,
                            num_groups: int) -> torch.Tensor:
    """q_pad [P, np, hn] (padded layout) -> sum over each block's tokens [ng, NB, rep, hn]
    (float32, a permuted view; summed in float32 without a float copy of q)."""
    nb, bs = layout.num_blocks, layout.block_size
    _, nh, hn = q_pad.shape
    s = q_pad[:nb * bs].view(nb, bs, num_groups, nh // num_groups, hn).sum(
        dim=1, dtype=torch.float32)
    return s.permute(1, 0, 2, 3)


def _mean(qsum, layout):
    return qsum / _block_len_f(layout).view(1, -1, 1, 1)


def _block_len_f(layout: BlockLayout) -> torch.Tensor:
    if "block_len_f" not in layout.memo:
        layout.memo["block_len_f"] = layout.block_len.to(torch.float32)
    return layout.memo["block_len_f"]


def _disallowed(layout: BlockLayout) -> torch.Tensor:
    if "disallowed" not in layout.memo:
        nb = layout.num_blocks
        layout.memo["disallowed"] = ~layout.allowed().view(1, nb, 1, nb)
    return layout.memo["disallowed"]


def _maxkey_chunks(layout: BlockLayout, ng: int, rep: int) -> list:
    """(i0, i1, kb0) chunks of query blocks whose score tensor fits ``_SCORE_BUDGET``."""
    key = ("maxkey_chunks", ng, rep)
    if key in layout.memo:
        return layout.memo[key]
    nb, bs = layout.num_blocks, layout.block_size
    local = layout.block_local_host
    chunks, i0 = [], 0
    while i0 < nb:
        kb0 = i0 - int(local[i0])
        i1 = i0 + 1
        while i1 < nb and ng * (i1 + 1 - i0) * rep * (i1 + 1 - kb0) * bs <= _SCORE_BUDGET \
                and i1 + 1 - i0 <= 64:
            i1 += 1
        chunks.append((i0, i1, kb0))
        i0 = i1
    layout.memo[key] = chunks
    return chunks


def _maxkey_scores_torch(qbar, keys, layout):
    """qbar [ng, NB, rep, hn] f32, keys [ng, NB*B, hn] -> max over each key block's real keys of
    qbar . key, [ng, NB, rep, NB] f32 (-inf outside the chunk's key span)."""
    ng, nb, rep, hn = qbar.shape
    bs = layout.block_size
    tok = torch.arange(bs, device=qbar.device)
    key_pad = tok[None, :] >= layout.block_len[:, None]                 # [NB, B]
    scores = torch.full((ng, nb, rep, nb), float("-inf"), device=qbar.device)
    for i0, i1, kb0 in _maxkey_chunks(layout, ng, rep):
        span = i1 - kb0
        qc = qbar[:, i0:i1].reshape(ng, (i1 - i0) * rep, hn)
        kc = keys[:, kb0 * bs:i1 * bs].float()
        s = torch.bmm(qc, kc.transpose(1, 2)).view(ng, i1 - i0, rep, span, bs)
        s.masked_fill_(key_pad[kb0:i1].view(1, 1, 1, span, bs), float("-inf"))
        scores[:, i0:i1, :, kb0:i1] = s.amax(dim=-1)
    return scores


def _maxkey_shares(qsum, keys, layout, softmax_scale):
    from . import maxkey_triton
    if maxkey_triton.usable(keys, layout.block_size):
        s = maxkey_triton.maxkey_scores(qsum, keys, layout, softmax_scale)
    else:
        s = _maxkey_scores_torch(_mean(qsum, layout), keys, layout) * softmax_scale
    s.masked_fill_(_disallowed(layout), float("-inf"))
    return torch.softmax(s, dim=-1).mean(dim=2)


def _pooled_shares(qsum, keys, layout, softmax_scale):
    ng, nb, rep, hn = qsum.shape
    qbar = _mean(qsum, layout)
    kbar = keys.unflatten(1, (nb, layout.block_size)).sum(dim=2, dtype=torch.float32) \
        / _block_len_f(layout).view(1, -1, 1)
    s = torch.bmm(qbar.reshape(ng, nb * rep, hn), kbar.transpose(1, 2)).view(ng, nb, rep, nb)
    s = s * softmax_scale
    s.masked_fill_(_disallowed(layout), float("-inf"))
    return torch.softmax(s, dim=-1).mean(dim=2)


ESTIMATORS: Dict[str, Callable] = {"maxkey": _maxkey_shares, "pooled": _pooled_shares}


def shares_from_block_sums(qsum: torch.Tensor, keys: torch.Tensor, layout: BlockLayout,
                           estimator: str, softmax_scale: float) -> torch.Tensor:
    """Estimated shares from each block's query sums ``[ng, NB, rep, hn]`` (float32) and the
    keys of the padded layout ``[ng, NB*B, hn]`` (any strides, zeros in padding) ->
    ``[ng, NB, NB]`` float32."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: expected one of {', '.join(ESTIMATORS)}")
    with torch.no_grad():
        return ESTIMATORS[estimator](qsum, keys, layout, softmax_scale)


def estimate_block_shares(q_blk: torch.Tensor, k_blk: torch.Tensor, layout: BlockLayout,
                          estimator: str, softmax_scale: float) -> torch.Tensor:
    """Estimated attention-mass share of every key block, per KV group.

    q_blk ``[ng, NB, rep, B, hn]``, k_blk ``[ng, NB, B, hn]`` (padded layout, zeros in padding)
    -> ``[ng, NB, NB]`` float32; each row sums to 1 over its causal in-document key blocks.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: expected one of {', '.join(ESTIMATORS)}")
    with torch.no_grad():
        return shares_from_block_sums(block_query_sums(q_blk), k_blk.flatten(1, 2), layout,
                                      estimator, softmax_scale)


def _budget_tensors(layout: BlockLayout, bounds: KeptBounds, density: torch.Tensor, ng: int,
                    sink_blocks: int, local_blocks: int, selection_mode: str,
                    min_density: float, max_density: float) -> dict:
    """What the selection needs besides the shares, per micro-batch and budget (memoised on the
    bounds, which are memoised on the layout): no layer recomputes it."""
    key = ("tensors", ng)
    if key in bounds.memo:
        return bounds.memo[key]
    nb, dev = layout.num_blocks, layout.block_doc.device
    kmax = bounds.kmax
    allowed = layout.allowed()
    forced = forced_blocks(layout, sink_blocks, local_blocks)
    avail = layout.block_available()                                   # [NB]
    n_forced = forced.sum(dim=-1)                                      # [NB]
    # priority = sanitised shares (in [0, 1], 0 where not allowed) + base, decided by index:
    # the diagonal in [4, 5] (kernels rely on slot 0 being the diagonal), the other forced
    # blocks in [2, 3], the other allowed blocks in [0, 1] by share, disallowed ones at -1
    base = torch.where(forced, 2.0, torch.where(allowed, 0.0, -1.0))
    base.diagonal().add_(2.0)

    t = dict(base=base, avail=avail,
             diag=torch.arange(nb, device=dev).view(1, nb, 1).expand(ng, nb, kmax),
             slots=torch.arange(kmax, device=dev))
    doc = layout.block_doc
    t["avail_doc"] = torch.zeros(layout.num_docs, dtype=torch.float64, device=dev).index_add_(
        0, doc, avail.double() * ng)
    t["nblk_doc"] = torch.zeros(layout.num_docs, dtype=torch.float64, device=dev).index_add_(
        0, doc, torch.full((nb,), float(ng), dtype=torch.float64, device=dev))
    if selection_mode == "density":
        k = kept_count(density[doc], avail).clamp(min=1)
        k = torch.minimum(torch.maximum(k, n_forced), avail)           # [NB]
        t["kv_num"] = k.view(1, nb).expand(ng, nb).contiguous()
        t["slot_valid"] = t["slots"] < t["kv_num"][..., None]           # [ng, NB, K]
        kept = torch.zeros(layout.num_docs, dtype=torch.float64, device=dev).index_add_(
            0, doc, t["kv_num"].double().sum(dim=0))
        t["density_kept"] = (kept / t["avail_doc"]).float()
    else:
        t["lo"] = torch.maximum(kept_count(min_density, avail), n_forced)
        t["hi"] = torch.minimum(torch.maximum(kept_count(max_density, avail), n_forced), avail)
        t["hi_kv"] = t["hi"].view(1, nb).expand(ng, nb).contiguous()   # threshold 1.0
    bounds.memo[key] = t
    return t


def sanitize_shares(shares: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[ng, NB, NB]`` shares as the selection ranks them: NaN -> 0, +inf -> 1, clamped to
    [0, 1], 0 outside the causal in-document blocks. Finite estimator output is unchanged (a
    softmax is already in [0, 1] and 0 where masked); a NaN or inf from q or k cannot outrank a
    forced block or lift a disallowed one."""
    nb = layout.num_blocks
    return (shares.nan_to_num(nan=0.0, posinf=1.0, neginf=0.0).clamp_(0.0, 1.0)
            .masked_fill_(_disallowed(layout).view(nb, nb), 0.0))


def select_from_shares(shares: torch.Tensor, layout: BlockLayout, density: torch.Tensor, *,
                       sink_blocks: int = 1, local_blocks: int = 0,
                       selection_mode: str = "density", mass_threshold: float = 0.9,
                       min_density: float = 0.125, max_density: float = 1.0,
                       density_host: Optional[List[float]] = None) -> BlockSelection:
    """Turn estimated shares ``[ng, NB, NB]`` into kept blocks under the budget.

    ``density`` is ``[ndoc]`` (float, in (0, 1]). In ``density`` mode every query block keeps
    ``max(ceil(density * available), forced)`` blocks; in ``mass`` mode the fewest blocks whose
    estimated share reaches ``mass_threshold``, clipped to
    ``[ceil(min_density * available), ceil(max_density * available)]`` (never below the forced
    blocks); a threshold of 1.0 keeps every allowed block up to ``max_density``. Counts round
    by ``kept_count``. Shares are sanitised first (``sanitize_shares``): the forced blocks are
    kept and no disallowed block is chosen whatever the shares hold; ``selection.shares`` and the
    statistics use the sanitised shares. ``density_host``: the same densities as a host list
    (read from ``density`` if None: a device round trip).
    """
    if selection_mode not in ("density", "mass"):
        raise ValueError(f"selection_mode={selection_mode!r}: expected 'density' or 'mass'")
    if density_host is None:
        density_host = [float(x) for x in density.reshape(-1).tolist()]
    bounds = kept_bounds(layout, density_host, sink_blocks=sink_blocks,
                         local_blocks=local_blocks, selection_mode=selection_mode,
                         min_density=min_density, max_density=max_density)
    kmax = bounds.kmax
    with torch.no_grad():
        ng, nb, _ = shares.shape
        t = _budget_tensors(layout, bounds, density, ng, sink_blocks, local_blocks,
                            selection_mode, min_density, max_density)
        shares = sanitize_shares(shares, layout)
        order = (shares + t["base"]).topk(kmax, dim=-1).indices      # [ng, NB, K], best first
        if selection_mode == "density":
            kv_num, slot_valid = t["kv_num"], t["slot_valid"]
        else:
            if mass_threshold >= 1.0:   # all of the mass: every allowed block, up to max_density
                kv_num = t["hi_kv"]
            else:   # float64 running sum: float32's drift could drop the last blocks
                sorted_shares = shares.gather(-1, order).double()
                before = sorted_shares.cumsum(dim=-1) - sorted_shares   # mass of the blocks ahead
                need = (before < mass_threshold).sum(dim=-1)            # [ng, NB]
                kv_num = torch.minimum(torch.maximum(need, t["lo"]), t["hi"])
            slot_valid = t["slots"] < kv_num[..., None]
        kv_indices = torch.where(slot_valid, order, t["diag"])
        recall_row = (shares.gather(-1, kv_indices) * slot_valid).sum(dim=-1)  # [ng, NB]

        ndoc, doc = layout.num_docs, layout.block_doc
        if selection_mode == "density":
            density_kept = t["density_kept"]
        else:
            kept = torch.zeros(ndoc, dtype=torch.float64, device=shares.device).index_add_(
                0, doc, kv_num.double().sum(dim=0))
            density_kept = (kept / t["avail_doc"]).float()
        rec = torch.zeros(ndoc, dtype=torch.float64, device=shares.device).index_add_(
            0, doc, recall_row.double().sum(dim=0))
        return BlockSelection(layout, kv_indices, kv_num, shares, density_kept,
                              (rec / t["nblk_doc"]).float(), bounds)


def select_blocks(q_blk: torch.Tensor, k_blk: torch.Tensor, layout: BlockLayout,
                  density: torch.Tensor, *, estimator: str = "maxkey",
                  softmax_scale: float = None, **budget) -> BlockSelection:
    """Score, then select: q_blk ``[ng, NB, rep, B, hn]``, k_blk ``[ng, NB, B, hn]``."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q_blk.shape[-1])
    shares = estimate_block_shares(q_blk, k_blk, layout, estimator, softmax_scale)
    return select_from_shares(shares, layout, density, **budget)
