"""A finished run whose launcher died ends normally: ``Watchdog.stop`` (``hooks.finish``) is as
guarded as its exit handler where the job's store is gone (torchrun hosts it; SIGKILLed, its
store's socket answers ``DistNetworkError: Broken pipe``)."""

from __future__ import annotations

import io

import pytest

from sparsebalance_megatron.megatron.runtime.watchdog import Watchdog, WatchdogTiming


class GoneStore:
    """A store whose launcher died (``gone``): every call then fails as torch's TCPStore client
    does."""

    def __init__(self, gone=True):
        self.calls, self.gone = 0, gone

    def _call(self, *a, **k):
        self.calls += 1
        if self.gone:
            raise RuntimeError("DistNetworkError: Broken pipe")   # a RuntimeError in torch

    set = get = check = add = _call


@pytest.mark.reliability(area="fault", case="the launcher SIGKILLed; the run finishes and "
                         "stops its watchdog (the job's store gone)",
                         expect="stop() returns, no exception, the rank is finished")
def test_stop_without_the_store_ends_quietly():
    store, out = GoneStore(), io.StringIO()
    wd = Watchdog(store, 0, 2, lambda: WatchdogTiming.for_threshold(10.0), out=out)
    wd.stop()                                 # raised DistNetworkError before
    assert wd.state == "finished" and store.calls == 1
    wd._atexit()                              # a finished rank's exit says nothing
    assert store.calls == 1 and out.getvalue() == ""


def test_a_launcher_gone_is_seen_before_the_store_is_touched():
    """Under torchrun's agent store a new parent means the launcher and its store are gone: the
    heartbeat says so once and stops; ``stop`` and the exit handler then leave the store alone
    (each call on a dead store also prints torch's C++ warning with its stack)."""
    store, out = GoneStore(gone=False), io.StringIO()
    wd = Watchdog(store, 1, 2, lambda: WatchdogTiming.for_threshold(0.05), out=out,
                  launcher_gone=lambda: store.gone)
    wd.tick(0, "forward step")                # starts the thread (its first record published)
    store.gone = True
    wd._thread.join(timeout=30)
    assert not wd._thread.is_alive()
    assert out.getvalue().count("the launcher has exited") == 1, out.getvalue()
    calls = store.calls                       # the first record only
    wd.stop()
    wd._atexit()
    assert store.calls == calls and wd.state == "finished"
