"""The per-step control plane: each rank's ``RankReport`` gathered into the ``StepSummary`` every
rank ends a step with, as fixed-size float64 tensors over the process groups Megatron already has
(``runtime/comm.py`` moves them; ``step/record.py`` lays them out), and the gloo copy of the DP
group DST's rounds use (``ExchangeGroups.rounds``, ``step/agreement.py``). No plan travels: each
DP rank plans its own rows (``Drafter.own_draft``, ``settle``) and agrees the rest in DST's and
SAB's fixed-size reductions.

The gather, in three levels:

1. the tensor- and context-parallel group (the ranks of one (DP rank, stage) cell, one node in
   the usual layout): every rank's record; each rank combines them (``combine_cell``);
2. the pipeline group: the cells of this DP rank's pipeline, joined into its line
   (``join_pipeline``);
3. the data-parallel group: the sums and maxima of the DP rank's line (losses, budget
   violations, planner events; the step time, the attention fallback, a packing that
   differed), one fixed-size all-reduce per op whatever the DP size (``reduce``). A DP rank's
   busy seconds and documents are its own (SAB per rank: a rank holds only its micro-batches
   and calibrates only its pipeline), decoded from its own line (``decode_step``). Every DP
   rank's line is gathered only where a budget violation is to be described (the error names
   the first few anywhere) or ``--sb-metrics-file`` writes every unit's times.

Every rank takes part in every level: the TP/CP ranks of a cell hold the same combined record, so
their parallel copies of levels 2 and 3 carry identical data. A rank receives (t - 1) rank
records, (pp - 1) cell records and two reductions of a few floats, not world-size pickles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime import comm
from .record import (RankReport, RecordShape, StepSummary, combine_cell, decode_step,
                     encode_rank, join_pipeline, split_docs)


@dataclass
class ExchangeGroups:
    """The three process groups of a rank (None: that dimension is 1)."""

    cell: object = None        # tensor x context parallel: the ranks of this rank's cell
    pipeline: object = None    # the pipeline stages of this DP rank (stage order)
    data: object = None        # the DP ranks at this rank's stage and TP/CP place (DP order)
    rounds: object = None      # a gloo copy of ``data``: DST's rounds, beside the training
                               # thread (``step/agreement.py``)

    @classmethod
    def from_megatron(cls) -> "ExchangeGroups":
        """Megatron's groups of this rank (``parallel_state``, once initialised), and the gloo
        copy of its DP group (collective)."""
        from megatron.core import parallel_state as ps

        data = ps.get_data_parallel_group()
        return cls(ps.get_tensor_and_context_parallel_group(),
                   ps.get_pipeline_model_parallel_group(), data, comm.gloo_copy(data))


    @classmethod
    def for_layout(cls, tp: int, pp: int, dp: int) -> tuple:
        """(this rank's (dp, pp, tp) place, its groups) of a job of ``tp x pp x dp`` ranks laid
        out in Megatron's default order (rank = tp + TP x (dp + DP x pp)), for a harness without
        Megatron (benchmarks, tests). Collective: every rank makes every group."""
        world = tp * pp * dp
        if comm.world_size() != world:
            raise ValueError(f"a TP {tp} x PP {pp} x DP {dp} layout needs {world} ranks, the job "
                             f"has {comm.world_size()}")
        place = {r: (r // tp % dp, r // (tp * dp), r % tp) for r in range(world)}
        mine, found = place[comm.rank()], {}
        for name, same in (("cell", (0, 1)), ("pipeline", (0, 2)), ("data", (1, 2))):
            for key in sorted({tuple(p[i] for i in same) for p in place.values()}):
                ranks = [r for r, p in place.items() if tuple(p[i] for i in same) == key]
                group = comm.new_group(ranks)
                if tuple(mine[i] for i in same) == key:
                    found[name] = group
        found["rounds"] = comm.gloo_copy(found["data"])
        return mine, cls(**found)


class StepExchange:
    """One rank's end of the per-step gather and reductions."""

    def __init__(self, groups: ExchangeGroups):
        self.groups = groups
        self.sizes = tuple(comm.group_size(g) for g in (groups.cell, groups.pipeline,
                                                         groups.data))
        self.ranks = tuple(comm.group_rank(g) for g in (groups.cell, groups.pipeline,
                                                         groups.data))
        self._wait_s, self._bytes = 0.0, 0

    def _all_gather(self, buf: np.ndarray, group) -> np.ndarray:
        t0 = time.perf_counter()
        out = comm.all_gather_tensor(torch.from_numpy(buf), group).numpy()
        self._wait_s += time.perf_counter() - t0
        self._bytes += buf.nbytes * (len(out) - 1)
        return out

    def gather(self, report: RankReport, shape: RecordShape, slots) -> StepSummary:
        """The step's ``StepSummary`` (collective: every rank of the job, once per step).
        ``shape``: one rank's record (``stages`` 1); ``slots``: the document slots of this
        rank's DP rank (``record.doc_slots``; only read with ``shape.docs``): its documents'
        sums travel in its cell and pipeline only, so the summary's are its DP rank's."""
        cell_g, pipe_g, data_g = self.groups.cell, self.groups.pipeline, self.groups.data
        self._wait_s, self._bytes = 0.0, 0
        mine = encode_rank(report, shape, slots if shape.docs else ())
        cell = combine_cell(self._all_gather(mine, cell_g), shape)
        line = join_pipeline(self._all_gather(cell, pipe_g), shape)
        pipeline = shape.with_stages(self.sizes[1])
        bare = RecordShape(pipeline.stages, pipeline.timed, pipeline.units)
        line, ids, sums = split_docs(line, pipeline, slots)
        summary = decode_step(line[None], bare, (), first=self.ranks[2])     # its DP rank's
        summary.doc_ids, summary.doc_sums = ids, sums
        step_s = -np.inf if summary.step_s is None else summary.step_s
        got = self.reduce({"sum": {"loss": np.array(summary.loss), "bad": summary.violations,
                                   "events": summary.planner_events},
                           "max": {"step_s": step_s, "backend": summary.backend,
                                   "differ": int(not summary.fingerprints_agree)}})
        if got["bad"] or bare.units:     # an error's examples, --sb-metrics-file's unit times
            whole = decode_step(self._all_gather(line, data_g), bare, ())
            summary.examples, summary.unit_times = whole.examples, whole.unit_times
        summary.loss = (float(got["loss"][0]), float(got["loss"][1]))
        summary.step_s = None if got["step_s"] == -np.inf else float(got["step_s"])
        summary.violations, summary.planner_events = int(got["bad"]), int(got["events"])
        summary.backend, summary.fingerprints_agree = int(got["backend"]), not got["differ"]
        summary.comm_s, summary.bytes_received = self._wait_s, self._bytes
        return summary

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        """[dp, len(row)]: every DP rank's float64 ``row`` (the same length on every rank) over
        the data-parallel group, in DP order (collective: every rank, in the same order)."""
        return self._all_gather(np.ascontiguousarray(row, dtype=np.float64), self.groups.data)

    def reduce(self, parts: dict) -> dict:
        """The data-parallel group's sums and maxima of ``parts`` (``{"sum": {name: value},
        "max": {...}}``, the same names and shapes on every rank): one all-reduce of a
        fixed-size float64 vector per op, whatever the DP size (``agreement.DPReducer``;
        collective: every rank, in the same order)."""
        from .agreement import DPReducer

        t0, reducer = time.perf_counter(), DPReducer(self.groups.data)
        out = reducer(dict(parts, cat={}))
        self._wait_s += time.perf_counter() - t0
        self._bytes += sum(reducer.sent)
        return out
