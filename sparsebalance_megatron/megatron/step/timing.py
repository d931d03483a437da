"""Per-micro-batch timings from Megatron's schedule through ``config.timers``.

Megatron's pipeline schedules call ``config.timers('forward-compute').start()/.stop()`` around
each micro-batch's forward and ``'backward-compute'`` around its backward. ``MicrobatchTimers``
records every interval in order: wall clock on CPU, CUDA events on a GPU (resolved once per step,
so the schedule never synchronises). ``step_timings()``, called once per step from the
finalize hook, returns the step's per-micro-batch seconds and the time since the schedule started
(``forward-backward``), then starts a new step. ``TeeTimers`` feeds Megatron's ``Timers`` and ours
from one ``config.timers``.
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

    def open_for_s(self, name: str) -> float | None:
        """Seconds since the still-open interval ``name`` started (None if it is not open)."""
        timer = self._timers.get(name)
        if timer is None or timer._start is None:
            return None
        now = self._now()
        if self.use_cuda:
            now.synchronize()
            return timer._start.elapsed_time(now) / 1e3
        return now - timer._start

    def step_timings(self) -> dict:
        """{'fwd_s': [...], 'bwd_s': [...], 'step_s': seconds since the schedule began} of the
        step so far; then the records are cleared for the next step."""
        out = {"fwd_s": self.durations_s("forward-compute"),
               "bwd_s": self.durations_s("backward-compute"),
               "step_s": self.open_for_s("forward-backward")}
        self._records.clear()
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


class _TeeInterval:
    def __init__(self, megatron_timer, ours: _Interval):
        self._m, self._o = megatron_timer, ours

    def start(self, barrier: bool = False):
        self._o.start()
        self._m.start(barrier=barrier)

    def stop(self, barrier: bool = False):
        self._m.stop(barrier=barrier)
        self._o.stop()

    def __getattr__(self, name):
        return getattr(self._m, name)


class TeeTimers:
    """Megatron's ``Timers`` and our ``MicrobatchTimers`` behind one object: every interval
    Megatron times is also recorded per call; everything else is Megatron's."""

    def __init__(self, megatron_timers, ours: MicrobatchTimers):
        self.megatron_timers, self.ours = megatron_timers, ours

    def __call__(self, name, log_level=None, barrier: bool = False):
        return _TeeInterval(self.megatron_timers(name, log_level), self.ours(name))

    def __getattr__(self, name):
        return getattr(self.megatron_timers, name)


def install_timers_tee(ours) -> None:
    """Megatron's global ``Timers`` -> ``TeeTimers(Timers, ours)``.

    ``train()`` sets ``config.timers = get_timers()`` and ``evaluate()`` restores it from there,
    so the tee is seen by every schedule. Targets megatron-core >=0.19.2,<0.21
    (``megatron.training.global_vars._GLOBAL_TIMERS``); idempotent; a test fails if the
    attribute disappears.
    """
    from megatron.training import global_vars

    current = global_vars._GLOBAL_TIMERS
    if current is None:
        raise RuntimeError("Megatron's timers are not set up (parse_and_validate_args first)")
    if isinstance(current, TeeTimers):
        current.ours = ours
        return
    global_vars._GLOBAL_TIMERS = TeeTimers(current, ours)
