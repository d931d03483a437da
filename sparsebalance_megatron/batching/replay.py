"""Plans a run recorded, read back so that another run trains on them (``--sb-replay-plans``).

``--sb-metrics-file`` writes, with every step's line, the step's plan: ``plan`` (``plan_record``:
which segments of which documents each DP rank runs in each micro-batch slot, and the packing
settings they were made under) and ``densities`` ([dp][m][stages], the DST or static plan; absent
in a dense run). ``RecordedPlans`` reads such a file and serves, step by step, the recorded
``BatchPlan`` and densities, after checking that the replaying run draws the same documents for
the step and has the same shape (DP ranks, micro-batches, stages, packing settings).

Why: planning depends on the latency model, and a CP=N run plans with the CP-adapted one, so it
may pack and budget differently from a CP=1 run on the same data. Given the same plan, CP=N
computes CP=1's numbers; replaying the CP=1 run's plans gives it that plan.

Pure Python + numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..config import flag_name
from .plan import BatchPlan

PLAN_FORMAT = 1
FLAG = flag_name("replay_plans")


class ReplayError(ValueError):
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
