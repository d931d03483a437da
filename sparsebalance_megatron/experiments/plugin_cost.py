"""The plugin's own per-step cost on the training critical path, put into every simulated step
time (issue 44): every speedup a study states is net of it, at the flags its row names.

    net step = gross step (simulated) + planning + control plane + calibration and reporting

- **planning**, by ``--sb-planner``: ``inline``, the draft's CPU time on the training thread
  (SAB packing, the latency features and unit costs, DST: the runtime's draft,
  ``megatron/step/drafting.py``; a DP rank's own draft and its settle where the measurement is
  one rank's, else rank 0's whole draft while every rank waits for the plan's broadcast); the
  do-no-harm rule packs every candidate (SAB's and the baseline's: features twice) and DST
  plans both (``--sb-stand-down-compare planned``, the default) or the packing it chooses
  (``static``). ``process`` (the default) and
  ``thread``: the step is planned ahead while the one before trains, and only what stays on the
  critical path is charged: handing the draft's inputs over and reading it back, and the wait at
  the join (a thread planner's GIL share of the training thread is not priced here; the
  planner_cost study measures it).
- **control plane**: every rank's gather of its step record, and with DST the plan's broadcast,
  priced for the row's world size (DP x PP x CP).
- **calibration and reporting**: after the step, the calibration's prediction and the reports'
  density weights (the planner_cost study's last part; the log line and metrics writers are not
  timed).
- **quality refresh** (``--sb-quality-refresh-interval N``, DST's quality objective;
  ``refresh_s``): K x (1 + groups) forward passes of a held-out micro-batch through the pipeline
  every N steps (K: ``--sb-quality-refresh-microbatches``), each priced as the step's mean
  micro-batch at d0 crossing every (virtual) stage forward (the DP ranks run theirs at once),
  spread over the N steps; the simulated plans do
  not follow the refreshed model (the study's quality model is the launch-time one).

Costs come from the project's measurements, read from ``docs/results`` JSONs by name, so a
newer measurement replaces an older one without a code change:

- planning, calibration: ``PLANNER_COST[(dst_objective, dst_descent)]`` (``planner_cost``'s
  JSON, its ``steps.best``: the best static layout, the configuration the studies compare with);
  fields read: ``parts_ms`` (``sab_plan``, ``features + UnitCosts.from_latency``,
  ``sensitivity + DST``, ``after the step: busy_s + unit_work``: one packing's parts, which the
  charge counts once per candidate packing, DST once per packing it plans), ``draft_ms`` (the
  runtime's whole draft: where present, the in-line parts are scaled so that SAB + DST with the
  stand-down at the measured shape costs exactly it; ``candidates`` and ``dst_candidates`` say
  how many packings that draft packed and planned, ``candidates`` both where the file has no
  ``dst_candidates``), per ahead planner ``plan_ahead`` (the ``planner`` it names, else a
  thread: the study before ``--sb-planner``) and ``plan_ahead_thread``, each with
  ``join_wait_ms``, ``handoff_ms`` (0 when absent) and ``after_step_ms``, and the shape
  (``shape``/``layout`` text, or ``dp``, ``microbatches``, ``pp``, ``virtual_stages``,
  ``seq_length``). A planner form the file did not measure is priced by the nearest one it did
  (process by thread, or the reverse), and the charge's source says so;
- control plane: ``CONTROL_PLANE``'s ``rows`` of ``world_size``, ``microbatches``,
  ``gather_ms``, ``broadcast_ms`` (critical path per step).

Scaled from the measured shape to a row's: packing with the tokens of the global batch
(dp x m x seq); features, DST, calibration and the planner's handoff with the units (dp x m x
virtual stages); the join wait as measured (nothing while the planner finishes within the step); the
control plane interpolated in world size (linear between measured sizes, and beyond the last
two), at the nearest measured micro-batch count scaled by m. Linear growth is the target of
issue 44 (no faster than linear in DP x micro-batches); a measurement with its own exponents
replaces it. A measurement of one DP rank (``per_rank``: the study prices the rank's own draft
and settle, its DST rounds, and its own after-step work, as every rank plans in a run) scales
with the rank's own share instead: packing with its tokens (m x seq), features, DST,
calibration and the after-step work with its units (m x virtual stages), not with DP; only the
handoff, which sends the step's segments (the global batch's documents), scales with the
global batch's tokens (dp x m x seq).

Who pays: a run of SparseBalance's (SAB and / or DST: ``sab``, ``dst*``, ``sab_dst*``,
``dense_sab``) pays its parts every step it plans; the baselines (``BASELINES``: static and
dense attention with sequential, token-balanced or Megatron's dp_balanced packing) pay nothing, as if the plugin's control plane were off: every ratio against
them is then conservative. Do no harm on net (``net_gate.NetGate``): a run stands down
without planning (the baseline packing at d0, run as the static baseline: nothing planned,
gathered or broadcast, so nothing paid) while its last planned step's predicted gain did not
cover its own cost, probing again after 8 steps, then 16, 32, ... (up to 256).

Pure Python + numpy; must not import torch or megatron.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..config import PLANNERS, STAND_DOWN_COMPARES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
PLANNER_COST = {
    ("quality", "critical_path"): "planner_cost_quality_descent.json",
    ("quality", "off"): "planner_cost_quality_descent_off.json",
    ("density", "off"): "planner_cost.json",
}
"""(--sb-dst-objective, --sb-dst-descent) -> the planner_cost JSON measured with those flags."""
CONTROL_PLANE = "control_plane.json"
"""The control plane's cost per world size (``scripts/bench.py control_plane``)."""
PARTS = {"packing": "sab_plan", "features": "features + UnitCosts.from_latency",
         "dst": "sensitivity + DST", "calibration": "after the step: busy_s + unit_work"}
