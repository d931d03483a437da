"""SAB's candidate ranks agreed with a fixed number of bytes whatever the DP size (issue 77):
``candidate_rounds`` is one DP rank's generator of rounds (the form of ``policy.dst_rounds``: it
yields its part, ``{"sum": ..., "max": ...}``, and is sent the group's) that ends with
``slots.candidates`` of every rank's makespan, exactly, without gathering the makespans.

The candidates are the k smallest and the k largest makespans (ties to the lower rank), so each
end is "the k smallest keys (key, rank)" (key: the makespan, or its negative). Each round every
rank still on an end's boundary adds its key to a histogram of ``BINS`` bins over the boundary's
[min, max] (summed), with each bin's min and max key (maxima); the bins below the one where the
count reaches k are in, that bin is the next boundary, with its exact range. Where its keys are
all equal the ties are split the same way by rank (distinct integers). Once an end's members
(in, and the boundary) are at most ``GATHERED``, they are gathered into ``SLOTS`` hash slots
(summed: count, rank + 1, key; a rank whose slot two ranks share tries again with the next salt)
and every rank sorts them exactly. A refinement round is 3 x ``BINS`` floats per end refined (at
most 3 KB), a gather round 3 x ``SLOTS`` (6 KB): at DP 4,096 four to six rounds, about 18 KB,
where the makespans' gather was 32 KB and grew 8 bytes a rank.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from typing import Generator

import numpy as np

from .slots import extremes

BINS = 64           # histogram bins a refinement round splits an end's boundary into
GATHERED = 32       # an end's members gathered once at most this many
SLOTS = 256         # hash slots of a gather round (members placed, 2 x GATHERED at most)


def _bins(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Each of ``x``'s bin in [0, BINS) over [lo, hi] (all 0 where lo == hi)."""
    if hi <= lo:
        return np.zeros(x.shape, dtype=np.int64)
    return np.clip(np.floor((x - lo) / (hi - lo) * BINS), 0, BINS - 1).astype(np.int64)


class _End:
    """One end's state on one rank: the boundary's range, how many are in below it, whether
    this rank is in, on the boundary, or out; by key, then (ties) by rank."""

    def __init__(self, key: float, rank: int, k: int, dp: int, lo: float, hi: float):
        self.key, self.rank, self.k, self.dp = float(key), int(rank), int(k), int(dp)
        self.lo, self.hi, self.by_rank, self.below = lo, hi, False, 0
        self.state = "boundary"

    def value(self) -> float:
        return float(self.rank) if self.by_rank else self.key

    def parts(self) -> tuple:
        """(histogram [BINS], bins' max [BINS], bins' -min [BINS]) of this rank's part."""
        hist, top, low = np.zeros(BINS), np.full(BINS, -np.inf), np.full(BINS, -np.inf)
        if self.state == "boundary":
            b = int(_bins(np.array([self.value()]), self.lo, self.hi)[0])
            hist[b], top[b], low[b] = 1.0, self.value(), -self.value()
        return hist, top, low

    def advance(self, hist: np.ndarray, top: np.ndarray, low: np.ndarray) -> int:
        """The round's outcome: the next boundary; the members (in + boundary) now."""
        need = self.k - self.below
        cum = np.cumsum(hist)
        j = int(np.searchsorted(cum, need, side="left"))      # the bin where k is reached
        if self.state == "boundary":
            b = int(_bins(np.array([self.value()]), self.lo, self.hi)[0])
            self.state = "in" if b < j else "boundary" if b == j else "out"
        self.below += int(cum[j] - hist[j])
        self.lo, self.hi = -float(low[j]), float(top[j])
        if self.lo == self.hi and not self.by_rank:              # equal keys: by rank
            self.by_rank = True
            self.lo, self.hi = 0.0, float(self.dp - 1)
        return self.below + int(hist[j])


def _slot(rank: int, salt: int) -> int:
    """A rank's hash slot at ``salt`` (splitmix64 of both: two ranks that share one slot
    share the next salt's with chance 1 / SLOTS)."""
    m = (1 << 64) - 1
    x = (rank + (salt + 1) * 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return (x ^ (x >> 31)) % SLOTS


def candidate_rounds(span: float, rank: int, dp: int, k: int
                     ) -> Generator[dict, dict, np.ndarray]:
    """DP rank ``rank``'s rounds of the candidates (ascending ranks) of every rank's makespan
    (``span`` its own): ``slots.candidates`` with ``k`` = its 2 rounds + partners + 1."""
    if dp <= 2 * k:
        return np.arange(dp)
    got = yield {"sum": {}, "max": {"top": float(span), "low": -float(span)}}
    ends = [_End(span, rank, k, dp, -got["low"], got["top"]),          # smallest makespans
            _End(-span, rank, k, dp, -got["top"], got["low"])]         # largest
    members = [dp, dp]
    while max(members) > GATHERED:      # an end small enough is not refined further
        refine = [i for i in range(2) if members[i] > GATHERED]
        parts = {i: ends[i].parts() for i in refine}
        got = yield {"sum": {f"h{i}": p[0] for i, p in parts.items()},
                     "max": {**{f"t{i}": p[1] for i, p in parts.items()},
                             **{f"l{i}": p[2] for i, p in parts.items()}}}
        for i in refine:
            members[i] = ends[i].advance(got[f"h{i}"], got[f"t{i}"], got[f"l{i}"])
    mine = any(e.state != "out" for e in ends)
    placed: dict = {}
    salt = 0
    while True:
        block = np.zeros((SLOTS, 3))
        slot = _slot(rank, salt)
        if mine and rank not in placed:
            block[slot] = (1.0, rank + 1.0, float(span))
        got = yield {"sum": {"slots": block}, "max": {}}
        rows = np.asarray(got["slots"])
        alone = rows[:, 0] == 1
        for r, s in zip(rows[alone, 1].astype(np.int64) - 1, rows[alone, 2]):
            placed[int(r)] = float(s)
        if not (rows[:, 0] > 1).any():
            break
        salt += 1
    return extremes(np.array(list(placed.values())), np.array(list(placed), dtype=np.int64), k)
