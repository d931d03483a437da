"""The plugin's checkpoint state with Megatron's interleaved schedule (model chunks), where
Megatron's data loader hook cannot save it: ``state.save_at_checkpoints`` writes the file the hook
would have at the start of Megatron's checkpoint save, atomically, and the resume reads it, or
refuses a missing or damaged one in one line naming --sb-fresh-state.

In-process on the files; the torchrun runs that save and resume through Megatron's own
``save_checkpoint_and_time`` are tests/distributed/test_sparse_balance_run.py's
(``test_interleaved_*``).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparsebalance_megatron.megatron.launch.checks import LaunchError
from sparsebalance_megatron.megatron.runtime.watchdog_megatron import watch_phases
from sparsebalance_megatron.megatron.step.state import (SAVE_TIMERS, STATE_VERSION,
                                                        StateSavingTimers, load_plugin_state,
                                                        plugin_state_path, save_at_checkpoints,
                                                        write_state_file)
from sparsebalance_megatron.megatron.step.timing import MicrobatchTimers, TeeTimers

ARGS = SimpleNamespace(pipeline_model_parallel_size=2)


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")


class Timers:
    """Megatron's ``Timers`` as far as the tee uses them; records starts and stops."""

    def __init__(self, events):
        self.events = events

    def __call__(self, name, log_level=None):
        events = self.events

        class Timer:
            def start(self, barrier=False):
                events.append(("start", name))

            def stop(self, barrier=False):
                events.append(("stop", name))

        return Timer()


def _callback(save_dir, dp_rank, events):
    """The callback's side of the save: its state after ``curr_iteration`` (Megatron's loop
    variable) and where it saves; every ``state_dict`` call is an event."""
    cb = SimpleNamespace(args=SimpleNamespace(pipeline_model_parallel_size=2, save=str(save_dir),
                                              curr_iteration=1), dp_rank=dp_rank)

    def state_dict():
        events.append(("state_dict", cb.args.curr_iteration))
        return {"version": STATE_VERSION, "iteration": cb.args.curr_iteration + 1,
                "latency": {"corrections": {"0": 1.25, "1": 0.75}, "errors": [0.1]},
                "sensitivity": None, "stand_down": None, "timing_source": "measured"}

    cb.state_dict = state_dict
    return cb


@pytest.mark.reliability(area="resume", case="interleaved-schedule checkpoint: Megatron's data "
                         "loader hook takes one iterator, train() passes one per model chunk",
                         expect="the plugin's state written at the start of every save "
                         "(persistent or not), where the resume reads it, per DP rank")
def test_each_checkpoint_save_writes_the_state_the_resume_reads(tmp_path):
    events: list = []
    tees = []
    for dp_rank in (0, 1):                 # the first stage's ranks of two DP ranks
        tee = TeeTimers(Timers(events), MicrobatchTimers(use_cuda_events=False))
        save_at_checkpoints(tee, _callback(tmp_path, dp_rank, events))
        tees.append(tee)
    for name in ("forward-compute", "interval-time", "load-checkpoint"):
        tees[0](name).start()
        tees[0](name).stop()
    assert [e for e in events if e[0] == "state_dict"] == []        # only a save writes
    assert not any(tmp_path.iterdir())
    for tee in tees:
        tee("save-checkpoint", log_level=0).start(barrier=False)
        tee("save-checkpoint").stop(barrier=False)
    # written before Megatron's timer starts, i.e. before save_checkpoint writes anything
    assert events[6:] == [("state_dict", 1), ("start", "save-checkpoint"),
                          ("stop", "save-checkpoint")] * 2
    folder = tmp_path / "iter_0000002" / "mp_rank_00_000"
    assert sorted(os.listdir(folder)) == ["train_dataloader_dprank000.pt",
                                          "train_dataloader_dprank001.pt"]
    state = load_plugin_state(ARGS, str(tmp_path), 2)    # torch.load(weights_only=True)
    assert state == _callback(tmp_path, 0, []).state_dict()
    assert plugin_state_path(ARGS, str(tmp_path), 2) == str(folder /
                                                            "train_dataloader_dprank000.pt")
    # a non-persistent save two steps on writes too (the hook writes for both kinds)
    cb = _callback(tmp_path, 0, events)
    cb.args.curr_iteration = 3
    save_at_checkpoints(tees[0], cb)                     # again: updates, does not wrap twice
    assert not isinstance(tees[0].megatron_timers.timers, StateSavingTimers)
    tees[0]("save-checkpoint-non-persistent", log_level=0).start(barrier=False)
    assert load_plugin_state(ARGS, str(tmp_path), 4)["iteration"] == 4
    assert set(SAVE_TIMERS) == {"save-checkpoint", "save-checkpoint-non-persistent"}


