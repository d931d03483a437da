"""The Triton backends' per-layer call, checked on CPU in Triton's interpreter (the ``interp``
worker, as ``test_attention_triton.py``): its launches counted, its inputs' alignment, and what
the micro-batch's setup builds once for every layer.

- Launches: ``sparse_triton_select.triton_block_sparse`` (the fused selection, lists and kernels)
  gives the padded API path's selection and output, and a layer call after the micro-batch's
  first costs 7 launches forward and 3 backward (maxkey), with no host round trip.
- Built once: a layer's block lists (the forward's and the backward's transposed ones) come
  from one ``_lists_kernel`` launch in its forward, saved for its backward, which builds none;
  FA4's partial (diagonal) lists are built once per block count and read by every layer's
  forward and backward (FA4's own kernels stubbed). The selection itself is each layer's own
  (it scores the layer's q and k): nothing of it can be shared between layers.
- The same results: layers that share the micro-batch's setup (one upload, tables derived on
  the device) give bit for bit what a call with its own setup gives, the tables equal the ones
  built from host lists, and the output and gradients match the float64 reference.
- Misaligned inputs are copied before any launch.
"""

import pytest
import torch

from tests.unit._host_syncs import HostSyncCounter
from tests.unit.test_attention_triton import BS, CU, CU_128, _inputs, _odd

# aten ops that launch nothing (views, allocations, metadata)
_FREE_OPS = {"view", "_unsafe_view", "permute", "expand", "slice", "select", "as_strided", "t",
             "transpose", "unsqueeze", "squeeze", "alias", "detach", "empty", "empty_like",
             "new_empty", "empty_strided", "new_empty_strided", "lift_fresh", "unbind",
             "split", "reshape", "diagonal", "_reshape_alias", "unflatten", "flatten"}


def _count_launches(fn):
    """Kernel launches of ``fn()``: every Triton kernel launch plus every aten op that is not a
    view or an allocation (each is a kernel on a GPU), with their names."""
    import collections

    from torch._library.custom_ops import _maybe_get_opdef
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    seen, inside = collections.Counter(), []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if func.namespace == "sparsebalance":  # our custom ops: count what they run
                with Ops():
                    return _maybe_get_opdef(func)._init_fn(*args, **(kwargs or {}))
            if not inside and name not in _FREE_OPS:
                seen["aten." + name] += 1
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def counted(self, *a, **kw):         # the interpreter's own copies are not launches
        seen["triton." + self.fn.__name__] += 1
        inside.append(1)
        try:
            return run(self, *a, **kw)
        finally:
            inside.pop()

    InterpretedFunction.run = counted
    try:
        with Ops():
            fn()
    finally:
        InterpretedFunction.run = run
    return seen


def check_fused_path_and_launches(estimator, nh, ng):
    """``sparse_triton_select.triton_block_sparse`` (the unpadded per-layer call) gives the
    padded API path's selection and output (the generic selection too: mass mode with a share
    reduction), and a layer call (after the micro-batch's first) costs 7 launches forward and
    3 backward (maxkey), with no host sync, where the padded path made 29 + 16."""
    from sparsebalance_megatron.attention import block_sparse_attention, build_layout
    from sparsebalance_megatron.attention.blocks import check_density

    from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
    q, k, v, w = _inputs(nh, ng, 32, seed=7)
    budget = dict(sink_blocks=1, local_blocks=1, selection_mode="density", mass_threshold=0.9,
                  min_density=0.125, max_density=1.0)
    kw = dict(estimator=estimator, softmax_scale=0.2, **budget)
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    api_kw = dict(block_size=BS, backend="triton", cache={}, **kw)
    res = {}
    # the API path, launches counted (its set-up adds host tables and uploads, no Triton launch)
    api_fwd = _count_launches(lambda: res.update(zip(("ref", "rsel"), block_sparse_attention(
        *x, CU, 0.4, **api_kw))))
    api_bwd = _count_launches(lambda: res.update(grads=torch.autograd.grad(res["ref"], x, w)))
    ref, rsel, ref_grads = res["ref"], res["rsel"], res["grads"]
    lay = build_layout(CU, CU[-1], BS, "cpu")
    dens, host = check_density(0.4, lay.num_docs, "cpu")
    out, sel = triton_block_sparse(*x, lay, dens, density_host=host, **kw)   # layer 1: set-up
    grads = torch.autograd.grad(out, x, w)
    assert bool((sel.kv_indices == rsel.kv_indices).all())
    assert bool((sel.kv_num == rsel.kv_num).all())
    assert float((sel.shares - rsel.shares).abs().max()) < 1e-6
    assert float((sel.recall - rsel.recall).abs().max()) < 1e-6
    assert bool((sel.density_kept == rsel.density_kept).all())
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert float((a - b).abs().max()) < 1e-5
    with HostSyncCounter() as syncs:
        fwd = _count_launches(lambda: res.update(out=triton_block_sparse(
            *x, lay, dens, density_host=host, **kw)[0]))
        bwd = _count_launches(lambda: torch.autograd.grad(res["out"], x, w))
    assert syncs.reads == [] and syncs.writes == [], (syncs.reads, syncs.writes)
    want_fwd = {"triton._block_sums_kernel": 1, "triton._shares_kernel": 1,
                "aten.topk": 1, "triton._lists_kernel": 1, "aten.mv": 1,
                "triton.fwd_kernel": 1}
    want_fwd.update({"triton._maxkey_kernel": 1} if estimator == "maxkey" else
                    {"triton._block_sums_kernel": 2, "aten.div": 2, "aten.bmm": 1,
                     "aten.mul": 1})
    assert dict(fwd) == want_fwd, dict(fwd)
    assert dict(bwd) == {"triton.bwd_pre_kernel": 1, "triton.dkv_kernel": 1,
                         "triton.bwd_post_kernel": 1}, dict(bwd)
    # mass mode with a share reduction takes the generic selection on the same scores
    mass = dict(kw, selection_mode="mass", mass_threshold=0.6)
    ref, rsel = block_sparse_attention(*x, CU, 0.4, reduce_shares=lambda s: s * 1.0,
                                       **dict(api_kw, **mass))
    out, sel = triton_block_sparse(*x, lay, dens, density_host=host,
                                   reduce_shares=lambda s: s * 1.0, **mass)
    assert bool((sel.kv_indices == rsel.kv_indices).all()) and bool((sel.kv_num != 1).any())
    assert float((out - ref).abs().max()) < 1e-5
    # the API's triton backend is this fused call: the same kernels, and the same backward
    kernels = lambda c: {n: m for n, m in c.items() if n.startswith("triton.")}
    assert kernels(api_fwd) == kernels(fwd), (dict(api_fwd), dict(fwd))
    assert dict(api_bwd) == dict(bwd), dict(api_bwd)
    print("LAUNCHES", estimator, sum(fwd.values()), sum(bwd.values()),
          sum(api_fwd.values()), sum(api_bwd.values()), dict(api_fwd), dict(api_bwd))


