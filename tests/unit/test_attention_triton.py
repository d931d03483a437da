"""The Triton block-sparse FlashAttention and its list builder, checked on CPU in Triton's
interpreter against the float64 dense reference (output and dq, dk, dv) and a pure-torch
construction of the lists.

Triton decides at decoration time whether a kernel is interpreted, so the checks run in one
worker process started with ``TRITON_INTERPRET=1`` (the ``interp`` fixture of
``tests/unit/conftest.py``; whatever this process imported before is untouched). The worker
imports this file and runs its ``check_*`` functions; each test sends one and fails with the
worker's traceback. Shapes are tiny (block 16, head dims 16/32, ~13 blocks): the interpreter
runs every program in Python. The per-layer call (launches, alignment, what the setup builds
once) is ``test_attention_triton_call.py``; its host round trips ``test_attention_host_syncs.py``.
"""

import os
from pathlib import Path

import pytest
import torch

# documents: a short last block (37 = 2 x 16 + 5), a 1-token document, a 7-block document
# (its first block, the sink, is kept by 6 later query blocks), a short one
CU = [0, 37, 38, 138, 166]
BS = 16
# block 128 for the target shapes' own default configs: a 3-block document with a short last
# block, a 1-token one, a 4-block one
CU_128 = [0, 300, 301, 813]

# --- checks (run in the worker) ----------------------------------------------------------------

def _inputs(nh, ng, hn, seed, dtype=torch.float32, cu=CU):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k, v = (torch.randn(t, h, hn, generator=g, dtype=dtype) for h in (nh, ng, ng))
    return q, k, v, torch.randn(t, nh, hn, generator=g, dtype=dtype)


def _selection(q, k, density, fixed_length=False, bs=BS, cu=CU, **budget):
    """A selection over a layout built here (``fixed_length``: a padded tail past the blocks)."""
    from sparsebalance_megatron.attention import build_layout
    from sparsebalance_megatron.attention.blocks import check_density
    from sparsebalance_megatron.attention.kernels import to_blocks_kv, to_blocks_q
    from sparsebalance_megatron.attention.selection import select_blocks
    lay = build_layout(cu, cu[-1], bs, "cpu", fixed_length=fixed_length)
    t = lay.num_blocks * bs
    dens, host = check_density(torch.tensor(density) if isinstance(density, list) else density,
                               lay.num_docs, "cpu")
    return select_blocks(to_blocks_q(lay.pad(q)[:t], k.shape[1], bs),
                         to_blocks_kv(lay.pad(k)[:t], bs), lay, dens, estimator="pooled",
                         density_host=host, **budget)


def _expected_lists(sel):
    """Pure torch, from the selection's dense block mask: per (g, i) the kept key blocks but
    the diagonal, per (g, j) the query blocks != j that keep j, both ascending."""
    mask = sel.block_mask().clone()
    mask.diagonal(dim1=1, dim2=2).fill_(False)
    ng, nb, _ = mask.shape
    rows = [[mask[g, i].nonzero().flatten().tolist() for i in range(nb)] for g in range(ng)]
    cols = [[mask[g, :, j].nonzero().flatten().tolist() for j in range(nb)] for g in range(ng)]
    return rows, cols


