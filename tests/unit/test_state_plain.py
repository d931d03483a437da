"""The plugin's checkpoint state always loads (issue 34): ``state.plain_state`` turns whatever
numpy or torch numbers the balancer's objects hold into plain Python types at save time, so a
state round-trips through ``torch.load(weights_only=True)``; what cannot be made plain is refused
when it is saved, naming the field. A state the landed version wrote for a PP=2 run (numpy
float64 stage corrections, tests/fixtures/landed_state_pp2) resumes with the same values.

The populated state comes from the real objects that make it: the latency model's calibration
(per rank and per pipeline stage), the sensitivity tracker, the stand-down counts and the
callback's own ``state_dict`` (with a plan-ahead basis). --sb-replay-plans adds nothing to it.
"""

from __future__ import annotations

import io
import itertools
import shutil
import types
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparsebalance_megatron.batching.sensitivity import SensitivityTracker
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.megatron.step.callback import SparseBalanceCallback
from sparsebalance_megatron.megatron.step.state import (STATE_VERSION, load_plugin_state,
                                                        plain_state, plugin_state_path,
                                                        read_state_file, restore_saved_state)
from sparsebalance_megatron.policy.stand_down import StandDownCounts

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "landed_state_pp2"
FIELDS = {"version", "iteration", "latency", "sensitivity", "timing_source", "stand_down",
          "ahead_basis", "layout", "quality_scales"}
PLAIN = (type(None), bool, int, float, str)


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")


def _callback(load_dir=".", *, pp=2, fresh=False):
    """A SparseBalanceCallback's state path on a stub: its own state methods over a real latency
    model (pp stages), sensitivity tracker and stand-down counts."""
    lm = LatencyModel.analytic(ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128,
                                          num_attention_heads=4, num_query_groups=2,
                                          seq_length=256, pp=pp), pp=pp)
    cb = SimpleNamespace(args=SimpleNamespace(pipeline_model_parallel_size=pp, curr_iteration=1,
                                              load=str(load_dir), iteration=2),
                         sb=SparseBalanceConfig(sparse_balance=True, fresh_state=fresh,
                                                planner="process"),
                         latency=lm, tracker=SensitivityTracker(signal="loss"),
                         reporter=SimpleNamespace(stood=StandDownCounts(), eval_profile=None), _ready_basis=None,
                         dp=2, dp_rank=0, pp=pp, vp=1, _ready=None,
                         _drafter=SimpleNamespace(quality_scales=None),
                         quality_probe=SimpleNamespace(scales=None))
    for name in ("state_dict", "load_state_dict", "_planning_state", "_state_basis",
                 "_tracker_loaded", "ahead_basis", "_quality_scales", "drafter"):
        setattr(cb, name, types.MethodType(getattr(SparseBalanceCallback, name), cb))
    return cb


def _populated(cb):
    """Two steps of a DP=2 x PP=2 run fed to the real objects with numpy inputs, as the callback
    feeds them (one DP rank's last stage 1.3x slow), a plan-ahead basis taken between them."""
    rng = np.random.default_rng(3)
    for step in range(2):
        predicted = rng.uniform(0.5, 1.0, size=(2, 2))              # [dp, pp] busy seconds
        measured = predicted * np.array([[1.0, 1.0], [1.1, 1.3]])
        for r in range(2):
            cb.latency.calibrate(r, predicted[r], measured[r])
            cb.latency.calibrate_stages(r, predicted[r], measured[r])
        ids = np.arange(4 * step, 4 * step + 4)
        cb.tracker.update(ids, rng.integers(100, 3000, size=4), rng.uniform(2.0, 6.0, size=4))
        cb.reporter.stood.add(np.bool_(step == 0), np.bool_(True))
        if step == 0:
            cb._ready_basis = cb._state_basis()
            cb._drafter.quality_scales = (1.5, 0.25, 4.0)    # refreshed after the basis
    cb.args.curr_iteration = 1
    return cb


