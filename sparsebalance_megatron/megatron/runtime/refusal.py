"""A refusal (a launch setting, a resume state, the planner's package) said once per job.

Every rank of a job runs the same checks on the same flags, so a refusal is met by every rank at
about the same moment. Printed by each, the user read it once per rank, each copy followed by
torchrun's failure block, whose root cause read "To enable traceback see ..." (a ``SystemExit``
leaves torchrun no error file). Here, where the job has a store to agree on (the process
group's once it exists; before it torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE``:
torchrun hosts it and the ranks reach it at ``MASTER_ADDR:MASTER_PORT`` before any process
group):

- the first rank to meet a refusal says it, and only that rank: the ranks claim the line on the
  store (``add`` on a key made from the line, so that another line is said too);
- every rank leaves torchrun its error file (``TORCHELASTIC_ERROR_FILE``): the rank that said
  the line puts the line there, the others a note that points to it, dated a second later, so
  that torchrun's "Root Cause" (the earliest failure) is the line;
- every rank exits with the same code, 1: each waits (``ALL_MET_S`` at most) until every rank
  has met the refusal and left its error file (a second key counts the ranks that are done), then
  leaves at once (``os._exit`` after flushing: nothing of a run exists yet to tear down). The
  ranks cannot leave at the same instant, and torchrun stops the others with SIGTERM as soon as
  one has failed, so a rank that has met the refusal answers SIGTERM by leaving with the same
  code: which rank is faster decides nothing. A rank that never meets it (a refusal of one
  rank's own, a file only its node lacks) is not waited for past ``ALL_MET_S``.

Without a store (another launcher, before the process group) every rank that meets it says it
(rank 0 alone could be stopped by its launcher before it says it, as soon as a silent rank has
left), and each rank leaves as Python does. A single process keeps the plain form: ``refusal``
returns a
``SystemExit`` carrying the line (Python prints it as the process ends), ``say_refusal`` prints
it now and returns the code. The store comes from ``comm`` (the one module that touches
torch.distributed).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 1
STORE_TIMEOUT_S = 10.0      # connecting to torchrun's agent store (it is up before the ranks)
ALL_MET_S = 30.0            # how long a refusing rank waits for the others to meet it (ranks
                            # importing torch on a loaded machine meet it seconds apart)


def refusal(line: str) -> SystemExit:
    """``raise refusal("error: ...") from None``: the line said once per job, exit code 1."""
    said = _refuse(line)
    return SystemExit(line if said else EXIT_CODE)


def say_refusal(line: str) -> SystemExit:
    """As ``refusal``, the line printed now (stderr) where this rank says it; the SystemExit
    carries the code alone."""
    if _refuse(line):
        print(line, file=sys.stderr, flush=True)
    return SystemExit(EXIT_CODE)


def _refuse(line: str) -> bool:
    """Whether this rank says ``line`` (left to the caller: a single process, no store). With
    a store the job agrees on, this rank says it or not and leaves with the others here."""
    world = _world_size()
    if world <= 1:
        said = _rank() == 0
        _leave_error_file(line, said)
        return said
    try:
        store = _store()
    except Exception:                           # noqa: BLE001 - unreachable: say it here
        store = None
    if store is None:           # nothing to agree on: said by every rank, never by none
        _leave_error_file(line, True)
        return True
    key = (f"sparsebalance/refusal/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"{hashlib.sha1(line.encode()).hexdigest()[:16]}")
    _exit_on_terminate()
    try:
        said = int(store.add(key, 1)) == 1
    except Exception:                           # noqa: BLE001 - said twice rather than never
        _leave_error_file(line, True)
        return True
    _leave_error_file(line, said)
    if said:
        print(line, file=sys.stderr, flush=True)
    done = key + "/done"                        # said (or not) and the error file left
    try:
        store.add(done, 1)
    except Exception:                           # noqa: BLE001 - the store went: leave now
        pass
    _wait_for_all(store, done, world)
    _exit_together()
    return said                                 # (a test's _exit_together returns)


def _world_size() -> int:
    from . import comm

    return comm.world_size() if comm.is_initialized() else int(os.environ.get("WORLD_SIZE", "1")
                                                               or 1)


def _rank() -> int:
    from . import comm

    return comm.launch_rank()


def _store():
    from . import comm

    return comm.job_store(timeout_s=STORE_TIMEOUT_S)


def _exit_on_terminate() -> None:
    """SIGTERM (torchrun stopping the ranks once the first has left) ends this rank with the
    refusal's code, not -15. Only the main thread may set a handler; a refusal met elsewhere
    keeps the default."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: _exit_together())


def _wait_for_all(store, key: str, world: int) -> None:
    """Until every rank has counted itself on ``key`` (met the same refusal, its error file
    left), ``ALL_MET_S`` at most."""
    end = time.monotonic() + ALL_MET_S
    try:
        while int(store.add(key, 0)) < world and time.monotonic() < end:
            time.sleep(0.05)
    except Exception:                           # noqa: BLE001 - the store went: leave now
        pass


def _exit_together() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:                       # noqa: BLE001
            pass
    os._exit(EXIT_CODE)


def error_file_record(line: str, said: bool, rank: int, now: Optional[float] = None) -> dict:
    """What this rank leaves torchrun: the line where it said it, else a note pointing to it,
    dated a second later (torchrun's root cause is the earliest failure)."""
    now = time.time() if now is None else now
    if said:
        return {"message": line, "timestamp": int(now)}
    return {"message": f"[sparsebalance] rank {rank} refused the launch as well: the same "
                       f"refusal, said once by the first rank that met it (the root cause)",
            "timestamp": int(now) + 1}


def _leave_error_file(line: str, said: bool) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(error_file_record(line, said, _rank()), f)
    except OSError:
        pass


__all__ = ["refusal", "say_refusal"]
