"""Routing (``block_sparse_attention(dense_below_tokens=N)``): short documents through one dense
call, long ones through the block-sparse path. Routed outputs, gradients and statistics equal the
unrouted computation with density 1 forced on the short documents and the float64 oracle; the
all-short / all-long cases make one kind of call only; the route is built once per micro-batch."""

import pytest
import torch

from sparsebalance_megatron.attention import RoutedSelection, api, block_sparse_attention, routing
from tests.unit.test_attention_dense import masked_reference

CU = [0, 40, 300, 310, 333, 600]         # lengths 40, 260, 10, 23, 267: long = 260, 267
LONG = [b - a >= 100 for a, b in zip(CU[:-1], CU[1:])]
KW = dict(block_size=16, sink_blocks=1, local_blocks=1, backend="torch")


def _qkv(t=CU[-1], nh=4, ng=2, hn=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, hn, generator=g, dtype=torch.float64).requires_grad_(True)
            for h in (nh, ng, ng)]


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("density", [0.3, torch.tensor([0.5, 0.3, 0.9, 0.2, 0.6])])
def test_routed_equals_density_one_on_short_documents(density):
    q, k, v = _qkv()
    out, sel = block_sparse_attention(q, k, v, CU, density, dense_below_tokens=100, **KW)
    per_doc = density if torch.is_tensor(density) else torch.full((5,), density)
    forced = torch.where(torch.tensor(LONG), per_doc.double(), 1.0)
    want, want_sel = block_sparse_attention(q, k, v, CU, forced, **KW)
    torch.testing.assert_close(out, want)
    for a, b in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b)
    assert isinstance(sel, RoutedSelection) and sel.dense_docs == (0, 2, 3)
    torch.testing.assert_close(sel.density_kept, want_sel.density_kept)
    torch.testing.assert_close(sel.recall, want_sel.recall)
    assert sel.density_kept[[0, 2, 3]].tolist() == [1.0] * 3
    assert sel.sparse.layout.doc_lens == [260, 267]      # the selection saw long documents only
    oracle, _ = block_sparse_attention(q, k, v, CU, forced, **dict(KW, backend="reference"))
    torch.testing.assert_close(out, oracle)


def test_all_short_makes_no_sparse_call_and_equals_the_reference(monkeypatch):
    monkeypatch.setattr(api, "_sparse_attention", _refuse("the sparse path"))
    q, k, v = _qkv()
    out, sel = block_sparse_attention(q, k, v, CU, 0.3, dense_below_tokens=1000, **KW)
    torch.testing.assert_close(out, masked_reference(q, k, v, CU, 8 ** -0.5))
    assert sel.sparse is None and sel.density_kept.tolist() == [1.0] * 5
    assert sel.recall.tolist() == [1.0] * 5
    for a, b in zip(_grads(out, (q, k, v)),
                    _grads(masked_reference(q, k, v, CU, 8 ** -0.5), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_all_long_makes_no_dense_call_and_is_the_unrouted_computation(monkeypatch):
    monkeypatch.setattr(routing, "dense_varlen_attention", _refuse("the dense kernel"))
    q, k, v = _qkv()
    out, sel = block_sparse_attention(q, k, v, CU, 0.3, dense_below_tokens=10, **KW)
    want, want_sel = block_sparse_attention(q, k, v, CU, 0.3, **KW)
    assert torch.equal(out, want) and torch.equal(sel.density_kept, want_sel.density_kept)


def test_no_document_at_all_is_refused_with_or_without_routing():
    q, k, v = _qkv(t=0)
    for n in (0, 100):
        with pytest.raises(ValueError, match="at least one document"):
            block_sparse_attention(q, k, v, [0], 0.5, dense_below_tokens=n, **KW)


def test_route_is_built_once_per_micro_batch_and_later_layers_read_nothing():
    cu = torch.tensor(CU)
    reads = []
    cu.tolist = lambda: reads.append(1) or CU
    cache = {}
    for layer in range(3):                     # every layer: new activations, same documents
        q, k, v = _qkv(seed=layer)
        block_sparse_attention(q, k, v, cu, 0.5, dense_below_tokens=100, cache=cache, **KW)
    assert len(reads) == 1
    (route,) = [x for key, x in cache.items() if key[0] == "route"]
    assert route.dense_docs == [0, 2, 3] and route.sparse_bounds == [0, 260, 527]


def test_bad_routing_arguments_name_the_argument_and_value():
    q, k, v = _qkv()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"dense_below_tokens={bad!r}: expected an integer"):
            block_sparse_attention(q, k, v, CU, 0.5, dense_below_tokens=bad, **KW)
    with pytest.raises(ValueError, match=r"pad_to_tokens=-5: expected an integer >= 0"):
        block_sparse_attention(q, k, v, CU, 0.5, pad_to_tokens=-5, **KW)
    with pytest.raises(ValueError, match="dense_kernel='cudnn': expected one of auto, varlen"):
        block_sparse_attention(q, k, v, CU, 0.5, dense_below_tokens=100, dense_kernel="cudnn",
                               **KW)
    with pytest.raises(ValueError, match=r"density has 2 entries: expected a scalar or one per "
                                         r"document \(5\)"):
        block_sparse_attention(q, k, v, CU, torch.tensor([0.5, 0.5]), dense_below_tokens=100,
                               **KW)
    for n in (100, 1000):        # a dense document's entry is checked too, all-short or not
        with pytest.raises(ValueError, match=r"density=7.0: expected a value in \(0, 1\]"):
            block_sparse_attention(q, k, v, CU, torch.tensor([7.0, 0.5, 0.5, 0.5, 0.5]),
                                   dense_below_tokens=n, **KW)
        with pytest.raises(ValueError, match=r"density=0.0: expected a value in \(0, 1\]"):
            block_sparse_attention(q, k, v, CU, 0, dense_below_tokens=n, **KW)


def _refuse(what):
    def fail(*a, **k):
        raise AssertionError(f"{what} was called")
    return fail
