"""Processes a rank starts die with it, however it ends.

A rank can end without running a finaliser: torchrun's SIGKILL, the watchdog's ``os._exit``, an
out-of-memory kill. Its children (the planner process, the start-up latency profiler, the
checkpoint results server) would then live on as orphans holding memory, files or the job's
output. ``die_with_parent`` asks Linux to send the calling process SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``; the parent is the thread that started it, which for every child here is
the rank's main thread), and exits at once where the parent ended before the request took
effect. Elsewhere it does nothing (the finalisers remain). ``process_state`` probes a local
process (the watchdog's judgement of a peer, a late planner process); ``launcher_store_gone``
tells a rank that torchrun, which hosts the job's store, has exited. Pure Python: no torch, no
megatron.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: Optional[int] = None) -> bool:
    """This process gets SIGKILL when its parent ends; ``parent``: the pid it was started by
    (where it is no longer the parent, that one has ended already: exit now). True where the
    request was taken (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        taken = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) == 0
    except (OSError, AttributeError):
        taken = False
    if parent is not None and os.getppid() != parent:
        os._exit(0)
    return taken


def process_state(pid: int) -> Optional[str]:
    """The state letter of a local process (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``
    zombie), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"   # alive, no /proc (not Linux)


def launcher_store_gone() -> Callable[[], bool]:
    """Whether the launcher that hosts the job's store has exited: under torchrun's agent store
    (``TORCHELASTIC_USE_AGENT_STORE``), this process's parent is that launcher, and a new parent
    means it is gone (SIGKILLed); elsewhere (the store in rank 0) never."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return lambda: False
    parent = os.getppid()
    return lambda: os.getppid() != parent


__all__ = ["die_with_parent", "launcher_store_gone", "process_state"]
