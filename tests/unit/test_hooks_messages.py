"""A refusal every rank meets once the process groups exist (a resume without the plugin's
state, e.g. after an interleaved-schedule run) is one line from rank 0, not a traceback per
rank."""

from __future__ import annotations

import pytest
import torch

from sparsebalance_megatron.megatron import hooks
from sparsebalance_megatron.megatron.launch import LaunchError


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
