"""Megatron data path: a step's documents -> packed THD micro-batches for this rank.

Every rank runs the same deterministic sampler and packer, so all TP and PP ranks of a DP rank
build identical micro-batches without communication, and every rank knows every DP rank's
documents (which DST needs). One step is read ahead so the plan for step t+1 can be built from
its documents before step t+1 starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..data.packing import GlobalBatchSampler, materialize, sequential_pack

Segment = tuple[int, int, int]
# packer(segments, *, capacity, dp, num_microbatches) -> [dp][m] lists of segments
Packer = Callable[..., list]


@dataclass
class StepData:
    """The documents of one training step, assigned to (dp rank, micro-batch slot)."""

    step: int
    assignment: list  # [dp][m] -> list[Segment]

    @property
    def num_microbatches(self) -> int:
        return len(self.assignment[0])

    def split_documents(self, doc_lengths: np.ndarray, capacity: int) -> int:
        """Documents of this step longer than a micro-batch, hence split into segments."""
        docs = {d for rank in self.assignment for mb in rank for d, _, _ in mb}
        return int(sum(1 for d in docs if doc_lengths[d] + 1 > capacity))

    def fingerprint(self) -> int:
        """A hash of the assignment: every rank must hold the same one."""
        return hash(tuple(tuple(tuple(mb) for mb in rank) for rank in self.assignment))

    def num_tokens(self) -> int:
        return int(sum(e - s for rank in self.assignment for mb in rank for _, s, e in mb))


class StepBatcher:
    """Sampler + packer: the same ``StepData`` sequence on every rank, resumable by step count."""

    def __init__(self, corpus, *, capacity: int, dp: int, num_microbatches: int, seed: int,
                 long_sample_policy: str = "split", packer: Packer | None = None):
        self.corpus, self.capacity = corpus, capacity
        self.dp, self.num_microbatches = dp, num_microbatches
        self.sampler = GlobalBatchSampler(
            corpus.lengths, capacity=capacity, dp=dp, num_microbatches=num_microbatches,
            seed=seed, long_sample_policy=long_sample_policy)
        self.packer = packer or sequential_pack
        self.step = 0

    def next_step(self) -> StepData:
        segments = self.sampler.next_global_batch()
        assignment = self.packer(segments, capacity=self.capacity, dp=self.dp,
                                 num_microbatches=self.num_microbatches)
        _check_assignment(segments, assignment, self.capacity, self.dp, self.num_microbatches)
        data = StepData(self.step, assignment)
        self.step += 1
        return data

    def skip(self, steps: int) -> None:
        """Advance past ``steps`` steps without packing (resume: same order as uninterrupted)."""
        for _ in range(steps):
            self.sampler.next_global_batch()
            self.step += 1


def _check_assignment(segments, assignment, capacity, dp, m) -> None:
    """A packer must use every segment of the step exactly once and respect the capacity."""
    if len(assignment) != dp or any(len(r) != m for r in assignment):
        raise RuntimeError(f"packer returned a {len(assignment)} x ? assignment, expected {dp} x {m}")
    used = sorted(seg for rank in assignment for mb in rank for seg in mb)
    if used != sorted(segments):
        raise RuntimeError("packer dropped or duplicated segments of the global batch")
    for r, rank in enumerate(assignment):
        for j, mb in enumerate(rank):
            n = sum(e - s for _, s, e in mb)
            if n > capacity:
                raise RuntimeError(f"packer put {n} tokens in micro-batch ({r}, {j}), capacity {capacity}")


def microbatch_tensors(segments, corpus, capacity: int, index: int, device) -> dict:
    """One packed micro-batch as Megatron THD inputs: tokens/labels/position_ids ``[1, T]``."""
    mb = materialize(segments, corpus, capacity)
    cu = torch.from_numpy(np.asarray(mb.cu_seqlens, dtype=np.int32)).to(device)
    max_len = int((cu[1:] - cu[:-1]).max())
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max_len, max_seqlen_kv=max_len)

    def t(a, dtype):
        return torch.from_numpy(np.asarray(a)).to(device=device, dtype=dtype).unsqueeze(0)

    return {
        "index": index,
        "doc_ids": [d for d, _, _ in segments],
        "tokens": t(mb.tokens, torch.int64),
        "labels": t(mb.labels, torch.int64),
        "loss_mask": t(mb.loss_mask, torch.float32),
        "position_ids": t(mb.position_ids, torch.int64),
        "packed_seq_params": psp,
        "num_real_tokens": int(sum(e - s for _, s, e in segments)),
    }


def rank_microbatches(step: StepData, dp_rank: int, corpus, capacity: int, device) -> Iterator[dict]:
    """This DP rank's micro-batches of the step, in schedule order."""
    for j, segments in enumerate(step.assignment[dp_rank]):
        yield microbatch_tensors(segments, corpus, capacity, j, device)
