"""Online calibration of a latency model: one multiplicative correction per rank, and within a
pipeline one per (DP rank, pipeline rank).

Each calibration moves a rank's factor toward measured / predicted by an EMA (weight
``calibration_ema``), the ratio clipped to ``[1 / CALIBRATION_CLIP, CALIBRATION_CLIP]`` times the
current factor so that one outlier timing cannot throw the factor off; unusable samples keep it.
The relative errors of the corrected predictions are kept for ``recent_error`` (the raise
headroom of DST). ``LatencyModel`` inherits this.

With PP > 1 one GPU of a DP rank's pipeline can be slower than its peers (thermal throttling, a
bad link): ``calibrate_stages`` learns, by the same EMA and clip, each pipeline rank's measured /
predicted relative to its DP rank's, so the stage factor is 1 when every stage is off by the same
ratio and the DP rank's factor times the stage factor follows that GPU alone
(``correction_grid``, what ``UnitCosts.from_latency`` plans with).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Optional

import numpy as np

ERROR_HISTORY = 4096
"""Calibration errors (one per rank and step) kept for ``recent_error``."""
CALIBRATION_CLIP = 4.0
"""One calibration update moves a rank's factor toward measured / predicted clipped to
``[old / CALIBRATION_CLIP, old * CALIBRATION_CLIP]``: a single outlier (a 1e9 s glitch, a
paused process, a timer that read 0) moves the factor by at most ``1 + w * (CLIP - 1)`` (x1.9, or
/1.9, at the default EMA weight w = 0.3) instead of to the outlier, while a lasting slowdown is
still followed: at w = 0.3 the factor reaches 90% of a 10x slowdown in 8 steps (7 unclipped), of
a 100x one in 11 (7 unclipped)."""

class Calibration:
    """Per-rank correction factors and the recent errors of the corrected predictions."""

    def init_calibration(self, calibration_ema: float) -> None:
        if not (0.0 < calibration_ema <= 1.0):
            raise ValueError(f"calibration_ema={calibration_ema!r}: expected a value in (0, 1]")
        self.calibration_ema = float(calibration_ema)
        self._correction: dict[int, float] = {}
        self._stage_correction: dict[tuple[int, int], float] = {}
        self._errors: deque = deque(maxlen=ERROR_HISTORY)
        self._warned_bad_measurement = False
        self._warned_clipped = False

    def correction(self, rank: Optional[int]) -> float:
        return self._correction.get(int(rank), 1.0) if rank is not None else 1.0

    def calibrate(self, rank: int, predicted_s, measured_s) -> None:
        """EMA update of ``rank``'s factor toward measured / predicted (sums over the arrays),
        the ratio clipped to ``[1 / CALIBRATION_CLIP, CALIBRATION_CLIP]`` x the current factor.

        ``predicted_s`` must be the *uncorrected* prediction. A NaN, inf, negative, zero, missing
        or non-numeric sample (any element of it) keeps the previous factor and warns once; a
        clipped outlier warns once.
        """
        try:
            p = np.asarray(predicted_s if predicted_s is not None else np.nan, dtype=np.float64)
            m = np.asarray(measured_s if measured_s is not None else np.nan, dtype=np.float64)
        except (TypeError, ValueError):
            p = m = np.asarray(np.nan)
        ps, ms = float(p.sum()) if p.size else math.nan, float(m.sum()) if m.size else math.nan
        ok = (p.shape == m.shape and np.all(np.isfinite(p)) and np.all(np.isfinite(m))
              and np.all(m >= 0) and ps > 0 and ms > 0)
        if not ok:
            if not self._warned_bad_measurement:
                warnings.warn(f"latency calibration of rank {rank}: unusable measurement "
                              f"(predicted={ps!r}, measured={ms!r}); keeping the previous "
                              f"correction {self.correction(rank):.3f}", stacklevel=2)
                self._warned_bad_measurement = True
            return
        w = self.calibration_ema
        old = self.correction(rank)
        ratio = ms / ps
        clipped = min(max(ratio, old / CALIBRATION_CLIP), old * CALIBRATION_CLIP)
        if clipped != ratio and not self._warned_clipped:
            warnings.warn(f"latency calibration of rank {rank}: measured / predicted = "
                          f"{ratio:.3g} ({ms:.3g} s / {ps:.3g} s) is more than "
                          f"{CALIBRATION_CLIP:g}x off the current correction {old:.3g}; this update uses {clipped:.3g} "
                          f"(an outlier moves the factor by a bounded step)", stacklevel=2)
            self._warned_clipped = True
        self._errors.append(abs(old * ps - ms) / ms)
        self._correction[int(rank)] = (1.0 - w) * old + w * clipped

    def calibrate_ranks(self, predicted_s, measured_s, first: int = 0) -> None:
        """One step's calibration of DP ranks ``first``, ``first + 1``, ...: ``predicted_s``,
        ``measured_s`` [ranks, pp] uncorrected predicted and measured busy seconds per (DP
        rank, pipeline rank) (in a run one row: a DP rank calibrates its own pipeline). Each DP
        rank's factor by ``calibrate`` (a row with a missing or NaN time keeps it) and its
        pipeline ranks' by ``calibrate_stages``."""
        predicted = np.asarray(predicted_s, dtype=np.float64)
        measured = np.asarray(measured_s, dtype=np.float64)
        if self._calibrate_all(predicted, measured, int(first)):
            return
        for i in range(predicted.shape[0]):
            ok = np.isfinite(measured[i]).all()      # missing/NaN: keep the previous factor
            r = int(first) + i
            self.calibrate(r, predicted[i] if ok else None, measured[i] if ok else None)
            self.calibrate_stages(r, predicted[i], measured[i])

    def _calibrate_all(self, p: np.ndarray, m: np.ndarray, first: int = 0) -> bool:
        """``calibrate_ranks`` as array operations over every DP rank, for the common step where
        every time is usable and no update needs a warning: the same operations per element in
        the same order as ``calibrate`` and ``calibrate_stages``, so the factors and errors are
        the loop's, bit for bit (a unit test compares them). False, with nothing changed, where
        the loop must decide (an unusable time, a first clipped update)."""
        if p.ndim != 2 or p.shape != m.shape or p.shape[0] == 0 or p.shape[1] == 0:
            return False
        if not (np.isfinite(p).all() and np.isfinite(m).all() and (m >= 0).all()):
            return False
        ps, ms = p.sum(axis=1), m.sum(axis=1)
        if not ((ps > 0).all() and (ms > 0).all()):
            return False
        dp, pp = p.shape
        old = np.array([self._correction.get(first + r, 1.0) for r in range(dp)],
                       dtype=np.float64)
        ratio = ms / ps
        clipped = np.minimum(np.maximum(ratio, old / CALIBRATION_CLIP), old * CALIBRATION_CLIP)
        if not self._warned_clipped and (clipped != ratio).any():
            return False
        w = self.calibration_ema
        stage_rows = np.zeros(dp, dtype=bool)
        if pp >= 2:
            stage_rows = (p > 0).all(axis=1) & (m > 0).all(axis=1)
            rows = np.flatnonzero(stage_rows)
            s_old = np.array([[self._stage_correction.get((first + int(r), s), 1.0)
                               for s in range(pp)]
                              for r in rows], dtype=np.float64).reshape(rows.size, pp)
            overall = ms[rows] / ps[rows]
            s_ratio = (m[rows] / p[rows]) / overall[:, None]
            s_ratio = np.minimum(np.maximum(s_ratio, s_old / CALIBRATION_CLIP),
                                 s_old * CALIBRATION_CLIP)
            s_new = ((1.0 - w) * s_old + w * s_ratio).tolist()
        self._errors.extend((np.abs(old * ps - ms) / ms).tolist())
        for r, f in enumerate(((1.0 - w) * old + w * clipped).tolist()):
            self._correction[first + r] = f
        if stage_rows.any():
            for r, row in zip(rows.tolist(), s_new):
                for s, f in enumerate(row):
                    self._stage_correction[first + r, s] = f
        return True

    def stage_correction(self, rank: Optional[int], stage: int) -> float:
        """The factor of pipeline rank ``stage`` relative to DP rank ``rank``'s (1: no news)."""
        return 1.0 if rank is None else self._stage_correction.get((int(rank), int(stage)), 1.0)

    def correction_grid(self, dp: int, pp: int) -> np.ndarray:
        """[dp, pp] correction of every (DP rank, pipeline rank): rank factor x stage factor."""
        # one pass over the learned factors, not two look-ups per cell: the planner asks for
        # the grid a dozen times per draft (the same float64 products as correction(r) x
        # stage_correction(r, s); a factor never learned is 1)
        rank, stage = np.ones(dp), np.ones((dp, pp))
        for r, f in self._correction.items():
            if 0 <= r < dp:
                rank[r] = f
        for (r, s), f in self._stage_correction.items():
            if 0 <= r < dp and 0 <= s < pp:
                stage[r, s] = f
        return rank[:, None] * stage

    def calibrate_stages(self, rank: int, predicted_s, measured_s) -> None:
        """EMA update of each pipeline rank's factor of DP rank ``rank`` toward its measured /
        predicted over the DP rank's (``predicted_s``, ``measured_s``: [pp] uncorrected predicted
        and measured busy seconds per pipeline rank), clipped like ``calibrate``. A sample with
        one stage unusable (NaN, <= 0) keeps every factor; one stage: nothing to learn."""
        p = np.asarray(predicted_s, dtype=np.float64).ravel()
        m = np.asarray(measured_s, dtype=np.float64).ravel()
        if p.size < 2 or p.shape != m.shape or not (np.all(np.isfinite(p)) and
                                                    np.all(np.isfinite(m)) and
                                                    np.all(p > 0) and np.all(m > 0)):
            return
        overall = m.sum() / p.sum()
        w = self.calibration_ema
        for s in range(p.size):
            old = self.stage_correction(rank, s)
            ratio = float((m[s] / p[s]) / overall)     # a Python float: it is saved state
            ratio = min(max(ratio, old / CALIBRATION_CLIP), old * CALIBRATION_CLIP)
            self._stage_correction[int(rank), s] = (1.0 - w) * old + w * ratio

    def recent_error(self, last: int = 16) -> Optional[float]:
        """Median relative error |corrected prediction - measured| / measured over the ``last``
        calibrations (each taken before its own update: the error a plan made with the model
        would have had; one per rank and step); None before any."""
        if not self._errors:
            return None
        return float(np.median(list(self._errors)[-max(int(last), 1):]))

    def recent_errors(self, last: int = 8) -> list:
        """The ``last`` calibration errors (oldest first): in a run, this DP rank's own last
        steps (each rank calibrates its own pipeline), which the group's median agrees from
        (``policy.agreed_stats``)."""
        return list(self._errors)[-max(int(last), 1):]

    def corrections(self) -> dict[int, float]:
        return dict(self._correction)

    def calibration_state(self) -> dict:
        """What online calibration learned: per-rank factors and the recent errors."""
        out = {"corrections": {str(r): float(f) for r, f in self._correction.items()},
               "errors": [float(e) for e in self._errors]}
        if self._stage_correction:     # PP runs; an older state has none (all 1)
            out["stage_corrections"] = {f"{r},{s}": float(f)
                                        for (r, s), f in self._stage_correction.items()}
        return out

    def load_calibration_state(self, state: dict) -> None:
        """Restore ``calibration_state()`` (a resumed run continues where the saved one stood)."""
        self._correction.clear()
        self.load_corrections(state.get("corrections", {}))
        self._stage_correction.clear()
        for key, factor in state.get("stage_corrections", {}).items():
            f = float(factor)
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"stage correction {key}: {factor!r}: expected a number > 0")
            r, s = (int(x) for x in str(key).split(","))
            self._stage_correction[r, s] = f
        errors = [float(e) for e in state.get("errors", [])]
        if not all(math.isfinite(e) and e >= 0 for e in errors):
            raise ValueError("calibration errors must be finite numbers >= 0")
        self._errors.clear()
        self._errors.extend(errors)

    def load_corrections(self, corrections: dict) -> None:
        """Restore per-rank factors saved with ``corrections()`` (a resumed run)."""
        for rank, factor in corrections.items():
            f = float(factor)
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"correction of rank {rank}: {factor!r}: expected a number > 0")
            self._correction[int(rank)] = f