def check_lists(density, sink_blocks, local_blocks, selection_mode, scan_block=None):
    """``scan_block``: scan the documents in steps of that many blocks (``_SCAN_BYTES`` set
    to fit it), fewer than the longest document has: counts carried over several steps and
    a last step with rows past the document masked."""
    import triton

    from sparsebalance_megatron.attention import block_lists
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    from sparsebalance_megatron.attention.sparse_triton import KV_CHUNK
    q, k, _, _ = _inputs(4, 2, 16, seed=1)
    sel = _selection(q, k, density, sink_blocks=sink_blocks, local_blocks=local_blocks,
                     selection_mode=selection_mode)
    saved = block_lists._SCAN_BYTES
    if scan_block is not None:
        kp = triton.next_power_of_2(max(sel.kv_indices.shape[-1] - 1, 1))
        size = sel.kv_indices.element_size()
        block_lists._SCAN_BYTES = scan_block * kp * size
        assert block_lists.scan_block(kp, size) == scan_block < sel.layout.max_doc_blocks - 1
    try:
        lists = build_block_lists(sel)
    finally:
        block_lists._SCAN_BYTES = saved
    lay = sel.layout
    rows, cols = _expected_lists(sel)
    ng, nb = sel.kv_num.shape
    assert lists.q_idx.shape == (ng, nb, max(sel.kv_indices.shape[-1] - 1, 1))
    assert lists.kv_idx.shape == (ng, nb, lay.max_doc_blocks - 1)
    for x in (lists.q_num, lists.q_idx, lists.kv_num, lists.kv_idx):
        assert x.dtype == torch.int32 and x.is_contiguous()
    for g in range(ng):
        for b in range(nb):
            for num, idx, want in ((lists.q_num, lists.q_idx, rows[g][b]),
                                   (lists.kv_num, lists.kv_idx, cols[g][b])):
                n = int(num[g, b])
                assert idx[g, b, :n].tolist() == want, (g, b, idx[g, b].tolist(), want)
                assert bool((idx[g, b, n:] == b).all())          # padding: the row's own block
    # the dK/dV programs of a key block take chunks of its transposed list: the sink column
    # of the 7-block document (block 4) is spread over several programs, each bounded
    sink = lay.doc_block_start[2]
    for chunk in (2, KV_CHUNK):
        programs = lists.column_chunks(chunk)
        for g in range(ng):
            for j in range(nb):
                n = int(lists.kv_num[g, j])
                pieces = [lists.kv_idx[g, j, c * chunk:min(n, (c + 1) * chunk)].tolist()
                          for c in range(programs)]
                assert sum(pieces, []) == cols[g][j] and all(len(p) <= chunk for p in pieces)
        if sink_blocks and chunk == 2:
            assert len(cols[0][sink]) == 6 and programs == 3


