"""Do no harm (issue 27; docs/DESIGN.md section 5, "Do no harm"): per step, commit SAB's packing
and DST's plan only where they are predicted no slower than what a static run of the same step
would do (``choose_step``; ``--sb-stand-down``, ``--sb-stand-down-compare``), on the predictor DST
plans with. One rule for the runtime (``megatron/step/choice.py``) and the simulated study.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Generator, Optional, Sequence

import numpy as np

from ..config import STAND_DOWN_COMPARES
from ..kernels.slack import slower
from ..sim.pipeline import pipeline_makespan_s
from .costs import UnitCosts
from .dst_rounds import group_max, plan_rounds_in_process

def plan_step_time_s(costs: UnitCosts, densities: np.ndarray, p2p_s: float = 0.0) -> float:
    """Predicted step time of a plan: max over DP ranks of the pipeline makespan (1F1B, or the
    interleaved schedule when the costs have virtual stages), densities [dp, m, stages] on the
    costs' grid (the nearest grid density at or above each)."""
    d = np.asarray(densities, dtype=np.float64)
    if d.shape != costs.shape:
        raise ValueError(f"densities {d.shape} do not match the costs' units {costs.shape}")
    f, b = costs.at(costs.grid_index(d))
    return float(pipeline_makespan_s(f, b, p2p_s, pp=costs.pipeline_ranks).max())


@dataclass
class PackingOutcome:
    """One packing's step after the DST rule."""

    densities: np.ndarray          # [dp, m, stages] committed plan
    step_s: float                  # its predicted step time
    static_s: float                # the static plan's (every unit at d0)
    planned_s: Optional[float]     # DST's plan's (None: no DST)
    dst_stood_down: Optional[bool]  # None: no DST
    plan: object = None            # what plan_fn returned (e.g. a DSTPlan), None without DST


@dataclass
class StepChoice:
    """The committed packing and plan of one step, and why."""

    index: int                       # which of the candidate packings is committed
    outcome: PackingOutcome          # its plan
    sab_stood_down: Optional[bool]   # None: one candidate only (no SAB, or the rule is off)
    step_s: list                     # predicted step time of every candidate, after the DST rule
                                     # (compare 'static': the candidate not planned, its static)
    baseline_s: Optional[float] = None  # the static plan of the last candidate (the baseline)

    @property
    def dst_stood_down(self) -> Optional[bool]:
        return self.outcome.dst_stood_down

    def as_dict(self) -> dict:
        o = self.outcome
        return {"dst_stood_down": o.dst_stood_down, "sab_stood_down": self.sab_stood_down,
                "packing_index": self.index, "predicted_step_s": [float(x) for x in self.step_s],
                "predicted_static_s": o.static_s, "predicted_dst_s": o.planned_s}


def choose_step(costs: Sequence[UnitCosts], d0: float, p2p_s: float = 0.0,
                plan_fn: Optional[Callable[[int, UnitCosts], tuple]] = None,
                enabled: bool = True, compare: str = "planned") -> StepChoice:
    """The do-no-harm choice of one step in one process (``choice_rounds`` with a DP group of
    one): costs of each candidate packing of the same documents, SAB's first and the baseline
    second (one entry: no packing choice); plan_fn(i, costs_i) -> (densities [dp, m, stages],
    payload) is DST's plan for candidate i (None: static runs); ``compare``: ``planned`` or
    ``static`` (the candidate not committed is not planned: its ``step_s`` is its static
    plan's); ``enabled`` False commits the first candidate and DST's plan as they are (the
    ablation), still reporting what the rule would have predicted."""
    plans = None if plan_fn is None else [_no_rounds(plan_fn, i, c)
                                          for i, c in enumerate(costs)]
    return plan_rounds_in_process([choice_rounds(costs, d0, p2p_s, plans, enabled,
                                                 compare)])[0]


def _no_rounds(fn: Callable, *args) -> Generator[dict, dict, tuple]:
    """``fn(*args)`` as a candidate's plan that exchanges no round: called when the race
    first drives it, so only a candidate the rule plans is planned."""
    yield from ()
    return fn(*args)