def test_the_write_counts_as_the_checkpoint_save_for_the_watchdog(tmp_path):
    """The watchdog wraps Megatron's timers after the saver (hooks' order): the state is written
    inside its 'checkpoint save' phase, where a slow write is no hang."""
    busy: list = []

    class Watchdog:
        phases: list = []

        def enter(self, phase):
            self.phases.append(phase)

        def leave(self, phase):
            self.phases.remove(phase)

    wd = Watchdog()
    tee = TeeTimers(Timers([]), MicrobatchTimers(use_cuda_events=False))
    cb = _callback(tmp_path, 0, [])
    inner = cb.state_dict
    cb.state_dict = lambda: (busy.append(list(wd.phases)), inner())[1]
    save_at_checkpoints(tee, cb)
    watch_phases(tee, wd)
    tee("save-checkpoint", log_level=0).start(barrier=False)
    tee("save-checkpoint").stop(barrier=False)
    assert busy == [["checkpoint save"]] and wd.phases == []


def test_a_failed_write_leaves_the_previous_file_and_no_part(tmp_path, monkeypatch):
    path = str(tmp_path / "iter_0000002" / "mp_rank_00_000" / "train_dataloader_dprank000.pt")
    write_state_file(path, {"version": STATE_VERSION, "iteration": 2})
    before = Path(path).read_bytes()
    real_save = torch.save

    def save_then_fail(obj, f, *a, **kw):
        real_save({"dataloader_state_dict": {"partial": True}}, f)   # bytes on disk, then
        raise OSError(28, "No space left on device")                  # the disk fills up

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        write_state_file(path, {"version": STATE_VERSION, "iteration": 2, "more": 1})
    assert Path(path).read_bytes() == before
    assert os.listdir(os.path.dirname(path)) == ["train_dataloader_dprank000.pt"]


@pytest.mark.reliability(area="resume", case="interleaved-schedule checkpoint whose plugin state "
                         "is missing (written by an earlier plugin version) or truncated, "
                         "resumed without --sb-fresh-state",
                         expect="refused in one line naming the file and --sb-fresh-state")
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_damaged_chunked_state_is_refused_in_one_line(tmp_path, damage):
    tee = TeeTimers(Timers([]), MicrobatchTimers(use_cuda_events=False))
    save_at_checkpoints(tee, _callback(tmp_path, 0, []))
    tee("save-checkpoint", log_level=0).start(barrier=False)
    path = Path(plugin_state_path(ARGS, str(tmp_path), 2))
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(LaunchError) as e:
        load_plugin_state(ARGS, str(tmp_path), 2)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "pass --sb-fresh-state" in msg, msg
    want = "no SparseBalance state at" if damage == "missing" else "cannot be read"
    assert want in msg
    assert load_plugin_state(ARGS, str(tmp_path), 2, fresh=True) is None


def test_megatron_starts_a_save_timer_before_it_saves():
    """What the saver relies on, read from Megatron's source: ``save_checkpoint_and_time``
    starts one of ``SAVE_TIMERS`` before it calls ``save_checkpoint`` (fails when a megatron-core
    release moves or renames it)."""
    spec = importlib.util.find_spec("megatron.training")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    src = (Path(spec.origin).parent / "training.py").read_text()
    body = src[src.index("def save_checkpoint_and_time("):]
    body = body[:body.index("\ndef ")]
    for name in SAVE_TIMERS:
        assert f"'{name}'" in body or f'"{name}"' in body, name
    start = re.search(r"timers\(timer_key, log_level=0\)\.start\(", body)
    save = re.search(r"\n\s+save_checkpoint\(", body)
    assert start and save and start.start() < save.start()
