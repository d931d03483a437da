"""Dense varlen attention (``attention/dense.py``) on CPU: the exact loop and the padded SDPA
layout against a float64 masked softmax written here, input checks, and one host read per
micro-batch. The fused CUDA kernels are compared in tests/gpu/test_dense_attention.py."""

import pytest
import torch

from sparsebalance_megatron.attention.dense import (DENSE_KERNELS, _padded_sdpa,
                                                    dense_varlen_attention, packed_docs)

CU = [0, 7, 40, 41, 90]


def masked_reference(q, k, v, cu, scale):
    """float64 softmax over keys of the same document at or before the query (GQA by group)."""
    q, k, v = (x.double() for x in (q, k, v))
    t, nh, _ = q.shape
    doc = torch.zeros(t, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = d
    i = torch.arange(t)
    allow = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    rep = nh // k.shape[1]
    out = torch.empty_like(q)
    for h in range(nh):
        s = (q[:, h] @ k[:, h // rep].T * scale).masked_fill(~allow, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[:, h // rep]
    return out


def _qkv(t=90, nh=4, ng=2, hn=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, hn, generator=g, dtype=dtype).requires_grad_(True)
            for h in (nh, ng, ng)]


@pytest.mark.parametrize("kernel", DENSE_KERNELS)
def test_cpu_runs_the_exact_loop_for_every_kernel(kernel):
    q, k, v = _qkv()
    out = dense_varlen_attention(q, k, v, torch.tensor(CU), 0.3, kernel=kernel)
    torch.testing.assert_close(out.double(), masked_reference(q, k, v, CU, 0.3),
                               atol=2e-6, rtol=1e-5)


def test_loop_gradients_equal_the_float64_reference():
    q, k, v = _qkv(dtype=torch.float64)
    w = torch.randn(90, 4, 8, dtype=torch.float64)
    got = torch.autograd.grad((dense_varlen_attention(q, k, v, CU) * w).sum(), (q, k, v))
    want = torch.autograd.grad((masked_reference(q, k, v, CU, 8 ** -0.5) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_padded_sdpa_layout_equals_the_reference():
    """The ``sdpa`` kernel's padding (documents padded on the right to the longest) is exact:
    run on CPU in float64 here, it takes whatever SDPA backend the CPU has."""
    q, k, v = _qkv(dtype=torch.float64)
    docs = packed_docs(CU, 90, "cpu")
    out = _padded_sdpa(q, k, v, docs, 0.3)
    torch.testing.assert_close(out, masked_reference(q, k, v, CU, 0.3))
    w = torch.randn(90, 4, 8, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((masked_reference(q, k, v, CU, 0.3) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_packed_docs_reads_cu_seqlens_once_per_micro_batch():
    cu = torch.tensor(CU)
    reads = []
    cu.tolist = lambda: reads.append(1) or CU
    cache = {}
    first = packed_docs(cu, 90, "cpu", cache)
    assert packed_docs(cu, 90, "cpu", cache) is first and len(reads) == 1
    assert first.max_len == 49 and first.cu().dtype == torch.int32
    q, k, v = _qkv()
    dense_varlen_attention(q, k, v, first)       # a PackedDocs is not read again
    assert len(reads) == 1


@pytest.mark.parametrize("kw,needle", [
    (dict(kernel="flash"), r"kernel='flash': expected one of auto, varlen, sdpa"),
    (dict(softmax_scale=-1.0), r"softmax_scale=-1.0"),
    (dict(cu_seqlens=[0, 50]), r"cu_seqlens ends at 50 but there are 90 tokens"),
    (dict(cu_seqlens=[0, 50, 40, 90]), r"strictly increasing"),
])
def test_bad_arguments_name_the_argument_and_value(kw, needle):
    q, k, v = _qkv()
    args = dict(cu_seqlens=CU, softmax_scale=None, kernel="auto")
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        dense_varlen_attention(q, k, v, args.pop("cu_seqlens"), **args)
    with pytest.raises(ValueError, match="cu_seqlens ends at 50"):
        dense_varlen_attention(q, k, v, packed_docs([0, 50], 50, "cpu"))