def check_attention(nh, ng, hn, density, sink_blocks, local_blocks, selection_mode="density",
                    kv_chunk=None, seed=0, dtype="float32", tol=1e-4, tokens=False,
                    config=None, bs=BS, cu=CU, tiles_of=None):
    """Output and dq, dk, dv against the float64 reference on the same selection and inputs
    (max error relative to the largest entry below ``tol``). ``kv_chunk`` None: through
    ``block_sparse_attention`` (backend triton); else with that chunk length the padded kernel
    on a fixed-length layout (a padded tail), or (``tokens``) the kernel on the unpadded
    tokens. ``config``: LaunchConfig fields overriding the defaults (other tiles, sub-tiles);
    ``cu``: the documents (``CU_128`` for block 128); ``tiles_of``: (hn, block, rep) whose
    default config to launch with (a target shape's tiles at a cheaper head dim)."""
    from dataclasses import replace

    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    from sparsebalance_megatron.attention.kernels import reference_attention
    from sparsebalance_megatron.attention.sparse_triton import (sparse_attention,
                                                                sparse_attention_padded)
    from sparsebalance_megatron.attention.triton_launch import default_config
    q, k, v, w = _inputs(nh, ng, hn, seed, getattr(torch, dtype), cu=cu)
    scale = 0.7 / hn ** 0.5
    budget = dict(sink_blocks=sink_blocks, local_blocks=local_blocks,
                  selection_mode=selection_mode, mass_threshold=0.5, max_density=0.6)
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if kv_chunk is None:
        out, sel = block_sparse_attention(*x, cu, torch.tensor(density) if isinstance(
            density, list) else density, block_size=bs, backend="triton", estimator="pooled",
            softmax_scale=scale, **budget)
    else:
        sel = _selection(q, k, density, fixed_length=not tokens, bs=bs, cu=cu, **budget)
        lay = sel.layout
        cfg = replace(default_config(*(tiles_of or (hn, bs, nh // ng))), **(config or {}))
        if tokens:      # the micro-batch's own tokens: no padded copy in or out
            out = sparse_attention(*x, build_block_lists(sel), lay, scale, kv_chunk=kv_chunk,
                                   config=cfg)
        else:
            assert lay.padded_blocks > lay.num_blocks
            out_pad = sparse_attention_padded(*(lay.pad(t) for t in x), build_block_lists(sel),
                                              lay, scale, kv_chunk=kv_chunk, config=cfg)
            assert bool((out_pad[lay.num_blocks * bs:] == 0).all())
            out = lay.unpad(out_pad)
    grads = torch.autograd.grad((out * w).sum(), x)
    x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*x64, sel, scale)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), x64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert a.dtype == q.dtype
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < tol, f"{name}: max error {err:.2e} relative to the largest entry"
    if cu == CU:
        assert float(sel.density_kept[2]) < 0.7      # the 7-block document is sparse
    else:
        assert float(sel.density_kept[2]) < 1.0      # the last document skips blocks


def check_broken_lists_fail():
    """A list missing one entry gives a visible error: the comparisons above can fail. The
    forward reads the query-side lists, dK/dV the key-side ones (the sink column here)."""
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    from sparsebalance_megatron.attention.kernels import reference_attention
    from sparsebalance_megatron.attention.sparse_triton import sparse_attention_padded
    q, k, v, w = _inputs(4, 2, 16, seed=3)
    sel = _selection(q, k, 0.5, sink_blocks=1)
    lay = sel.layout
    k64 = k.double().requires_grad_(True)
    ref = reference_attention(q.double(), k64, v.double(), sel, 0.25)
    ref_dk = torch.autograd.grad((ref * w.double()).sum(), k64)[0]
    for side in ("q", "kv"):
        lists = build_block_lists(sel)
        num = getattr(lists, f"{side}_num")
        b = int(num[1].argmax())
        num[1, b] -= 1                      # group 1 forgets block b's last listed entry
        x = [lay.pad(t).requires_grad_(True) for t in (q, k, v)]
        out = lay.unpad(sparse_attention_padded(*x, lists, lay, 0.25))
        err = float((out.double() - ref).abs().max())
        if side == "q":
            assert err > 1e-2, err
        else:
            dk = lay.unpad(torch.autograd.grad((lay.pad(out) * lay.pad(w)).sum(), x[1])[0])
            per_group = (dk.double() - ref_dk).abs().amax(dim=(0, 2))
            assert err < 1e-5 and float(per_group[1]) > 1e-3 > 1e-5 > float(per_group[0]), \
                per_group


def check_refusals_and_fake_op():
    """Why it cannot run, by name; the custom op's fake implementation gives the shapes."""
    from dataclasses import astuple

    from torch._subclasses.fake_tensor import FakeTensorMode

    from sparsebalance_megatron.attention.triton_launch import default_config

    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.attention import sparse_triton
    q, k, v, _ = _inputs(4, 2, 16, seed=4)
    for args, needle in (((q[..., :12], k[..., :12], v[..., :12]), "head dim 12: expected a "
                          "power of two in 16..256"),
                         ((q.double(), k.double(), v.double()), "q dtype torch.float64"),
                         ((q, k, v, 8), "block_size=8: expected >= 16")):
        bs = args[3] if len(args) > 3 else BS
        try:
            block_sparse_attention(*args[:3], CU, 0.5, block_size=bs, backend="triton")
        except ValueError as e:
            assert str(e).startswith("backend='triton': ") and needle in str(e), str(e)
        else:
            raise AssertionError(f"{needle}: not refused")
    assert sparse_triton.usable(q, BS) and not sparse_triton.usable(q, 8)
    # the unpadded entry takes the micro-batch's own tokens; a bad launch config is named
    from dataclasses import replace

    from sparsebalance_megatron.attention.block_lists import build_block_lists
    sel = _selection(q, k, 0.5)
    lists, lay = build_block_lists(sel), sel.layout
    for call, needle in (
            (lambda: sparse_triton.sparse_attention(lay.pad(q), lay.pad(k), lay.pad(v), lists,
                                                    lay, 0.25),
             f"q has {lay.padded_tokens} tokens: expected the layout's {CU[-1]}"),
            (lambda: sparse_triton.sparse_attention(q, k, v, lists, lay, 0.25, config=replace(
                default_config(16, BS, 2), bwd_block_n=32)),
             "bwd_block_n=32: expected a power of two >= 16 dividing the block size 16")):
        try:
            call()
        except ValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"{needle}: not refused")
    with FakeTensorMode():
        t, nh, hn = 64, 4, 16
        fq, fk = torch.empty(t, nh, hn), torch.empty(t, 2, hn)
        ints = torch.empty(2, 5, dtype=torch.int32)
        idx = torch.empty(2, 5, 3, dtype=torch.int32)
        blk = torch.empty(5, dtype=torch.int32)
        cfg = list(astuple(default_config(hn, BS, 2)))
        out, lse = torch.ops.sparsebalance.sparse_attn_fwd(
            fq, fk, fk, ints, idx, ints, idx, blk, blk, BS, 0.25, False, cfg)
        # lse over the 5 blocks' slots, out in the tokens' own space
        assert out.shape == (t, nh, hn) and lse.shape == (nh, 5 * BS) and lse.dtype == torch.float32


def check_overflow_checks_are_dead():
    """The premise of ``tests/unit/_interpreter.py``: with its overflow checks computed, the
    interpreter lets an int32 overflow in a kernel pass unless ``debug`` is set (then it
    raises); the worker skips the computation."""
    from dataclasses import replace

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def _times(x_ptr, y_ptr, out_ptr):
        tl.store(out_ptr, tl.load(x_ptr) * tl.load(y_ptr))      # int32 * int32

    builder = interpreter.interpreter_builder
    saved = builder.options
    assert not saved.sanitize_overflow and not saved.debug
    x, y = (torch.tensor([v], dtype=torch.int32) for v in (2 ** 30, 4))
    raised = {}
    try:
        for debug in (False, True):
            builder.options = replace(saved, sanitize_overflow=True, debug=debug)
            try:
                _times[(1,)](x, y, torch.empty_like(x))
                raised[debug] = ""
            except Exception as e:      # the interpreter wraps the kernel's AssertionError
                raised[debug] = f"{e!r} {e.__cause__!r}"
    finally:
        builder.options = saved
    assert raised[False] == "" and "int32 overflow detected" in raised[True], raised


def _odd(x):
    """``x``'s values as a contiguous view one element into a fresh buffer (differentiable):
    ``.contiguous()`` returns it uncopied and its data pointer is not 16-byte aligned."""
    y = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)
    assert y.is_contiguous() and y.contiguous().data_ptr() == y.data_ptr()
    assert y.data_ptr() % 16 != 0
    return y


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("density,sink,local,mode,scan_block", [
    (0.5, 1, 1, "density", None),
    ([1.0, 0.25, 0.125, 0.5], 2, 0, "mass", None),
    # the scans in steps of 2 and 1 blocks (as at the target shapes, where a step holds a few
    # of a document's blocks)
    (0.5, 1, 1, "density", 2),
    ([1.0, 0.25, 0.125, 0.5], 2, 0, "mass", 1),
])
def test_list_builder_equals_a_torch_construction(interp, density, sink, local, mode,
                                                  scan_block):
    interp("check_lists", density=density, sink_blocks=sink, local_blocks=local,
           selection_mode=mode, scan_block=scan_block)


