"""The per-step control plane on real process groups: 8 gloo processes as TP 2 x PP 2 x DP 2 (the
groups laid out as Megatron's default order lays them, ``ExchangeGroups.for_layout``), the
hierarchical gather (``StepExchange.gather``) and the DP group's reductions (``reduce``). Every
rank must end with the same bits: the summary the pure functions give from every rank's report. (The training runs of ``test_sparse_balance_run.py`` and ``test_hybrid_run.py``
use Megatron's own groups, ``ExchangeGroups.from_megatron``.)"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import spawn

pytestmark = pytest.mark.distributed

TP, PP, DP, M = 2, 2, 2, 3


def _batch():
    rng = np.random.default_rng(5)
    return [[[(int(d), 0, 8) for d in rng.choice(30, 2, replace=False)] for _ in range(M)]
            for _ in range(DP)]


def _report(dp: int, pp: int, tp: int, bad: bool = True):
    from sparsebalance_megatron.megatron.step.checks import Violation
    from sparsebalance_megatron.megatron.step.record import RankReport, doc_slots

    rng = np.random.default_rng(100 + 10 * dp + 3 * pp + tp)
    slots = doc_slots(_batch())[dp]
    return RankReport(dp, pp, fingerprint=42, fwd_s=rng.uniform(0, 1, M).tolist(),
                      bwd_s=rng.uniform(0, 1, M).tolist(), units=[(j, pp) for j in range(M)],
                      step_s=float(rng.uniform(2, 3)), loss=(float(rng.uniform(1, 2)), 7.0),
                      violations=[Violation("request", pp, 2, 0.3, 0.5)]
                      if bad and (dp, pp, tp) == (1, 1, 1) else [],
                      doc_values={int(d): (float(rng.uniform(0, 1)), 2.0) for d in slots})


def _shape():
    from sparsebalance_megatron.megatron.step.record import RecordShape, doc_slots

    slots = doc_slots(_batch())
    return RecordShape(1, M, M, max(len(s) for s in slots)), slots


def _worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    from sparsebalance_megatron.megatron.step.exchange import ExchangeGroups, StepExchange

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=TP * PP * DP)
    where, groups = ExchangeGroups.for_layout(TP, PP, DP)
    ex = StepExchange(groups)
    assert ex.sizes == (TP, PP, DP) and ex.ranks == (where[2], where[1], where[0])
    shape, slots = _shape()
    summary = ex.gather(_report(*where), shape, slots[where[0]])
    # a healthy step without --sb-metrics-file's unit times: the DP level is two reductions
    healthy = ex.gather(_report(*where, bad=False), replace(shape, units=0), slots[where[0]])
    reduced = ex.reduce({"sum": {"n": np.array([where[0] + 1.0, 1.0])},
                         "max": {"top": float(where[0]), "neg": -float(where[0])}})
    with open(f"{out_dir}/{rank}.pkl", "wb") as f:
        pickle.dump({"where": where, "summary": summary, "reduced": reduced,
                     "healthy": healthy}, f)
    dist.destroy_process_group()


def _reference():
    """The summary the pure functions give from every rank's report, in one process: the lines
    decoded without their documents, and each DP rank's documents from its own line."""
    from sparsebalance_megatron.megatron.step.record import (RecordShape, combine_cell,
                                                              decode_step, encode_rank,
                                                              join_pipeline, split_docs)

    shape, slots = _shape()
    cells = {(d, p): combine_cell(np.stack([encode_rank(_report(d, p, t), shape, slots[d])
                                            for t in range(TP)]), shape)
             for d, p in itertools.product(range(DP), range(PP))}
    split = [split_docs(join_pipeline(np.stack([cells[d, p] for p in range(PP)]), shape),
                        shape.with_stages(PP), slots[d]) for d in range(DP)]
    bare = RecordShape(PP, shape.timed, shape.units)
    return decode_step(np.stack([x[0] for x in split]), bare, ()), \
        [x[1:] for x in split], bare


def test_every_rank_ends_with_the_same_summary(tmp_path):
    spawn(_worker, TP * PP * DP, str(tmp_path / "rendezvous"), str(tmp_path), cwd=tmp_path)
    runs = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in range(TP * PP * DP)]
    assert sorted(r["where"] for r in runs) == sorted(itertools.product(range(DP), range(PP),
                                                                        range(TP)))
    want, docs, bare = _reference()
    for r in runs:
        s = r["summary"]
        dp_r = r["where"][0]                          # its DP rank's busy seconds alone
        assert np.array_equal(s.busy_s, want.busy_s[dp_r:dp_r + 1]) and s.step_s == want.step_s
        assert s.loss == want.loss and s.unit_times == want.unit_times
        ids, sums = docs[r["where"][0]]              # its DP rank's documents alone
        assert ids.size and np.array_equal(s.doc_ids, ids)
        assert np.array_equal(s.doc_sums, sums)                 # bit for bit
        assert s.violations == 1 and s.examples == want.examples
        assert s.examples == ["(dp 1, stage 1, micro-batch 2): 0.3 != 0.5"]
        assert s.fingerprints_agree
        # what a rank received: its TP peer's record, its pipeline peer's cell, the DP group's
        # sums (4 floats) and maxima (3), and, as a violation is to be described (and per-unit
        # times travel), its DP peer's line without its documents (TP 2 x PP 2 x DP 2)
        shape, _ = _shape()
        assert s.bytes_received == shape.nbytes * 2 + 8 * 7 + bare.nbytes
        h = r["healthy"]
        assert h.violations == 0 and h.examples == [] and h.unit_times == {}
        assert (h.loss, h.step_s, h.fingerprints_agree) == (want.loss, want.step_s, True)
        assert np.array_equal(h.busy_s, want.busy_s[dp_r:dp_r + 1])
        assert h.bytes_received == replace(shape, units=0).nbytes * 2 + 8 * 7   # no line
        # the DP group's sums and maxima (``StepExchange.reduce``): over the DP ranks alone
        red = r["reduced"]
        assert red["n"].tolist() == [DP * (DP + 1) / 2, DP]
        assert red["top"] == DP - 1 and red["neg"] == 0.0
