"""The watchdog's entry into Megatron: built once the process groups exist (``hooks``' post-wrap
hook), ticked by every forward step, and told of the progress phases through Megatron's own
timers: ``train()``, ``evaluate()`` and ``save_checkpoint_and_time`` time evaluation, checkpoint
saves and loads, the optimizer step and (our forward step) data loading with the global
``Timers``; ``watch_megatron_phases`` wraps them, nothing of Megatron's loop is replaced.
"""

from __future__ import annotations

from typing import Optional

from .watchdog import Watchdog
from .watchdog_judgement import PHASES, WatchdogTiming, distributed_timeouts_s


class _PhaseTimer:
    """One of Megatron's timers that also marks its progress phase on the watchdog: entered
    before the timer starts (and its barrier), left after it stops (and its barrier)."""

    def __init__(self, timer, watchdog: Watchdog, phase: str):
        self._timer, self._wd, self._phase = timer, watchdog, phase

    def start(self, *args, **kwargs):
        self._wd.enter(self._phase)
        return self._timer.start(*args, **kwargs)

    def stop(self, *args, **kwargs):
        try:
            return self._timer.stop(*args, **kwargs)
        finally:
            self._wd.leave(self._phase)

    def __getattr__(self, name):
        return getattr(self._timer, name)


class PhaseTimers:
    """Megatron's ``Timers`` whose timers of ``PHASES`` also mark the watchdog's progress phases;
    everything else is Megatron's."""

    def __init__(self, timers, watchdog: Watchdog):
        self.timers, self.watchdog = timers, watchdog

    def __call__(self, name, *args, **kwargs):
        timer = self.timers(name, *args, **kwargs)
        phase = PHASES.get(name)
        return timer if phase is None else _PhaseTimer(timer, self.watchdog, phase)

    def __getattr__(self, name):
        return getattr(self.timers, name)


def watch_phases(tee, watchdog: Watchdog) -> None:
    """Mark progress phases through ``tee`` (our ``timing.TeeTimers``, Megatron's global timers,
    which ``train()``, ``evaluate()`` and ``save_checkpoint_and_time`` time their work with): its
    Megatron half becomes ``PhaseTimers`` (idempotent)."""
    inner = tee.megatron_timers
    if isinstance(inner, PhaseTimers):
        inner.watchdog = watchdog
    else:
        tee.megatron_timers = PhaseTimers(inner, watchdog)


def watch_megatron_phases(watchdog: Optional[Watchdog]) -> None:
    """``watch_phases`` on Megatron's global timers (``hooks`` has made them a ``TeeTimers``)."""
    if watchdog is not None:
        from megatron.training import global_vars

        watch_phases(global_vars._GLOBAL_TIMERS, watchdog)


def start_for_megatron(args, sb) -> Optional[Watchdog]:
    """This rank's watchdog (None with ``--sb-watchdog-seconds 0``), once Megatron's process
    groups exist; its thread starts at the first ``tick``."""
    from megatron.core import parallel_state as ps

    from . import comm

    w = sb.watchdog_seconds_value
    if w == 0 or not comm.is_initialized():
        return None
    init, after = distributed_timeouts_s(args)
    coords = dict(dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                  tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank())
    fixed = WatchdogTiming.for_threshold(w) if w else None
    at_init = fixed or WatchdogTiming.for_timeout(init)
    later = fixed or (WatchdogTiming.for_timeout(after) if after is not None else at_init)
    first: list = []

    def timing() -> WatchdogTiming:
        # Megatron shortens the groups' timeout after the first step of this run.
        it = wd.iteration
        if it is not None and not first:
            first.append(it)
        return later if it is not None and it > first[0] else at_init

    wd = Watchdog(comm.watchdog_store(), comm.rank(), comm.world_size(), timing, coords=coords)
    return wd
