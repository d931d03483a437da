"""--sb-replay-plans: the plans --sb-metrics-file records are read back exactly, and a run that
cannot replay them is refused naming the flag: at launch for its flags, on the step for its
documents or a file that runs out of steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance_megatron.batching.packing import sequential_plan
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.launch.replay import (RecordedPlans, ReplayError,
                                                           StepShape, plan_record)

SEGMENTS = [(0, 0, 100), (1, 0, 60), (2, 0, 200), (3, 0, 40), (4, 0, 120), (5, 0, 80),
            (6, 0, 36), (7, 0, 252)]


def _write(path, steps: int = 2, dense: bool = False, seed=None):
    """A metrics file as the reporter writes it: DP=2, 2 micro-batches, 2 stages."""
    lines = []
    for n in range(steps):
        segs = [(d + 8 * n, s, e) for d, s, e in SEGMENTS]
        batch = sequential_plan(segs, dp=2, num_microbatches=2, max_tokens=256)
        dens = np.full((2, 2, 2), 0.5)
        dens[0, 1, 0] = 0.375
        rec = {"step": n + 1, "loss": 5.0, "plan": plan_record(batch, 4 * n, 4, seed)}
        if not dense:
            rec["densities"] = dens.tolist()
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


SHAPE = StepShape(dp=2, num_microbatches=2, max_tokens=256, pad_multiple=4, length_multiple=0,
                  stages=2)


def test_the_recorded_plan_comes_back_exactly(tmp_path):
    rec = RecordedPlans.read(str(_write(tmp_path / "m.jsonl")))
    segs = [(d + 8, s, e) for d, s, e in SEGMENTS]
    batch, dens = rec.step(1, 4, list(reversed(segs)), SHAPE)   # the draw's order is free
    assert batch.micro_batches == sequential_plan(segs, dp=2, num_microbatches=2,
                                                  max_tokens=256).micro_batches
    assert dens.shape == (2, 2, 2) and dens[0, 1, 0] == 0.375 and dens[1, 1, 1] == 0.5


@pytest.mark.reliability(area="plan replay", case="--sb-replay-plans: the run draws other "
                         "documents, runs past the recorded steps, or has another shape",
                         expect="refused naming the flag, the file and the step")
def test_a_step_that_cannot_be_replayed_is_refused(tmp_path):
    path = _write(tmp_path / "m.jsonl")
    rec = RecordedPlans.read(str(path))
    with pytest.raises(ReplayError, match=r"--sb-replay-plans .*m.jsonl: step 1's documents "
                       r"differ"):
        rec.step(0, 0, [(d + 1, s, e) for d, s, e in SEGMENTS], SHAPE)
    with pytest.raises(ReplayError, match=r"step 3 is not recorded \(the file holds steps 1-2\)"):
        rec.step(2, 8, SEGMENTS, SHAPE)
    with pytest.raises(ReplayError, match=r"step 2 starts at sample 6 in this run, at 4"):
        rec.step(1, 6, SEGMENTS, SHAPE)
    with pytest.raises(ReplayError, match=r"--seq-length x --micro-batch-size: recorded 256, "
                       r"this run 512"):
        rec.step(0, 0, SEGMENTS, StepShape(2, 2, 512, 4, 0, 2))
    with pytest.raises(ReplayError, match=r"plan stages .*: recorded 2, this run 0"):
        rec.step(0, 0, SEGMENTS, StepShape(2, 2, 256, 4, 0, 0))     # a dense run
    dense = RecordedPlans.read(str(_write(tmp_path / "d.jsonl", dense=True)))
    assert dense.step(0, 0, SEGMENTS, StepShape(2, 2, 256, 4, 0, 0))[1] is None


@pytest.mark.parametrize("text, needle", [
    ('{"step": 1, "loss": 3.0}\n', "step 1 (line 1) records no plan"),
    ('{"step": 1, "plan": {"format": 1}}\n', "step 1: damaged plan (KeyError"),
    ('{"step": 1, "plan": {"format": 9}}\n', "plan format 9, this version reads 1"),
    ("not json\n", "line 1 is not JSON"),
    ("", "no step recorded"),
])
def test_a_file_without_usable_plans_is_refused(tmp_path, text, needle):
    path = tmp_path / "m.jsonl"
    path.write_text(text)
    with pytest.raises(ReplayError, match="--sb-replay-plans") as e:
        RecordedPlans.read(str(path))
    assert needle in str(e.value)


def _args(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                context_parallel_size=2, micro_batch_size=1, global_batch_size=4,
                seq_length=256)
    return SimpleNamespace(**dict(base, **kw))


@pytest.mark.reliability(area="plan replay", case="--sb-replay-plans with another --seq-length, "
                         "DP size or padding than the recorded run, or the file that is also "
                         "--sb-metrics-file", expect="refused at launch in one line naming the "
                         "flag and each setting, recorded vs this run")
def test_launch_refuses_flags_the_recorded_plans_do_not_fit(tmp_path, monkeypatch):
    from sparsebalance_megatron.megatron.launch.replay import launch_problems

    path = str(_write(tmp_path / "m.jsonl"))
    sb = SparseBalanceConfig(sparse_balance=True, replay_plans=path)
    monkeypatch.setenv("WORLD_SIZE", "8")                 # DP = 8 / (PP 2 x CP 2) = 2
    assert launch_problems(_args(), sb) == []
    (msg,) = launch_problems(_args(seq_length=512), sb)
    assert msg.startswith(f"--sb-replay-plans {path}: step 1 cannot be replayed") and \
        "--seq-length x --micro-batch-size: recorded 256, this run 512" in msg
    monkeypatch.setenv("WORLD_SIZE", "16")
    (msg,) = launch_problems(_args(), sb)
    assert "data-parallel size (world size / (TP x PP x CP)): recorded 2, this run 4" in msg
    monkeypatch.setenv("WORLD_SIZE", "8")
    (msg,) = launch_problems(_args(context_parallel_size=4, pipeline_model_parallel_size=1), sb)
    assert "--sb-seq-pad-multiple (0: 2 x --context-parallel-size): recorded 4, this run 8" in msg
    same = SparseBalanceConfig(sparse_balance=True, replay_plans=path, metrics_file=path)
    (msg,) = launch_problems(_args(), same)
    assert "the same file as --sb-metrics-file" in msg


@pytest.mark.reliability(area="plan replay", case="--sb-replay-plans with another --sb-seed "
                         "than the recorded run, or a file one step short of --train-iters",
                         expect="refused at launch (before the process group) in one line "
                         "naming the flag, the file, both seeds / the missing step")
def test_launch_refuses_another_seed_and_too_few_steps(tmp_path, monkeypatch):
    from sparsebalance_megatron.megatron.launch.replay import launch_problems

    monkeypatch.setenv("WORLD_SIZE", "8")
    path = str(_write(tmp_path / "m.jsonl", steps=3, seed=7))
    sb = SparseBalanceConfig(sparse_balance=True, replay_plans=path, seed=7)
    assert launch_problems(_args(train_iters=3), sb) == []
    assert launch_problems(_args(train_iters=2), sb) == []       # fewer steps than recorded
    other = SparseBalanceConfig(sparse_balance=True, replay_plans=path, seed=8)
    assert launch_problems(_args(train_iters=3), other) == [
        f"--sb-replay-plans {path}: recorded with --sb-seed 7, this run has --sb-seed 8 "
        f"(another seed draws other documents): pass --sb-seed 7"]
    assert launch_problems(_args(train_iters=4), sb) == [
        f"--sb-replay-plans {path}: holds steps 1-3, this run trains --train-iters 4: step 4 "
        f"not recorded; replay at most --train-iters 3"]
    both = launch_problems(_args(train_iters=4), other)          # both named, in one refusal
    assert len(both) == 2 and "--sb-seed 8" in both[0] and "step 4 not recorded" in both[1]
    # a file written before plans recorded their seed: the seed is not compared
    old = str(_write(tmp_path / "old.jsonl", steps=3))
    assert launch_problems(_args(train_iters=3), SparseBalanceConfig(
        sparse_balance=True, replay_plans=old, seed=8)) == []
    # a file of a resumed run (steps 3-5) serves a run resumed at step 3; a gap is refused
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    gap = tmp_path / "gap.jsonl"
    gap.write_text(lines[0] + "\n" + lines[2] + "\n")
    (msg,) = launch_problems(_args(train_iters=3), SparseBalanceConfig(
        sparse_balance=True, replay_plans=str(gap), seed=7))
    assert msg == f"--sb-replay-plans {gap}: holds steps 1-3, this run trains --train-iters 3: " \
        f"step 2 not recorded; replay at most --train-iters 1"


def test_the_recorded_seed_must_be_an_integer(tmp_path):
    path = _write(tmp_path / "m.jsonl", steps=1, seed=7)
    path.write_text(path.read_text().replace('"seed": 7', '"seed": "7"'))
    with pytest.raises(ReplayError, match=r"step 1: damaged plan \(ValueError: seed '7'"):
        RecordedPlans.read(str(path))


def test_the_cp_latency_model_may_pack_other_micro_batches():
    """Why replay: given the same documents, SAB packs by the latency model of the run, and a
    CP=2 run's (``with_context_parallel``: token work halved, per-document costs kept, the
    all-to-all added) orders their costs otherwise than CP=1's; so CP=2 and CP=1 runs on the same
    data may train on different plans unless one replays the other's."""
    from sparsebalance_megatron.batching.packing import latency_sample_cost_fn, sab_plan
    from sparsebalance_megatron.latency import LatencyModel, ModelShape

    shape = ModelShape(num_layers=8, seq_length=16384)
    cp1 = LatencyModel.analytic(shape)
    cp2 = cp1.with_context_parallel(2)
    rng = np.random.default_rng(0)
    differ = 0
    for seed in range(4):
        lengths = np.minimum(rng.lognormal(np.log(2048), 1.2, size=64).astype(int) + 4, 16384)
        segs = [(i, 0, int(n + (-n) % 4)) for i, n in enumerate(lengths)]
        plans = [sab_plan(segs, dp=2, num_microbatches=16, max_tokens=16384, seed=seed,
                          cost_fn=latency_sample_cost_fn(m, 0.5)).micro_batches
                 for m in (cp1, cp2)]
        differ += plans[0] != plans[1]
    assert differ >= 1
