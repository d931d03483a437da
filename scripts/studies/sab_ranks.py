"""SAB's packing as a DP rank pays for it (issue 77; docs/DESIGN.md section 6): every rank's
micro-batches packed on every rank (``whole``) against a rank's own only (``own``), by phase, at
DP 512 to 4,096. Thread CPU time, each figure the least of ``REPEAT`` runs."""

from __future__ import annotations

import functools
import gc
import importlib
import resource
import sys
import threading
import time

import numpy as np

from .common import parser, write_result

# ---- the per-phase profiler ----------------------------------------------------------------------

PACKAGE = "sparsebalance_megatron"
FIGURES = ("cpu_s", "sys_s", "faults")
REPEAT = 3             # runs of each figure (thread CPU: the minimum)


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


# ---- the study ---------------------------------------------------------------------------------

P = "sparsebalance_megatron."
WHOLE = (
    ("segments", "the step's segments converted and sorted once (checked_segments, "
     "segment_counts)", [P + "batching.plan:checked_segments",
                         P + "megatron.step.checks:segment_counts"]),
    ("prepare", "prepare_samples (checks, long samples)", [P + "batching.packing:prepare_samples"]),
    ("costs", "the segments' costs (sample_costs)", [P + "batching.packing:sample_costs"]),
    ("order", "the seeded cost order (assignment set-up)",
     [P + "batching.assignment:SABAssignment.__init__"]),
    ("lpt", "the LPT over DP ranks (kernels.packing.lpt_ranks)",
     [P + "kernels.packing:lpt_ranks"]),
    ("sensitivity", "the segments' sensitivity estimates",
     [P + "batching.sensitivity:SensitivityTracker.estimate"]),
    ("units", "each rank's segments in order (SABAssignment.units, the rest)",
     [P + "batching.assignment:SABAssignment.units"]),
    ("bins", "each rank's cut into micro-batches (rank_bins, first-fit-decreasing)",
     [P + "batching.assignment:_cut"]),
    ("unit_costs", "the micro-batches' per-stage costs", [P + "batching.latency_cost:"
                                                          "LatencyCost.unit_costs"]),
    ("seeds", "every rank's seed slots (simulated)", [P + "batching.slots:seed_slots"]),
    ("search", "the cross-rank slot search over the candidates",
     [P + "batching.slots:candidates", P + "batching.slots:search"]),
    ("finish", "the plan's per-segment records (finish_plan)",
     [P + "batching.packing:finish_plan"]),
    ("check", "the packing checked to hold the step's segments",
     [P + "megatron.step.checks:check_assignment"]),
    ("features", "latency features of the packed micro-batches",
     [P + "latency.model:LatencyModel.unit_features", P + "batching.plan:BatchPlan.unit_csr"]),
)
OWN = ("assign", "units", "rank_plan", "features")


def _whole(drafter, raw, m: int, repeat: int):
    """(the whole plan, its phases' thread CPU [min over runs], the total's min)."""
    from sparsebalance_megatron.batching import plan as plan_mod
    from sparsebalance_megatron.megatron.step import checks

    prof = PhaseProfile([(k, t) for k, _, t in WHOLE])
    best, total, batch = {}, float("inf"), None
    with prof:                  # (the functions looked up inside: the profile wraps them)
        for _ in range(repeat):
            prof.reset()
            c0 = time.thread_time()
            segs = plan_mod.checked_segments(list(raw))
            given = checks.segment_counts(segs)
            batch = drafter.pack(segs, m)
            drafter.checked(segs, batch, given)
            t = time.thread_time() - c0
            split = prof.split(t)
            total = min(total, t)
            best = {k: min(best.get(k, np.inf), v) for k, v in split.items()}
    return batch, best, total


