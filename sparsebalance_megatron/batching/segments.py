"""A step's segments as arrays: the forms a global batch arrives in, checked once
(``checked_segments``: the sampler's [n, 3] int64 rows, their tuples made only where read), and
the micro-batches of a plan made from such rows (``SegmentRows``: a rank's lists of tuples made
when first read), so a packer, the planner's pipe and the plan's consumers move arrays, not a
Python object per segment.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from collections import abc
from itertools import chain
from typing import Optional

import numpy as np


class CheckedSegments(abc.Sequence):
    """A step's segments checked once (``checked_segments``): their [n, 3] int64 ``array``, and
    the (sample_id, start, end) tuples of Python ints, made only when read (a packer reads the
    array; a rank's own micro-batches index a few). Not to be modified."""

    def __init__(self, array: np.ndarray, tuples: Optional[list] = None):
        self.array, self._tuples = array, tuples

    def _list(self) -> list:
        if self._tuples is None:
            self._tuples = list(map(tuple, self.array.tolist()))
        return self._tuples

    def __len__(self) -> int:
        return self.array.shape[0]

    def __getitem__(self, i):
        if self._tuples is not None or isinstance(i, slice):
            return self._list()[i]
        return tuple(self.array[i].tolist())

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return self._list() == list(other)

    def __repr__(self) -> str:
        return f"CheckedSegments({len(self)} segments)"


def checked_segments(samples) -> CheckedSegments:
    """``samples`` checked and converted once: a list of (sample_id, start, end) triples, an
    [n, 3] integer array of them (``GlobalBatchSampler.next_bin_array``: copied, its tuples
    left for when they are read) or a [n] array of lengths (sample i = tokens [0, length_i)).
    Well-formed segments are checked in one vectorised pass; anything else goes through the
    per-item path, whose errors name the offending sample."""
    if type(samples) is CheckedSegments:
        return samples
    if isinstance(samples, np.ndarray) and samples.ndim == 1:
        samples = [(i, 0, int(n)) for i, n in enumerate(samples.tolist())]
    try:
        a = np.array(samples, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        a = None
    if a is not None and a.ndim == 2 and a.shape[1] == 3 and len(a) \
            and bool(np.all((a[:, 1] >= 0) & (a[:, 1] < a[:, 2]))):
        if not isinstance(samples, np.ndarray) and set(map(type, samples)) == {tuple} \
                and set(map(type, chain.from_iterable(samples))) == {int}:
            return CheckedSegments(a, list(samples))   # already triples of Python ints
        return CheckedSegments(a)
    out = []
    for k, seg in enumerate(samples):
        if isinstance(seg, (int, np.integer)):
            seg = (k, 0, int(seg))
        try:
            i, s, e = seg
            i, s, e = int(i), int(s), int(e)
        except (TypeError, ValueError):
            raise ValueError(f"sample {k}: {seg!r}: expected (sample_id, start, end)") from None
        if not 0 <= s < e:
            raise ValueError(f"sample {k}: segment {(i, s, e)}: expected 0 <= start < end")
        out.append((i, s, e))
    return CheckedSegments(np.asarray(out, dtype=np.int64).reshape(-1, 3), out)


def offsets_of(counts) -> np.ndarray:
    """[k + 1] int64 offsets of runs of ``counts`` [k] (a CSR's)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def take_runs(items: np.ndarray, counts: np.ndarray, units: np.ndarray) -> tuple:
    """(the runs ``units`` (any shape, read flat) of the CSR (``items``, ``counts``: every run's
    size, any shape, read flat) laid end to end in that order, their counts in ``units``'
    shape)."""
    flat = np.ravel(counts)
    want, first = flat[units.reshape(-1)], offsets_of(flat)[units.reshape(-1)]
    idx = np.repeat(first - np.cumsum(want) + want, want) + np.arange(int(want.sum()))
    return items[idx], want.reshape(units.shape)


class SegmentRows(abc.Sequence):
    """``BatchPlan.micro_batches`` of an unpickled plan: rank r's [m] lists of (sample id,
    start, end) tuples made from the [n, 3] ``segments`` when first read (a rank reads its own;
    the plan's consumers read the arrays), equal to the nested lists they stand for."""

    def __init__(self, segments: np.ndarray, offsets: np.ndarray, dp: int, m: int):
        self.segments, self.offsets, self._dp, self._m = segments, offsets, dp, m
        self._rows: dict = {}

    def __len__(self) -> int:
        return self._dp

    def __getitem__(self, r):
        r = range(self._dp)[r]
        if r not in self._rows:
            cut = self.offsets[r * self._m:(r + 1) * self._m + 1] - self.offsets[r * self._m]
            segs = list(map(tuple, self.segments[self.offsets[r * self._m]:
                                                 self.offsets[(r + 1) * self._m]].tolist()))
            self._rows[r] = [segs[a:b] for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]
        return self._rows[r]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"SegmentRows(dp={self._dp}, m={self._m}, segments={len(self.segments)})"
