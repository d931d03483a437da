"""DST's band search (``band_search``) and the narrower bands planned beside the configured one
for a persistently slow GPU (``agreed_stats.straggler_present``; issue 27): docs/DESIGN.md
section 5, steps 3 and "Floors". A narrower band (``NARROW_FRACTIONS`` of p) is kept only where
it meets the same floors and quality condition and is predicted faster by more than
``NARROW_MARGIN``; where the configured band misses the floors it is widened in
``SEARCH_ROUNDS`` rounds of 3 tolerances.
Every candidate is known before any verdict (``candidate_tree``), so a rank plans them all in one
pass (``dst_band``) and replays the search on the agreed verdicts (``dst_ranks``).

Pure; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .dst_settings import DSTSettings

NARROW_FRACTIONS = (0.5, 0.25, 0.0)   # narrower bands planned beside p, as fractions of p
NARROW_MARGIN = 2e-3                  # a narrower band must be predicted this much faster
SEARCH_ROUNDS = 3                     # widening rounds (with 2 a 3x-slow GPU stayed uncut)


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


def band_search(settings: DSTSettings, plans, *, narrow: bool = False, quality=None,
                guard=None):
    """The band search (module docstring): the plan kept. ``plans(candidates)``: the plans of a
    round's (anchor, tolerance) candidates (quality costs set for the quality objective).
    ``narrow``: a slow GPU stands out (``agreed_stats.straggler_present``): the narrower bands
    of ``band_ladder`` are tried first; ``guard``: what a narrower band's density-order plan
    must not lose in quality (``guard(plan)``: its quality cost)."""
    anchor, tolerance = settings.anchor, settings.tolerance
    floors = settings.density_floor * settings.d0, settings.stage_density_floor * settings.d0

    def meets(p) -> bool:
        return p.report.meets(*floors)

    best, *narrower = plans(band_ladder(anchor, tolerance) if narrow else [(anchor, tolerance)])
    if guard is not None and quality is None:       # a narrower band must not lose quality
        for p in narrower:
            p.report.quality_cost = guard(p)
    ok = [p for p in narrower if meets(p)]
    if (settings.density_floor <= 0 and settings.stage_density_floor <= 0 and quality is None) \
            or anchor == "max" or meets(best):
        return pick_band([best] + ok)
    lo, hi = max(float(tolerance), 1e-3), 10.0
    for rnd in range(SEARCH_ROUNDS):
        ts = _tolerances(lo, hi)
        cands = [(anchor, float(t)) for t in ts]
        found = plans(([("max", tolerance)] if rnd == 0 else []) + cands)
        if rnd == 0:
            ok.append(found.pop(0))                                  # no cuts: always meets
        hits = [i for i, p in enumerate(found) if meets(p)]
        ok += [found[i] for i in hits]
        if hits:
            lo, hi = (float(ts[hits[0] - 1]) if hits[0] > 0 else lo), float(ts[hits[0]])
        else:
            lo = float(ts[-1])
    return min(ok, key=lambda p: p.report.step_time_planned_s)


def _tolerances(lo: float, hi: float) -> np.ndarray:
    """A search round's 3 tolerances, spaced geometrically inside (lo, hi)."""
    return lo * (hi / lo) ** (np.arange(1, 4) / 4)


@lru_cache(maxsize=64)
def candidate_tree(settings: DSTSettings, narrow: bool) -> tuple:
    """Every (anchor, tolerance) ``band_search`` can ask for, in its order: the configured
    band (and the narrower ones with ``narrow``), the no-cut plan, then every round's 3
    tolerances in each of the 4 sub-intervals the previous round can leave. Made once per
    settings and ``narrow``: every rank's and step's alike."""
    anchor, tol = settings.anchor, settings.tolerance
    out = list(band_ladder(anchor, tol) if narrow else [(anchor, tol)])
    out.append(("max", tol))
    level = [(max(float(tol), 1e-3), 10.0)]
    for _ in range(SEARCH_ROUNDS):
        nxt = []
        for lo, hi in level:
            ts = _tolerances(lo, hi)
            out += [(anchor, float(t)) for t in ts]
            edges = [lo] + [float(t) for t in ts]
            nxt += [(edges[i], float(ts[i])) for i in range(3)] + [(float(ts[-1]), hi)]
        level = nxt
    return tuple(dict.fromkeys(out))                # each once, in first-asked order
