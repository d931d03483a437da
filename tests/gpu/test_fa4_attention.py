"""Backend fa4 on a Hopper GPU: FlashAttention-4's block-sparse CuTe kernels on our lists against
a float64 reference on the same selection, outputs and gradients, in bf16 at block 128 and head
dims 64 and 128; five repeated calls finite and consistent; no host sync per layer (needs
flash-attn-4; docs/GPU.md, "FlashAttention-4's block-sparse kernels called directly")."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention
from sparsebalance_megatron.attention.kernels import reference_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(14, 2, 64), (32, 8, 128)]         # (np, ng, hn): Qwen2.5-0.5B's heads, and hn 128
CU = [0, 1000, 1001, 2500, 4096]             # short last blocks: padding rows in the diagonals
DENSITY = [0.3, 1.0, 0.5, 0.2]
TOL = 2e-2          # bf16 kernel vs float64 on the same bf16 inputs (relative Frobenius error)
REPEAT_TOL = 5e-3   # repeat vs first call: dQ (and GQA dK/dV) are float32 atomic sums, so their
                    # order, and a bf16 rounding here and there, may differ; garbage would not


@pytest.fixture(autouse=True)
def _needs_fa4():
    from sparsebalance_megatron.attention.fa4_cute import fa4_missing
    why = fa4_missing("cuda")
    if why is not None:
        pytest.skip(f"backend 'fa4': {why}")


def _inputs(nh, ng, hn, strided):
    """bf16 q, k, v (``strided``: slices of one fused projection, as Megatron hands them) and
    the output weights ``w``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    t = CU[-1]
    qkv = torch.randn(t, nh + 2 * ng, hn, generator=g).to("cuda", torch.bfloat16)
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + ng], qkv[:, nh + ng:]
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return q, k, v, torch.randn(t, nh, hn, generator=g).cuda()


def _fa4(q, k, v, w):
    """backend fa4: out and the gradients of ``(out * w).sum()`` (float32 copies), selection."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, sel = block_sparse_attention(q, k, v, CU, torch.tensor(DENSITY, device="cuda"),
                                      block_size=128, backend="fa4", sink_blocks=1,
                                      local_blocks=1)
    (out.float() * w).sum().backward()
    return out.float(), [x.grad.float() for x in (q, k, v)], sel


def _reference64(q, k, v, w, sel):
    """Dense masked attention in float64 on the selection's token mask, same bf16 inputs."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out = reference_attention(q, k, v, sel, q.shape[-1] ** -0.5)
    (out * w.double()).sum().backward()
    return out, [x.grad for x in (q, k, v)]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("nh,ng,hn", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_fa4_matches_float64_reference(nh, ng, hn, strided):
    """Per-document densities, sinks and a window; outputs and dQ, dK, dV."""
    q, k, v, w = _inputs(nh, ng, hn, strided)
    out, grads, sel = _fa4(q, k, v, w)
    out_r, grads_r = _reference64(q, k, v, w, sel)
    assert _rel(out, out_r) < TOL
    for name, a, b in zip("qkv", grads, grads_r, strict=True):
        assert _rel(a, b) < TOL, f"d{name}: {_rel(a, b):.3g}"


@pytest.mark.parametrize("nh,ng,hn", SHAPES)
def test_fa4_repeated_calls_are_finite_and_stable(nh, ng, hn):
    """Five calls on the same inputs: every output and gradient finite and within TOL of the
    float64 reference; outputs bitwise equal to the first call's (no split-KV, no atomics in the
    forward), gradients within REPEAT_TOL of it. Catches a backward that now and then reads its
    preprocess's outputs before they are written (FA4 PR #2756: garbage or NaN gradients)."""
    q, k, v, w = _inputs(nh, ng, hn, strided=False)
    calls = []
    for i in range(5):
        out, grads, sel = _fa4(q, k, v, w)
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            assert bool(torch.isfinite(x).all()), f"call {i}: {name} has NaN or inf"
        if not calls:
            out_r, grads_r = _reference64(q, k, v, w, sel)
        calls.append((out, grads))
        assert _rel(out, out_r) < TOL, f"call {i}: out {_rel(out, out_r):.3g}"
        for name, a, b in zip("qkv", grads, grads_r, strict=True):
            assert _rel(a, b) < TOL, f"call {i}: d{name} {_rel(a, b):.3g}"
    out0, grads0 = calls[0]
    for i, (out, grads) in enumerate(calls[1:], 1):
        assert torch.equal(out, out0), f"call {i}: output differs from the first call's"
        for name, a, b in zip("qkv", grads, grads0, strict=True):
            assert _rel(a, b) < REPEAT_TOL, f"call {i}: d{name} {_rel(a, b):.3g} from call 0"


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