"""Our names of the planner_cost study's parts."""
BASELINES = ("dense", "static", "token_balanced", "dp_balanced", "dense_token_balanced",
             "dense_dp_balanced")
"""Runs without the plugin: they pay nothing."""


@dataclass(frozen=True)
class Shape:
    """What a step's plugin work scales with."""

    dp: int
    microbatches: int
    pp: int
    virtual_stages: int
    seq_length: int
    cp: int = 1
    tp: int = 1

    @property
    def units(self) -> int:
        return self.dp * self.microbatches * self.virtual_stages

    @property
    def tokens(self) -> int:
        return self.dp * self.microbatches * self.seq_length

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def rank_units(self) -> int:
        """A DP rank's own units."""
        return self.microbatches * self.virtual_stages

    @property
    def rank_tokens(self) -> int:
        """A DP rank's own tokens."""
        return self.microbatches * self.seq_length


def _named(path: str) -> str:
    """A result file by its path from the repository root (as the docs cite it)."""
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else path


def _stages_of(layout: str, pp: int) -> int:
    """Virtual stages of a layout as ``PipelineLayout.describe`` writes it ('7/8/8/1': pp;
    '[2+4]/[3+6]/...': pp x vp)."""
    return sum(len(part.strip("[]").split("+")) for part in layout.split("/")) if layout else pp


@dataclass(frozen=True)
class AheadCost:
    """What one ahead planner (``--sb-planner process`` or ``thread``) left on the training
    thread per step at the measured shape (ms): the handoff (inputs sent, draft read back; the
    slower of rank 0's and the other ranks'), the wait at the join, the after-step work."""

    handoff_ms: float
    join_wait_ms: float
    after_step_ms: float