def _numbers_everywhere(cb):
    """Put numpy and torch scalars in every numeric slot of the objects (values and integer
    keys), cycling through the kinds a numpy/torch computation leaves behind."""
    f = itertools.cycle([np.float64, np.float32, np.float16,
                         lambda x: torch.tensor(x, dtype=torch.float64),
                         lambda x: torch.tensor(x, dtype=torch.float32)])
    n = itertools.cycle([np.int64, np.int32, np.uint16, torch.tensor])      # int values
    key = itertools.cycle([np.int64, np.int32, np.uint16])                  # int keys
    lm, tr, stood = cb.latency, cb.tracker, cb.reporter.stood
    # float16 keeps ~3 digits: the expected values are taken after this, from the same slots
    lm._correction = {next(key)(r): next(f)(v) for r, v in lm._correction.items()}
    lm._stage_correction = {(next(key)(r), next(key)(s)): next(f)(v)
                            for (r, s), v in lm._stage_correction.items()}
    lm._errors = deque((next(f)(e) for e in lm._errors), maxlen=lm._errors.maxlen)
    tr.ema, tr._all = np.float64(tr.ema), torch.tensor(tr._all)
    tr._sample = {next(key)(i): next(f)(v) for i, v in tr._sample.items()}
    tr._bucket = {next(key)(b): next(f)(v) for b, v in tr._bucket.items()}
    tr.signal = np.str_(tr.signal)
    for k in ("dst_steps", "dst_stood_down", "sab_steps", "sab_stood_down"):
        setattr(stood, k, next(n)(getattr(stood, k)))
    cb.sb = SimpleNamespace(**{**vars(cb.sb), "timing_source": np.str_("measured")})
    cb.args.curr_iteration = torch.tensor(1)
    cb._ready_basis = {"latency": dict(cb._ready_basis["latency"],
                                       errors=np.asarray(cb._ready_basis["latency"]["errors"])),
                       "sensitivity": dict(cb._ready_basis["sensitivity"],
                                           all=np.float32(cb._ready_basis["sensitivity"]["all"])),
                       "quality_scales": cb._ready_basis["quality_scales"]}
    cb._drafter.quality_scales = tuple(next(f)(s) for s in cb._drafter.quality_scales)
    return cb


def _leaves(x, path="state"):
    if isinstance(x, dict):
        for k, v in x.items():
            assert type(k) in (str, int), (path, k, type(k))
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def _round_trip(state) -> dict:
    buf = io.BytesIO()
    torch.save({"dataloader_state_dict": state}, buf)       # what Megatron's save does
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)["dataloader_state_dict"]


def _expected(cb) -> dict:
    """The state the objects hold, read slot by slot with float()/int() (no plain_state)."""
    lm, tr, st = cb.latency, cb.tracker, cb.reporter.stood
    basis = cb._ready_basis
    return {"version": STATE_VERSION, "iteration": 2,
            "latency": {"corrections": {str(int(r)): float(v) for r, v in lm._correction.items()},
                        "errors": [float(e) for e in lm._errors],
                        "stage_corrections": {f"{int(r)},{int(s)}": float(v) for (r, s), v
                                              in lm._stage_correction.items()}},
            "sensitivity": {"ema": float(tr.ema), "signal": "loss", "all": float(tr._all),
                            "sample": {int(i): float(v) for i, v in tr._sample.items()},
                            "bucket": {int(b): float(v) for b, v in tr._bucket.items()}},
            "timing_source": "measured",
            "layout": {"dp": 2, "pp": 2, "vp": 1, "microbatches": None},   # issue 76
            "stand_down": {k: int(getattr(st, k)) for k in ("dst_steps", "dst_stood_down",
                                                            "sab_steps", "sab_stood_down")},
            "quality_scales": [float(s) for s in cb._drafter.quality_scales],
            "ahead_basis": {"latency": dict(basis["latency"],
                                            errors=[float(e) for e in basis["latency"]["errors"]]),
                            "sensitivity": dict(basis["sensitivity"],
                                                all=float(basis["sensitivity"]["all"])),
                            "quality_scales": None}}


def test_a_populated_state_round_trips_through_weights_only_load():
    cb = _numbers_everywhere(_populated(_callback()))
    raw = {**cb._planning_state(), "stand_down": cb.reporter.stood.state_dict()}
    with pytest.raises(Exception, match="Weights only load failed"):
        _round_trip(raw)                    # as the objects hold it: what resumes refused
    state = cb.state_dict()
    assert set(state) == FIELDS, "a new state field: populate it here and in _expected"
    loaded = _round_trip(state)
    assert loaded == _expected(cb)
    bad = [(p, type(v)) for p, v in _leaves(loaded) if type(v) not in PLAIN]
    assert not bad, bad
    n = sum(1 for _ in _leaves(loaded))
    assert n >= 30, n                       # every part populated: factors, errors, samples
    # and a fresh callback restored from it saves the same state
    again = _callback()
    again.load_state_dict(loaded)
    again.args.curr_iteration, again._ready_basis = 1, loaded["ahead_basis"]
    assert _round_trip(again.state_dict()) == loaded
    assert np.array_equal(again.latency.correction_grid(2, 2),
                          _callback_grid(loaded["latency"]))


def _callback_grid(latency: dict) -> np.ndarray:
    c, s = latency["corrections"], latency["stage_corrections"]
    return np.array([[c[str(r)] * s[f"{r},{p}"] for p in range(2)] for r in range(2)])


