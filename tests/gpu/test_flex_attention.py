"""FlexAttention backend on CUDA: equals the dense masked reference (outputs and gradients), makes
no host syncs per layer, compiles one graph per grad mode; the Triton maxkey kernel equals the
PyTorch estimator. Each case compiles (tens of seconds), so the cases are few."""

import warnings

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention, build_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()   # each case compiles its own static graph (no automatic dynamic)
    yield


def _run(backend, q, k, v, cu, density, block_size, w, cache=None):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, sel = block_sparse_attention(q, k, v, cu, density, block_size=block_size,
                                      backend=backend, sink_blocks=1, local_blocks=1,
                                      cache=cache)
    (out.float() * w).sum().backward()
    return out.float(), [x.grad.float() for x in (q, k, v)], sel


def _inputs(t, nh, ng, hn, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(t, h, hn, generator=g).to("cuda", dtype) for h in (nh, ng, ng))
    return q, k, v, torch.randn(t, nh, hn, generator=g).cuda()


# seen on an H100, torch 2.11, head dim 64: inductor's default flex backward configs are checked
# against the sparse block size before kernel_options apply, and none divides 64 (NoValidChoices)
_BLOCK64 = pytest.mark.xfail(strict=False, reason="torch 2.11: no default flex backward tile "
                              "config divides block 64 (seen at head dim 64)")


@pytest.mark.parametrize("dtype,tol,block_size,nh,ng,hn,split", [
    (torch.bfloat16, 3e-2, 128, 8, 2, 128, 16), (torch.bfloat16, 3e-2, 128, 14, 2, 64, 16),
    (torch.float32, 2e-3, 128, 4, 4, 64, 16),
    # the sink split with copies in play (runs of 3 query blocks; the default 16 makes none at
    # this length) and switched off
    (torch.bfloat16, 3e-2, 128, 8, 2, 128, 3), (torch.float32, 2e-3, 128, 4, 4, 64, 3),
    (torch.float32, 2e-3, 128, 4, 4, 64, 0),
    pytest.param(torch.bfloat16, 3e-2, 64, 8, 2, 128, 16, marks=_BLOCK64),
    pytest.param(torch.bfloat16, 3e-2, 64, 14, 2, 64, 16, marks=_BLOCK64)])
def test_flex_matches_reference(dtype, tol, block_size, nh, ng, hn, split):
    from sparsebalance_megatron.attention.flex import set_flex_tuning
    set_flex_tuning(split_blocks=split)
    try:
        _check_flex_matches_reference(dtype, tol, block_size, nh, ng, hn)
    finally:
        set_flex_tuning()


@pytest.mark.parametrize("dtype,tol,nh,ng,hn,split", [
    (torch.bfloat16, 3e-2, 8, 2, 128, 16), (torch.bfloat16, 3e-2, 14, 2, 64, 3)])
def test_flash_kernel_matches_reference(dtype, tol, nh, ng, hn, split):
    """backend 'flash': flex's FlashAttention-4 kernel (needs flash-attn-4 and a Hopper GPU)."""
    from sparsebalance_megatron.attention.flex import flash_kernel_missing, set_flex_tuning
    why = flash_kernel_missing("cuda")
    if why is not None:
        pytest.skip(f"backend 'flash': {why}")
    set_flex_tuning(split_blocks=split)
    try:
        _check_flex_matches_reference(dtype, tol, 128, nh, ng, hn, backend="flash")
    finally:
        set_flex_tuning()


def _check_flex_matches_reference(dtype, tol, block_size, nh, ng, hn, backend="flex"):
    cu = [0, 1000, 1001, 2500, 4096]
    q, k, v, w = _inputs(cu[-1], nh, ng, hn, dtype, seed=0)
    density = torch.tensor([0.3, 1.0, 0.5, 0.2], device="cuda")
    out_f, g_f, sel_f = _run(backend, q, k, v, cu, density, block_size, w)
    out_r, g_r, sel_r = _run("reference", q, k, v, cu, density, block_size, w)
    assert torch.equal(sel_f.block_mask(), sel_r.block_mask())
    rel = lambda a, b: float((a - b).norm() / b.norm())     # noqa: E731
    assert rel(out_f, out_r) < tol
    for a, b in zip(g_f, g_r):
        assert rel(a, b) < tol


def test_torch_backend_on_cuda_matches_reference():
    cu = [0, 700, 2048]
    q, k, v, w = _inputs(2048, 4, 2, 64, torch.float32, seed=1)
    out_t, g_t, _ = _run("torch", q, k, v, cu, 0.25, 64, w)
    out_r, g_r, _ = _run("reference", q, k, v, cu, 0.25, 64, w)
    assert float((out_t - out_r).abs().max()) < 1e-4
    for a, b in zip(g_t, g_r):
        assert float((a - b).norm() / b.norm()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_maxkey_equals_torch_estimator(dtype):
    from tests.maxkey_check import maxkey_pair
    q, k, _, _ = _inputs(4096, 8, 2, 128, dtype, seed=2)
    a, b, ok, _ = maxkey_pair([0, 700, 701, 3000, 4096], 4096, 64, q, k, "cuda")
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert float((a[ok] - b[ok]).abs().max() / b[ok].abs().max()) < tol


def test_per_layer_path_syncs_nothing_and_compiles_once():
    """Training-shaped calls: packed micro-batches of one token count, the DST density range;
    each micro-batch's first layer is the setup, its other layers (fwd + bwd) and a recomputed
    forward (no grad) run under ``torch.cuda.set_sync_debug_mode``."""
    from torch._dynamo.utils import counters
    counters.clear()
    t, bs, gen = 8192, 128, torch.Generator().manual_seed(3)
    graphs, syncs = [], []
    for step in range(8):
        cuts = sorted(torch.randperm(t - 1, generator=gen)[:1 + step % 6].add(1).tolist())
        cu = torch.tensor([0, *cuts, t], dtype=torch.int32, device="cuda")
        density = [1.0, 0.5, 0.25, 0.125, 0.3, 0.7, 0.2, 0.9][step]
        q, k, v, w = _inputs(t, 14, 2, 64, torch.bfloat16, seed=step)
        cache = {}
        _run("flex", q, k, v, cu, density, bs, w, cache)           # layer 1: setup
        if step == 0:                                               # compile the no-grad graph
            with torch.no_grad():
                block_sparse_attention(q, k, v, cu, density, block_size=bs, backend="flex",
                                       sink_blocks=1, local_blocks=1, cache=cache)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(2):
                    _run("flex", q, k, v, cu, density, bs, w, cache)
                with torch.no_grad():
                    block_sparse_attention(q, k, v, cu, density, block_size=bs, backend="flex",
                                           sink_blocks=1, local_blocks=1, cache=cache)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append([f"{c.filename}:{c.lineno}: {c.message}" for c in caught
                      if "synchroniz" in str(c.message)])
        graphs.append(counters["stats"]["unique_graphs"])
    # the first micro-batch is warm-up (one-time lazy initialisation may synchronise once)
    assert syncs[1:] == [[]] * 7, syncs
    assert graphs[-1] == graphs[0] <= 2, graphs     # grad + no-grad, nothing per batch or density