def _own(lm, kw: dict, segs, agreed, rank: int, whole, repeat: int) -> dict:
    """Rank ``rank``'s own packing by part (the min over ``repeat`` runs of each)."""
    from sparsebalance_megatron.batching.packing import sab_assignment

    best = dict.fromkeys(OWN + ("total",), np.inf)
    for _ in range(repeat):
        c = time.thread_time
        t0 = c()
        asg = sab_assignment(segs, **kw)
        t1 = c()
        mine = asg.units([rank])
        t2 = c()
        plan = asg.rank_plan(mine, agreed)
        t3 = c()
        lm.unit_features(plan.unit_csr(with_padding=True))
        t4 = c()
        for k, v in zip(OWN + ("total",), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            best[k] = min(best[k], v)
    if plan.micro_batches[0] != whole.micro_batches[rank] \
            or plan.predicted_rank_cost_s[0] != whole.predicted_rank_cost_s[rank]:
        raise SystemExit(f"rank {rank}: its own plan is not row {rank} of the whole plan")
    return best


def measure(dp: int, m: int, pp: int, repeat: int, seq: int = 32768) -> dict:
    from sparsebalance_megatron.batching.packing import latency_sample_cost_fn, sab_assignment
    from sparsebalance_megatron.batching.plan import checked_segments
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels

    from .drafts import make_drafter

    warm_up_kernels()
    sb = SparseBalanceConfig(sparse_balance=True)               # the default flags
    corpus = corpus_steps(dp, m, sb.density, 1, seq=seq, layout="best", pp=pp)
    lm, raw = corpus.lm, corpus.segments[0]
    drafter = make_drafter(lm, sb, dp, seq)
    gc.collect()
    gc.disable()
    try:
        whole, phases, total = _whole(drafter, raw, m, repeat)
        segs = checked_segments(raw)
        kw = dict(dp=dp, num_microbatches=m, max_tokens=seq, sensitivity=drafter.tracker,
                  cost_fn=latency_sample_cost_fn(lm, sb.density), seed=sb.seed,
                  long_sample_policy=sb.long_sample_policy, length_multiple=sb.length_multiple)
        asg = sab_assignment(segs, **kw)
        agreed = asg.agree(asg.units())                          # the other ranks' part
        c = agreed.candidates
        critical = int(c.ranks[np.argmax(c.span_s)]) if c is not None else 0
        ranks = sorted({0, dp // 2, dp - 1, critical})
        own = {r: _own(lm, kw, segs, agreed, r, whole, repeat) for r in ranks}
    finally:
        gc.enable()
    slowest = max(own, key=lambda r: own[r]["total"])
    return {"dp": dp, "m": m, "pp": pp, "seq": seq, "layout": lm.layout.describe(),
            "segments": len(raw), "whole_s": total, "whole_phases_s": phases,
            "own_s": {str(r): v for r, v in own.items()}, "own_max_s": own[slowest]["total"],
            "own_slowest_rank": slowest, "critical_rank": critical,
            "candidates": None if c is None else c.ranks.size}


def main(argv=None) -> int:
    p = parser(__doc__, "sab_ranks")
    a = p.parse_args(argv)
    points = []
    for dp in (512, 1024, 2048, 4096):
        pt = measure(dp, m=16, pp=4, repeat=REPEAT)
        points.append(pt)
        print(f"DP {dp}: {pt['segments']} segments, whole {1e3 * pt['whole_s']:.1f} ms, own "
              f"{1e3 * pt['own_max_s']:.1f} ms (slowest of ranks {sorted(pt['own_s'])})",
              flush=True)
    _print(points)
    write_result(a.json, {"clock": "thread CPU time, the collector paused; each figure the "
                                   f"minimum over {REPEAT} runs",
                          "whole_phases": {k: w for k, w, _ in WHOLE}, "points": points})
    return 0


def _print(points: list) -> None:
    print(f"{'thread CPU ms (min)':<22}" + "".join(f"{q['dp']:>9}" for q in points))
    for k, _, _ in WHOLE:
        print(f"  {k:<20}" + "".join(f"{1e3 * q['whole_phases_s'][k]:9.1f}" for q in points))
    print(f"  {'other':<20}" + "".join(f"{1e3 * q['whole_phases_s']['other']:9.1f}"
                                       for q in points))
    print(f"{'whole batch':<22}" + "".join(f"{1e3 * q['whole_s']:9.1f}" for q in points))
    for k in OWN:
        print(f"  own {k:<16}" + "".join(
            f"{1e3 * q['own_s'][str(q['own_slowest_rank'])][k]:9.1f}" for q in points))
    print(f"{'own rank (slowest)':<22}" + "".join(f"{1e3 * q['own_max_s']:9.1f}"
                                                 for q in points))
