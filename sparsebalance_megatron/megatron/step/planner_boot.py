"""How the planner process starts and ends: from the rank's own ``sys.path``, importing exactly the
package its rank imported, which it says first thing (``step/ahead.py`` checks it); its draft
pipe widened; at the end asked to stop, its pipes closed, reaped (``stop_process``); its exit
described (``describe_exit``).

A planner started with ``python -m`` from the rank's working directory imported the package found
there (a checkout of another version, say) while the rank ran the installed one: two halves of a
plan made by different code, silently. ``BOOT`` sets the process's ``sys.path`` to the rank's
before anything is imported; its worker then sends ``("package", version, path)`` before anything
else, and the rank refuses a mismatch in one line naming both (``PlannerPackageMismatch``, a
``LaunchError``): with the same ``sys.path`` that can only be the package changed on disk since
the rank imported it. Imports nothing of the package beyond ``errors`` (the worker reads it
before its own imports).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Optional

from ..errors import LaunchError

PACKAGE = __name__.split(".", 1)[0]                        # the package the rank imported
WORKER = __name__.rsplit(".", 1)[0] + ".planner_worker"   # what the process runs
BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv.pop(1)); "
        f"from {WORKER} import main; sys.exit(main(sys.argv[1:]))")
"""``python -c BOOT SYS_PATH FD_IN FD_OUT PARENT``: the rank's ``sys.path`` (JSON) first."""
STOP_WAIT_S = 5.0       # how long a closing training process waits for its planner to end


class PlannerPackageMismatch(LaunchError):
    """The planner process imported another copy of the package than its rank (another version,
    or the same version from another place): refused, as two halves of a plan made by different
    code would disagree silently."""


def package_identity() -> tuple[str, str]:
    """(version, real path of the package directory) of the package this process imported."""
    mod = sys.modules[PACKAGE]
    return getattr(mod, "__version__", "?"), os.path.realpath(os.path.dirname(mod.__file__))


def package_mismatch(rank: tuple, planner: Optional[tuple]) -> Optional[str]:
    """The refusal's line where the planner process's (version, path) is not the rank's; None
    where they agree. ``planner`` None: it did not say (a version of the package that predates
    the check)."""
    if planner is not None and tuple(planner) == tuple(rank):
        return None
    theirs = ("a version of it that does not say which (older than the check)"
              if planner is None else f"{planner[0]} from {planner[1]}")
    return (f"the SparseBalance planner process imported {PACKAGE} {theirs}, its rank "
            f"{rank[0]} from {rank[1]}: the two would plan with different code; the planner "
            f"process starts from the rank's sys.path, so the package changed on disk since "
            f"the rank imported it (reinstall or check out one version, then launch again)")


def describe_exit(code: Optional[int]) -> str:
    """``exit code 1``, ``signal 9 (SIGKILL)``, or ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


PIPE_BYTES = 1 << 20     # the draft pipe's capacity where Linux allows (its default maximum)


def widen_pipe(fd: int) -> None:
    """Let the draft pipe hold a whole draft (at 64 DP x 16, 0.5-1 MB), so that the planner
    process writes it in one call and the reader thread reads it in one: each read of a
    64 KB pipe takes the GIL back from the training thread once more. Left as it is where the
    system refuses (another OS, a lower limit)."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


def stop_process(proc, out: Connection, inp: Connection) -> None:
    """Ask the planner process to end, close the pipes (its EOF), and reap it."""
    try:
        out.send(("stop",))
    except (OSError, ValueError):
        pass
    for c in (out, inp):
        try:
            c.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
