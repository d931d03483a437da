"""``--sb-replay-plans``: the callback trains on another run's recorded plans instead of its own.

``--sb-metrics-file`` writes, with every step's line, the step's plan: ``plan`` (``plan_record``:
which segments of which documents each DP rank runs in each micro-batch slot, and the packing
settings they were made under) and ``densities`` ([dp][m][stages], the DST or static plan; absent
in a dense run). ``RecordedPlans`` reads such a file and serves, step by step, the recorded
``BatchPlan`` and densities.

Why: given the same plan (the same documents in the same micro-batch slots of the same DP ranks,
the same densities per unit), a CP=N run computes the numbers of a CP=1 run with CP=N's document
padding; but each plans with its own latency model (the CP=N one adapted by
``LatencyModel.with_context_parallel``), so SAB may pack and DST budget differently. Replaying the
CP=1 run's ``--sb-metrics-file`` gives the CP=N run the CP=1 plans.

Two checks: ``launch_problems`` (preflight, before the tokenizer and the process group) compares
the file's first step with the launch's flags; ``PlanReplay.step`` (every step, on the callback's
draft) checks that the run drew the recorded documents and has the recorded shape (DP ranks,
micro-batches, stages, packing settings). Every refusal is a ``ReplayError``, a ``LaunchError``
naming the flag and the file (on the first step one ``error:`` line; later the step's exception).
No torch.distributed; megatron only inside functions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...batching.plan import BatchPlan
from ...config import SparseBalanceConfig, flag_name
from ..errors import LaunchError

PLAN_FORMAT = 1
FLAG = flag_name("replay_plans")


class ReplayError(LaunchError):
    """The recorded plans cannot be replayed; the message names the flag and the file."""


def plan_record(batch: BatchPlan, first_bin: int, pad_multiple: int,
                seed: Optional[int] = None) -> dict:
    """The step's packing as one compact JSON-able dict: ``micro_batches[dp][m]`` a flat list
    ``[doc, start, end, doc, start, end, ...]`` of its segments, plus what shaped them
    (``seed``: the run's ``--sb-seed``, which draws the documents; a replay is checked against
    it at launch)."""
    return {"format": PLAN_FORMAT, "first_bin": int(first_bin), "method": batch.method,
            **({} if seed is None else {"seed": int(seed)}),
            "max_tokens": int(batch.max_tokens), "length_multiple": int(batch.length_multiple),
            "pad_multiple": int(pad_multiple), "split_docs": int(batch.num_split_samples),
            "micro_batches": [[[int(x) for seg in mb for x in seg] for mb in rank]
                              for rank in batch.micro_batches]}


@dataclass
class StepShape:
    """What a run must share with the recorded one for its plans to apply."""

    dp: int
    num_microbatches: int
    max_tokens: int            # --seq-length x --micro-batch-size
    pad_multiple: int          # --sb-seq-pad-multiple (or 2 x CP)
    length_multiple: int       # --sb-microbatch-multiple
    stages: int                # plan stages (PP x VP); 0: a dense run (no densities)


SHAPE_FLAGS = {"dp": "data-parallel size (world size / (TP x PP x CP))",
               "num_microbatches": "micro-batches per step (--global-batch-size / "
                                   "(--micro-batch-size x DP))",
               "max_tokens": "--seq-length x --micro-batch-size",
               "pad_multiple": "--sb-seq-pad-multiple (0: 2 x --context-parallel-size)",
               "length_multiple": "--sb-microbatch-multiple",
               "stages": "plan stages (pipeline stages x virtual stages; 0: a dense run)"}


class RecordedPlans:
    """Every step's recorded plan of a ``--sb-metrics-file`` (a step recorded twice, as by a
    resumed run appending to the file: the later line)."""

    def __init__(self, path: str, steps: dict):
        self.path, self.steps = path, steps

    @classmethod
    def read(cls, path: str) -> "RecordedPlans":
        where = f"{FLAG} {path}"
        if not os.path.exists(path):
            raise ReplayError(f"{where}: file not found")
        if not os.path.isfile(path):
            raise ReplayError(f"{where}: not a regular file (expected a --sb-metrics-file)")
        steps: dict = {}
        try:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ReplayError(f"{where}: line {n} is not JSON ({e.msg}); expected "
                                          f"the lines of a --sb-metrics-file") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                        raise ReplayError(f"{where}: line {n} has no step number; expected "
                                          f"the lines of a --sb-metrics-file")
                    if not isinstance(rec.get("plan"), dict):
                        raise ReplayError(f"{where}: step {rec['step']} (line {n}) records no "
                                          f"plan (written by an older version?): nothing to "
                                          f"replay")
                    steps[rec["step"]] = _parse_step(rec, f"{where}: step {rec['step']}")
        except UnicodeDecodeError as e:
            raise ReplayError(f"{where}: not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise ReplayError(f"{where}: cannot be read ({e.strerror or e})") from None
        if not steps:
            raise ReplayError(f"{where}: no step recorded")
        return cls(path, steps)

    def check_run(self, seed: Optional[int], train_iters: Optional[int]) -> list[str]:
        """What a run of this ``--sb-seed`` and ``--train-iters`` cannot replay, one line each,
        known at launch: another seed draws other documents (files that record none are not
        compared), and every step from the file's first to ``train_iters`` must be recorded
        (a run resumed from a checkpoint may start past the first)."""
        out = []
        seeds = sorted({s["seed"] for s in self.steps.values() if s["seed"] is not None})
        if seed is not None and seeds and seeds != [seed]:
            out.append(f"{FLAG} {self.path}: recorded with --sb-seed "
                       f"{'/'.join(map(str, seeds))}, this run has --sb-seed {seed} (another "
                       f"seed draws other documents): pass --sb-seed {seeds[0]}")
        if train_iters:
            first, last = min(self.steps), max(self.steps)
            missing = [n for n in range(first, train_iters + 1) if n not in self.steps]
            if missing:
                gap = f"steps {missing[0]}-{missing[-1]}" if len(missing) > 1 else \
                    f"step {missing[0]}"
                held = f"step {first}" if first == last else f"steps {first}-{last}"
                out.append(f"{FLAG} {self.path}: holds {held}, this run trains --train-iters "
                           f"{train_iters}: {gap} not recorded; replay at most --train-iters "
                           f"{missing[0] - 1}")
        return out

    def check_shape(self, want: StepShape, step: Optional[int] = None) -> None:
        """``ReplayError`` naming every setting in which ``want`` differs from the recorded
        step (the first one by default); ``None`` fields of ``want`` are not compared."""
        n = min(self.steps) if step is None else step
        have = self.steps[n]["shape"]
        bad = [f"{SHAPE_FLAGS[k]}: recorded {getattr(have, k)}, this run {getattr(want, k)}"
               for k in SHAPE_FLAGS
               if getattr(want, k) is not None and getattr(want, k) != getattr(have, k)]
        if bad:
            raise ReplayError(f"{FLAG} {self.path}: step {n} cannot be replayed by this run: "
                              + "; ".join(bad))

    def step(self, iteration: int, first_bin: int, segments, shape: StepShape
             ) -> tuple[BatchPlan, Optional[np.ndarray]]:
        """(BatchPlan, densities [dp, m, stages] or None) of Megatron's 0-based ``iteration``,
        checked against this run: the step is recorded, starts at the same sample, has the
        run's shape, and packs exactly the ``segments`` this run drew for it."""
        n = iteration + 1
        if n not in self.steps:
            have = sorted(self.steps)
            raise ReplayError(f"{FLAG} {self.path}: step {n} is not recorded (the file holds "
                              f"steps {have[0]}-{have[-1]}); replay at most as many "
                              f"--train-iters as the recorded run ran")
        rec = self.steps[n]
        if rec["first_bin"] != first_bin:
            raise ReplayError(f"{FLAG} {self.path}: step {n} starts at sample {first_bin} in "
                              f"this run, at {rec['first_bin']} in the recorded one (another "
                              f"--global-batch-size or batch-size ramp?)")
        self.check_shape(shape, n)
        batch = rec["batch"]
        if sorted(batch.segments()) != sorted(tuple(int(x) for x in s) for s in segments):
            raise ReplayError(f"{FLAG} {self.path}: step {n}'s documents differ from the ones "
                              f"this run drew (the same --data-path, --split, --sb-seed, "
                              f"--sb-tokenizer and --sb-seq-pad-multiple are needed)")
        return batch, rec["densities"]


