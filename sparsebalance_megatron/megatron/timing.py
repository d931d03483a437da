"""Per-micro-batch timings from Megatron's schedule through ``config.timers``.

Megatron's pipeline schedules call ``config.timers('forward-compute').start()/.stop()`` around
each micro-batch's forward and ``'backward-compute'`` around its backward. ``MicrobatchTimers``
records every interval in order: wall clock on CPU, CUDA events on a GPU (resolved once per step,
so the schedule never synchronises). Also usable as Megatron's ``Timers`` where only
``__call__(name, log_level=...)`` is needed.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class _Interval:
    def __init__(self, owner: "MicrobatchTimers", name: str):
        self.owner, self.name = owner, name
        self._start = None

    def start(self, barrier: bool = False):
        self._start = self.owner._now()

    def stop(self, barrier: bool = False):
        if self._start is not None:
            self.owner._records[self.name].append((self._start, self.owner._now()))
            self._start = None

    def reset(self):
        self._start = None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return self.owner.total_s(self.name)


class MicrobatchTimers:
    """Collects (start, stop) pairs per timer name for one training step."""

    def __init__(self, use_cuda_events: bool | None = None):
        self.use_cuda = torch.cuda.is_available() if use_cuda_events is None else use_cuda_events
        self._records: dict[str, list] = defaultdict(list)
        self._timers: dict[str, _Interval] = {}

    def __call__(self, name: str, log_level: int | None = None, barrier: bool = False) -> _Interval:
        if name not in self._timers:
            self._timers[name] = _Interval(self, name)
        return self._timers[name]

    def _now(self):
        if self.use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def durations_s(self, name: str) -> list[float]:
        """Seconds of every recorded interval of ``name``, in call order."""
        out = []
        for a, b in self._records.get(name, []):
            if self.use_cuda:
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                out.append(b - a)
        return out

    def total_s(self, name: str) -> float:
        return float(sum(self.durations_s(name)))

    def reset(self) -> None:
        self._records.clear()
        for t in self._timers.values():
            t.reset()

    # Megatron's Timers API, for code that logs through config.timers.
    def log(self, *args, **kwargs):
        pass

    def write(self, *args, **kwargs):
        pass