@dataclass
class PlannerCost:
    """One planner_cost measurement: per-step parts (ms) at the shape it was measured at."""

    source: str
    shape: Shape
    parts_ms: dict
    ahead: dict
    """{planner form: ``AheadCost``} for the forms the file measured."""
    draft_ms: Optional[float] = None
    """The runtime's whole draft (every candidate packing), where the file has it."""
    candidates: int = 2
    """Packings the measured draft packed (2 with the do-no-harm rule)."""
    dst_candidates: int = 2
    """Packings the measured draft's DST planned (1 with ``--sb-stand-down-compare static``)."""
    per_rank: bool = False
    """The parts are one DP rank's (module docstring: they scale with the rank's own share)."""

    @classmethod
    def load(cls, path: str, layout: str = "best") -> "PlannerCost":
        with open(path) as f:
            data = json.load(f)
        step = (data.get("steps") or {}).get(layout)
        if step is None:
            raise ValueError(f"{path}: no steps.{layout}: expected a scripts/bench.py "
                             f"planner_cost result")
        if all(k in step for k in ("dp", "microbatches", "pp", "seq_length")):
            dp, m, pp, seq = (int(step[k]) for k in ("dp", "microbatches", "pp", "seq_length"))
        else:
            got = re.match(r"(\d+) DP x (\d+) micro-batches x PP(\d+), (\d+) tokens",
                           step.get("shape", ""))
            if got is None:
                raise ValueError(f"{path}: steps.{layout}.shape {step.get('shape')!r}: expected "
                                 f"'D DP x M micro-batches x PPp, T tokens'")
            dp, m, pp, seq = (int(x) for x in got.groups())
        stages = int(step.get("virtual_stages") or _stages_of(step.get("layout", ""), pp))
        missing = [v for v in PARTS.values() if v not in step.get("parts_ms", {})]
        if missing:
            raise ValueError(f"{path}: steps.{layout}.parts_ms lacks {missing}")
        ahead = {}
        for key in ("plan_ahead", "plan_ahead_thread"):
            a = step.get(key)
            if not a:
                continue
            # before --sb-planner the study's only ahead planner was a thread (--sb-plan-ahead)
            form = a.get("planner", "process" if key == "plan_ahead" and "planner" in data
                         else "thread")
            ahead.setdefault(form, AheadCost(     # the slower rank's handoff
                max(float(a.get("handoff_ms", 0.0)), float(a.get("handoff_other_ms", 0.0))),
                float(a.get("join_wait_ms", 0.0)),
                float(a.get("after_step_ms", step["parts_ms"][PARTS["calibration"]]))))
        return cls(source=_named(path), shape=Shape(dp, m, pp, stages, seq),
                   parts_ms={k: float(step["parts_ms"][v]) for k, v in PARTS.items()},
                   ahead=ahead,
                   draft_ms=float(step["draft_ms"]) if "draft_ms" in step else None,
                   candidates=int(step.get("candidates", 2)),
                   dst_candidates=int(step.get("dst_candidates", step.get("candidates", 2))),
                   per_rank=bool(step.get("per_rank")))

    def scale(self, shape: Shape) -> dict:
        """A row's ``shape`` over the measured one (module docstring): ``units`` (features, DST,
        calibration, the after-step work), ``tokens`` (packing) and ``handoff``; a DP rank's
        own share where the measurement is one rank's (``per_rank``)."""
        m = self.shape
        batch = shape.tokens / m.tokens
        if self.per_rank:
            return {"units": shape.rank_units / m.rank_units,
                    "tokens": shape.rank_tokens / m.rank_tokens, "handoff": batch}
        units = shape.units / m.units
        return {"units": units, "tokens": batch, "handoff": units}

    def ahead_of(self, planner: str) -> tuple[AheadCost, str]:
        """(the ahead cost of ``planner``, a note when another form's measurement stands in)."""
        if planner in self.ahead:
            return self.ahead[planner], ""
        if not self.ahead:
            raise ValueError(f"{self.source}: no plan_ahead measurement: cannot price "
                             f"--sb-planner {planner}")
        other = next(iter(self.ahead))
        return self.ahead[other], (f"; --sb-planner {planner} priced by the {other} planner's "
                                   f"measurement")

    def draft_scale(self) -> float:
        """The measured draft over the parts' sum for SAB + DST as it was measured (every
        candidate packed, DST on ``dst_candidates`` of them; 1 where the file has no draft):
        what the draft spends beyond its parts (the baseline's packing, the stand-down's
        predictions)."""
        if self.draft_ms is None:
            return 1.0
        p = self.parts_ms
        parts = p["packing"] + self.candidates * p["features"] + self.dst_candidates * p["dst"]
        return self.draft_ms / parts if parts > 0 else 1.0


