"""Per-sample sparsity sensitivity: a length prior refined by measured attention-mass recall.

Sensitivity = 1 - recall, where recall is the share of attention mass the sparse selection kept
(recorded by the attention, ``plan.record_attention_stats``). Low recall at the base density means
the sample spreads its attention and loses accuracy when sparsified: high sensitivity.

Estimate of a sample, best first:
1. the recall measured the last time this sample went through attention;
2. an EMA of the recalls measured on samples of its length bucket (powers of two);
3. a prior by length: recall rises with length at a fixed density (DESIGN.md section 3 measured
   oracle top-k recall 0.85 at 2K and 0.88 at 4K tokens, density 0.25, SmolLM2-135M), so the
   prior is ``recall = 0.85 + 0.03 * log2(length / 2048)`` clipped to [0.5, 0.99]. Only the order
   of the estimates matters to SAB and DST, and measurements replace the prior quickly.

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PRIOR_RECALL_AT_2K = 0.85
PRIOR_RECALL_PER_DOUBLING = 0.03


def length_bucket(lengths) -> np.ndarray:
    """[n] bucket index floor(log2(length)) (length >= 1)."""
    return np.floor(np.log2(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))).astype(
        np.int64)


def prior_sensitivity(lengths) -> np.ndarray:
    """[n] 1 - prior recall by length (see the module docstring)."""
    L = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
    recall = PRIOR_RECALL_AT_2K + PRIOR_RECALL_PER_DOUBLING * np.log2(L / 2048.0)
    return 1.0 - np.clip(recall, 0.5, 0.99)


class SensitivityTracker:
    """Remembers measured recall per sample and per length bucket (EMA with weight ``ema``)."""

    def __init__(self, ema: float = 0.3):
        if not (0.0 < ema <= 1.0):
            raise ValueError(f"ema={ema!r}: expected a number in (0, 1]")
        self.ema = float(ema)
        self._sample: dict[int, float] = {}     # sample id -> last measured recall
        self._bucket: dict[int, float] = {}     # length bucket -> EMA of recall

    def update(self, sample_ids: Sequence[int], lengths, recall) -> None:
        """Record recalls in [0, 1] of samples (NaN entries are skipped: no measurement)."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        r = np.asarray(recall, dtype=np.float64).reshape(-1)
        if not (ids.size == L.size == r.size):
            raise ValueError(f"sample_ids ({ids.size}), lengths ({L.size}) and recall "
                             f"({r.size}) must have the same length")
        ok = np.isfinite(r)
        if np.any((r[ok] < 0) | (r[ok] > 1)):
            raise ValueError(f"recall must lie in [0, 1], got min={r[ok].min()!r} "
                             f"max={r[ok].max()!r}")
        for i, b, x in zip(ids[ok].tolist(), length_bucket(L[ok]).tolist(), r[ok].tolist()):
            self._sample[i] = x
            old = self._bucket.get(b)
            self._bucket[b] = x if old is None else (1 - self.ema) * old + self.ema * x
        return None

    def estimate(self, sample_ids: Sequence[int], lengths) -> np.ndarray:
        """[n] sensitivity (1 - recall) per sample: measured, else its bucket, else the prior."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if ids.size != L.size:
            raise ValueError(f"sample_ids ({ids.size}) and lengths ({L.size}) must have the "
                             "same length")
        out = prior_sensitivity(L)
        if self._bucket:
            for j, b in enumerate(length_bucket(L).tolist()):
                r = self._bucket.get(b)
                if r is not None:
                    out[j] = 1.0 - r
        if self._sample:
            for j, i in enumerate(ids.tolist()):
                r = self._sample.get(i)
                if r is not None:
                    out[j] = 1.0 - r
        return out

    def state_dict(self) -> dict:
        return {"ema": self.ema, "sample": dict(self._sample), "bucket": dict(self._bucket)}

    def load_state_dict(self, state: dict) -> None:
        self.ema = float(state["ema"])
        self._sample = {int(k): float(v) for k, v in state["sample"].items()}
        self._bucket = {int(k): float(v) for k, v in state["bucket"].items()}


def unit_sensitivity(micro_batches, tracker: SensitivityTracker) -> np.ndarray:
    """[dp, m] mean sensitivity of each micro-batch's segments (0 for an empty micro-batch):
    the per-unit sensitivity DST takes."""
    dp = len(micro_batches)
    m = len(micro_batches[0]) if dp else 0
    segs = [seg for rank in micro_batches for mb in rank for seg in mb]
    if not segs:
        return np.zeros((dp, m))
    est = tracker.estimate([s[0] for s in segs], [s[2] - s[1] for s in segs])
    counts = np.asarray([len(mb) for rank in micro_batches for mb in rank])
    unit = np.repeat(np.arange(dp * m), counts)
    sums = np.bincount(unit, weights=est, minlength=dp * m)
    return (sums / np.maximum(counts, 1)).reshape(dp, m)