@pytest.mark.parametrize("case", [
    # GQA 4:2, sink columns split over programs of 2 entries (atomic dK/dV), a padded tail
    dict(nh=4, ng=2, hn=16, density=0.5, sink_blocks=1, local_blocks=1, kv_chunk=2),
    # np = ng, head dim 32, per-document densities 1 / 0.25 / 0.125 / 0.5, two sinks, the API
    dict(nh=2, ng=2, hn=32, density=[1.0, 0.25, 0.125, 0.5], sink_blocks=2, local_blocks=0),
    # 3 query heads per group (a stacked tile with masked rows), no sink, mass selection
    dict(nh=6, ng=2, hn=16, density=0.25, sink_blocks=0, local_blocks=2,
         selection_mode="mass", kv_chunk=3),
    # half precision through the API (bfloat16 is left to tests/gpu: the interpreter's tl.dot
    # mishandles bfloat16 operands in triton 3.7)
    dict(nh=4, ng=2, hn=32, density=0.25, sink_blocks=1, local_blocks=0, dtype="float16",
         tol=3e-3),
    # the unpadded token space (short last blocks read and written in place, no padded copy),
    # GQA 7, the sink column split (atomic dK/dV and dQ from several programs), row tiles of
    # 32 stacked rows spanning two heads
    dict(nh=7, ng=1, hn=16, density=0.5, sink_blocks=1, local_blocks=1, kv_chunk=2,
         tokens=True, config=dict(bwd_block_m=32, fwd_block_m=32)),
    # the unpadded token space in half precision, GQA 3, row tiles of one head each
    dict(nh=6, ng=2, hn=32, density=0.25, sink_blocks=1, local_blocks=0, dtype="float16",
         tol=3e-3, kv_chunk=4, tokens=True, config=dict(bwd_block_m=16, fwd_block_m=16)),
    # block 32 with dK/dV in two key sub-tiles of 16 per block (each adds its own dQ share),
    # the padded space and its tail, 64-row tiles over two heads
    dict(nh=4, ng=2, hn=16, density=0.5, sink_blocks=1, local_blocks=0, kv_chunk=2, bs=32,
         config=dict(bwd_block_n=16, bwd_block_m=64)),
    # the target shapes' default configs (the compile gate's "default" rows: 8/2/128 and 14/2/64
    # at block 128, 8/2/128 at block 64), their tiles at head dim 32; split sink columns. The
    # tiles follow the query heads per group (4, 7), which stay; at block 128 one KV group of
    # them (the group's offsets are the block-64 case's and every case above's)
    dict(nh=4, ng=1, hn=32, density=0.25, sink_blocks=1, local_blocks=0, kv_chunk=2,
         tokens=True, bs=128, cu=CU_128, tiles_of=[128, 128, 4]),
    dict(nh=7, ng=1, hn=32, density=0.25, sink_blocks=1, local_blocks=0, kv_chunk=2,
         tokens=True, bs=128, cu=CU_128, tiles_of=[64, 128, 7], dtype="float16", tol=3e-3),
    dict(nh=8, ng=2, hn=32, density=0.25, sink_blocks=1, local_blocks=0, kv_chunk=2,
         tokens=True, bs=64, cu=CU_128, tiles_of=[128, 64, 4]),
    # the split backward (dQ in a kernel of its own over the forward's lists, dK/dV without
    # it): the padded space and its tail, GQA 3 (masked stacked rows), dQ tiles of 32 rows
    # spanning two heads and the padding slots' dQ = 0; then the unpadded tokens in half
    # precision, GQA 7, the sink column split, dQ tiles of 16 rows
    dict(nh=6, ng=2, hn=16, density=0.5, sink_blocks=1, local_blocks=1, kv_chunk=2,
         config=dict(dq_block_m=32, bwd_block_m=32)),
    dict(nh=7, ng=1, hn=32, density=[1.0, 0.25, 0.125, 0.5], sink_blocks=1, local_blocks=0,
         kv_chunk=2, tokens=True, dtype="float16", tol=3e-3,
         config=dict(dq_block_m=16, bwd_block_m=16)),
], ids=["gqa-split-tail", "mha-per-doc-api", "rep3-nosink-mass", "fp16-api", "tokens-rep7",
        "tokens-fp16-rep3", "block32-key-subtiles", "default-tiles-8-2-128-b128",
        "default-tiles-14-2-64-b128-fp16", "default-tiles-8-2-128-b64", "split-dq-padded-rep3",
        "split-dq-tokens-fp16-rep7"])
