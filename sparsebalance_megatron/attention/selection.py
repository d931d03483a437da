"""Budgeted key-block selection: cheap block scores -> estimated mass shares -> kept blocks.

For every query block of every document and every key/value head (GQA group) this picks the key
blocks the sparse kernels will compute. Key blocks are scored causally and inside the document
only; a softmax over the key blocks turns scores into an estimated attention-mass share.
Estimators (pluggable, ``ESTIMATORS``):

- ``maxkey`` (default): mean-pooled query block . every key, max over the keys of each key block
  (cost ~ 1/block_size of dense attention);
- ``pooled``: mean-pooled query block . mean-pooled key block (cheaper, less accurate).

GQA: shares are computed per query head and averaged over the query heads of a group, so one
selection serves the group. The diagonal block, the first ``sink_blocks`` blocks of the document
and ``local_blocks`` blocks before the diagonal are always kept; the rest is filled by density
(top-k, k = ceil(density * available)) or by an estimated-mass threshold clipped to
[min_density, max_density]. Selection is never differentiated.
Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict

import torch

from .blocks import BlockLayout

# Elements of the largest score tensor built at once while estimating (bounds selection memory).
_SCORE_BUDGET = 1 << 25
# Guard against ceil(0.7 * 10) = 8 from floating-point noise.
_CEIL_EPS = 1e-9


@dataclass
class BlockSelection:
    """Kept key blocks of every (KV head, query block), plus per-document statistics.

    ``kv_indices[g, i, :kv_num[g, i]]`` are the global key-block indices kept for query block
    ``i`` and KV head ``g`` (all in the same document, at or before ``i``). Slot 0 is always the
    diagonal block ``i``; slots past ``kv_num`` also hold ``i`` and must be ignored.
    """

    layout: BlockLayout
    kv_indices: torch.Tensor    # [ng, NB, K] long
    kv_num: torch.Tensor        # [ng, NB] long
    shares: torch.Tensor        # [ng, NB, NB] float32 estimated mass share (0 where not allowed)
    density_kept: torch.Tensor  # [ndoc] float32: kept blocks / causal blocks
    recall: torch.Tensor        # [ndoc] float32: estimated mass share of the kept blocks

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


def allowed_blocks(layout: BlockLayout) -> torch.Tensor:
    """[NB, NB] bool: key block j is causal (j <= i) and in the same document as query block i."""
    nb = layout.num_blocks
    ar = torch.arange(nb, device=layout.block_doc.device)
    return (layout.block_doc[:, None] == layout.block_doc[None, :]) & (ar[None, :] <= ar[:, None])


def forced_blocks(layout: BlockLayout, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """[NB, NB] bool: always-kept blocks (diagonal, document sinks, local window)."""
    loc = layout.block_local
    kb_local = loc[None, :]
    forced = (kb_local < sink_blocks) | (kb_local >= loc[:, None] - local_blocks)
    return forced & allowed_blocks(layout)


def _pooled_queries(q_blk: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """q_blk [ng, NB, rep, B, hn] (zeros in padding) -> mean over real tokens [ng, NB, rep, hn]."""
    n = layout.block_len.to(torch.float32).view(1, -1, 1, 1)
    return q_blk.float().sum(dim=3) / n


def _estimate_maxkey(q_blk, k_blk, layout, softmax_scale):
    ng, nb, rep, bs, hn = q_blk.shape
    qbar = _pooled_queries(q_blk, layout)                       # [ng, NB, rep, hn]
    kf = k_blk.float()                                          # [ng, NB, B, hn]
    local = layout.block_local.tolist()
    tok = torch.arange(bs, device=kf.device)
    key_pad = tok[None, :] >= layout.block_len[:, None]         # [NB, B]
    allowed = allowed_blocks(layout)
    shares = torch.zeros(ng, nb, nb, dtype=torch.float32, device=kf.device)
    i0 = 0
    while i0 < nb:
        kb0 = i0 - local[i0]
        # grow the chunk while the score tensor [ng, C, rep, span, B] stays within budget
        i1 = i0 + 1
        while i1 < nb and ng * (i1 + 1 - i0) * rep * (i1 + 1 - kb0) * bs <= _SCORE_BUDGET \
                and i1 + 1 - i0 <= 64:
            i1 += 1
        span = i1 - kb0
        qc = qbar[:, i0:i1].reshape(ng, (i1 - i0) * rep, hn)
        keys = kf[:, kb0:i1].reshape(ng, span * bs, hn)
        s = torch.bmm(qc, keys.transpose(1, 2)).view(ng, i1 - i0, rep, span, bs)
        s.masked_fill_(key_pad[kb0:i1].view(1, 1, 1, span, bs), float("-inf"))
        s = s.amax(dim=-1) * softmax_scale                      # [ng, C, rep, span]
        s.masked_fill_(~allowed[i0:i1, kb0:i1].view(1, i1 - i0, 1, span), float("-inf"))
        shares[:, i0:i1, kb0:i1] = torch.softmax(s, dim=-1).mean(dim=2)
        i0 = i1
    return shares


def _estimate_pooled(q_blk, k_blk, layout, softmax_scale):
    ng, nb, rep, bs, hn = q_blk.shape
    qbar = _pooled_queries(q_blk, layout).reshape(ng, nb * rep, hn)
    kbar = k_blk.float().sum(dim=2) / layout.block_len.to(torch.float32).view(1, -1, 1)
    s = torch.bmm(qbar, kbar.transpose(1, 2)).view(ng, nb, rep, nb) * softmax_scale
    s.masked_fill_(~allowed_blocks(layout).view(1, nb, 1, nb), float("-inf"))
    return torch.softmax(s, dim=-1).mean(dim=2)


ESTIMATORS: Dict[str, Callable] = {"maxkey": _estimate_maxkey, "pooled": _estimate_pooled}


def estimate_block_shares(q_blk: torch.Tensor, k_blk: torch.Tensor, layout: BlockLayout,
                          estimator: str, softmax_scale: float) -> torch.Tensor:
    """Estimated attention-mass share of every key block, per KV group.

    q_blk ``[ng, NB, rep, B, hn]``, k_blk ``[ng, NB, B, hn]`` (padded layout, zeros in padding)
    -> ``[ng, NB, NB]`` float32; each row sums to 1 over its causal in-document key blocks.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: expected one of {', '.join(ESTIMATORS)}")
    with torch.no_grad():
        return ESTIMATORS[estimator](q_blk, k_blk, layout, softmax_scale)


