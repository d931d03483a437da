"""Mass recall of block selections against exact attention, and the oracle at the same density.

Given one layer's q ``[t, np, hn]`` and k ``[t, ng, hn]`` for a single causal document, the
exact attention probabilities are summed into blocks: ``true_shares[g, i, j]`` is the attention
mass that query block ``i`` puts on key block ``j``, averaged over the block's query tokens and
the query heads of KV group ``g`` (each row sums to 1 over causal blocks). The mass recall of a
selection is the true mass of its kept blocks, averaged over query blocks and groups; the oracle
keeps the top blocks by true mass under the same budget rules (forced diagonal and sinks, same
k per row). Estimator selections come from ``attention.selection.select_blocks``, the exact
function the kernels use. Pure torch; must not import megatron.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch

from ..attention.blocks import build_layout
from ..attention.kernels import to_blocks_kv, to_blocks_q
from ..attention.selection import select_blocks, select_from_shares


def true_block_shares(q: torch.Tensor, k: torch.Tensor, block_size: int,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """Exact causal attention mass per (group, query block, key block): ``[ng, NB, NB]``."""
    t, nh, hn = q.shape
    ng = k.shape[1]
    if k.shape[0] != t or nh % ng:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: expected [t, np, hn] and "
                         f"[t, ng, hn] with np a multiple of ng")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    rep, nb = nh // ng, -(-t // block_size)
    pad = nb * block_size - t
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    block_len = torch.full((nb,), float(block_size), device=q.device)
    block_len[-1] = t - (nb - 1) * block_size
    out = torch.zeros(nh, nb, nb, dtype=torch.float32, device=q.device)
    for h in range(nh):  # one head at a time keeps memory at [t, t]
        s = (q[:, h].float() @ k[:, h // rep].float().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)      # [t, t]
        p = torch.nn.functional.pad(p, (0, pad, 0, pad))                      # [NB*B, NB*B]
        blk = p.view(nb, block_size, nb, block_size).sum(dim=(1, 3))          # [NB, NB]
        out[h] = blk / block_len[:, None]
    return out.view(ng, rep, nb, nb).mean(dim=1)


def selection_recall(true_shares: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over groups and query blocks of the true mass in the kept blocks (mask [ng,NB,NB])."""
    return float((true_shares * mask).sum(dim=-1).mean())


def layer_recalls(q: torch.Tensor, k: torch.Tensor, densities: Sequence[float], *,
                  block_size: int = 64, sink_blocks: int = 1, local_blocks: int = 0,
                  estimator: str = "maxkey", mass_threshold: float | None = 0.9,
                  min_density: float = 0.125, max_density: float = 1.0,
                  softmax_scale: float | None = None) -> Dict[str, Dict[str, float]]:
    """Recall of the estimator's and the oracle's selections for one layer of one document.

    Returns ``{"static@<d>": {"recall", "oracle_recall", "density"}, "mass": {...}}``; for
    ``mass`` the oracle gets the density the estimator's mass selection actually kept.
    """
    t, nh, hn = q.shape
    ng = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    layout = build_layout([0, t], t, block_size, q.device)
    q_blk = to_blocks_q(layout.pad(q.detach().float()), ng, block_size)
    k_blk = to_blocks_kv(layout.pad(k.detach().float()), block_size)
    shares = true_block_shares(q, k, block_size, scale)
    budget = dict(sink_blocks=sink_blocks, local_blocks=local_blocks, min_density=min_density,
                  max_density=max_density)
    out = {}

    def one(name, density, mode):
        d = torch.tensor([density], dtype=torch.float64)
        est = select_blocks(q_blk, k_blk, layout, d, estimator=estimator, softmax_scale=scale,
                            selection_mode=mode, mass_threshold=mass_threshold or 0.9, **budget)
        kept = float(est.density_kept[0])
        od = torch.tensor([kept if mode == "mass" else density], dtype=torch.float64)
        orc = select_from_shares(shares, layout, od, **budget)
        out[name] = {"recall": selection_recall(shares, est.block_mask()),
                     "oracle_recall": selection_recall(shares, orc.block_mask()),
                     "estimated_recall": float(est.recall[0]), "density": kept}

    for dens in densities:
        one(f"static@{dens:g}", float(dens), "density")
    if mass_threshold is not None:
        one("mass", max_density, "mass")
    return out
