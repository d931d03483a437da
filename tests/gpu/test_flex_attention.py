"""FlexAttention backend (compiled BlockMask) == dense masked reference, outputs and gradients (CUDA)."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(backend, q, k, v, cu, density, block_size, w):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, sel = block_sparse_attention(q, k, v, cu, density, block_size=block_size,
                                      backend=backend, sink_blocks=1, local_blocks=1)
    (out.float() * w).sum().backward()
    return out.float(), [x.grad.float() for x in (q, k, v)], sel


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("nh,ng", [(8, 2), (4, 4)])
def test_flex_matches_reference(dtype, tol, block_size, nh, ng):
    torch.manual_seed(0)
    cu = [0, 1000, 1001, 2500, 4096]
    t, hn = cu[-1], 64
    q = torch.randn(t, nh, hn, device="cuda", dtype=dtype)
    k = torch.randn(t, ng, hn, device="cuda", dtype=dtype)
    v = torch.randn(t, ng, hn, device="cuda", dtype=dtype)
    w = torch.randn(t, nh, hn, device="cuda")
    density = torch.tensor([0.3, 1.0, 0.5, 0.2], device="cuda")
    out_f, g_f, sel_f = _run("flex", q, k, v, cu, density, block_size, w)
    out_r, g_r, sel_r = _run("reference", q, k, v, cu, density, block_size, w)
    assert torch.equal(sel_f.block_mask(), sel_r.block_mask())
    rel = lambda a, b: float((a - b).norm() / b.norm())
    assert rel(out_f, out_r) < tol
    for a, b in zip(g_f, g_r):
        assert rel(a, b) < tol


def test_torch_backend_on_cuda_matches_reference():
    torch.manual_seed(1)
    cu = [0, 700, 2048]
    q = torch.randn(2048, 4, 64, device="cuda")
    k = torch.randn(2048, 2, 64, device="cuda")
    v = torch.randn(2048, 2, 64, device="cuda")
    w = torch.randn(2048, 4, 64, device="cuda")
    out_t, g_t, _ = _run("torch", q, k, v, cu, 0.25, 64, w)
    out_r, g_r, _ = _run("reference", q, k, v, cu, 0.25, 64, w)
    assert float((out_t - out_r).abs().max()) < 1e-4
    for a, b in zip(g_t, g_r):
        assert float((a - b).norm() / b.norm()) < 1e-4
