"""Backend fa4 on a Hopper GPU: FlashAttention-4's block-sparse CuTe kernels on our lists equal
the dense masked reference, outputs and gradients, in bf16 at block 128 (needs flash-attn-4;
docs/GPU.md, "FlashAttention-4's block-sparse kernels called directly")."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _needs_fa4():
    from sparsebalance_megatron.attention.fa4_cute import fa4_missing
    why = fa4_missing("cuda")
    if why is not None:
        pytest.skip(f"backend 'fa4': {why}")


def _run(backend, q, k, v, cu, density, w):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, sel = block_sparse_attention(q, k, v, cu, density, block_size=128, backend=backend,
                                      sink_blocks=1, local_blocks=1)
    (out.float() * w).sum().backward()
    return out.float(), [x.grad.float() for x in (q, k, v)], sel


@pytest.mark.parametrize("nh,ng,hn", [(14, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("strided", [False, True])
def test_fa4_matches_reference(nh, ng, hn, strided):
    """Documents with short last blocks (padding rows in the diagonal blocks), per-document
    densities; ``strided``: q/k/v are slices of one fused projection, as Megatron hands them."""
    cu = [0, 1000, 1001, 2500, 4096]
    g = torch.Generator(device="cpu").manual_seed(0)
    t = cu[-1]
    qkv = torch.randn(t, nh + 2 * ng, hn, generator=g).to("cuda", torch.bfloat16)
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + ng], qkv[:, nh + ng:]
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    w = torch.randn(t, nh, hn, generator=g).cuda()
    density = torch.tensor([0.3, 1.0, 0.5, 0.2], device="cuda")
    out_f, g_f, sel_f = _run("fa4", q, k, v, cu, density, w)
    out_r, g_r, sel_r = _run("reference", q, k, v, cu, density, w)
    assert torch.equal(sel_f.block_mask(), sel_r.block_mask())
    rel = lambda a, b: float((a - b).norm() / b.norm())     # noqa: E731
    assert rel(out_f, out_r) < 3e-2
    for name, a, b in zip("qkv", g_f, g_r):
        assert rel(a, b) < 3e-2, name


def test_fa4_per_layer_path_syncs_nothing():
    """After the micro-batch's first layer (which lays it out; forward and backward also
    compile FA4's kernels), a layer's forward and backward read nothing back from the device:
    the selection, the lists (``build_block_lists``, one Triton kernel for the forward and the
    transposed lists) and FA4's kernels."""
    cu, nh, ng, hn = [0, 3000, 8192], 14, 2, 64
    q, k, v = (torch.randn(8192, h, hn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (nh, ng, ng))
    cache = {}
    out, _ = block_sparse_attention(q, k, v, cu, 0.25, block_size=128, backend="fa4",
                                    cache=cache)
    out.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = block_sparse_attention(q, k, v, cu, 0.25, block_size=128, backend="fa4",
                                        cache=cache)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
