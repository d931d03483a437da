"""A refusal every rank meets once the process groups exist (a resume without the plugin's
state, e.g. after an interleaved-schedule run) is one line from rank 0, not a traceback per
rank."""

from __future__ import annotations

import pytest
import torch

from sparsebalance_megatron.megatron import hooks
from sparsebalance_megatron.megatron.launch.checks import LaunchError


@pytest.mark.reliability(area="resume", case="interleaved-schedule checkpoint (no plugin state) "
                         "resumed without --sb-fresh-state, on every rank",
                         expect="one 'error:' line from rank 0, no traceback; every rank exits 1")
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refusal_in_the_data_provider_is_one_line_from_rank_0(rank, monkeypatch, capsys):
    msg = ("resuming iteration 2 from ckpt: no SparseBalance state at ckpt/iter_0000002/"
           "mp_rank_00_000/train_dataloader_dprank000.pt (the checkpoint was written ... with the "
           "interleaved schedule, ...); pass --sb-fresh-state")

    def refuse(vp_stage):
        raise LaunchError(msg)

    monkeypatch.setenv("RANK", rank)
    # torchrun's RANK is the rank here: a process group another test left behind is not ours
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(hooks._run, "plugin_data", True)
    monkeypatch.setattr(hooks, "_datasets", refuse)
    provider = hooks.datasets_provider()
    with pytest.raises(SystemExit) as e:
        provider([8, 0, 0], vp_stage=1)
    assert e.value.code == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"error: {msg}\n" if rank == "0" else "")


FRESH = "pretrain() built the model from a config that hooks.install(args, model_cfg) did not change"


@pytest.mark.reliability(area="integration", case="a model config made afresh after "
                         "hooks.install and passed to pretrain() (the plugin's data path, or "
                         "Megatron's with --sb-sparse-attention)",
                         expect="one 'error:' line saying to pass install's model_cfg to "
                         "pretrain; no AttributeError, no training on Megatron's attention")
@pytest.mark.parametrize("plugin_data", [True, False])
def test_a_config_made_after_install_is_named(plugin_data, monkeypatch, capsys):
    from sparsebalance_megatron.config import SparseBalanceConfig

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    # what install leaves; the post-wrap hook it added to its model_cfg never ran
    monkeypatch.setattr(hooks._run, "sb", SparseBalanceConfig(sparse_attention=True))
    monkeypatch.setattr(hooks._run, "plugin_data", plugin_data)
    monkeypatch.setattr(hooks._run, "callback", None)
    monkeypatch.setattr(hooks._run, "model_built", False)

    def megatron_provider(train_val_test_num_samples, vp_stage=None):
        return "megatron's datasets"

    megatron_provider.is_distributed = True
    provider = hooks.datasets_provider(None if plugin_data else megatron_provider)
    assert getattr(provider, "is_distributed", False)
    with pytest.raises(SystemExit) as e:
        provider([8, 0, 0])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {FRESH}") and err.count("\n") == 1, err
    assert "pretrain(pretrain_cfg_container_from_args(args, model_cfg), ...)" in err
    if not plugin_data:     # the model install changed was built: Megatron's provider runs
        monkeypatch.setattr(hooks._run, "model_built", True)
        assert provider([8, 0, 0]) == "megatron's datasets"


@pytest.mark.reliability(area="integration", case="the plugin's flags on, hooks.install never "
                         "called (a model_provider holding the plugin's spec beside a container "
                         "with a model, which pretrain() builds instead)",
                         expect="one 'error:' line saying install never ran; a stock run (no "
                         "switch on) goes on")
def test_install_never_called_is_named(monkeypatch, capsys):
    import argparse

    from sparsebalance_megatron.arguments import add_sparsebalance_args

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(hooks._run, "sb", None)           # install never ran
    monkeypatch.setattr(hooks._run, "plugin_data", False)

    def megatron_provider(train_val_test_num_samples, vp_stage=None):
        return "megatron's datasets"

    def parsed(argv):
        p = argparse.ArgumentParser()
        add_sparsebalance_args(p)
        return p.parse_args(argv)

    provider = hooks.datasets_provider(megatron_provider)
    monkeypatch.setattr(hooks, "_megatron_args", lambda: parsed(["--sb-sparse-attention"]))
    with pytest.raises(SystemExit) as e:
        provider([8, 0, 0])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the plugin's switches are on") and err.count("\n") == 1, err
    assert "hooks.install never ran" in err
    monkeypatch.setattr(hooks, "_megatron_args", lambda: parsed([]))
    assert provider([8, 0, 0]) == "megatron's datasets"     # stock: nothing of the plugin on
