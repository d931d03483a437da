"""The Triton block-sparse FlashAttention (backend ``triton``) on CUDA: output and gradients
against the dense reference on the same selection (bf16 at block 128, head dims 64 and 128;
float32 tightly), the sink column split over several dK/dV programs, the split backward's
candidates (a dQ kernel of its own), no host sync per layer;
the fused per-layer call on unpadded tokens (``sparse_triton_select``) the same way in bf16."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention
from sparsebalance_megatron.attention.kernels import reference_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(t, nh, ng, hn, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(t, h, hn, generator=g).to("cuda", dtype) for h in (nh, ng, ng))
    return q, k, v, torch.randn(t, nh, hn, generator=g).to("cuda", dtype)


def _grads(fn, inputs, w, dtype=None):
    x = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in inputs]
    out = fn(*x)
    (out.float() * w.float()).sum().backward()
    return [out.float()] + [t.grad.float() for t in x]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype,nh,ng,hn,cu,density", [
    # several documents (a 1-token one, short last blocks), per-document densities
    (torch.bfloat16, 8, 2, 128, [0, 1000, 1001, 2500, 4096], [0.3, 1.0, 0.5, 0.2]),
    (torch.bfloat16, 14, 2, 64, [0, 1000, 1001, 2500, 4096], [0.3, 1.0, 0.5, 0.2]),
    # one 64-block document: its sink column (63 query blocks) spans 4 dK/dV programs
    (torch.bfloat16, 8, 8, 128, [0, 8192], 0.25),
    (torch.float32, 4, 2, 64, [0, 8192], 0.125),
])
def test_triton_matches_reference(dtype, nh, ng, hn, cu, density):
    t = cu[-1]
    q, k, v, w = _inputs(t, nh, ng, hn, dtype, seed=0)
    dens = torch.tensor(density, device="cuda") if isinstance(density, list) else density
    kw = dict(block_size=128, sink_blocks=1, local_blocks=1)
    sel = {}

    def triton_fn(q, k, v):
        out, sel["s"] = block_sparse_attention(q, k, v, cu, dens, backend="triton", **kw)
        return out

    got = _grads(triton_fn, (q, k, v), w)
    ref = lambda q, k, v: reference_attention(q, k, v, sel["s"], hn ** -0.5)  # noqa: E731
    exact = _grads(ref, (q, k, v), w, torch.float32)       # the same selection, in float32
    if dtype == torch.float32:
        for a, b in zip(got, exact):
            assert _rel(a, b) < 1e-4
        return
    low = _grads(ref, (q, k, v), w)                        # the reference in bf16: error bar
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert _rel(a, b) <= max(2 * _rel(c, b), 1e-2), (name, _rel(a, b), _rel(c, b))


@pytest.mark.parametrize("nh,ng,hn", [(8, 2, 128), (14, 2, 64)])
def test_split_backward_candidates_match_the_reference(monkeypatch, nh, ng, hn):
    """The first split-backward autotune candidate (``dq_block_m``: dQ in a kernel of its own)
    at the target shapes, bf16, pinned as the autotune would pin it: the same error bar as the
    one pass (one per shape: the tests step has 150 s; the autotune checks every candidate it
    times against the default's gradients)."""
    from sparsebalance_megatron.attention import triton_launch
    cu = [0, 1000, 1001, 2500, 4096]
    q, k, v, w = _inputs(cu[-1], nh, ng, hn, torch.bfloat16, seed=2)
    key = (hn, 128, nh // ng)
    split = [c for c in triton_launch.candidates(*key) if c.dq_block_m][:1]
    assert split
    for cfg in split:
        monkeypatch.setitem(triton_launch.PINNED, key, cfg)
        sel = {}

        def triton_fn(q, k, v):
            out, sel["s"] = block_sparse_attention(q, k, v, cu, 0.3, backend="triton",
                                                   block_size=128, sink_blocks=1)
            return out

        got = _grads(triton_fn, (q, k, v), w)
        ref = lambda q, k, v: reference_attention(q, k, v, sel["s"], hn ** -0.5)  # noqa: E731
        exact, low = _grads(ref, (q, k, v), w, torch.float32), _grads(ref, (q, k, v), w)
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, exact, low):
            assert _rel(a, b) <= max(2 * _rel(c, b), 1e-2), (cfg, name, _rel(a, b), _rel(c, b))


def test_triton_per_layer_path_syncs_nothing():
    cu = torch.tensor([0, 1000, 1001, 2500, 4096], device="cuda")
    q, k, v, w = _inputs(4096, 8, 2, 128, torch.bfloat16, seed=1)
    x = [t.requires_grad_(True) for t in (q, k, v)]
    kw = dict(block_size=128, backend="triton", cache={})
    block_sparse_attention(*x, cu, 0.3, **kw)                 # layer 1: the set-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = block_sparse_attention(*x, cu, 0.3, **kw)
        (out * w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype,nh,ng,hn,cu,density", [
    (torch.bfloat16, 8, 2, 128, [0, 1000, 1001, 2500, 4096], 0.3),     # packed, short blocks
    (torch.bfloat16, 8, 2, 128, [0, 8192], 0.25),                      # a split sink column
])
def test_unpadded_fused_call_matches_reference_and_syncs_nothing(dtype, nh, ng, hn, cu,
                                                                 density):
    """``sparse_triton_select.triton_block_sparse``: the per-layer call on the unpadded tokens
    (7 launches fwd, 3 bwd; the 5-GEMM backward) in bf16 against the reference on its own
    selection, and its second call makes no host sync."""
    from sparsebalance_megatron.attention import build_layout
    from sparsebalance_megatron.attention.blocks import check_density
    from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
    t = cu[-1]
    q, k, v, w = _inputs(t, nh, ng, hn, dtype, seed=2)
    lay = build_layout(cu, t, 128, "cuda")
    dens, host = check_density(density, lay.num_docs, "cuda")
    kw = dict(estimator="maxkey", softmax_scale=hn ** -0.5, sink_blocks=1, local_blocks=1,
              selection_mode="density", mass_threshold=0.9, min_density=0.125,
              max_density=1.0)
    sel = {}

    def fused(q, k, v):
        out, sel["s"] = triton_block_sparse(q, k, v, lay, dens, density_host=host, **kw)
        return out

    got = _grads(fused, (q, k, v), w)
    ref = lambda q, k, v: reference_attention(q, k, v, sel["s"], hn ** -0.5)  # noqa: E731
    exact = _grads(ref, (q, k, v), w, torch.float32)
    low = _grads(ref, (q, k, v), w)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert _rel(a, b) <= max(2 * _rel(c, b), 1e-2), (name, _rel(a, b), _rel(c, b))
    x = [t.detach().requires_grad_(True) for t in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused(*x)
        (out * w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