def _parse_step(rec: dict, where: str) -> dict:
    """One metrics line -> {"shape", "first_bin", "batch", "densities"}; ``ReplayError``."""
    p = rec["plan"]
    try:
        if p.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {p.get('format')!r}, this version reads "
                             f"{PLAN_FORMAT}")
        mbs = p["micro_batches"]
        micro_batches = []
        for rank in mbs:
            row = []
            for flat in rank:
                if len(flat) % 3:
                    raise ValueError("a micro-batch's segment list is not (doc, start, end) "
                                     "triples")
                row.append([tuple(int(x) for x in flat[i:i + 3]) for i in range(0, len(flat), 3)])
            micro_batches.append(row)
        if not micro_batches or len({len(r) for r in micro_batches}) != 1:
            raise ValueError("micro_batches is not a [dp][m] list")
        batch = BatchPlan(micro_batches, method=str(p["method"]), max_tokens=int(p["max_tokens"]),
                          num_split_samples=int(p.get("split_docs", 0)),
                          length_multiple=int(p["length_multiple"]))
        densities = rec.get("densities")
        if densities is not None:
            densities = np.asarray(densities, dtype=np.float64)
            dp, m = batch.dp, batch.num_microbatches
            if densities.ndim != 3 or densities.shape[:2] != (dp, m) \
                    or not np.all((densities > 0) & (densities <= 1)):
                raise ValueError(f"densities of shape {densities.shape}: expected [{dp}, {m}, "
                                 f"stages] in (0, 1]")
        shape = StepShape(batch.dp, batch.num_microbatches, batch.max_tokens,
                          int(p["pad_multiple"]), batch.length_multiple,
                          0 if densities is None else int(densities.shape[2]))
        seed = p.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed {seed!r}: expected an integer")
        return {"shape": shape, "first_bin": int(p["first_bin"]), "batch": batch,
                "densities": densities, "seed": seed}
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{where}: damaged plan ({type(e).__name__}: {e})") from None