@dataclass
class ControlPlaneCost:
    """Critical-path ms per step of the gather and the broadcast, per (world size, m)."""

    source: str
    rows: list

    @classmethod
    def load(cls, path: str) -> "ControlPlaneCost":
        with open(path) as f:
            data = json.load(f)
        rows = []
        for r in data.get("rows", []):
            rows.append((int(r["world_size"]), int(r["microbatches"]), float(r["gather_ms"]),
                         float(r["broadcast_ms"])))
        if not rows:
            raise ValueError(f"{path}: no rows of world_size, microbatches, gather_ms, "
                             f"broadcast_ms")
        return cls(_named(path), sorted(rows))

    def at(self, world_size: int, microbatches: int) -> tuple[float, float]:
        """(gather_ms, broadcast_ms) at this world size and micro-batch count (module
        docstring: interpolated in world size, scaled by m from the nearest measured m)."""
        ms = sorted({r[1] for r in self.rows})
        m0 = min(ms, key=lambda m: (abs(np.log(m / microbatches)), m))
        pts = [r for r in self.rows if r[1] == m0]
        w = np.array([r[0] for r in pts], dtype=np.float64)
        out = []
        for j in (2, 3):
            y = np.array([r[j] for r in pts])
            if w.size == 1:
                v = y[0] * world_size / w[0]
            elif world_size <= w[-1]:
                v = float(np.interp(world_size, w, y))
            else:                     # beyond the last size: the last segment's slope
                v = y[-1] + (y[-1] - y[-2]) / (w[-1] - w[-2]) * (world_size - w[-1])
            out.append(max(float(v), 0.0) * microbatches / m0)
        return out[0], out[1]


@dataclass
class RunCharge:
    """One run's cost per step that plans (``plan_s``, by part ``parts_ms``); a step that stood
    down without planning (``NetGate``) runs as the static baseline and pays nothing."""

    plan_s: float
    parts_ms: dict
    flags: str
    source: str


