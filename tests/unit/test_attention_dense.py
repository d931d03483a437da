"""Dense varlen attention (``attention/dense.py``) on CPU: the exact loop and the ``sdpa``
kernel's grouped layout at padded lengths against a float64 masked softmax written here, its
bounded set of shapes and its padding bound over many micro-batches, input checks, and one host
read per micro-batch. The fused CUDA kernels are compared in tests/gpu/test_dense_attention.py."""

import numpy as np
import pytest
import torch

from sparsebalance_megatron.attention.dense import (DENSE_KERNELS, _grouped_sdpa,
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


# lengths 7, 33, 1, 49, 32, 31, 5: every one padded to 128, so one group of 7 (no padded work
# beyond each document's own 128), run as calls of 4 (49, 33, 32, 31), 2 (7, 5) and 1 (the
# 1-token document at 40: its 128 rows would run past the micro-batch, so a padded copy)
GROUPED = [0, 7, 40, 41, 90, 122, 153, 158]
# lengths 1100, 300, 290, 280, 140, 60, 560: 1100 alone at 1152, a view (its 1152 rows from 0
# lie inside the micro-batch); 300, 290, 280 one group (all at 384), run as 2 (a padded copy)
# and 1 (280, a view); 140 alone at 256 and 60 alone at 128, views; 560 alone at 640, a padded
# copy (the micro-batch ends 560 tokens after its start)
LONG = [0, 1100, 1400, 1690, 1970, 2110, 2170, 2730]


def _sdpa_run_and_grads(cu, reference):
    t = cu[-1]
    q, k, v = _qkv(t=t, dtype=torch.float64)
    out = _grouped_sdpa(q, k, v, packed_docs(cu, t, "cpu"), 0.3)
    want = reference(q, k, v, cu, 0.3)
    torch.testing.assert_close(out, want)
    w = torch.randn(t, 4, 8, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cu", [CU, GROUPED, [0, 90]])
def test_grouped_sdpa_equals_the_reference(cu):
    """The ``sdpa`` kernel's calls (views, padded copies, outputs put back in token order) are
    exact, outputs and gradients: run on CPU in float64 here, they take whatever SDPA backend
    the CPU has."""
    _sdpa_run_and_grads(cu, masked_reference)


def test_grouped_sdpa_with_padded_lengths_equals_the_exact_loop():
    """Documents padded at their end to ``sdpa_padded_len`` (zeros in a copy, the next
    documents' tokens in a view) give the exact outputs and gradients: padded keys are never
    read by a real query, padded outputs are dropped (the exact loop, itself checked against the
    masked float64 softmax above, is the reference at this length)."""
    from sparsebalance_megatron.attention.dense import causal_per_document
    assert [(c.n, c.length, c.start is not None) for c in
            packed_docs(LONG, LONG[-1], "cpu").sdpa_groups()] == \
        [(1, 1152, True), (1, 640, False), (2, 384, False), (1, 384, True), (1, 256, True),
         (1, 128, True)]
    _sdpa_run_and_grads(LONG, causal_per_document)


def test_sdpa_groups_pad_to_bounded_lengths_within_the_slack():
    """Longest first; a document joins while n x B(Lmax)^2 <= 1.1 x sum B(L)^2; a group runs
    as power-of-two calls, a lone document as a view where its padded rows fit."""
    groups = packed_docs(GROUPED, 158, "cpu").sdpa_groups()
    assert [(c.n, c.length, c.start, c.rows) for c in groups] == \
        [(4, 128, None, 145), (2, 128, None, 12), (1, 128, None, 1)]
    assert packed_docs([0, 90], 90, "cpu").sdpa_order() is None     # one document: in order
    view = packed_docs([0, 256, 300], 300, "cpu").sdpa_groups()[0]
    assert (view.n, view.length, view.start, view.rows, view.tokens) == (1, 256, 0, 256, None)


def test_sdpa_padded_len_is_a_small_set_within_a_sixteenth():
    """Multiples of 128 and of 1/32 of the next power of two: 80 lengths up to 32K, 96 up to
    64K; never shorter, and less than max(128, L / 16) longer."""
    from sparsebalance_megatron.attention.dense import sdpa_padded_len
    got = [sdpa_padded_len(n) for n in range(1, 65537)]
    assert len(set(got[:32768])) == 80 and len(set(got)) == 96
    assert all(b % 128 == 0 and n <= b < n + max(128, n / 16) for n, b in enumerate(got, 1))
    assert [sdpa_padded_len(n) for n in (1, 128, 129, 2048, 2049, 4097, 16385, 32768)] == \
        [128, 128, 256, 2048, 2176, 4352, 17408, 32768]


def _random_bounds(rng, t=32768, low=1):
    """A packed micro-batch of ``t`` tokens: log-uniform document lengths from ``low`` tokens
    to all of them (a remainder under ``low`` joins the last document)."""
    bounds = [0]
    while bounds[-1] < t:
        n = int(np.exp(rng.uniform(np.log(low), np.log(t))))
        end = bounds[-1] + n
        if t - end < low:
            end = t
        bounds.append(end)
    return bounds


def test_sdpa_shapes_stay_bounded_and_padding_within_the_bound_over_many_micro_batches():
    """Over 400 random 32K micro-batches: every call's (n, length) is one of the bounded set
    (n a power of two up to 128, length one of the 80), far fewer than the document lengths; each
    micro-batch's padded work is within SDPA_PAD_SLACK of its documents' at their own padded
    lengths, and within 1.1 x 1.13 of their causal work where every document has 2K+ tokens."""
    from sparsebalance_megatron.attention.dense import SDPA_PAD_SLACK, sdpa_padded_len
    rng = np.random.default_rng(0)
    shapes, lengths, long_only = set(), set(), 0
    allowed = {sdpa_padded_len(n) for n in range(1, 32769)}
    for i in range(400):
        bounds = _random_bounds(rng, low=1 if i % 2 else 2048)
        lens = np.diff(bounds)
        calls = packed_docs(bounds, bounds[-1], "cpu").sdpa_groups()
        assert sum(c.rows for c in calls) == bounds[-1]
        shapes |= {(c.n, c.length) for c in calls}
        lengths |= set(lens.tolist())
        padded = sum(c.n * c.length ** 2 for c in calls)
        assert padded <= SDPA_PAD_SLACK * sum(sdpa_padded_len(n) ** 2 for n in lens)
        if lens.min() >= 2048:
            long_only += 1
            assert padded <= SDPA_PAD_SLACK * 1.0625 ** 2 * float((lens ** 2).sum())
    assert all(n & (n - 1) == 0 and length in allowed for n, length in shapes)
    assert len({length for _, length in shapes}) <= 80 and len({n for n, _ in shapes}) <= 8
    # 147 shapes (of the 80 x 8 possible) for 1,967 document lengths
    assert len(shapes) < len(lengths) // 10 and long_only >= 200, (len(shapes), len(lengths))


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


# --- varlen_attn through its signature (attention/torch_compat.py) -----------------------------

def _fake_varlen(gqa):
    """A CPU stand-in for torch's ``varlen_attn`` (the exact loop inside): ``gqa`` is
    ``"enable_gqa"`` (torch 2.13's signature: refuses unequal heads without the flag),
    ``"native"`` (torch 2.11's: no flag, the kernel shares K/V heads) or ``"refuse"`` (no flag,
    the kernel refuses unequal heads). Records the head counts it was given."""
    from sparsebalance_megatron.attention.dense import causal_per_document
    seen = []

    def run(q, k, v, cu, max_len, scale, window_size, enable_gqa=False):
        assert window_size == (-1, 0), window_size         # causal, as a tuple
        seen.append((q.shape[1], k.shape[1]))
        if k.shape[1] != q.shape[1] and (gqa == "refuse" or gqa == "enable_gqa"
                                         and not enable_gqa):
            raise RuntimeError(f"expected equal heads, got Hq={q.shape[1]} Hkv={k.shape[1]}")
        return causal_per_document(q, k, v, cu.tolist(), scale)

    if gqa == "enable_gqa":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                        return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
            return run(query, key, value, cu_seq_q, max_q, scale, window_size, enable_gqa)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                        return_aux=None, scale=None, window_size=(-1, -1)):
            return run(query, key, value, cu_seq_q, max_q, scale, window_size)
    varlen_attn.seen = seen
    return varlen_attn


@pytest.mark.parametrize("gqa,want_mode,kv_heads_seen", [
    ("enable_gqa", "enable_gqa", 2), ("native", "native", 2), ("refuse", "repeat", 4)])
def test_varlen_gqa_follows_the_signature_and_equals_the_reference(monkeypatch, gqa, want_mode,
                                                                   kv_heads_seen):
    """torch 2.11's varlen_attn has no enable_gqa (passing it is a TypeError): K/V then reach
    the kernel with their own heads, or repeated where the kernel refuses; the result is the
    exact GQA attention, outputs and gradients, in each case."""
    import torch.nn.attention.varlen as varlen_mod

    from sparsebalance_megatron.attention import torch_compat
    from sparsebalance_megatron.attention.dense import _varlen
    fake = _fake_varlen(gqa)
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    q, k, v = _qkv(dtype=torch.float64)
    w = torch.randn(90, 4, 8, dtype=torch.float64)
    out = _varlen(q, k, v, packed_docs(CU, 90, "cpu"), 0.3)
    assert torch_compat.varlen_gqa_mode(fake)[0] == want_mode
    assert fake.seen[-1] == (4, kv_heads_seen)
    torch.testing.assert_close(out, masked_reference(q, k, v, CU, 0.3))
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((masked_reference(q, k, v, CU, 0.3) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    n = len(fake.seen)
    _varlen(q, k, v, packed_docs(CU, 90, "cpu"), 0.3)        # decided once: one call now
    assert len(fake.seen) == n + 1


def test_torch_signatures_of_the_gpu_paths_are_checked():
    """Every GPU path's torch call has the keywords it passes in this torch (make device-stack
    runs this under the device's torch 2.11), and a missing one is named."""
    import torch.nn.functional as F

    from sparsebalance_megatron.attention import torch_compat
    assert torch_compat.signature_problems() == []
    assert "enable_gqa" in torch_compat.parameter_names(F.scaled_dot_product_attention)
    probs = torch_compat.signature_problems((
        ("torch.nn.attention.varlen:varlen_attn", ("enable_gqa_typo",), "a test"),
        ("torch.nn.attention:no_such_api", (), "a test"),
        ("torch:repeat_interleave", (("nope", "output_size"),), "a test")))
    assert len(probs) == 2 and "no keyword enable_gqa_typo" in probs[0] \
        and "no_such_api" in probs[1]
