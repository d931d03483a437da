"""Planning step n+1 while step n trains (``--sb-planner process`` or ``thread``).

``Planner`` drafts on a thread of the training process. The draft is Python and numpy: it holds
the GIL most of the time, so a training thread that launches many small kernels (a GPU step's
forward and backward) runs slower while it drafts. ``PlannerProcess`` drafts in a process of its
own (one per rank, started at the first draft): the training thread only sends the draft's
inputs (the step's segments, the latency calibration, the sensitivity updates since the last
draft). A reader thread waits for the draft (without the GIL) and reads it back as soon as it is
made, while the step still trains, so that the step's end only joins it. What comes back is
what the rank may use: of the two packings a step may draft (SAB's and the do-no-harm
baseline's), the one the step commits where the rank knows it (``reply``), both where rank 0's
broadcast will say; packings and features are pickled without their caches.

The process holds a copy of the rank's ``Drafter`` (config, latency model, tracker) made when it
starts, and before each draft sets its latency calibration to the one sent and replays the
tracker's updates in order (or replaces its state when the training process loaded a state), so
it drafts from exactly the state the training process holds when it asks: the same function on
the same inputs as the in-line planner (a unit test compares the three). It ends when the
training process closes the pipe (its exit included, a crash too); a draft's error is raised on
the training thread, and so is the process's death, naming its exit code.

The worker side (``python -m sparsebalance_megatron.megatron.step.ahead FD_IN FD_OUT``) imports
numpy and the package's pure layers only: no torch, no megatron.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Optional

from .drafting import Draft, Drafter

POLL_S = 1.0            # how often a wait for the planner process checks that it is alive
STOP_WAIT_S = 5.0       # how long a closing training process waits for its planner to end


class Planner:
    """One background draft on a daemon thread (``--sb-planner thread``): its result or
    exception."""

    def __init__(self, fn, basis: dict):
        self.basis, self._out, self._err = basis, None, None
        self.wait_s = 0.0                    # training thread's seconds blocked in ``result``
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="sparsebalance-planner")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out = fn()
        except BaseException as e:           # re-raised on the training thread by result()
            self._err = e

    def done(self) -> bool:
        """Whether the draft is made (``result`` would not wait)."""
        return not self._thread.is_alive()

    def result(self) -> Draft:
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s = time.perf_counter() - t0
        if self._err is not None:
            raise self._err
        self._out.basis = self.basis
        return self._out


class PlannerProcessError(RuntimeError):
    """The planner process ended without answering (killed, crashed, out of memory)."""


PIPE_BYTES = 1 << 20     # the draft pipe's capacity where Linux allows (its default maximum)


def _widen(fd: int) -> None:
    """Let the draft pipe hold a whole draft (at 64 DP x 16, 0.5-1 MB), so that the planner
    process writes it in one call and the reader thread reads it in one: each read of a
    64 KB pipe takes the GIL back from the training thread once more. Left as it is where the
    system refuses (another OS, a lower limit)."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


