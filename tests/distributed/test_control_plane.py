"""The per-step control plane on real process groups: 8 gloo processes as TP 2 x PP 2 x DP 2 (the
groups laid out as Megatron's default order lays them, ``ExchangeGroups.for_layout``), the
hierarchical gather (``StepExchange.gather``) and the plan broadcast down the same groups. Every
rank must end with the same bits: the summary the pure functions give from every rank's report,
and rank 0's plan. (The training runs of ``test_sparse_balance_run.py`` and ``test_hybrid_run.py``
use Megatron's own groups, ``ExchangeGroups.from_megatron``.)"""

from __future__ import annotations

import itertools
import json
import pickle
from dataclasses import replace

import numpy as np
import pytest

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


def _plan():
    from sparsebalance_megatron.megatron.step.plan_record import PlanShape
    from sparsebalance_megatron.policy.dst_band import DSTReport

    rng = np.random.default_rng(9)
    report = DSTReport(1.0, 0.9, 0.8, 1.25, 1.3, 1.1, 0.5, 0.55, 0.5, 0.49, 3, 2, 0,
                       density_per_stage=(0.4, 0.6), quality_cost=float("nan")).as_dict()
    report.update(raise_headroom=0.05, unit_sensitivity=rng.uniform(size=(DP, M)).tolist(),
                  stand_down={"dst_stood_down": False, "sab_stood_down": True,
                              "packing_index": 1, "predicted_step_s": [1.0, 0.95],
                              "predicted_static_s": 1.0, "predicted_dst_s": 0.8},
                  predicted_busy_s=rng.uniform(1, 2, (DP, PP)).tolist())
    return (rng.uniform(0.2, 1, (DP, M, PP)), report), PlanShape(DP, M, PP, 2, True, PP)


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
    payload, plan_shape = _plan()
    plan = ex.broadcast_plan(payload if rank == 0 else None, plan_shape)
    # a healthy step without --sb-metrics-file's unit times: the DP level is two reductions
    healthy = ex.gather(_report(*where, bad=False), replace(shape, units=0), slots[where[0]])
    reduced = ex.reduce({"sum": {"n": np.array([where[0] + 1.0, 1.0])},
                         "max": {"top": float(where[0]), "neg": -float(where[0])}})
    with open(f"{out_dir}/{rank}.pkl", "wb") as f:
        pickle.dump({"where": where, "summary": summary, "plan": plan,
                     "plan_bytes": ex.broadcast_bytes, "reduced": reduced,
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


def test_every_rank_ends_with_the_same_summary_and_plan(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=TP * PP * DP,
             join=True)
    runs = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in range(TP * PP * DP)]
    assert sorted(r["where"] for r in runs) == sorted(itertools.product(range(DP), range(PP),
                                                                        range(TP)))
    want, docs, bare = _reference()
    (dens, report), plan_shape = _plan()
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
        # the plan: once from each group above the rank, rank 0 none (TP 2 x PP 2 x DP 2)
        hops = (r["where"][2] == 0 and r["where"][0] == 0 and r["where"][1] > 0) \
            + (r["where"][2] == 0 and r["where"][0] > 0) + (r["where"][2] > 0)
        assert r["plan_bytes"] == hops * plan_shape.nbytes
        h = r["healthy"]
        assert h.violations == 0 and h.examples == [] and h.unit_times == {}
        assert (h.loss, h.step_s, h.fingerprints_agree) == (want.loss, want.step_s, True)
        assert np.array_equal(h.busy_s, want.busy_s[dp_r:dp_r + 1])
        assert h.bytes_received == replace(shape, units=0).nbytes * 2 + 8 * 7   # no line
        # the DP group's sums and maxima (``StepExchange.reduce``): over the DP ranks alone
        red = r["reduced"]
        assert red["n"].tolist() == [DP * (DP + 1) / 2, DP]
        assert red["top"] == DP - 1 and red["neg"] == 0.0
        got_d, got = r["plan"]
        assert np.array_equal(got_d, dens)
        assert json.dumps(got, sort_keys=True) == json.dumps(
            dict(report, density_per_stage=list(report["density_per_stage"])), sort_keys=True)