@dataclass
class PluginCost:
    """The cost model: a planner measurement and a control-plane measurement (module
    docstring). ``charge`` prices one run of a study."""

    planner: PlannerCost
    control: ControlPlaneCost
    notes: list = field(default_factory=list)
    dst_flags: str = ""
    """The DST flags the planning measurement was taken with (named in every DST row)."""

    @classmethod
    def from_results(cls, dst_objective: str, dst_descent: str,
                     results: str = RESULTS) -> "PluginCost":
        """The measurements named for these flags (``PLANNER_COST``, ``CONTROL_PLANE``)."""
        name = PLANNER_COST.get((dst_objective, dst_descent))
        notes = []
        if name is None:      # the nearest measured: same objective, else the default flags
            near = [k for k in PLANNER_COST if k[0] == dst_objective] or [
                ("quality", "critical_path")]
            name = PLANNER_COST[near[0]]
            notes.append(f"planning: no measurement at --sb-dst-objective {dst_objective} "
                         f"--sb-dst-descent {dst_descent}; {name} stands in")
        cp = os.path.join(results, CONTROL_PLANE)
        if not os.path.exists(cp):
            raise FileNotFoundError(f"no control-plane measurement in {results} (expected "
                                    f"{CONTROL_PLANE}: python scripts/bench.py control_plane "
                                    f"--json docs/results/{CONTROL_PLANE})")
        return cls(PlannerCost.load(os.path.join(results, name)), ControlPlaneCost.load(cp),
                   notes, f"--sb-dst-objective {dst_objective} --sb-dst-descent {dst_descent}")

    def charge(self, shape: Shape, *, sab: bool, dst: bool, planner: str,
               stand_down: bool, compare: str = "planned") -> Optional[RunCharge]:
        """The per-step cost of one run at ``shape`` with SAB packing (``sab``) and / or DST
        (``dst``) planned by ``planner`` (``--sb-planner``: process, thread or inline) under
        these flags (``compare``: ``--sb-stand-down-compare``); None for a run with neither (a
        baseline pays nothing)."""
        if planner not in PLANNERS:
            raise ValueError(f"planner={planner!r}: expected one of {PLANNERS}")
        if compare not in STAND_DOWN_COMPARES:
            raise ValueError(f"compare={compare!r}: expected one of {STAND_DOWN_COMPARES}")
        if not (sab or dst):
            return None
        cand = 2 if sab and stand_down else 1         # the draft packs each candidate packing
        planned = cand if compare == "planned" else 1   # and DST plans one, or each
        m = self.planner.shape
        ratio = self.planner.scale(shape)
        units, tokens = ratio["units"], ratio["tokens"]
        p = self.planner.parts_ms
        scale = self.planner.draft_scale()
        planning = {"packing": p["packing"] * tokens * scale if sab else 0.0,
                    "features": p["features"] * units * cand * scale,
                    "dst": p["dst"] * units * planned * scale if dst else 0.0}
        gather, bcast = self.control.at(shape.world_size, shape.microbatches)
        note = ""
        if planner == "inline":
            plan_ms, calib = sum(planning.values()), p["calibration"] * units
        else:
            ahead, note = self.planner.ahead_of(planner)
            plan_ms = ahead.join_wait_ms + ahead.handoff_ms * ratio["handoff"]
            calib = ahead.after_step_ms * units
        parts = {"planning": plan_ms, "gather": gather, "broadcast": bcast if dst else 0.0,
                 "calibration": calib}
        sd = ("on" + (f" ({compare})" if sab else "")) if stand_down else "off"
        flags = (f"--sb-planner {planner}, stand-down {sd}, "
                 f"{shape.world_size} ranks "
                 f"({shape.dp} DP x {shape.pp} PP{f' x {shape.cp} CP' if shape.cp > 1 else ''}"
                 f"{f' x {shape.tp} TP' if shape.tp > 1 else ''})"
                 + (f", {self.dst_flags}" if dst and self.dst_flags else ""))
        return RunCharge(plan_s=sum(parts.values()) * 1e-3, parts_ms=parts, flags=flags,
                         source=f"{self.planner.source} (planning, calibration; measured at "
                                f"{m.dp} DP x {m.microbatches} x {m.virtual_stages} stages"
                                f"{', one DP rank' if self.planner.per_rank else ''}"
                                f"{note}); {self.control.source} (control plane)")


def refresh_s(costs, d0: float, interval: int, groups: int, microbatches: int = 1) -> float:
    """--sb-quality-refresh-interval's share of a step (seconds; 0 when ``interval`` is 0):
    ``microbatches`` x (1 + ``groups``) forward passes of a micro-batch through every stage of
    ``costs`` (a ``UnitCosts``: the step's mean unit's forward seconds at ``d0``, summed over
    the stages) every ``interval`` steps (``microbatches``: --sb-quality-refresh-microbatches;
    the passes are priced one after another, the schedule's forward-only overlap of stages not
    credited)."""
    if not interval:
        return 0.0
    one = float(costs.fwd_s[..., costs.index_of(d0)].sum(axis=2).mean())   # [dp, m] -> mean
    return int(microbatches) * (1 + int(groups)) * one / int(interval)
