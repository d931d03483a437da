"""The two statistics DST reads from every DP rank's calibration: whether a slow GPU stands out
of the calibration factors (``straggler_present``: narrower bands, ``bands``) and the median of
the latency model's recent errors (the 'auto' raise headroom, ``step/choice.headroom``), agreed
where each rank has calibrated only its own pipeline (issue 77).

Both are medians over the group, which no sum or maximum gives. ``agreed_rounds`` makes them in
the rounds' form of ``dst_rounds`` (a rank yields its part, ``{"sum": ..., "max": ...}``, and
is sent the group's), with a fixed number of bytes whatever the DP size:

- where the group's values fit ``EXACT_VALUES`` floats, they are gathered (``cat``: every
  rank's in DP order, at most that many), and the medians are ``np.median``'s, as a rank that
  calibrated every rank computed them;
- else from histograms summed over the group (``BINS`` bins; the factors' in log2, the errors'
  linear up to the headroom's cap, which caps the median anyway): the median interpolated
  within its bin, a relative error well under 0.1% for factors; the spread (the median absolute
  deviation) needs a second round around that median, made only where the slowest factor is far
  enough above it to matter (``bands.excess_matters``).

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import math
from typing import Generator, Optional

import numpy as np

EXACT_VALUES = 2048      # values per statistic the group shares exactly (16 KB)
BINS = 4096              # histogram bins (plus one below and one above the range)
ERRORS_PER_RANK = 8      # each rank's last errors: the 'auto' headroom's 8 steps
FACTOR_LOG2 = (-8.0, 8.0)      # factors 1/256 .. 256
SPREAD_LOG2 = (-40.0, 8.0)     # absolute deviations from the median
MAD_SIGMA = 1.4826        # a normal sample's standard deviation per median absolute deviation
NOISE_MARGIN = 1.5        # sigmas a straggler stands above where the largest of N noisy
#                           factors lies, sqrt(2 ln N) sigmas up


def straggler_present(rank_scale: Optional[np.ndarray], tolerance: float) -> bool:
    """Some (DP rank, pipeline rank) computes more than (1 + p/2) x the median one's time, and
    stands out of the factors' noise: its excess over the median is more than
    (sqrt(2 ln N) + ``NOISE_MARGIN``) x their spread (1.4826 x the median absolute deviation, a
    standard deviation that the few slow GPUs themselves do not inflate; sqrt(2 ln N) is about
    where the largest of N normal draws lies). Noise-free factors (a spread of 0) need only the
    half band. ``rank_scale``: [dp, pp] factors, the calibration's ``correction_grid``; None:
    unknown."""
    if rank_scale is None:
        return False
    s = np.asarray(rank_scale, dtype=np.float64)
    if s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"rank_scale must be positive finite [dp, pp] factors, got {s.tolist()}")
    median = float(np.median(s))
    top = float(s.max())
    if not excess_matters(median, top, tolerance):
        return False
    return excess_stands_out(median, top, MAD_SIGMA * float(np.median(np.abs(s - median))),
                             s.size)


def excess_matters(median: float, top: float, tolerance: float) -> bool:
    """The slowest factor ``top`` is more than half the band (``tolerance`` x the median) above
    the ``median`` one (``straggler_present``'s first test)."""
    return top - median > median * float(tolerance) / 2.0


def excess_stands_out(median: float, top: float, spread: float, n: int) -> bool:
    """``top``'s excess over the ``median`` stands out of the noise of ``n`` factors of this
    ``spread`` (a standard deviation): more than sqrt(2 ln n) + ``NOISE_MARGIN`` of it."""
    return top - median > spread * (math.sqrt(2.0 * math.log(n)) + NOISE_MARGIN)


def histogram(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """[BINS + 2] counts of ``x`` over [lo, hi) in ``BINS`` equal bins, with one bin below (and
    -inf) and one above."""
    t = (np.asarray(x, dtype=np.float64) - lo) * (BINS / (hi - lo))
    idx = np.clip(np.floor(np.nan_to_num(t, neginf=-1.0, posinf=BINS)), -1, BINS)
    return np.bincount(idx.astype(np.int64) + 1, minlength=BINS + 2).astype(np.float64)


def histogram_median(counts: np.ndarray, lo: float, hi: float) -> float:
    """The median of the values ``histogram`` counted, each bin's values taken as spread evenly
    through it (the bins below and above: ``lo`` and ``hi``)."""
    n = float(counts.sum())
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, n / 2.0, side="left"))
    if i == 0:
        return lo
    if i == BINS + 1:
        return hi
    before = cum[i] - counts[i]
    return float(lo + (i - 1 + (n / 2.0 - before) / counts[i]) * (hi - lo) / BINS)


def agreed_rounds(factors: Optional[np.ndarray], errors: np.ndarray, *, dp: int,
                  tolerance: float, error_cap: float
                  ) -> Generator[dict, dict, tuple[bool, Optional[float]]]:
    """A DP rank's rounds of (a slow GPU stands out, the median recent error or None
    before any). ``factors``: its pipeline's [pp] calibration factors (None: no calibration,
    no straggler); ``errors``: its recent errors, the last ``ERRORS_PER_RANK`` used;
    ``tolerance``: DST's band (the excess that matters); ``error_cap``: what the median is
    capped at by its reader (the histogram's range)."""
    errors = np.asarray(errors, dtype=np.float64).reshape(-1)[-ERRORS_PER_RANK:]
    have = np.zeros(ERRORS_PER_RANK)
    have[:errors.size] = 1.0
    own_e = np.zeros(ERRORS_PER_RANK)
    own_e[:errors.size] = errors
    exact_e = dp * ERRORS_PER_RANK <= EXACT_VALUES
    f = None if factors is None else np.asarray(factors, dtype=np.float64).reshape(-1)
    exact_f = f is not None and dp * f.size <= EXACT_VALUES
    parts: dict = {"sum": {}, "max": {}, "cat": {}}
    if exact_e:
        parts["cat"].update(errors=own_e, have=have)
    else:
        parts["sum"]["errors"] = histogram(errors, 0.0, error_cap)
    if f is not None:
        if exact_f:
            parts["cat"]["factors"] = f
        else:
            parts["sum"]["factors"] = histogram(np.log2(f), *FACTOR_LOG2)
            parts["max"]["top"] = float(f.max())
    got = yield parts
    if exact_e:
        kept = np.asarray(got["errors"])[np.asarray(got["have"]) > 0]
        error = float(np.median(kept)) if kept.size else None
    else:
        counts = np.asarray(got["errors"])
        error = histogram_median(counts, 0.0, error_cap) if counts.sum() else None
    if f is None:
        return False, error
    if exact_f:
        return straggler_present(np.asarray(got["factors"]).reshape(-1, f.size),
                                 tolerance), error
    median = 2.0 ** histogram_median(np.asarray(got["factors"]), *FACTOR_LOG2)
    top, n = float(got["top"]), dp * f.size
    if not excess_matters(median, top, tolerance):
        return False, error
    with np.errstate(divide="ignore"):
        dev = np.log2(np.abs(f - median))
    got = yield {"sum": {"spread": histogram(dev, *SPREAD_LOG2)}, "max": {}}
    counts = np.asarray(got["spread"])
    mad = 0.0 if counts[0] * 2 > counts.sum() else \
        2.0 ** histogram_median(counts, *SPREAD_LOG2)
    return excess_stands_out(median, top, MAD_SIGMA * mad, n), error
