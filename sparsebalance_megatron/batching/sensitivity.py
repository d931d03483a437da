"""Per-sample sparsity sensitivity (docs/DESIGN.md section 6, "Sensitivity"): a length prior
refined by a measured signal (``--sb-sensitivity-signal``: minus the document's training loss by
default, or 1 - the sparse selection's kept attention mass). A sample's estimate, best first: its
own last measurement; its length bucket's EMA (powers of two); (loss) the EMA over all measured
samples, so measured and unmeasured estimates share a scale; the prior ``recall = 0.85 + 0.03 *
log2(length / 2048)`` clipped to [0.5, 0.99] (recall rises with length, DESIGN section 3). Only
the order of the estimates matters to SAB and DST.

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def length_bucket(lengths) -> np.ndarray:
    """[n] bucket index floor(log2(length)) (length >= 1)."""
    return np.floor(np.log2(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))).astype(
        np.int64)


def prior_sensitivity(lengths) -> np.ndarray:
    """[n] 1 - prior recall by length (see the module docstring)."""
    L = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
    recall = 0.85 + 0.03 * np.log2(L / 2048.0)
    return 1.0 - np.clip(recall, 0.5, 0.99)


SIGNALS = ("loss", "recall")


class SensitivityTracker:
    """Remembers a measured signal (``signal``: ``loss`` or ``recall``, module docstring) per
    sample and per length bucket (EMA with weight ``ema``)."""

    def __init__(self, ema: float = 0.3, signal: str = "loss"):
        if not (0.0 < ema <= 1.0):
            raise ValueError(f"ema={ema!r}: expected a number in (0, 1]")
        if signal not in SIGNALS:
            raise ValueError(f"--sb-sensitivity-signal={signal!r}: expected one of "
                             f"{', '.join(SIGNALS)}")
        self.ema, self.signal = float(ema), signal
        self._sample: dict[int, float] = {}     # sample id -> last measured value
        self._bucket: dict[int, float] = {}     # length bucket -> EMA of the value
        self._all: float | None = None          # EMA over every measured sample (loss)

    def update(self, sample_ids: Sequence[int], lengths, values) -> None:
        """Record measured values of samples (NaN entries are skipped: no measurement): recalls
        in [0, 1], or mean losses >= 0 (nats per token)."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        r = np.asarray(values, dtype=np.float64).reshape(-1)
        if not (ids.size == L.size == r.size):
            raise ValueError(f"sample_ids ({ids.size}), lengths ({L.size}) and values "
                             f"({r.size}) must have the same length")
        ok = np.isfinite(r)
        hi = 1.0 if self.signal == "recall" else np.inf
        if np.any((r[ok] < 0) | (r[ok] > hi)):
            raise ValueError(f"{self.signal} must lie in [0, {hi}], got min={r[ok].min()!r} "
                             f"max={r[ok].max()!r}")
        for i, b, x in zip(ids[ok].tolist(), length_bucket(L[ok]).tolist(), r[ok].tolist()):
            self._sample[i] = x
            old = self._bucket.get(b)
            self._bucket[b] = x if old is None else (1 - self.ema) * old + self.ema * x
            self._all = x if self._all is None else (1 - self.ema) * self._all + self.ema * x

    def _sensitivity(self, value):
        """Sensitivity of a measured value (a float or an array of them)."""
        return 1.0 - value if self.signal == "recall" else -value

    def estimate(self, sample_ids: Sequence[int], lengths) -> np.ndarray:
        """[n] sensitivity per sample: measured, else its bucket, else (loss) the mean over all
        samples, else the length prior."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if ids.size != L.size:
            raise ValueError(f"sample_ids ({ids.size}) and lengths ({L.size}) must have the "
                             "same length")
        out = prior_sensitivity(L)
        if self.signal == "loss" and self._all is not None:
            out[:] = self._sensitivity(self._all)
        # per distinct bucket, then the samples' values in one assignment (the planner asks
        # for thousands of segments a draft): the same floats as per-segment look-ups
        if self._bucket:
            buckets, at = np.unique(length_bucket(L), return_inverse=True)
            self._fill(out, at, [self._bucket.get(b) for b in buckets.tolist()])
        if self._sample:
            self._fill(out, np.arange(ids.size), list(map(self._sample.get, ids.tolist())))
        return out

    def _fill(self, out: np.ndarray, at: np.ndarray, got: list) -> None:
        """out[j] = sensitivity of got[at[j]] wherever that is not None."""
        hit = np.fromiter((g is not None for g in got), dtype=bool, count=len(got))
        if hit.any():
            vals = np.zeros(len(got))
            vals[hit] = [g for g in got if g is not None]
            rows = hit[at]
            out[rows] = self._sensitivity(vals[at[rows]])

    def state_dict(self) -> dict:
        return {"ema": self.ema, "signal": self.signal, "all": self._all,
                "sample": dict(self._sample), "bucket": dict(self._bucket)}

    def load_state_dict(self, state: dict) -> None:
        signal = state.get("signal", "recall")        # states saved before the loss signal
        if signal != self.signal:
            raise ValueError(f"the saved sensitivity state measured {signal!r}, this run "
                             f"--sb-sensitivity-signal {self.signal!r}: resume with "
                             f"--sb-sensitivity-signal {signal} (or --sb-fresh-state)")
        self.ema = float(state["ema"])
        self._all = None if state.get("all") is None else float(state["all"])
        self._sample = {int(k): float(v) for k, v in state["sample"].items()}
        self._bucket = {int(k): float(v) for k, v in state["bucket"].items()}


class LazySensitivity:
    """``unit_sensitivity`` of one packing, estimated the first time it is asked for and then
    kept (a race that plans only some of its candidates estimates only theirs); ``rank``: that
    DP rank's row alone ([1, m]); without a tracker, None."""

    def __init__(self, batch, tracker, rank=None):
        self.batch, self.tracker, self.rank = batch, tracker, rank
        self.done, self.value = tracker is None, None

    def __call__(self):
        if not self.done:
            v = unit_sensitivity(self.batch, self.tracker)
            self.value = v if self.rank is None else v[self.rank:self.rank + 1]
            self.done = True
        return self.value


def unit_sensitivity(batch, tracker: SensitivityTracker) -> np.ndarray:
    """[dp, m] mean sensitivity of each micro-batch's segments of a ``BatchPlan`` (0 for an
    empty micro-batch): the per-unit sensitivity DST takes, from the plan's segment array and
    CSR offsets."""
    dp, m = batch.dp, batch.num_microbatches
    segs, counts = batch.segment_array(), np.diff(batch.unit_csr()[0])
    if not len(segs):
        return np.zeros((dp, m))
    est = tracker.estimate(segs[:, 0], segs[:, 2] - segs[:, 1])
    sums = np.bincount(np.repeat(np.arange(dp * m), counts), weights=est, minlength=dp * m)
    return (sums / np.maximum(counts, 1)).reshape(dp, m)
