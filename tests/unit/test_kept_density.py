"""The kept density beside the planned one (megatron/step/reporting.py): short documents keep more
blocks than a density asks for (every query block keeps its sink, local and diagonal blocks), so
the ``[sparsebalance]`` line and the ``sparsebalance/density/kept`` scalar say what was kept, and
it is what the attention's selection really keeps."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from sparsebalance_megatron.batching.packing import sequential_plan
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.plan import BudgetPlan

BLOCK = 16
# short documents (2 to 7 blocks of 16 tokens) filling a 512-token micro-batch
SEGMENTS = [(i, 0, n) for i, n in enumerate((40, 60, 100, 20, 48, 64, 30, 90, 60))]


class Writer:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))

    def log(self, values, step):
        self.calls.extend((k, v, step) for k, v in values.items())


def _report(monkeypatch, capsys, segments, density=0.5):
    from megatron.training import global_vars as gv

    from sparsebalance_megatron.megatron.step.callback import PreparedStep
    from sparsebalance_megatron.megatron.step.reporting import StepReporter

    tb, wandb = Writer(), Writer()
    monkeypatch.setattr(gv, "_GLOBAL_TENSORBOARD_WRITER", tb)
    monkeypatch.setattr(gv, "_GLOBAL_WANDB_WRITER", wandb)
    args = argparse.Namespace(log_interval=1, train_iters=1, tensorboard_log_interval=1)
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK, density=density)
    batch = sequential_plan(segments, dp=1, num_microbatches=1, max_tokens=512)
    step = PreparedStep(0, 0, batch, BudgetPlan.static(0, density, 1, 1, 1), None)
    from sparsebalance_megatron.megatron.step.record import StepSummary

    gathered = StepSummary(step_s=0.3, loss=(10.0, 5.0))
    rec = StepReporter(args, sb, dp=1).report(1, step, gathered, np.full((1, 1), 0.3), {},
                                              overhead_s=0.01)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[sparsebalance]")]
    return rec, line, tb, wandb, batch


def test_short_documents_keep_more_than_the_planned_density(monkeypatch, capsys):
    rec, (line,), tb, wandb, _ = _report(monkeypatch, capsys, SEGMENTS)
    assert rec["mean_density"] == pytest.approx(0.5)
    kept = rec["kept_density"]
    assert 0.65 < kept < 1.0                          # the short documents' forced blocks
    assert f"density 0.500 kept {kept:.3f}" in line, line
    for writer in (tb, wandb):
        assert ("sparsebalance/density/kept", pytest.approx(kept), 1) in writer.calls
        assert ("sparsebalance/density/mean", pytest.approx(0.5), 1) in writer.calls
    # one long document alone keeps about what was asked
    long_only, _, _, _, _ = _report(monkeypatch, capsys, [(0, 0, 512)])
    assert long_only["kept_density"] == pytest.approx(0.5, abs=0.05)


def test_the_kept_density_is_what_the_selection_keeps(monkeypatch, capsys):
    """The reported figure against the attention's own per-document statistics
    (``selection.density_kept``, what ``BudgetContext.record`` collects), run on the packed
    micro-batch's sequences (documents and padding) on the CPU."""
    from sparsebalance_megatron.attention import block_sparse_attention

    rec, _, _, _, batch = _report(monkeypatch, capsys, SEGMENTS)
    lengths = batch.unit_csr(with_padding=True)[1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(int(cu[-1]), 2, 16, generator=g) for _ in range(3))
    _, sel = block_sparse_attention(q, k, v, cu, 0.5, block_size=BLOCK, backend="torch")
    nb = (lengths + BLOCK - 1) // BLOCK
    causal = nb * (nb + 1) / 2                        # causal block pairs of every sequence
    realised = float((sel.density_kept.double().numpy() * causal).sum() / causal.sum())
    assert rec["kept_density"] == pytest.approx(realised, rel=1e-6)


def test_scalars_name_every_number_and_leave_out_what_is_missing():
    from sparsebalance_megatron.megatron.step.reporting import SCALARS, scalars

    rec = {key: float(i) for i, (_, key) in enumerate(SCALARS)}
    rec.update(loss=float("nan"), units_cut=None, density_per_stage=[0.5, 0.75])
    out = scalars(rec)
    expected = {f"sparsebalance/{name}": float(i) for i, (name, key) in enumerate(SCALARS)
                if key not in ("loss", "units_cut")}
    expected.update({"sparsebalance/density/stage0": 0.5, "sparsebalance/density/stage1": 0.75})
    assert out == expected
    # the DP ranks' densities are two scalars (least, greatest), not one per DP rank (issue 77)
    assert {"sparsebalance/density/rank_min", "sparsebalance/density/rank_max"} <= set(out)
    assert scalars({}) == {}