def test_forward_and_backward_equal_the_reference(interp, case):
    interp("check_attention", **case)


@pytest.mark.slow
@pytest.mark.parametrize("nh,hn,bs,dtype,tol", [(8, 128, 128, "float32", 1e-4),
                                                 (14, 64, 128, "float16", 3e-3),
                                                 (8, 128, 64, "float32", 1e-4)],
                         ids=["8-2-128-b128", "14-2-64-b128-fp16", "8-2-128-b64"])
def test_target_shapes_default_configs_equal_the_reference(interp, nh, hn, bs, dtype, tol):
    """The larger form of the ``default-tiles-*`` cases: the target shapes themselves."""
    interp("check_attention", nh=nh, ng=2, hn=hn, density=0.25, sink_blocks=1, local_blocks=0,
           kv_chunk=2, tokens=True, bs=bs, cu=CU_128, dtype=dtype, tol=tol)


def test_aligned_copies_only_what_needs_it():
    from sparsebalance_megatron.attention.sparse_triton import aligned
    x = torch.randn(6, 4, 16)
    assert aligned(x) is x or aligned(x).data_ptr() == x.data_ptr()
    y = _odd(x)
    z = aligned(y)
    assert z.data_ptr() % 16 == 0 and z.data_ptr() != y.data_ptr() and torch.equal(z, x)
    t = x.transpose(0, 1)                  # not contiguous: copied by .contiguous() already
    assert aligned(t).is_contiguous() and aligned(t).data_ptr() % 16 == 0


def test_the_interpreters_overflow_checks_are_dead_work(interp):
    interp("check_overflow_checks_are_dead")


def test_a_wrong_list_is_caught(interp):
    interp("check_broken_lists_fail")


@pytest.mark.reliability(area="attention", case="the triton kernels given tokens of another "
                         "layout, or a launch config they cannot take", expect="ValueError "
                         "naming the value and what was expected, before any launch")
def test_refusals_name_the_value_and_the_op_has_a_fake(interp):
    interp("check_refusals_and_fake_op")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(),
                    reason="the interpreter or a GPU is there")
def test_backend_without_cuda_or_interpreter_says_why():
    from sparsebalance_megatron.attention import block_sparse_attention
    q, k, v, _ = _inputs(4, 2, 16, seed=5)
    with pytest.raises(ValueError, match=r"backend='triton': it needs a CUDA device \(q is on "
                                         r"cpu; TRITON_INTERPRET=1 runs it"):
        block_sparse_attention(q, k, v, CU, 0.5, block_size=BS, backend="triton")


