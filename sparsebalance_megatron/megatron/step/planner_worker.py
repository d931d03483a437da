"""The planner process's side of ``step/ahead.py``: ``python -c ahead.BOOT SYS_PATH FD_IN FD_OUT
PARENT`` (the rank's ``sys.path``, so that it imports the package its rank imported).

It first says which package it imported (``("package", version, path)``: the rank refuses
another), then reads its copy of the rank's ``Drafter`` (``init``), imports what a draft uses and makes the
planner's compiled kernels ready before it says ``ready``, then answers ``draft`` requests in
order: the training process's latency calibration and tracker updates applied first
(``sync_state``), the draft settled as the request's DP rank where it names one
(``Drafter.settle``, its collectives relayed by the rank: ``step/relay.py``; ``cancelled`` where
the rank took the step over), then ``("drafted",)`` once the draft is made and the draft itself
(``reply``: without the packing the rank will not commit), or the draft's error. It ends at ``stop`` or at
the training process's end (EOF), and with its rank however that ends
(``runtime.children.die_with_parent``). It runs single-threaded (BLAS, OpenMP and numba pools at
one thread) at a lower CPU priority than training (``NICE``), and imports numpy and the
package's pure layers only: no torch, no megatron.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Optional

from .drafting import Draft, Drafter
from .relay import CANCELLED, RelayClosed, RelayReducer, SettleCancelled

NICE = 5                # the process's CPU priority below the training process's


def sync_state(drafter: Drafter, latency_state: Optional[dict], tracker_sync,
               quality_scales: Optional[tuple] = None) -> None:
    """Bring ``drafter``'s latency calibration, tracker and quality model's refreshed scales to
    the training process's state."""
    drafter.quality_scales = quality_scales
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
    it learns it from rank 0's broadcast: its own stand-down choice, as the rank that plans
    DST the plan's, or the one its settled DST (``agreed``) commits."""
    if draft.options < 2:
        return 0
    if draft.agreed is not None:                  # as ``StepPlanning._commit`` reads it
        report = draft.agreed[1]                  # None: no DST (the stand-down on the draft)
        stand = report.get("stand_down") if report is not None else draft.stand_down
        return 1 if stand is not None and stand["packing_index"] == 1 else 0
    stand = draft.stand_down
    if draft.payload is not None:
        stand = draft.payload[1].get("stand_down")
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
    before its first step (its reports and layout check simulate too)."""
    from ... import kernels

    kernels.warm_up()


def _import_draft_modules() -> None:
    """What a draft imports on first use (packing, DST, the quality cost), imported at start-up
    instead of during the first draft, and the compiled kernels made ready."""
    from ...batching import packing  # noqa: F401
    from ...policy import critical_path, dst_rounds  # noqa: F401
    from ...quality import refresh  # noqa: F401
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
    order (``("drafted",)`` once the draft is made, then the answer), until ``stop`` or the
    training process's end (EOF)."""
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
            sync_state(drafter, req["latency"], req["tracker"], req.get("quality"))
            draft = drafter.draft(req["iteration"], req["first_bin"], req["segments"],
                                  req["num_microbatches"], with_dst=req["with_dst"],
                                  rank=req.get("rank"))
            if req.get("settle") is not None:             # settled here, rounds relayed
                draft.agreed = drafter.settle(draft, rank=req["settle"],
                                              agree=RelayReducer(inp, out))
            answer = ("ok", reply(draft))
        except SettleCancelled:                            # the training thread settles it
            answer = (CANCELLED,)
        except RelayClosed:                                # the training process ended
            return
        except Exception as e:                             # raised on the training thread
            text = traceback.format_exc()
            try:
                pickle.dumps(e)
            except Exception:
                e = None
            answer = ("error", e, text)
        try:
            if answer[0] == "ok":
                out.send(("drafted",))                     # what is left is the sending
            out.send(answer)
        except (BrokenPipeError, OSError):
            return


def main(argv=None) -> int:
    """``FD_IN FD_OUT PARENT``: the pipes, and the pid of the rank that started it (this process
    dies with it, and drafts at a lower priority than it trains)."""
    from ..runtime.children import die_with_parent

    from .planner_boot import package_identity

    fd_in, fd_out, parent = (int(x) for x in (argv or sys.argv[1:]))
    die_with_parent(parent)
    try:
        os.nice(NICE)
    except OSError:
        pass
    out = Connection(fd_out, readable=False)
    try:
        out.send(("package", *package_identity()))
    except (BrokenPipeError, OSError):
        return 0
    serve(Connection(fd_in, writable=False), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
