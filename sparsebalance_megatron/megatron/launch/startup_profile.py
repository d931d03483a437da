"""The start-up latency profile of a run without ``--sb-latency-table``: one rank measures, the
others wait for it without the job's distributed timeout cutting them off, and nothing measured
is lost.

Rank 0 runs the profiler CLI in a subprocess (``profile_cli``) into the run's cache path; the
profiler saves every sample as it is measured (``latency/partial.py``), so a run killed while
profiling resumes the profile on its retry. The other ranks wait on a gloo group of their own
created with ``--sb-profile-timeout-minutes`` (``comm.broadcast_bytes``: they poll the
broadcast instead of blocking in it), never in a collective under
``--distributed-timeout-minutes``; rank 0 then sends them the table's bytes, which they write to
their own cache path when it lacks them (a node without a shared file system). Every rank prints
a progress line every ``PROGRESS_INTERVAL_S`` seconds (samples measured of the whole, seconds
spent), read from the partial profile where it can see it. If rank 0 fails, the others stop at
once with its message, naming rank 0 and the table; if rank 0 disappears or the wait runs past
its timeout, they stop with a message naming rank 0, the table and the flag.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

from ...latency.partial import partial_path, read_progress
from ..runtime import comm
from ..runtime.children import die_with_parent

PROGRESS_INTERVAL_S = 30.0
"""Seconds between two progress lines of a rank waiting for (or running) the profile."""

OK, FAILED = 0, 1


def progress_line(path: str, elapsed_s: float) -> str:
    """``profiling latency: 12/40 samples, 35 s`` (samples read from the partial profile of
    ``path``; without one yet, the seconds alone)."""
    got = read_progress(partial_path(path))
    done = "" if got is None else f"{got[0]}/{got[1] if got[1] is not None else '?'} samples, "
    return f"profiling latency: {done}{elapsed_s:.0f} s"


def run_profiler(cmd: list[str], path: str, *, env: Optional[dict] = None,
                 interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Run the profiler ``cmd`` (writing the table ``path``), its progress bar live on stderr and
    a progress line every ``interval_s``; ``SystemExit`` with the end of its output if it
    fails."""
    import tempfile

    t0 = last = clock()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=None, text=True, env=env,
                                preexec_fn=die_with_parent if sys.platform == "linux" else None)
        try:
            while proc.poll() is None:
                time.sleep(min(1.0, interval_s))
                now = clock()
                if now - last >= interval_s:
                    last = now
                    comm.say(f"rank 0: {progress_line(path, now - t0)} (measuring)")
        except BaseException:
            proc.kill()
            raise
        if proc.returncode != 0:
            out.seek(0)
            raise SystemExit(f"error: latency profiling failed (its saved samples stay in "
                             f"{partial_path(path)}; a new run resumes from them):\n"
                             f"{out.read()[-3000:]}")


def shared_table(path: str, profile: Callable[[], None], *, timeout_minutes: float,
                 interval_s: float = PROGRESS_INTERVAL_S, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> Optional[bytes]:
    """Make sure the latency table ``path`` exists on every rank: rank 0 calls ``profile()``
    when it lacks it. Collective (every rank calls it). Returns the table's bytes as rank 0 read
    them (None without a process group or with one rank: then ``path`` is all there is)."""
    if comm.world_size() == 1:
        if not os.path.exists(path):
            profile()
        return None
    rank = comm.rank()
    group = comm.new_gloo_group(timedelta(minutes=timeout_minutes))
    try:
        if rank == 0:
            return _lead(path, profile, group)
        return _wait(path, rank, group, timeout_minutes, interval_s, poll_s, clock)
    finally:
        comm.destroy_group(group)


def _lead(path: str, profile: Callable[[], None], group) -> bytes:
    try:
        if not os.path.exists(path):
            profile()
        with open(path, "rb") as fh:
            payload = fh.read()
    except BaseException as e:   # the others must not wait for a table that will not come
        why = str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        try:
            comm.broadcast_bytes(why.encode(), FAILED, group=group)
        except RuntimeError:     # the others are gone already: rank 0's own error is the news
            pass
        raise
    comm.broadcast_bytes(payload, OK, group=group)
    return payload


def _wait(path: str, rank: int, group, timeout_minutes: float, interval_s: float,
          poll_s: float, clock) -> bytes:
    t0 = clock()
    last = [t0]

    def tick():
        now = clock()
        if now - last[0] >= interval_s:
            last[0] = now
            print(f"[sparsebalance] rank {rank}: {progress_line(path, now - t0)}; waiting for "
                  f"rank 0 (at most {timeout_minutes:g} min: --sb-profile-timeout-minutes)",
                  flush=True)

    try:
        status, payload = comm.broadcast_bytes(None, OK, group=group, on_wait=tick,
                                               poll_s=poll_s)
    except RuntimeError as e:
        raise SystemExit(f"error: rank {rank}: rank 0 did not deliver the latency table {path} "
                         f"after {clock() - t0:.0f} s (it stopped, or profiling took longer "
                         f"than --sb-profile-timeout-minutes {timeout_minutes:g}; its saved "
                         f"samples in {partial_path(path)} are resumed by the next run): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if status != OK:
        raise SystemExit(f"error: rank {rank}: rank 0 failed to profile the latency table "
                         f"{path}: {payload.decode(errors='replace')}")
    _keep(path, payload, rank)
    return payload


def _keep(path: str, payload: bytes, rank: int) -> None:
    """Write rank 0's table to this rank's ``path`` unless it holds those bytes already (a
    shared file system: rank 0 wrote it)."""
    try:
        with open(path, "rb") as fh:
            if fh.read() == payload:
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.rank{rank}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(payload)
    os.replace(tmp, path)
