"""Megatron's own packer, ``DpBalancedScheduler`` (``megatron/core/datasets/data_schedule.py``),
as a ``BatchPlan``: the baseline SAB is proven against (docs/DESIGN.md section 6 states the
rule), at CP 1; its micro-batches hold their documents only (``length_multiple`` 1), as Megatron
packs them by default.

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from itertools import chain
from typing import Optional, Sequence

import numpy as np

from .packing import finish_plan, prepare_samples
from .plan import BatchingError, BatchPlan, check_int


def dp_balanced_groups(seqlens: Sequence[int], *, max_seqlen_per_dp_cp_rank: int, dp: int,
                       microbatch_group_size_per_vp_stage: Optional[int] = None,
                       empty_groups: bool = False) -> list:
    """``[micro-batch][dp rank]`` lists of indices into ``seqlens``: Megatron's
    ``DpBalancedScheduler.get_groups_and_subsamples`` on sequences of these lengths, in this
    order. Where Megatron's rule has no answer (an assertion: it runs out of groups holding
    more than one sequence): BatchingError, or with ``empty_groups`` empty groups up to the
    multiple (so a study can time the step)."""
    cap = check_int("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)
    dp = check_int("dp", dp)
    multiple = dp * (check_int("microbatch_group_size_per_vp_stage",
                                microbatch_group_size_per_vp_stage)
                     if microbatch_group_size_per_vp_stage is not None else 1)
    lengths = [int(n) for n in seqlens]
    if not lengths:
        raise BatchingError("empty global batch: no sequences for Megatron's dp_balanced rule")
    if min(lengths) < 0:
        raise ValueError(f"sequence length {min(lengths)}: expected lengths >= 0")
    groups, cur, total = [], [], 0
    for i, n in enumerate(lengths):
        if total + n <= cap:
            cur.append(i)
            total += n
        else:                      # Megatron closes the group even when it is empty
            groups.append(cur)
            cur, total = [i], n
    if cur:
        groups.append(cur)
    short = (-len(groups)) % multiple
    g = len(groups) - 1
    while short:
        if g < 0 and empty_groups:
            groups += [[] for _ in range(short)]
            break
        if g < 0:
            raise BatchingError(
                f"{len(lengths)} sequences cannot make a multiple of {multiple} groups (dp "
                f"{dp}): Megatron's dp_balanced rule moves single sequences into groups of "
                f"their own and runs out; use a larger global batch or fewer DP ranks")
        if len(groups[g]) > 1:
            groups.append([groups[g].pop()])
            short -= 1
        else:
            g -= 1
    m = len(groups) // dp
    return [groups[i * dp:(i + 1) * dp] for i in range(m)]


def megatron_order(n: int, dp: int) -> np.ndarray:
    """[n] positions of the global batch's samples in Megatron's gathered order: sample k goes to
    DP rank ``k % dp`` (``MegatronPretrainingSampler``, one sample a micro-batch), each rank
    keeps its samples in order, and the ranks are concatenated in rank order."""
    k = np.arange(n)
    return np.lexsort((k, k % dp))


def dp_balanced_plan(samples, *, dp: int, num_microbatches: int, max_tokens: int,
                     long_sample_policy: str = "split", empty_groups: bool = False,
                     microbatch_group_size_per_vp_stage: Optional[int] = None) -> BatchPlan:
    """Megatron's dp_balanced packing of one global batch, in Megatron's order. samples:
    (sample_id, start, end) segments in the sampler's order, or a [n] array of lengths;
    num_microbatches: the micro-batches the other packings get (checks the batch fits them; the
    plan's own count is Megatron's, ``plan.num_microbatches``); max_tokens: also Megatron's
    ``--max-seqlen-per-dp-cp-rank`` (what Megatron-LM sets from ``--seq-length``);
    empty_groups: as in ``dp_balanced_groups`` (the plan's ``fallback`` is then True where they
    were needed: a step Megatron itself would stop on).
    microbatch_group_size_per_vp_stage: what Megatron passes under VPP (``wrap_data_iterator``:
    the config's value, which defaults to pp): the group count becomes a multiple of
    dp x it, so every step interleaves; None without VPP.
    """
    arr, sizes, n_split = prepare_samples(samples, dp, num_microbatches, max_tokens,
                                          long_sample_policy)
    idx = megatron_order(sizes.size, dp)
    groups = dp_balanced_groups(
        sizes[idx].tolist(), max_seqlen_per_dp_cp_rank=max_tokens, dp=dp,
        empty_groups=empty_groups,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    cells = [mb[r] for r in range(dp) for mb in groups]           # rank-major, in slot order
    counts = np.array([len(c) for c in cells], dtype=np.int64).reshape(dp, len(groups))
    items = idx[np.fromiter(chain.from_iterable(cells), np.int64, int(counts.sum()))]
    plan = finish_plan(items, counts, "dp_balanced", max_tokens, n_split, not counts.all(), arr,
                       sizes.astype(np.float64))
    return plan.with_length_multiple(1)
