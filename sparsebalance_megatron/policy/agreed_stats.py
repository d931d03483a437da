"""The two statistics DST reads from every DP rank's calibration, agreed where each rank has
calibrated only its own pipeline (issue 77): whether a slow GPU stands out of the calibration
factors (``bands.straggler_present``: narrower bands) and the median of the latency model's
recent errors (the 'auto' raise headroom, ``step/choice.headroom``).

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

from typing import Generator, Optional

import numpy as np

from .bands import MAD_SIGMA, excess_matters, excess_stands_out, straggler_present

EXACT_VALUES = 2048      # values per statistic the group shares exactly (16 KB)
BINS = 4096              # histogram bins (plus one below and one above the range)
ERRORS_PER_RANK = 8      # each rank's last errors: the 'auto' headroom's 8 steps
FACTOR_LOG2 = (-8.0, 8.0)      # factors 1/256 .. 256
SPREAD_LOG2 = (-40.0, 8.0)     # absolute deviations from the median


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
