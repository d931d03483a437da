"""Resuming with a damaged or partial plugin state: --sb-fresh-state starts the balancer fresh
with a warning naming the file; without it the refusal says how to go on; a dense run's
checkpoint (no balancer state in it) says once that the balancer starts fresh.

In-process on the state file Megatron's checkpoint folder holds (``megatron/step/state.py``); the
torchrun resume through the entry is tests/distributed/test_sparse_balance_run.py's.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.step.callback import SparseBalanceCallback
from sparsebalance_megatron.megatron.launch.checks import LaunchError
from sparsebalance_megatron.megatron.step.state import (STATE_VERSION, load_plugin_state,
                                                        plugin_state_path, restore_saved_state)

ARGS = SimpleNamespace(pipeline_model_parallel_size=1)


def _state_file(tmp_path, content) -> str:
    path = plugin_state_path(ARGS, str(tmp_path), 2)
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(content, bytes):
        with open(path, "wb") as f:
            f.write(content)
    else:
        torch.save({"dataloader_state_dict": content}, path)
    return path


GOOD = {"version": STATE_VERSION, "iteration": 2, "latency": None,
        "sensitivity": {"ema": 0.3, "signal": "loss", "all": -1.5, "sample": {"3": -2.0},
                        "bucket": {}}}
DAMAGED = [pytest.param(b"\x80\x02truncated", "cannot be read", id="truncated"),
           pytest.param(b"not a checkpoint at all", "cannot be read", id="garbage"),
           pytest.param({"iteration": 2}, "cannot be read", id="no-version"),
           pytest.param(dict(GOOD, version=STATE_VERSION + 1), "has version", id="version"),
           pytest.param(dict(GOOD, iteration=5), "belongs to iteration 5", id="iteration")]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")


@pytest.mark.parametrize("content, problem", DAMAGED)
@pytest.mark.reliability(area="resume", case="damaged plugin state (truncated, not a "
                         "checkpoint, wrong schema, other version or iteration) without "
                         "--sb-fresh-state", expect="refused naming the file, saying to pass "
                         "--sb-fresh-state or restore the file")
def test_a_damaged_state_is_refused_with_the_way_out(tmp_path, content, problem):
    path = _state_file(tmp_path, content)
    with pytest.raises(LaunchError) as e:
        load_plugin_state(ARGS, str(tmp_path), 2)
    msg = str(e.value)
    assert msg.startswith(f"SparseBalance state {path} {problem}"), msg
    assert "pass --sb-fresh-state to start the balancer fresh" in msg
    assert "restore the file from a copy of the checkpoint" in msg


@pytest.mark.parametrize("content, problem", DAMAGED)
@pytest.mark.reliability(area="resume", case="damaged plugin state with --sb-fresh-state",
                         expect="a warning naming the file; the balancer starts fresh")
def test_fresh_state_covers_a_damaged_state(tmp_path, content, problem, capsys):
    path = _state_file(tmp_path, content)
    assert load_plugin_state(ARGS, str(tmp_path), 2, fresh=True) is None
    out = capsys.readouterr().out
    assert out.count("warning: SparseBalance state") == 1
    assert f"{path} {problem}" in out and "starting the balancer fresh (--sb-fresh-state)" in out


def _callback(tmp_path, *, fresh: bool, latency=None):
    """A SparseBalanceCallback's resume path on a stub: its state methods, a real tracker."""
    from sparsebalance_megatron.batching.sensitivity import SensitivityTracker
    from sparsebalance_megatron.policy.stand_down import StandDownCounts

    cb = SimpleNamespace(args=SimpleNamespace(**vars(ARGS), load=str(tmp_path), iteration=2),
                         sb=SparseBalanceConfig(sparse_balance=True, fresh_state=fresh),
                         latency=latency, tracker=SensitivityTracker(signal="loss"),
                         reporter=SimpleNamespace(stood=StandDownCounts(), eval_profile=None), dp=1, pp=1, vp=1,
                         dp_rank=0, _drafter=SimpleNamespace(quality_scales=None),
                         quality_probe=None)
    for name in ("load_state_dict", "_planning_state", "_state_basis", "_tracker_loaded",
                 "_quality_scales", "drafter"):
        setattr(cb, name, types.MethodType(getattr(SparseBalanceCallback, name), cb))
    return cb


def test_a_state_that_fails_to_load_starts_fresh_with_the_flag(tmp_path, capsys):
    """A readable file with bad contents (the recall signal where this run measures loss): the
    refusal without the flag; with it, the tracker left as fresh as it was."""
    path = _state_file(tmp_path, dict(GOOD, sensitivity=dict(GOOD["sensitivity"],
                                                             signal="recall")))
    with pytest.raises(LaunchError, match="pass --sb-fresh-state"):
        restore_saved_state(_callback(tmp_path, fresh=False))
    cb = _callback(tmp_path, fresh=True)
    before = cb.tracker.state_dict()
    assert restore_saved_state(cb) == (None, False)
    assert cb.tracker.state_dict() == before
    out = capsys.readouterr().out
    assert f"warning: SparseBalance state {path} cannot be loaded (ValueError" in out


def test_a_damaged_state_beside_a_good_plan_ahead_basis_is_refused(tmp_path):
    """Plan-ahead: the first step is planned from the saved basis and the state itself loaded
    after it; a state whose own part cannot be loaded is refused at the resume, naming the file,
    not when the first step is prepared."""
    path = _state_file(tmp_path, dict(GOOD, sensitivity=dict(GOOD["sensitivity"],
                                                             signal="recall"),
                                      ahead_basis={"sensitivity": GOOD["sensitivity"]}))
    cb = _callback(tmp_path, fresh=False)
    assert cb.sb.plan_ahead
    with pytest.raises(LaunchError, match=f"SparseBalance state {path} cannot be loaded"):
        restore_saved_state(cb)


@pytest.mark.reliability(area="resume", case="a dense run's checkpoint (plugin state without "
                         "latency calibration or sensitivities) loaded with --sparse-balance",
                         expect="one line (rank 0) saying the balancer starts fresh")
def test_a_dense_runs_checkpoint_says_the_balancer_starts_fresh(tmp_path, capsys, monkeypatch):
    path = _state_file(tmp_path, dict(GOOD, sensitivity=None))
    state, ahead = restore_saved_state(_callback(tmp_path, fresh=False))
    assert state is not None and not ahead
    out = capsys.readouterr().out
    assert out.count("[sparsebalance]") == 1, out
    assert f"the checkpoint's SparseBalance state {path} holds no sensitivities" in out
    assert "the balancer starts fresh" in out
    # a state that has them says nothing; other ranks never say it
    _state_file(tmp_path, GOOD)
    restore_saved_state(_callback(tmp_path, fresh=False))
    assert capsys.readouterr().out == ""
    from sparsebalance_megatron.megatron.runtime import comm  # rank 1 (also where an earlier test
    monkeypatch.setattr(comm, "launch_rank", lambda: 1)  # left a process group in this process)
    monkeypatch.setattr(comm, "rank", lambda: 1)
    _state_file(tmp_path, dict(GOOD, sensitivity=None))
    restore_saved_state(_callback(tmp_path, fresh=False))
    assert capsys.readouterr().out == ""
