"""Narrower tolerance bands beside the configured one (issue 27: absorb a persistent straggler).

DST cuts a load unit (dp rank, pipeline stage) only above (1 + p) x the anchor (``--sb-tolerance``
p, default 0.1). The band guards against the latency model's error: a unit a few percent above
the anchor may only look heavy. But a GPU that is persistently 10% slow (the per-(DP rank,
pipeline rank) calibration carries it into the costs) sits inside that band, so nothing is cut
and the whole step waits for it.

So when the calibration says a GPU is persistently slower than its peers by more than half the
band (``straggler_present`` on the [dp, pp] compute-time factors the costs were scaled by), and
by more than the factors' own noise could make one of them (per-step timing noise leaves every
factor a little off, and the largest of thousands of noisy factors is well above the median:
at a spread of 2.4%, as the planner-cost study's stand-in timings give, the largest of 256 is
6-7% up, and planning the narrow bands there would cut density for noise),
the band search plans the configured band and ``NARROW_FRACTIONS`` of it (p/2, p/4 and
0: cut everything above the anchor) in the same batched pass (``dst_band``; the
candidates are rows of the same vectorised calls), and keeps a narrower band's plan only when it
meets the same floors and quality condition and is predicted faster than the wider band's by more
than ``NARROW_MARGIN``: a cut that buys less than that is within what the band exists to ignore,
and the wider band keeps more density. The do-no-harm stand-down (``policy.stand_down``) still
replaces any plan predicted slower than static. Without such a GPU the band is the configured
one alone: ``--sb-tolerance`` keeps its meaning (a narrower band would also cut the structural
imbalance the user chose to tolerate, e.g. a slightly heavier LM-head stage).

Pure; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

NARROW_FRACTIONS = (0.5, 0.25, 0.0)   # narrower bands planned beside p, as fractions of p
NARROW_MARGIN = 2e-3                  # a narrower band must be predicted this much faster
NOISE_MARGIN = 1.5                    # sigmas a straggler stands above where the largest
#                                       of N noisy factors lies, sqrt(2 ln N) sigmas up


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


MAD_SIGMA = 1.4826      # a normal sample's standard deviation per median absolute deviation


def excess_matters(median: float, top: float, tolerance: float) -> bool:
    """The slowest factor ``top`` is more than half the band (``tolerance`` x the median) above
    the ``median`` one (``straggler_present``'s first test)."""
    return top - median > median * float(tolerance) / 2.0


def excess_stands_out(median: float, top: float, spread: float, n: int) -> bool:
    """``top``'s excess over the ``median`` stands out of the noise of ``n`` factors of this
    ``spread`` (a standard deviation): more than sqrt(2 ln n) + ``NOISE_MARGIN`` of it."""
    return top - median > spread * (math.sqrt(2.0 * math.log(n)) + NOISE_MARGIN)


def band_ladder(anchor: str, tolerance: float) -> list[tuple[str, float]]:
    """(anchor, tolerance) candidates: the configured band first, then the narrower ones (none
    for the ``max`` anchor, which never cuts, or a band already 0)."""
    cands = [(anchor, float(tolerance))]
    if anchor == "max" or tolerance <= 0:
        return cands
    return cands + [(anchor, float(tolerance) * f) for f in NARROW_FRACTIONS]


def pick_band(plans: list, step_time=lambda p: p.report.step_time_planned_s):
    """From plans of ``band_ladder`` order (widest first) that all meet the floors, the one kept:
    a narrower band replaces the current choice only when predicted faster by more than
    ``NARROW_MARGIN`` (relative), so equal speed keeps the wider band's density."""
    best = plans[0]
    for p in plans[1:]:
        if step_time(p) < step_time(best) * (1.0 - NARROW_MARGIN):
            best = p
    return best
