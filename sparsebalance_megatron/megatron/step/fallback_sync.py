"""After an attention kernel failed on some rank (``model/backend_fallback.py``): every rank runs the
same fallback kernel, and plans for it.

Each rank reports in the step's gather the kernel it runs after its own fallbacks (``RankReport
.backend``: 1 + its place in ``CHAIN``, 0 none); the step's summary holds the furthest of any
rank. At that step's end every rank adopts it (the layers' backend and ``auto``'s), re-prices its
latency model for it, and restarts its planner process, whose copy of the model was priced for
the old one: so the ranks' models stay identical (each rank packs its own micro-batches, and the
packings must agree) and the plans from the next draft on are made for the kernel that runs.

Re-pricing: the latency table's profile timed every candidate kernel on one document of the
micro-batch length at d0 (``attention.backend_choice.seconds``, ``launch/crossover.
fastest_backend``); the sparse kernel's terms of the model (kept block pairs, selection work,
the sparse call's fixed cost) are scaled by the ratio of the new kernel's time to the old one's.
A table without both times cannot tell: the model stays as it is and the line says so (online
calibration then follows the new kernel's measured times). Called from ``end_step`` after the
pending draft is joined (it read the old model on every rank alike) and before the next draft.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..model.backend_fallback import CHAIN
from ..runtime import comm

# the model's coefficients the sparse kernel's time is in (``latency.features.MODEL_FEATURES``)
SPARSE_TERMS = ("attention_work", "selection_work", "sparse_calls")


def reported(budget) -> int:
    """This rank's ``RankReport.backend``: 1 + the place in ``CHAIN`` of the kernel a fallback
    put in place, 0 where none did."""
    now = budget.fallback.current(budget)
    return 0 if now is None else CHAIN.index(now) + 1


def kernel_seconds(table: dict) -> dict:
    """{backend: fwd+bwd seconds} the table's profile timed (empty where it timed none)."""
    choice = (table.get("attention") or {}).get("backend_choice") or {}
    return {str(b): float(s) for b, s in (choice.get("seconds") or {}).items()}


def reprice(model, factor: float) -> None:
    """Scale ``model``'s sparse kernel terms (``SPARSE_TERMS``) by ``factor``, in place (every
    holder of the model sees it: the drafter, the reporter)."""
    from ...latency.features import MODEL_FEATURES

    scale = np.ones(len(MODEL_FEATURES))
    scale[[MODEL_FEATURES.index(t) for t in SPARSE_TERMS]] = factor
    done: dict = {}

    def scaled(a):
        if id(a) not in done:
            done[id(a)] = (a, a * scale)   # the old array kept alive: ids stay unique
        return done[id(a)][1]

    for kind, passes in list(model._coef_full.items()):
        model._coef_full[kind] = {p: scaled(c) for p, c in passes.items()}
    model._stage_coef = [{p: scaled(c) for p, c in coef.items()} for coef in model._stage_coef]
    n = len(model.coef[next(iter(model.coef))]["fwd"])
    model.coef = {k: {p: c[:n] for p, c in v.items()} for k, v in model._coef_full.items()}


def follow(cb, furthest: int, iteration: int) -> Optional[dict]:
    """Every rank adopts the kernel ``furthest`` (``StepSummary.backend``) names, if it is not
    the one this run plans for yet: the layers' backend, the latency model re-priced, the
    planner process restarted; rank 0 says it in one line. Returns the fallback for the
    metrics (``{"from", "to", "factor"}``), or None where nothing changed."""
    if furthest <= 0:
        return None
    to = CHAIN[furthest - 1]
    fb = cb.budget.fallback
    if fb.followed == to:
        return None
    before = fb.followed or _started_with(cb, fb)
    fb.followed = to
    if cb.budget.attention_backend != to:            # this rank's own kernel did not fail
        from ...attention.api import set_auto_backend
        cb.budget.set_backend(to)
        set_auto_backend(to, "the fallback every rank follows", device=cb.device)
    factor, how = None, "not re-priced: the latency table did not time both kernels"
    if cb.latency is not None:
        secs = kernel_seconds(cb.latency.table)
        if secs.get(before) and secs.get(to):
            factor = secs[to] / secs[before]
            reprice(cb.latency, factor)
            how = (f"the latency model re-priced x{factor:.2f} (the table's profile: {before} "
                   f"{1e3 * secs[before]:.2f} ms, {to} {1e3 * secs[to]:.2f} ms)")
        if cb._process is not None:   # its copy of the model is the old one: a new process
            cb.close_planner()          # (drafts on the training thread until it is ready)
            cb._start_process()
            cb._failures.restarting = True
    comm.say(f"warning: attention kernel fallback: every rank runs {to} from iteration "
             f"{iteration + 2} on (it replaces {before}, which failed on a rank: its warning "
             f"above); {how}")
    return {"from": before, "to": to, "factor": factor}


def _started_with(cb, fb) -> str:
    """The kernel the run started with, the same on every rank: the first one that failed here,
    or where none did the one the layers still run."""
    if fb.events:
        return fb.events[0]["from"]
    from ...attention.api import resolve_backend
    return resolve_backend(cb.budget.attention_backend or cb.sb.attention_backend, cb.device)