def launch_problems(args, sb: SparseBalanceConfig) -> list[str]:
    """What makes the recorded plans unusable by this launch's flags (the seed, the steps
    --train-iters needs, the shape of the first step), one entry each; the file's own problems
    are ``preflight.config_problems``'."""
    if not sb.replay_plans:
        return []
    if sb.metrics_file and os.path.abspath(sb.metrics_file) == os.path.abspath(sb.replay_plans):
        return [f"{flag_name('replay_plans')} {sb.replay_plans}: the same file as "
                f"{flag_name('metrics_file')} (the run would append to the plans it replays); "
                f"record this run elsewhere"]
    try:
        recorded = RecordedPlans.read(sb.replay_plans)
    except ReplayError:
        return []                      # config_problems names it
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    dp = world // (tp * pp * cp) if world and world % (tp * pp * cp) == 0 else None
    mbs = getattr(args, "micro_batch_size", None) or 1
    gbs = getattr(args, "global_batch_size", None)
    m = gbs // (mbs * dp) if dp and gbs and not getattr(args, "rampup_batch_size", None) \
        and not getattr(args, "step_batch_size_schedule", None) else None
    seq = getattr(args, "seq_length", None)
    virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None) \
        or getattr(args, "num_virtual_stages_per_pipeline_rank", None) \
        or getattr(args, "pipeline_model_parallel_layout", None)
    want = StepShape(dp=dp, num_microbatches=m, max_tokens=seq * mbs if seq else None,
                     pad_multiple=sb.pad_multiple(cp), length_multiple=sb.length_multiple,
                     stages=(None if virtual else pp) if sb.sparse_attention_enabled else 0)
    out = recorded.check_run(sb.seed, getattr(args, "train_iters", None))
    try:
        recorded.check_shape(want)
    except ReplayError as e:
        out.append(str(e))
    return out


class PlanReplay:
    """The recorded plans, served to one rank's callback step by step."""

    def __init__(self, sb: SparseBalanceConfig, *, dp: int, max_tokens: int, pad_multiple: int,
                 stages: int):
        self.recorded = RecordedPlans.read(sb.replay_plans)
        self.dp, self.max_tokens, self.pad_multiple = dp, max_tokens, pad_multiple
        self.length_multiple = sb.length_multiple
        self.stages = stages if sb.sparse_attention_enabled else 0

    def step(self, iteration: int, first_bin: int, segments, num_microbatches: int):
        """(BatchPlan, densities [dp, m, stages] or None) recorded for ``iteration``."""
        shape = StepShape(self.dp, num_microbatches, self.max_tokens, self.pad_multiple,
                          self.length_multiple, self.stages)
        return self.recorded.step(iteration, first_bin, segments, shape)


def plan_replay(sb: SparseBalanceConfig, **kw) -> Optional[PlanReplay]:
    return PlanReplay(sb, **kw) if sb.replay_plans else None
