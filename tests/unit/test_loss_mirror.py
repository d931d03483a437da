"""The plugin's loss mirrors Megatron-LM's ``pretrain_gpt.loss_func`` flag by flag.

Always: each argument ``loss_func`` reads is honoured (mirrored, checked through the rerun state
machine calls it makes) or refused at launch. With ``MEGATRON_LM_DIR`` (a Megatron-LM checkout):
the arguments its ``loss_func`` reads are exactly those ``loss.MEGATRON_LOSS_ARGS`` names, so a
flag Megatron adds to its loss path fails here until the plugin handles it.
"""

from __future__ import annotations

import ast
import functools
import os
import types
from pathlib import Path

import pytest
import torch

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.model import loss
from sparsebalance_megatron.megatron.launch.checks import LaunchError, check_launch


class _Machine:
    """Records ``validate_result`` calls as Megatron's RerunStateMachine receives them."""

    def __init__(self):
        self.calls = []

    def validate_result(self, result, rejection_func, message, tolerance, fatal):
        self.calls.append(dict(message=message, fatal=fatal, rejected=bool(rejection_func(result)),
                               func=rejection_func))

    def is_unexpectedly_large(self, result, threshold, context):
        return float(result) > threshold * 1.0


class _Callback:
    signal = "recall"

    def __init__(self):
        self.losses = []

    def record_loss(self, loss_sum, num_tokens):
        self.losses.append((float(loss_sum), int(num_tokens)))


def _run(monkeypatch, values, **flags):
    import megatron.core.rerun_state_machine as rsm

    machine = _Machine()
    monkeypatch.setattr(rsm, "get_rerun_state_machine", lambda: machine)
    args = types.SimpleNamespace(**{"check_for_nan_in_loss_and_grad": False,
                                    "check_for_spiky_loss": False, **flags})
    cb = _Callback()
    out = loss.loss_func(torch.ones(len(values)), types.SimpleNamespace(), cb, args,
                         torch.tensor(values))
    return out, machine.calls, cb


def test_the_loss_contract_is_megatrons(monkeypatch):
    (total, tokens, report), calls, cb = _run(monkeypatch, [1.0, 2.0, 3.0])
    assert float(total) == 6.0 and int(tokens) == 3
    assert report["lm loss"].tolist() == [6.0, 3.0]
    assert calls == [] and cb.losses == [(6.0, 3)]


def test_check_for_nan_in_loss_and_grad_is_honoured(monkeypatch):
    _, calls, _ = _run(monkeypatch, [1.0, float("nan")], check_for_nan_in_loss_and_grad=True)
    assert [(c["message"], c["fatal"]) for c in calls] == [
        ("found NaN in local forward loss calculation", True),
        ("found Inf in local forward loss calculation", True)]
    assert [c["rejected"] for c in calls] == [True, False]


def test_check_for_spiky_loss_is_honoured(monkeypatch):
    _, calls, _ = _run(monkeypatch, [50.0], check_for_spiky_loss=True)
    (call,) = calls
    assert call["message"] == "Spiky loss" and call["fatal"] is False
    assert isinstance(call["func"], functools.partial)
    assert call["func"].keywords == {"threshold": loss.SPIKY_LOSS_FACTOR, "context": "loss"}
    assert call["rejected"] is True      # 50 > 10 x 1 in the stand-in machine


def test_megatrons_rerun_machine_has_what_the_loss_calls():
    from megatron.core.rerun_state_machine import RerunStateMachine
    import inspect

    assert {"result", "rejection_func", "message", "tolerance", "fatal"} <= set(
        inspect.signature(RerunStateMachine.validate_result).parameters)
    assert {"threshold", "context"} <= set(
        inspect.signature(RerunStateMachine.is_unexpectedly_large).parameters)


@pytest.mark.parametrize("kw, needle", [
    (dict(logits_load_dir="/teacher"), "--logits-load-dir /teacher with the plugin's data path"),
    (dict(modelopt_enabled=True), "ModelOpt with the plugin's data path"),
])
def test_loss_paths_the_plugin_does_not_compute_are_refused(kw, needle):
    args = types.SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 context_parallel_size=1, seq_length=256, micro_batch_size=1,
                                 num_layers=4, transformer_impl="local",
                                 distributed_backend="gloo", world_size=1, **kw)
    with pytest.raises(LaunchError) as e:
        check_launch(args, SparseBalanceConfig(), plugin_data=True)
    assert needle in str(e.value)
    check_launch(args, SparseBalanceConfig(), plugin_data=False)   # Megatron's own loss path


def _args_read(fn: ast.FunctionDef) -> set[str]:
    """``args.X`` and ``getattr(args, 'X', ...)`` in a function's body."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "args":
            out.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "args" \
                and isinstance(node.args[1], ast.Constant):
            out.add(node.args[1].value)
    return out


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"),
                    reason="set MEGATRON_LM_DIR to a Megatron-LM checkout to read its loss_func")
def test_every_argument_megatrons_loss_func_reads_is_handled():
    src = Path(os.environ["MEGATRON_LM_DIR"]) / "pretrain_gpt.py"
    tree = ast.parse(src.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "loss_func")
    read = _args_read(fn)
    assert read, "loss_func reads no args: the parse above is out of date"
    missing = read - set(loss.MEGATRON_LOSS_ARGS)
    assert not missing, (f"{src}: loss_func reads {sorted(missing)}, which "
                         f"sparsebalance_megatron/megatron/model/loss.py does not handle")
    factor = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "SPIKY_LOSS_FACTOR" for t in n.targets))
    assert factor == loss.SPIKY_LOSS_FACTOR