@pytest.mark.parametrize("value, where", [
    pytest.param({"latency": {"errors": [0.1, object()]}}, "state['latency']['errors'][1]",
                 id="object"),
    pytest.param({"sensitivity": {"sample": {3: {1, 2}}}}, "state['sensitivity']['sample'][3]",
                 id="set"),
    pytest.param({"latency": {"corrections": {"0": np.complex128(1 + 2j)}}},
                 "state['latency']['corrections']['0']", id="numpy-complex"),
    pytest.param({"timing_source": np.array(["measured"])}, "state['timing_source']",
                 id="numpy-str-array"),
    pytest.param({"latency": {"stage_corrections": {(0, 1): 1.1}}},
                 "state['latency']['stage_corrections']: key (0, 1)", id="tuple-key"),
    pytest.param({"ahead_basis": {"latency": b"bytes"}}, "state['ahead_basis']['latency']",
                 id="bytes")])
@pytest.mark.reliability(area="checkpoint state", case="a value torch.load(weights_only=True) "
                         "cannot read (object, set, complex, str array, tuple key, bytes) in the "
                         "plugin state at save", expect="refused at save, naming the field path")
def test_what_cannot_be_made_plain_is_refused_naming_the_field(value, where):
    with pytest.raises(TypeError) as e:
        plain_state(value)
    assert str(e.value).startswith(where), str(e.value)


def test_numbers_and_containers_become_plain():
    got = plain_state({"a": (np.int8(3), np.uint64(7), np.bool_(False)),
                       np.int64(4): torch.tensor([[1.5, 2.0]], dtype=torch.bfloat16),
                       "b": np.arange(3, dtype=np.int16), "c": deque([np.float32(0.25)]),
                       "d": torch.tensor(True), "e": np.str_("x"), "f": float("nan")})
    assert got["a"] == [3, 7, False] and got[4] == [[1.5, 2.0]] and got["b"] == [0, 1, 2]
    assert got["c"] == [0.25] and got["d"] is True and got["e"] == "x"
    assert [type(v) for _, v in _leaves(got)] == [int, int, bool, float, float, int, int, int,
                                                  float, bool, str, float]


def _landed(tmp_path) -> str:
    """The fixture at the path a PP=2 resume of iteration 2 reads."""
    args = SimpleNamespace(pipeline_model_parallel_size=2)
    path = Path(plugin_state_path(args, str(tmp_path), 2))
    path.parent.mkdir(parents=True)
    shutil.copy(FIXTURE / "train_dataloader_dprank000.pt", path)
    return str(path)


@pytest.mark.reliability(area="resume", case="PP=2 checkpoint written by the landed version "
                         "(numpy float64 stage corrections in the plugin state)",
                         expect="resumes with the same calibration, sensitivities and counts")
def test_a_landed_pp2_checkpoint_resumes_with_the_same_values(tmp_path):
    path = _landed(tmp_path)
    with pytest.raises(Exception, match="numpy"):
        torch.load(path, weights_only=True)         # as the landed version read it
    as_written = torch.load(path, weights_only=False)["dataloader_state_dict"]   # our own file
    stages = as_written["latency"]["stage_corrections"]
    assert {type(v) for v in stages.values()} == {np.float64}
    assert stages["1,1"] == 1.13516255025464       # README.md beside the fixture

    state = load_plugin_state(SimpleNamespace(pipeline_model_parallel_size=2), str(tmp_path), 2)
    assert state == as_written                      # the same values ...
    bad = [(p, type(v)) for p, v in _leaves(state) if type(v) not in PLAIN]
    assert not bad, bad                             # ... as plain Python types
    cb = _callback(tmp_path)
    assert restore_saved_state(cb) == (state, False)
    grid = cb.latency.correction_grid(2, 2)
    assert np.array_equal(grid, _callback_grid(as_written["latency"]))
    assert cb.tracker.state_dict() == as_written["sensitivity"]
    assert cb.reporter.stood.state_dict() == as_written["stand_down"]
    assert list(cb.latency._errors) == as_written["latency"]["errors"]


@pytest.mark.parametrize("value", [pytest.param(np.str_("x"), id="numpy-str"),
                                   pytest.param(np.complex64(1j), id="numpy-complex")])
def test_reading_old_states_allows_numeric_numpy_scalars_only(tmp_path, value):
    """What the reader allows for the landed version's files is numpy's numeric scalars: other
    numpy scalars in a state file are still refused (and named damaged on resume). (Arrays are
    megatron-core's call: importing it allows them process-wide; plain_state makes them lists.)"""
    path = tmp_path / "s.pt"
    torch.save({"dataloader_state_dict": {"version": STATE_VERSION, "x": value}}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        read_state_file(str(path))
    torch.save({"dataloader_state_dict": {"version": np.int64(STATE_VERSION),
                                          "x": np.float32(0.5), "y": np.bool_(True)}}, path)
    assert read_state_file(str(path)) == {"version": STATE_VERSION, "x": 0.5, "y": True}
