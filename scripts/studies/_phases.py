"""Thread CPU time of a call split by phase (``sab_ranks``' profiler): the planner's public
and module-level functions wrapped from outside for the length of a ``PhaseProfile`` block, each
call's thread CPU time charged to the innermost phase open on the thread (exclusive time), and
the garbage collector's pauses to a phase of their own.

A phase is a name and the functions that open it, each named ``module:qualname`` (a function of
a module, or a method, classmethod or staticmethod of a class). A function imported by name into
other modules of the package (``from .dst_band import plan_dst_candidates``) is wrapped there
too, so the phase opens whichever module calls it. A target the tree does not have (renamed or
merged by a rewrite) is skipped and listed in ``absent``: its time stays with the phase that
calls it, so the profile runs against whichever planner is in the tree, and the remainder of a
call outside every phase is reported as ``other`` by the caller.

Beside the CPU time, each phase's share of it spent in the kernel (``sys_s``: on Linux mostly
zeroing the pages of fresh allocations; ``getrusage(RUSAGE_THREAD)``, whose user/system split is
the kernel's tick-sampled estimate) and its minor page faults (``faults``, exact).

Only the thread that opened the block is profiled (another thread's calls run unwrapped). The
wrappers cost a few microseconds a call; ``calls`` says how many each phase took.
"""

from __future__ import annotations

import functools
import gc
import importlib
import resource
import sys
import threading
import time

PACKAGE = "sparsebalance_megatron"
FIGURES = ("cpu_s", "sys_s", "faults")


def _now() -> tuple:
    """(thread CPU seconds, of which in the kernel, minor faults) of this thread so far."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), ru.ru_stime, ru.ru_minflt


def _resolve(spec: str):
    """(owner, attribute name, the attribute as stored: a function or descriptor) of
    ``module:qualname``, or None where the tree lacks it."""
    mod_name, _, qual = spec.partition(":")
    try:
        owner = importlib.import_module(mod_name)
    except ImportError:
        return None
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    if isinstance(owner, type):          # the class in the MRO that defines it
        for klass in owner.__mro__:
            if name in vars(klass):
                return klass, name, vars(klass)[name]
        return None
    got = vars(owner).get(name)
    return None if got is None or not callable(got) else (owner, name, got)


class PhaseProfile:
    """``with PhaseProfile(phases) as prof: ...``: ``prof.figures`` (phase -> exclusive
    [thread CPU seconds, of which in the kernel, minor faults]), ``prof.calls`` (phase ->
    calls), ``prof.absent`` (targets not in the tree), ``prof.gc_s`` (the collector's pauses on
    the thread). ``phases``: (name, [targets]) pairs; a phase may be called inside another
    (its time is then its own, not the caller's)."""

    def __init__(self, phases):
        self.phases = [(name, list(targets)) for name, targets in phases]
        self.figures = {name: [0.0, 0.0, 0] for name, _ in self.phases}
        self.calls = {name: 0 for name, _ in self.phases}
        self.absent: list = []
        self.gc_s = 0.0
        self._undo: list = []
        self._stack: list = []        # [phase, figures at its start, its children's figures]
        self._owner = None
        self._gc_at = None

    # -- wrapping --------------------------------------------------------------------------
    def _wrap(self, phase: str, fn):
        owner_ident = threading.get_ident

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if owner_ident() != self._owner:
                return fn(*args, **kwargs)
            frame = [phase, _now(), [0.0, 0.0, 0]]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                end = _now()
                self._stack.pop()
                mine, inner = self.figures[phase], frame[2]
                above = self._stack[-1][2] if self._stack else None
                for i in range(3):
                    spent = end[i] - frame[1][i]
                    mine[i] += spent - inner[i]
                    if above is not None:
                        above[i] += spent
                self.calls[phase] += 1
        return timed

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, vars(owner)[name]))
        setattr(owner, name, value)

    def __enter__(self) -> "PhaseProfile":
        self._owner = threading.get_ident()
        done = set()
        for phase, targets in self.phases:
            for spec in targets:
                got = _resolve(spec)
                if got is None:
                    self.absent.append(spec)
                    continue
                owner, name, stored = got
                if (id(owner), name) in done:
                    continue
                done.add((id(owner), name))
                if isinstance(stored, (classmethod, staticmethod)):
                    self._patch(owner, name, type(stored)(self._wrap(phase, stored.__func__)))
                    continue
                timed = self._wrap(phase, stored)
                self._patch(owner, name, timed)
                if isinstance(owner, type):
                    continue
                for mod in list(sys.modules.values()):    # its aliases in the package
                    mname = getattr(mod, "__name__", "") or ""
                    if mod is owner or not mname.startswith(PACKAGE):
                        continue
                    for alias, v in list(vars(mod).items()):
                        if v is stored and (id(mod), alias) not in done:
                            done.add((id(mod), alias))
                            self._patch(mod, alias, timed)
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()

    def _gc(self, stage: str, info: dict) -> None:
        """The collector's pauses on the profiled thread: a phase of their own (charged out of
        the phase they interrupt)."""
        if threading.get_ident() != self._owner:
            return
        if stage == "start":
            self._gc_at = time.thread_time()
        elif self._gc_at is not None:
            spent = time.thread_time() - self._gc_at
            self._gc_at = None
            self.gc_s += spent
            if self._stack:
                self._stack[-1][2][0] += spent

    # -- reading ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the figures (between the calls of one block)."""
        for k in self.figures:
            self.figures[k], self.calls[k] = [0.0, 0.0, 0], 0
        self.gc_s = 0.0

    def split(self, total_s: float, figure: str = "cpu_s") -> dict:
        """Phase -> exclusive ``figure`` (``FIGURES``) of one call; for CPU seconds (the call
        took ``total_s``) with ``gc`` and ``other`` (what no phase holds: the rest)."""
        i = FIGURES.index(figure)
        out = {k: v[i] for k, v in self.figures.items()}
        if figure == "cpu_s":
            out["gc"] = self.gc_s
            out["other"] = total_s - sum(out.values())
        return out


def wrapper_cost_s(n: int = 20000) -> float:
    """Thread CPU seconds one wrapped call adds (a wrapped no-op against the bare one): the
    profile's own cost per call, which ``calls`` multiplies."""
    prof = PhaseProfile([])
    prof._owner = threading.get_ident()
    bare = _noop
    timed = prof._wrap("x", bare)
    prof.figures["x"], prof.calls["x"] = [0.0, 0.0, 0], 0
    best = []
    for fn in (bare, timed, bare, timed):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best.append(time.thread_time() - t0)
    return max(0.0, (min(best[1], best[3]) - min(best[0], best[2])) / n)


def _noop():
    return None
