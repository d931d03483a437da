"""``--sb-attention-backend auto`` on CUDA: the fastest kernel measured when the latency table was
profiled (``crossover.fastest_backend``), recorded in the table and run by every layer."""

import dataclasses

import pytest
import torch

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.launch import crossover, latency_setup
from sparsebalance_megatron.megatron.model.budget import BudgetContext


@pytest.fixture(autouse=True)
def _no_measurement_leaks(monkeypatch):
    import sparsebalance_megatron.attention.api as api
    monkeypatch.setattr(api, "_AUTO_MEASURED", {})


def _sb(**kw):
    return SparseBalanceConfig(sparse_attention=True, block_size=16, **kw)


def test_fastest_backend_times_every_candidate_and_picks_the_fastest(monkeypatch):
    # on CPU the blockwise torch kernel and the dense-masked reference both run; a candidate
    # that cannot run here is recorded with its reason and never chosen
    monkeypatch.setattr(crossover, "AUTO_CANDIDATES", ("torch", "reference", "flex"))
    monkeypatch.setattr(crossover, "_time_fwd_bwd",
                        lambda fn, inputs, w, dev: {"torch": 2.0, "reference": 1.0}[fn.backend]
                        + fn(*inputs).float().sum().item() * 0)
    got = crossover.fastest_backend(_sb(), num_heads=4, num_groups=2, head_dim=16, tokens=64,
                                    device="cpu", dtype=torch.float32, repeats=2)
    assert got["chosen"] == "reference"
    assert got["seconds"] == {"torch": 2.0, "reference": 1.0}
    assert "CUDA" in got["failed"]["flex"]


def test_fastest_backend_refuses_when_nothing_runs(monkeypatch):
    monkeypatch.setattr(crossover, "AUTO_CANDIDATES", ("flex", "flash"))
    with pytest.raises(RuntimeError, match="auto: no sparse kernel ran on cpu"):
        crossover.fastest_backend(_sb(), num_heads=2, num_groups=1, head_dim=16, tokens=32,
                                  device="cpu", dtype=torch.float32)


def test_choose_backend_changes_nothing_off_cuda_or_when_named():
    sb = _sb()
    assert crossover.choose_backend(None, sb, 1, 1) == (sb, None)       # no CUDA here
    named = dataclasses.replace(sb, attention_backend="torch")
    assert crossover.choose_backend(None, named, 1, 1) == (named, None)


def test_the_table_pick_applies_to_auto_on_cuda_only(monkeypatch):
    table = {"attention": {"backend": "triton"}}
    assert latency_setup.table_backend(table, _sb()) is None              # no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import sparsebalance_megatron.attention.api as api
    monkeypatch.setattr(api, "backend_missing", lambda b, d, **kw: None)
    assert latency_setup.table_backend(table, _sb()) == "triton"
    # the table's pick is what every later 'auto' resolves to, not flex
    assert api.resolve_backend("auto", "cuda") == "triton"
    assert "latency table" in api.auto_backend("cuda")[1]
    assert latency_setup.table_backend(table, _sb(attention_backend="flex")) is None
    assert latency_setup.table_backend({"attention": {"backend": "auto"}}, _sb()) is None
    monkeypatch.setattr(api, "backend_missing", lambda b, d, **kw: "no flash-attn-4")
    assert latency_setup.table_backend({"attention": {"backend": "fa4"}}, _sb()) is None


def test_budget_context_carries_the_pick():
    b = BudgetContext(0.5)
    assert b.attention_backend is None
    b.set_backend("triton")
    assert b.attention_backend == "triton"
    for bad in ("auto", "cudnn"):
        with pytest.raises(ValueError, match=repr(bad)):
            b.set_backend(bad)


def test_auto_is_the_measured_pick_everywhere_and_says_why_without_one(monkeypatch):
    """One rule (api.auto_backend): before any measurement flex on CUDA (named with the reason),
    torch elsewhere; after the profiler's timing, its pick, through resolve_backend and the
    launch check alike."""
    import sparsebalance_megatron.attention.api as api
    from sparsebalance_megatron.megatron.launch import checks as launch
    backend, why = api.auto_backend("cuda")
    assert backend == api.AUTO_UNMEASURED == "flex" and "no measurement" in why
    assert api.resolve_backend("auto", "cpu") == "torch"
    monkeypatch.setattr(crossover, "fastest_backend", lambda *a, **kw: {"chosen": "triton"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    shape = type("S", (), dict(num_attention_heads=8, num_query_groups=2, head_dim=128,
                               seq_length=32768))()
    sb, choice = crossover.choose_backend(shape, _sb(), 1, 1)
    assert sb.attention_backend == "triton" == choice["chosen"]
    assert api.resolve_backend("auto", "cuda") == "triton"
    assert launch._gpu_kernel(_sb()) == "triton"
    assert api.resolve_backend("auto", "cpu") == "torch"       # per device type
    api.set_auto_backend(None, "forget")
    assert api.resolve_backend("auto", "cuda") == "flex"
    with pytest.raises(ValueError, match="backend='auto'"):
        api.set_auto_backend("auto", "a test")