class PlannerProcess:
    """The rank's planner process: ``submit`` a step's inputs, ``PendingDraft.result`` its
    draft. One draft in flight at a time."""

    def __init__(self, drafter: Drafter):
        r_child, w_parent = os.pipe()
        r_parent, w_child = os.pipe()
        _widen(r_parent)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(r_child), str(w_child)],
                pass_fds=(r_child, w_child), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(r_child)
            os.close(w_child)
        self._out = Connection(w_parent, readable=False)
        self._in = Connection(r_parent, writable=False)
        self._pending: Optional[PendingDraft] = None
        self._ready = False
        self._finalize = weakref.finalize(self, _stop, self.proc, self._out, self._in)
        self._out.send(("init", drafter))

    def wait_ready(self) -> None:
        """Wait until the process has read its Drafter and imported what a draft uses, so that
        its start-up costs no CPU during a training step (``submit`` waits for it too)."""
        if not self._ready:
            self._wait("while starting")
            if self._in.recv() != ("ready",):
                raise PlannerProcessError("the SparseBalance planner process answered its "
                                          "start-up with something else than ready")
            self._ready = True

    def _wait(self, when: str) -> None:
        while not self._in.poll(POLL_S):                 # waits without the GIL
            if self.proc.poll() is not None:
                raise self._died(when)

    def submit(self, iteration: int, first_bin: int, segments, num_microbatches: int, *,
               with_dst: bool, latency_state: Optional[dict], tracker_sync, basis: dict
               ) -> "PendingDraft":
        """Start the draft of ``iteration`` from these inputs; ``tracker_sync``: None (no
        tracker), ("reset", state) or ("updates", [(ids, lengths, values), ...])."""
        if self._pending is not None:
            raise RuntimeError("a draft of the planner process is still pending")
        self.wait_ready()
        c0 = time.thread_time()
        self._send(("draft", dict(iteration=iteration, first_bin=first_bin, segments=segments,
                                  num_microbatches=num_microbatches, with_dst=with_dst,
                                  latency=latency_state, tracker=tracker_sync)))
        self._pending = PendingDraft(self, basis, send_s=time.thread_time() - c0)
        return self._pending

    def _send(self, msg) -> None:
        try:
            self._out.send(msg)
        except (BrokenPipeError, OSError):
            raise self._died("before it was sent a draft") from None

    def _answer(self, when: str):
        """The process's next answer: its value, or its error raised here."""
        try:
            kind, *rest = self._in.recv()
        except EOFError:
            raise self._died(when) from None
        if kind == "error":
            err, text = rest
            if not isinstance(err, BaseException):
                raise PlannerProcessError(text)
            err.add_note(f"in the planner process (pid {self.proc.pid}):\n{text}")
            raise err
        return rest[0]

    def _died(self, when: str) -> PlannerProcessError:
        code = self.proc.wait()
        return PlannerProcessError(f"the SparseBalance planner process (pid {self.proc.pid}) "
                                   f"ended {when} with exit code {code}; its error, if any, "
                                   f"is above. Plan on the training process instead with "
                                   f"--sb-planner thread or inline")

    def close(self) -> None:
        self._finalize()


class PendingDraft:
    """A draft the planner process is making: a reader thread waits for it (the GIL released)
    and reads it back as soon as it is made, while the step trains; ``result`` joins it
    (``Planner``'s API) and raises what the draft or the process raised. ``send_s``: the
    training thread's CPU seconds pickling the inputs; ``recv_s``: the reader thread's reading
    the draft back (off the critical path; it holds the GIL while it unpickles, which a
    launch-bound training thread beside it pays: ``planner_cost``'s slowdown study); ``wait_s``:
    wall seconds the training thread waited at the join."""

    def __init__(self, planner: PlannerProcess, basis: dict, send_s: float):
        self._planner, self.basis = planner, basis
        self.send_s, self.recv_s, self.wait_s = send_s, 0.0, 0.0
        self._draft: Optional[Draft] = None
        self._err: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name="sparsebalance-planner-reader")
        self._thread.start()

    def _read(self) -> None:
        try:
            self._planner._wait("while drafting")
            c0 = time.thread_time()
            self._draft = self._planner._answer("while sending its draft")
            self.recv_s = time.thread_time() - c0
        except BaseException as e:          # raised on the training thread by result()
            self._err = e

    def done(self) -> bool:
        """Whether the draft is read back (``result`` would not wait)."""
        return not self._thread.is_alive()

    def result(self) -> Draft:
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s = time.perf_counter() - t0
        self._planner._pending = None
        if self._err is not None:
            raise self._err
        self._draft.basis = self.basis
        return self._draft


def _stop(proc, out: Connection, inp: Connection) -> None:
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


