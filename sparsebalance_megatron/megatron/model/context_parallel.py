"""Context parallelism (CP) for the sparse core attention: all-to-all over Megatron's CP group.

The scheme is Megatron's ``--cp-comm-type a2a`` (DeepSpeed-Ulysses style): a CP rank holds its
share of every packed sequence (Megatron's per-document zigzag order, ``data.context_parallel``)
for all heads; one all-to-all gathers the sequence and scatters the heads, so each rank holds
whole documents for ``np / cp`` query heads and the KV heads they read; the tokens are put back in
natural order (padding left out) and the block-sparse attention runs unchanged on whole
documents; the output goes back the same way. Every CP rank runs the same plan density on the same
documents, so selection, budgets and statistics agree with a CP=1 run.

GQA: with ``ng >= cp`` KV groups each rank takes ``ng / cp`` of them with their query heads; with
``ng < cp`` (``cp`` a multiple of ``ng``) the KV heads are replicated so each rank gets the one its
query heads read, and the estimated block shares, averaged over a group's query heads on one rank,
are averaged over the ``cp / ng`` ranks that share the group (one all-reduce of ``[ng, NB, NB]``
per layer), so the selection is the one a CP=1 run makes over all of the group's heads.

The same path serves CP=1 on padded sequences (``cu_seqlens_q_padded``): the padding is left out
of the attention (transformer-engine's semantics), and its outputs are zeros.
Collectives go through ``comm`` (the only torch.distributed user).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...attention.blocks import upload
from ...config import CP_COMM_TYPES
from ...data.context_parallel import gather_index
from ..runtime import comm


def check_heads(num_heads: int, num_groups: int, cp_size: int) -> None:
    """``ValueError`` unless ``num_heads`` query heads and ``num_groups`` KV groups (this tensor-
    parallel rank's) split over ``cp_size`` ranks."""
    if cp_size <= 1:
        return
    if num_heads % cp_size:
        raise ValueError(f"{num_heads} query heads per tensor-parallel rank do not split over "
                         f"context-parallel size {cp_size}: the a2a scheme gives every CP rank "
                         f"num_heads / cp heads (use a context-parallel size that divides it)")
    if num_groups % cp_size and cp_size % num_groups:
        raise ValueError(f"{num_groups} KV groups per tensor-parallel rank and context-parallel "
                         f"size {cp_size}: expected one to divide the other (each CP rank takes "
                         f"whole groups, or replicas of one)")


def cp_group_of(config, cp_comm_type, pg_collection, who: str):
    """The CP process group a core attention built with Megatron's ``config`` uses (None without
    CP), after checking the communication type and that its heads split over the CP ranks."""
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    if cp == 1:
        return None
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r} with context_parallel_size={cp}: {who} "
                         f"implements only {', '.join(CP_COMM_TYPES)} (--cp-comm-type a2a)")
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    heads = config.num_attention_heads
    check_heads(heads // tp, max((config.num_query_groups or heads) // tp, 1), cp)
    group = getattr(pg_collection, "cp", None)
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_context_parallel_group()
    return group


def kv_per_rank(num_groups: int, cp_size: int) -> int:
    """KV heads each CP rank holds after the all-to-all."""
    return max(num_groups // cp_size, 1)


def _host_bounds(psp):
    """(real, padded) sequence boundaries as host lists: the data path's host copies where
    ``SparsePackedSeqParams`` carries them, else read back from the device (one read each)."""
    real = psp.cu_seqlens_q
    padded = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else real
    real_h = getattr(psp, "sb_cu_seqlens_host", None)
    padded_h = getattr(psp, "sb_cu_seqlens_padded_host", None) \
        if psp.cu_seqlens_q_padded is not None else real_h
    if real_h is None:
        real_h = real.tolist() if torch.is_tensor(real) else real
    if padded_h is None:
        padded_h = real_h if padded is real else \
            (padded.tolist() if torch.is_tensor(padded) else padded)
    return [int(x) for x in real_h], [int(x) for x in padded_h]


def _layout(psp, num_local: int, cp_size: int, device, cache: Optional[dict]):
    """(index ``[T_real]`` or None, host cu_seqlens of the real tokens): where every real token
    lies in the gathered tensor, in natural order. Built once per micro-batch (cached): at most
    one host read (none where the data path gave the host bounds) and one upload."""
    key = ("cp", cp_size, num_local)
    if cache is not None and key in cache:
        return cache[key]
    real_h, padded_h = _host_bounds(psp)
    total = num_local * cp_size
    if padded_h[-1] != total:
        what = "cu_seqlens_q_padded" if psp.cu_seqlens_q_padded is not None else "cu_seqlens_q"
        raise ValueError(f"packed_seq_params.{what} ends at {padded_h[-1]} tokens, the input holds "
                         f"{num_local} x context-parallel size {cp_size} = {total}: expected the "
                         f"whole micro-batch's boundaries (split for CP by the data path)")
    if cp_size == 1 and real_h == padded_h:
        out = (None, real_h)                     # no padding: attend in place, as without CP
    else:
        index, = upload([gather_index(real_h, padded_h, cp_size)], device)
        out = (index, real_h)
    if cache is not None:
        cache[key] = out
    return out


def _scatter_heads(q, k, v, group, cp: int):
    """q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (this rank's tokens, all heads) -> ``[cp * t, np/cp,
    hn]`` and ``[cp * t, ng_l, hn]`` (every rank's tokens, rank 0's first; this rank's heads),
    in one all-to-all."""
    t, nh, hn = q.shape
    ng = k.shape[1]
    if ng < cp:                                  # each rank needs a copy of one KV head
        k, v = (x.repeat_interleave(cp // ng, dim=1) for x in (k, v))
    ngl = kv_per_rank(ng, cp)
    x = torch.cat([q.view(t, cp, nh // cp, hn), k.view(t, cp, ngl, hn),
                   v.view(t, cp, ngl, hn)], dim=2)                 # [t, cp, np/cp + 2 ngl, hn]
    y = comm.all_to_all(x.transpose(0, 1), group)                  # [cp, t, ...]: from rank i
    y = y.reshape(cp * t, nh // cp + 2 * ngl, hn)
    return y.split([nh // cp, ngl, ngl], dim=1)


def _gather_heads(out, group, cp: int):
    """``[cp * t, h, hn]`` (every rank's tokens, this rank's heads) -> ``[t, cp * h, hn]``."""
    rows, h, hn = out.shape
    y = comm.all_to_all(out.reshape(cp, rows // cp, h, hn), group)   # [cp, t, h, hn]: rank i's heads
    return y.transpose(0, 1).reshape(rows // cp, cp * h, hn)


def share_reducer(num_groups: int, group, cp: int) -> Optional[Callable]:
    """With fewer KV groups than CP ranks: the function that averages a rank's estimated block
    shares ``[1, NB, NB]`` over the ranks holding query heads of the same group; else None."""
    if cp <= 1 or num_groups >= cp:
        return None
    per_group = cp // num_groups
    g = comm.group_rank(group) // per_group

    def reduce(shares: torch.Tensor) -> torch.Tensor:
        buf = shares.new_zeros((num_groups,) + tuple(shares.shape[1:]))
        buf[g] = shares[0]
        comm.all_reduce_sum_(buf, group)
        return buf[g:g + 1] / per_group

    return reduce


def attend_whole_documents(q, k, v, psp, group, attend: Callable, cache: Optional[dict] = None):
    """Attention over whole documents of a packed micro-batch split over the CP ``group`` (None:
    no CP).

    q ``[t, np, hn]``, k/v ``[t, ng, hn]``: this rank's tokens in Megatron's CP order.
    ``attend(q, k, v, cu_seqlens, reduce_shares)`` runs on whole documents in natural order
    (``[T_real, h, hn]``, the heads of this rank) and returns ``[T_real, h, hn]``.
    Returns ``[t, np, hn]``: this rank's tokens, all heads; zeros at padding positions.
    """
    cp = comm.group_size(group)
    check_heads(q.shape[1], k.shape[1], cp)
    index, cu = _layout(psp, q.shape[0], cp, q.device, cache)
    ng = k.shape[1]
    if cp > 1:
        q, k, v = _scatter_heads(q, k, v, group, cp)               # [cp * t, heads/cp, hn]
    rows = q.shape[0]
    if index is not None:                                          # natural order, no padding
        q, k, v = (x.index_select(0, index) for x in (q, k, v))
    out = attend(q, k, v, cu, share_reducer(ng, group, cp))       # [T_real, np/cp, hn]
    if index is not None:   # index_put saves only the index for the backward (index_copy: out too)
        out = out.new_zeros((rows,) + tuple(out.shape[1:])).index_put((index,), out)
    if cp > 1:
        out = _gather_heads(out, group, cp)
    return out