def select_from_shares(shares: torch.Tensor, layout: BlockLayout, density: torch.Tensor, *,
                       sink_blocks: int = 1, local_blocks: int = 0,
                       selection_mode: str = "density", mass_threshold: float = 0.9,
                       min_density: float = 0.125, max_density: float = 1.0) -> BlockSelection:
    """Turn estimated shares ``[ng, NB, NB]`` into kept blocks under the budget.

    ``density`` is ``[ndoc]`` (float, in (0, 1]). In ``density`` mode every query block keeps
    ``max(ceil(density * available), forced)`` blocks; in ``mass`` mode the fewest blocks whose
    estimated share reaches ``mass_threshold``, clipped to
    ``[ceil(min_density * available), ceil(max_density * available)]`` (never below the forced
    blocks).
    """
    if selection_mode not in ("density", "mass"):
        raise ValueError(f"selection_mode={selection_mode!r}: expected 'density' or 'mass'")
    with torch.no_grad():
        ng, nb, _ = shares.shape
        dev = shares.device
        allowed = allowed_blocks(layout)
        forced = forced_blocks(layout, sink_blocks, local_blocks)
        avail = layout.block_available()                                # [NB]
        n_forced = forced.sum(dim=-1)                                   # [NB]
        # the diagonal first (kernels rely on slot 0 being the diagonal), then the other forced
        # blocks (share + 2), then by share; disallowed last (-1)
        priority = torch.where(forced, shares + 2.0, torch.where(allowed, shares, -1.0))
        priority.diagonal(dim1=1, dim2=2).add_(2.0)

        def ceil_frac(frac):
            return torch.ceil(frac * avail.double() - _CEIL_EPS).long()

        if selection_mode == "density":
            k = ceil_frac(density[layout.block_doc]).clamp(min=1)
            k = torch.minimum(torch.maximum(k, n_forced), avail)        # [NB]
            kv_num = k.view(1, nb).expand(ng, nb).contiguous()
            kmax = int(kv_num.max())
            kv_indices = priority.topk(kmax, dim=-1).indices
        else:
            order = priority.argsort(dim=-1, descending=True)
            sorted_shares = shares.gather(-1, order)
            before = sorted_shares.cumsum(dim=-1) - sorted_shares       # mass of the blocks ahead
            need = (before < mass_threshold).sum(dim=-1)                # [ng, NB]
            f64 = dict(dtype=torch.float64, device=dev)   # float32 0.6 * 10 would ceil to 7
            lo = torch.maximum(ceil_frac(torch.tensor(min_density, **f64)), n_forced)
            hi = torch.maximum(ceil_frac(torch.tensor(max_density, **f64)), n_forced)
            kv_num = torch.minimum(torch.maximum(need, lo), torch.minimum(hi, avail))
            kmax = int(kv_num.max())
            kv_indices = order[..., :kmax].contiguous()
        slot_valid = torch.arange(kmax, device=dev) < kv_num[..., None]   # [ng, NB, K]
        diag = torch.arange(nb, device=dev).view(1, nb, 1).expand_as(kv_indices)
        kv_indices = torch.where(slot_valid, kv_indices, diag)
        recall_row = (shares.gather(-1, kv_indices) * slot_valid).sum(dim=-1)  # [ng, NB]

        ndoc = layout.num_docs
        doc = layout.block_doc
        kept = torch.zeros(ndoc, dtype=torch.float64, device=dev).index_add_(
            0, doc, kv_num.double().sum(dim=0))
        avail_doc = torch.zeros(ndoc, dtype=torch.float64, device=dev).index_add_(
            0, doc, avail.double() * ng)
        rec = torch.zeros(ndoc, dtype=torch.float64, device=dev).index_add_(
            0, doc, recall_row.double().sum(dim=0))
        nblk_doc = torch.zeros(ndoc, dtype=torch.float64, device=dev).index_add_(
            0, doc, torch.full((nb,), float(ng), dtype=torch.float64, device=dev))
        return BlockSelection(layout, kv_indices, kv_num, shares,
                              (kept / avail_doc).float(), (rec / nblk_doc).float())


def select_blocks(q_blk: torch.Tensor, k_blk: torch.Tensor, layout: BlockLayout,
                  density: torch.Tensor, *, estimator: str = "maxkey",
                  softmax_scale: float = None, **budget) -> BlockSelection:
    """Score, then select: q_blk ``[ng, NB, rep, B, hn]``, k_blk ``[ng, NB, B, hn]``."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q_blk.shape[-1])
    shares = estimate_block_shares(q_blk, k_blk, layout, estimator, softmax_scale)
    return select_from_shares(shares, layout, density, **budget)