def check_misaligned_inputs_are_copied():
    """q, k, v and dO at an offset that is not 16-byte aligned: every kernel launch (selection,
    lists, forward, backward) still gets aligned pointers (the compile gate judged only the
    aligned build), and the results equal the float64 reference."""
    from triton.runtime.interpreter import InterpretedFunction

    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.attention.kernels import reference_attention
    q, k, v, w = _inputs(4, 2, 16, seed=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    seen = []
    run = InterpretedFunction.run

    def record(self, *a, **kw):
        seen.extend((self.fn.__name__, x.data_ptr() % 16) for x in a
                    if isinstance(x, torch.Tensor))
        return run(self, *a, **kw)

    InterpretedFunction.run = record
    try:
        out, sel = block_sparse_attention(*(_odd(t) for t in leaves), CU, 0.5, block_size=BS,
                                          backend="triton", estimator="maxkey",
                                          softmax_scale=0.25, cache={})
        grads = torch.autograd.grad(out, leaves, _odd(w))
    finally:
        InterpretedFunction.run = run
    names = {n for n, _ in seen}
    assert {"fwd_kernel", "dkv_kernel", "bwd_pre_kernel", "_maxkey_kernel"} <= names, names
    assert [x for x in seen if x[1]] == [], [x for x in seen if x[1]]
    x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*x64, sel, 0.25)
    ref_grads = torch.autograd.grad(ref, x64, w.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < 1e-4, f"{name}: max error {err:.2e} relative to the largest entry"


# --- what the setup builds once --------------------------------------------------------------

def _fa4_layer_launches(n_layers, cu, seed=0):
    """fa4 (FA4's kernels stubbed, filling nothing) over ``n_layers`` calls of one micro-batch:
    the launches of each call's forward and backward."""
    from sparsebalance_megatron.attention import block_sparse_attention
    from tests.unit.test_attention_host_syncs import fa4_stubbed
    q, k, v, w = _inputs(6, 2, 32, seed, torch.float16, cu=cu)
    x = [t.requires_grad_(True) for t in (q, k, v)]
    kw = dict(block_size=128, backend="fa4", cache={}, local_blocks=1)
    res, per_layer = {}, []
    with fa4_stubbed(fill=False):
        for _ in range(n_layers):
            fwd = _count_launches(lambda: res.update(out=block_sparse_attention(
                *x, cu, 0.4, **kw)[0]))
            bwd = _count_launches(lambda: torch.autograd.grad(res["out"], x, w))
            per_layer.append((fwd, bwd))
    return per_layer


def check_lists_once_per_layer_and_diagonal_once():
    """One lists launch per layer, in its forward (the backward reads the transposed lists it
    saved); FA4's diagonal lists (``aten.ones`` + ``aten.arange``) in the first layer of the
    first micro-batch of a block count only, neither in a later layer nor a later micro-batch
    of as many blocks; a layer's launches after that are pinned."""
    from sparsebalance_megatron.attention import fa4_cute
    fa4_cute._DIAGONALS.clear()
    first = _fa4_layer_launches(3, CU_128)
    again = _fa4_layer_launches(2, [0, 200, 201, 813], seed=1)     # other documents, 7 blocks
    for n, (fwd, bwd) in enumerate(first + again):
        assert fwd["triton._lists_kernel"] == 1 and "triton._lists_kernel" not in bwd
        assert fwd["aten.ones"] == (n == 0), (n, fwd)          # the diagonal's counts
        if n not in (0, 3):                                    # past each micro-batch's setup
            assert "aten.arange" not in fwd, (n, fwd)          # nor its block ids
        assert "aten.ones" not in bwd and "aten.arange" not in bwd, bwd
    fwd, bwd = first[1]
    assert dict(fwd) == {"triton._block_sums_kernel": 1, "triton._maxkey_kernel": 1,
                         "triton._shares_kernel": 1, "aten.topk": 1, "triton._lists_kernel": 1,
                         "aten.mv": 1, "aten.new_zeros": 3, "aten.index_copy": 3,
                         "aten.index_select": 1}, dict(fwd)
    # the backward: unpad's and pad's own (FA4's kernels make the rest)
    assert dict(bwd) == {"aten.new_zeros": 1, "aten.zeros": 1, "aten.index_add": 1,
                         "aten.index_select": 3}, dict(bwd)
    assert len(fa4_cute._DIAGONALS) == 1


def _host_tables(lay):
    """The per-block tables as they were built before (from host lists, one upload each)."""
    dev, bs = lay.block_doc.device, lay.block_size
    bounds = torch.tensor(lay.doc_block_start, dtype=torch.int32, device=dev)
    doc_tok = [0]
    for n in lay.doc_lens[:-1]:
        doc_tok.append(doc_tok[-1] + n)
    first = torch.tensor(doc_tok, dtype=torch.long, device=dev)
    start = (first[lay.block_doc] + lay.block_local * bs).to(torch.int32)
    nblk = torch.tensor([b - a for a, b in zip(lay.doc_block_start[:-1],
                                               lay.doc_block_start[1:])], dtype=torch.float32)
    return dict(span=(bounds[:-1][lay.block_doc], bounds[1:][lay.block_doc]), start=start,
                nblk=nblk)


def check_shared_setup_gives_the_same_results():
    """A second layer that reads the micro-batch's setup from the cache gives bit for bit what a
    call that builds its own (``cache=None``) gives, output and gradients, and meets the float64
    reference; the device tables derived from the one upload equal those built from host
    lists (two micro-batches)."""
    from sparsebalance_megatron.attention import block_sparse_attention, build_layout
    from sparsebalance_megatron.attention.block_lists import _doc_span
    from sparsebalance_megatron.attention.block_tables import block_tables
    from sparsebalance_megatron.attention.kernels import reference_attention
    from sparsebalance_megatron.attention.sparse_triton_select import _tables
    kw = dict(block_size=BS, backend="triton", local_blocks=1, softmax_scale=0.3)
    cache = {}
    with torch.no_grad():                               # layer 1: the setup
        block_sparse_attention(*_inputs(4, 2, 16, seed=0)[:3], torch.tensor(CU), 0.4,
                               cache=cache, **kw)
    q, k, v, w = _inputs(4, 2, 16, seed=1)
    runs = []
    for c in (cache, None):                             # layer 2, then on its own
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, sel = block_sparse_attention(*x, torch.tensor(CU), 0.4, cache=c, **kw)
        runs.append((out, *torch.autograd.grad(out, x, w), sel))
    assert runs[0][4].layout is next(v for k, v in cache.items() if k[0] == "layout")
    for a, b in zip(runs[0][:4], runs[1][:4]):
        assert torch.equal(a, b)
    x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*x64, runs[0][4], 0.3)
    for a, b in zip(runs[0][:4], (ref, *torch.autograd.grad(ref, x64, w.double()))):
        assert float((a.double() - b).abs().max() / b.abs().max()) < 1e-4
    for cu in (CU, [0, 60, 61, 166]):
        lay = build_layout(torch.tensor(cu), cu[-1], BS, "cpu")
        want = _host_tables(lay)
        assert all(torch.equal(a, b) for a, b in zip(_doc_span(lay), want["span"]))
        assert torch.equal(block_tables(lay, padded=False)[1], want["start"])
        doc_start, weights = _tables(lay, 2)
        assert torch.equal(doc_start, want["span"][0])
        per_doc = weights.view(lay.num_docs, 2, -1).gt(0).sum(dim=(1, 2)).float() / 2
        assert torch.equal(per_doc, want["nblk"])         # each document's blocks, per group


def test_lists_once_per_layer_and_fa4_diagonal_once_per_block_count(interp):
    interp("check_lists_once_per_layer_and_diagonal_once")


def test_layers_sharing_the_setup_give_the_same_results(interp):
    interp("check_shared_setup_gives_the_same_results")


@pytest.mark.parametrize("estimator,nh,ng", [("maxkey", 6, 2), ("pooled", 4, 1)])
def test_fused_per_layer_call_matches_and_its_launches_are_pinned(interp, estimator, nh, ng):
    interp("check_fused_path_and_launches", estimator=estimator, nh=nh, ng=ng)


def test_misaligned_inputs_are_copied_before_any_launch(interp):
    interp("check_misaligned_inputs_are_copied")