def _loop_dots(fn):
    """``tl.dot`` calls inside the ``for`` loops of a function's AST, and in all of it."""
    import ast
    def dots(node):
        return sum(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                   and c.func.attr == "dot" for c in ast.walk(node))
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For)]
    return sum(dots(loop) for loop in loops), dots(fn)


def test_kernels_do_the_gemms_the_work_model_counts():
    """The backward is one pass of 5 GEMMs per kept tile (dQ inside the dK/dV loop), the
    forward 2: counted in the kernels' source, as the kernel module declares and the work model
    prices them. The split (a launch config's ``dq_block_m``) turns the loop's dQ GEMM off
    (``ONE_PASS``) and recomputes S and dP in ``dq_kernel``: 4 + 3 = 7, the work model's
    separate-dQ count. No other backward kernel has a GEMM."""
    import ast

    from sparsebalance_megatron.attention import work_model
    src = Path(__file__).parents[2] / "sparsebalance_megatron/attention/sparse_triton_kernels.py"
    tree = ast.parse(src.read_text())
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    declared = ast.literal_eval(next(
        n.value for n in tree.body if isinstance(n, ast.Assign)
        and getattr(n.targets[0], "id", "") == "GEMMS_PER_TILE"))
    assert declared == {"fwd_kernel": 2, "dkv_kernel": 5, "dq_kernel": 3}
    assert work_model.GEMMS_PER_TILE == {"fwd": declared["fwd_kernel"],
                                         "bwd": declared["dkv_kernel"]}
    assert _loop_dots(fns["fwd_kernel"])[0] == 2
    assert _loop_dots(fns["dkv_kernel"]) == (5, 5)          # all of them in its one loop
    one_pass_only = [n for n in ast.walk(fns["dkv_kernel"]) if isinstance(n, ast.If)
                     and getattr(n.test, "id", "") == "ONE_PASS"]
    assert len(one_pass_only) == 1 and _loop_dots(one_pass_only[0])[1] == 1
    assert _loop_dots(fns["dq_kernel"]) == (3, 6)           # the list loop, then the diagonal
    assert 5 - 1 + declared["dq_kernel"] == work_model.GEMMS_PER_TILE_SEPARATE_DQ["bwd"]
    bwd = [name for name in fns if name.startswith(("bwd_", "dkv_", "dq_"))]
    assert sorted(bwd) == ["bwd_post_kernel", "bwd_pre_kernel", "dkv_kernel", "dq_kernel"]
    assert sum(_loop_dots(fns[name])[1] for name in bwd) == 5 + 6
    # fwd+bwd: 7 GEMMs per tile where a separate dQ pass made it 9
    new = work_model.attention_flops(1000, 8, 128, 128)
    old = work_model.attention_flops(1000, 8, 128, 128, one_pass_backward=False)
    assert new["bwd"] * 7 == old["bwd"] * 5 and new["total"] * 9 == old["total"] * 7
    assert new["fwd"] == 1000 * 8 * 2 * (2 * 128 ** 3)
    # dQ by atomics: 2.5 * B backward FLOPs per byte; a reduction buffer at 32K, d 0.5, 8
    # heads would hold ~8.6 GB of partials
    tiles = work_model.causal_kept_tiles(256, 0.5)
    traffic = work_model.dq_traffic(tiles, 8, 128, 128)
    assert traffic["flop_per_atomic_byte"] == 2.5 * 128
    assert 8.0e9 < traffic["buffer_memory"] < 9.0e9
    # 64-key sub-tiles (the hn-128 default): each of a block's two programs adds its own dQ
    half = work_model.dq_traffic(tiles, 8, 128, 128, key_tile=64)
    assert half["atomic"] == 2 * traffic["atomic"] and half["flop_per_atomic_byte"] == 2.5 * 64
    with pytest.raises(ValueError, match="key_tile=48"):
        work_model.dq_traffic(1, 1, 128, 128, key_tile=48)
    d = work_model.backward_designs(128, 128, key_tile=64)
    assert (d["one_pass"]["gemms"], d["split"]["gemms"]) == (5, 7)
    assert d["split"]["flops"] * 5 == d["one_pass"]["flops"] * 7
    assert d["one_pass"]["atomic_bytes"] == 2 * 4 * 128 * 128 and d["split"]["atomic_bytes"] == 0
    assert d["one_pass"]["load_bytes"] == d["split"]["load_bytes"] == 4 * 128 * 128 * 2