# --- the planner process ------------------------------------------------------------------
def sync_state(drafter: Drafter, latency_state: Optional[dict], tracker_sync) -> None:
    """Bring ``drafter``'s latency calibration and tracker to the training process's state."""
    if latency_state is not None and drafter.latency is not None:
        drafter.latency.load_calibration_state(latency_state)
    if tracker_sync is not None and drafter.tracker is not None:
        kind, value = tracker_sync
        if kind == "reset":
            drafter.tracker.load_state_dict(value)
        else:
            for ids, lengths, values in value:
                drafter.tracker.update(ids, lengths, values)


def committed_index(draft: Draft) -> Optional[int]:
    """Which packing this rank knows the step commits (0 SAB's, 1 the baseline's), or None where
    it learns it from rank 0's broadcast: its own stand-down choice, or as the rank that plans
    DST, the plan's."""
    stand = draft.stand_down
    if draft.payload is not None:
        stand = draft.payload[1].get("stand_down")
    if draft.options < 2:
        return 0
    return None if stand is None else int(stand["packing_index"])


def reply(draft: Draft) -> Draft:
    """The draft as the planner process sends it back: without the packing a rank knows it
    will not commit (both stay where rank 0's broadcast will say which)."""
    index = committed_index(draft)
    if index == 0:
        draft.baseline = None
    elif index == 1:
        draft.batch = draft.units = None
    return draft


def warm_up_kernels() -> None:
    """The planner's compiled kernels made ready in this process (numba's import, and its
    compilation or its disk cache: seconds the first time in an environment), at start-up
    instead of in a step: the planner process before it says ready, the training process
    before its first step (its reports and layout check simulate too). Nothing without
    numba."""
    from ...batching import packing_kernels, slot_kernels
    from ...latency import features
    from ...policy import band_kernels, descent_kernels, floors, grid_kernels
    from ...sim import compiled, fit_kernels

    try:
        for module in (compiled, fit_kernels, grid_kernels, band_kernels, descent_kernels,
                       floors, features, packing_kernels, slot_kernels):
            module.warm_up()
    except Exception as e:      # a numba that cannot compile here: numpy, the same plans
        compiled.disable(f"{type(e).__name__}: {e}")


def _import_draft_modules() -> None:
    """What a draft imports on first use (packing, DST, the quality cost), imported at start-up
    instead of during the first draft, and the compiled kernels made ready."""
    from ...batching import packing  # noqa: F401
    from ...policy import critical_path, dst, quality  # noqa: F401
    from . import choice  # noqa: F401

    warm_up_kernels()


def _settle() -> None:
    """What the process holds once it is ready (its modules, numba's, the Drafter: about 100,000
    objects) moved out of the garbage collector's reach (``gc.freeze``): a draft's own objects
    survive into the oldest generation often enough that every few drafts a full collection
    walked all of them, 20-40 ms inside a draft of 60 (thread CPU, 64 DP x 16 x PP 4); frozen,
    the collections a draft pays walk only what drafts made. What is frozen is never freed, and
    it is held for the process's life anyway."""
    import gc

    gc.collect()
    gc.freeze()


def serve(inp: Connection, out: Connection) -> None:
    """The planner process's loop: ``init`` (the Drafter), ``draft`` requests answered in
    order, until ``stop`` or the training process's end (EOF)."""
    drafter: Optional[Drafter] = None
    while True:
        try:
            msg = inp.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "init":
            drafter = msg[1]
            _import_draft_modules()
            _settle()
            out.send(("ready",))
            continue
        req = msg[1]
        try:
            sync_state(drafter, req["latency"], req["tracker"])
            draft = drafter.draft(req["iteration"], req["first_bin"], req["segments"],
                                  req["num_microbatches"], with_dst=req["with_dst"])
            answer = ("ok", reply(draft))
        except Exception as e:                             # raised on the training thread
            text = traceback.format_exc()
            try:
                pickle.dumps(e)
            except Exception:
                e = None
            answer = ("error", e, text)
        try:
            out.send(answer)
        except (BrokenPipeError, OSError):
            return


def main(argv=None) -> int:
    fd_in, fd_out = (int(x) for x in (argv or sys.argv[1:]))
    serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