def choice_rounds(costs: Sequence[UnitCosts], d0: float, p2p_s: float = 0.0,
                  plans: Optional[Sequence[Generator]] = None, enabled: bool = True,
                  compare: str = "planned") -> Generator[dict, dict, StepChoice]:
    """``choose_step``'s rule as a DP rank's rounds (``policy.dst_rounds``' protocol): every
    step time it compares is the DP group's maximum (``dst_rounds.group_max``: a rank holding
    only its own [1, m, stages] costs chooses as every rank does), and ``plans[i]``, candidate
    i's DST plan as rounds that return (densities, payload) (``dst_rounds.planned_rounds``;
    None: static runs), is driven only where the rule plans candidate i."""
    if not costs:
        raise ValueError("choose_step needs at least one candidate packing")
    if compare not in STAND_DOWN_COMPARES:
        raise ValueError(f"compare={compare!r}: expected one of {', '.join(STAND_DOWN_COMPARES)}")
    if enabled and compare == "static" and len(costs) > 1:
        static = []
        for c in costs:
            static.append((yield from group_max(plan_step_time_s(c, np.full(c.shape, d0), p2p_s))))
        i = 0 if slower(static[1], static[0]) else 1        # SAB's static plan strictly faster
        plan, payload = (yield from plans[i]) if plans is not None else (None, None)
        out = yield from outcome_rounds(costs[i], d0, p2p_s, plan, enabled, payload, static[i])
        times = static[:i] + [out.step_s] + static[i + 1:]
        return StepChoice(i, out, i != 0, times, static[-1])
    outs = []
    for i, c in enumerate(costs):
        plan, payload = (yield from plans[i]) if plans is not None else (None, None)
        outs.append((yield from outcome_rounds(c, d0, p2p_s, plan, enabled, payload)))
    times = [o.step_s for o in outs]
    if len(outs) == 1:
        return StepChoice(0, outs[0], None, times, outs[0].static_s)
    keep = (not enabled) or slower(times[1], times[0])      # SAB strictly faster
    return StepChoice(0 if keep else 1, outs[0 if keep else 1], not keep, times,
                      outs[-1].static_s)


def outcome_rounds(costs: UnitCosts, d0: float, p2p_s: float, plan: Optional[np.ndarray],
                   enabled: bool, payload, static_s: Optional[float] = None
                   ) -> Generator[dict, dict, PackingOutcome]:
    """The DST rule on one packing, as a DP rank's rounds: ``plan`` (DST's densities, None:
    static run) is kept unless it is predicted slower than the static plan of the same
    micro-batches (``enabled`` False: always kept, the ablation); ``static_s``: that static
    plan's step time where the caller has predicted it already. Each step time it compares is
    the DP group's maximum (``dst_rounds.group_max``)."""
    static = np.full(costs.shape, float(d0))
    if static_s is None:
        static_s = yield from group_max(plan_step_time_s(costs, static, p2p_s))
    if plan is None:
        return PackingOutcome(static, static_s, static_s, None, None, payload)
    plan = np.asarray(plan, dtype=np.float64)
    planned_s = yield from group_max(plan_step_time_s(costs, plan, p2p_s))
    if enabled and slower(planned_s, static_s):
        return PackingOutcome(static, static_s, static_s, planned_s, True, payload)
    return PackingOutcome(plan, planned_s, static_s, planned_s, False, payload)


@dataclass
class StandDownCounts:
    """Cumulative stand-downs over a run: steps that had the choice, and how many stood down."""

    dst_steps: int = 0
    dst_stood_down: int = 0
    sab_steps: int = 0
    sab_stood_down: int = 0

    def add(self, dst: Optional[bool], sab: Optional[bool]) -> None:
        if dst is not None:
            self.dst_steps += 1
            self.dst_stood_down += int(bool(dst))
        if sab is not None:
            self.sab_steps += 1
            self.sab_stood_down += int(bool(sab))

    def describe(self) -> str:
        """'stood down DST 3/10 (30%) SAB 1/10 (10%)', the parts that had a choice."""
        parts = [f"{name} {n}/{k} ({100.0 * n / k:.0f}%)"
                 for name, n, k in (("DST", self.dst_stood_down, self.dst_steps),
                                    ("SAB", self.sab_stood_down, self.sab_steps)) if k]
        return "stood down " + " ".join(parts) if parts else ""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: Optional[dict]) -> None:
        for k, v in (state or {}).items():
            if k in self.state_dict():
                setattr(self, k, int(v))
