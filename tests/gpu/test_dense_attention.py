"""Dense varlen attention on CUDA: the fused kernels (one ``varlen_attn`` call; cuDNN SDPA over
documents grouped by length at padded lengths: views, padded copies, power-of-two groups) equal
the exact per-document loop in bf16, outputs and gradients, with GQA; and the routed
block-sparse attention equals its unrouted computation at density 1 on short documents."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention
from sparsebalance_megatron.attention.dense import (causal_per_document, dense_varlen_attention,
                                                    packed_docs)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# calls (n, padded length): 1024 and 923 (2, 1024), 512 a view (1, 512), 100 and 1 (2, 128)
CU = [0, 100, 1124, 1125, 2048, 2560]
# 524 a view of 640 rows (1, 640), 500, 512, 512, 512 (4, 512)
GROUPED = [0, 500, 1012, 1524, 2048, 2560]
# 2000 a view of 2048 rows, 560 a padded copy of 640 (its 640 rows would pass the end)
ENDS = [0, 2000, 2560]
CALLS = {tuple(CU): 3, tuple(GROUPED): 2, tuple(ENDS): 2}


def _inputs(nh, ng, hn, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = CU[-1]
    q, k, v = (torch.randn(t, h, hn, generator=g).to("cuda", torch.bfloat16)
               for h in (nh, ng, ng))
    return q, k, v, torch.randn(t, nh, hn, generator=g).cuda()


def _run(fn, q, k, v, w):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out.float() * w).sum().backward()
    return [out.float()] + [x.grad.float() for x in (q, k, v)]


@pytest.mark.parametrize("kernel,cu", [("varlen", CU), ("sdpa", CU), ("sdpa", GROUPED),
                                       ("sdpa", ENDS)])
@pytest.mark.parametrize("nh,ng,hn", [(8, 8, 64), (8, 2, 128), (14, 2, 64)])
def test_fused_kernel_equals_the_loop_in_bf16(kernel, cu, nh, ng, hn):
    q, k, v, w = _inputs(nh, ng, hn)
    docs = packed_docs(cu, cu[-1], "cuda")
    if kernel == "sdpa":
        assert len(docs.sdpa_groups()) == CALLS[tuple(cu)]
    got = _run(lambda a, b, c: dense_varlen_attention(a, b, c, docs, 0.1, kernel=kernel),
               q, k, v, w)
    want = _run(lambda a, b, c: causal_per_document(a, b, c, cu, 0.1), q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 3e-2 * max(scale, 1.0), (kernel, name)


def test_routed_attention_equals_density_one_on_short_documents_in_bf16():
    """The dense half (varlen) and the sparse half (flex) of a routed micro-batch together equal
    the flex kernel with density 1 on the short documents (bf16 tolerance)."""
    q, k, v, w = _inputs(8, 2, 128)
    long = torch.tensor([b - a >= 1024 for a, b in zip(CU[:-1], CU[1:])], device="cuda")
    dens = torch.where(long, 0.5, 1.0).double()
    kw = dict(block_size=128, backend="flex")
    got = _run(lambda a, b, c: block_sparse_attention(a, b, c, CU, 0.5, dense_below_tokens=1024,
                                                      **kw)[0], q, k, v, w)
    want = _run(lambda a, b, c: block_sparse_attention(a, b, c, CU, dens, **kw)[0], q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max().item() <= 3e-2 * max(b.abs().max().item(), 1.0), name


@pytest.mark.parametrize("mode", ["native", "repeat"])
def test_varlen_gqa_by_either_path_equals_the_loop_in_bf16(monkeypatch, mode):
    """torch 2.11's varlen_attn has no enable_gqa: K/V reach FlashAttention-2 with their own heads
    (native) or repeated (where a kernel refuses); both equal the per-document loop."""
    from torch.nn.attention.varlen import varlen_attn

    from sparsebalance_megatron.attention import torch_compat
    if mode == "native" and torch_compat.varlen_gqa_mode(varlen_attn)[0] == "enable_gqa":
        pytest.skip("this torch takes enable_gqa: the native path is not used")
    monkeypatch.setitem(torch_compat._VARLEN_MODE, varlen_attn, (mode, "forced by a test"))
    q, k, v, w = _inputs(8, 2, 128)
    docs = packed_docs(CU, CU[-1], "cuda")
    got = _run(lambda a, b, c: dense_varlen_attention(a, b, c, docs, 0.1, kernel="varlen"),
               q, k, v, w)
    want = _run(lambda a, b, c: causal_per_document(a, b, c, CU, 0.1), q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max().item() <= 3e-2 * max(b.abs().max().item(), 1.0), (mode, name)
