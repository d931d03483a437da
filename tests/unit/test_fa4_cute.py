"""The fa4 backend's block lists and its FA4 tensors, on CPU: the lists it hands FA4
(``build_block_lists``, the Triton kernel the ``triton`` backend uses too) against the
selection, FA4's forward and backward block-sparse tensors read the way its kernels read them
(the diagonal the only partial block, under the causal mask_mod; every other kept block full)
against the selection's token mask; the custom op's autograd wiring on fake tensors; the
refusals. Checks that build lists run in the ``interp`` worker (``tests/unit/conftest.py``: the
session's ``TRITON_INTERPRET=1`` process; triton decides interpretation when a kernel is
decorated).

Where flash-attn-4 imports (``flash_attn.cute``), ``test_fa4_compiles_our_lists_for_hopper``
compiles FA4's Hopper kernels without a GPU (CuTe DSL under a FakeTensorMode for sm_90, no JIT
engine) on our lists, tile sizes and GQA layout (docs/GPU.md says how to install it here)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention, build_layout
from sparsebalance_megatron.attention.fa4_cute import (
    fa4_block_sparse_attention, fa4_missing, fa4_shape_problem, fa4_sparse_tensors)
from sparsebalance_megatron.attention.kernels import token_mask, to_blocks_kv, to_blocks_q
from sparsebalance_megatron.attention.selection import select_blocks

REPO = Path(__file__).resolve().parents[2]


def _selection(cu, nh, ng, hn, bs, density, seed=0, **budget):
    """The estimator is ``pooled``: under the interpreter ``maxkey`` would run its own Triton
    kernel (seconds a selection); the lists do not depend on how the blocks were picked."""
    t = cu[-1]
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, nh, hn, generator=g), torch.randn(t, ng, hn, generator=g)
    lay = build_layout(cu, t, bs, "cpu")
    density = torch.as_tensor(density, dtype=torch.float64).expand(lay.num_docs)
    return select_blocks(to_blocks_q(lay.pad(q), ng, bs), to_blocks_kv(lay.pad(k), bs), lay,
                         density, estimator="pooled", **budget)


def _lists(sel):
    """The lists the fa4 backend hands FA4: ``(q_num, q_idx, kv_num, kv_idx)`` of
    ``build_block_lists`` (CPU tensors: under TRITON_INTERPRET=1 only)."""
    from sparsebalance_megatron.attention.block_lists import build_block_lists
    lists = build_block_lists(sel)
    return lists.q_num, lists.q_idx, lists.kv_num, lists.kv_idx


def _expand(cnt, idx, ng):
    """FA4's broadcast of a ``[1 or ng, 1, NB(, W)]`` list over the groups (its batch)."""
    return cnt.expand(ng, 1, cnt.shape[2]), idx.expand(ng, 1, *idx.shape[2:])


def _kernel_view(tensors, ng, bs, lay, transposed):
    """``[ng, t, t]`` counts of (query token, key token) pairs FA4 computes from its four
    block-sparse tensors: full blocks whole, the partial ones under the mask_mod ``kv <= q``;
    ``transposed``: the backward's lists (rows are key blocks, entries query blocks)."""
    mask_cnt, mask_idx, full_cnt, full_idx = tensors
    mask_cnt, mask_idx = _expand(mask_cnt, mask_idx, ng)
    full_cnt, full_idx = _expand(full_cnt, full_idx, ng)
    nb, p = lay.num_blocks, lay.padded_tokens
    view = torch.zeros(ng, p, p, dtype=torch.int64)
    ar = torch.arange(bs)
    for g in range(ng):
        for r in range(nb):
            for cnt, idx, partial in ((full_cnt, full_idx, False), (mask_cnt, mask_idx, True)):
                for e in idx[g, 0, r, :int(cnt[g, 0, r])].tolist():
                    i, j = (e, r) if transposed else (r, e)        # query block, key block
                    qi, kj = (i * bs + ar)[:, None], (j * bs + ar)[None, :]
                    keep = (kj <= qi) if partial else torch.ones(bs, bs, dtype=torch.bool)
                    view[g, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs] += keep.long()
    slots = lay.token_slot if lay.token_slot is not None else torch.arange(lay.num_tokens)
    return view[:, slots][:, :, slots]


CASES = [([0, 300, 301, 333, 700, 1024], 4, 2, 32, [0.3, 1.0, 0.5, 0.25, 0.6], {}),
         ([0, 2048], 6, 3, 64, 0.25, dict(sink_blocks=1, local_blocks=1)),
         ([0, 500, 1024], 2, 1, 64, 0.01, dict(sink_blocks=0)),      # diagonals only
         ([0, 700, 1024], 4, 2, 32, 0.5, dict(selection_mode="mass", mass_threshold=0.6))]


# --- checks (run in the interpreter worker) ----------------------------------------------------

@functools.lru_cache(maxsize=None)
def _case(case):
    """A case's selection and its lists, built once in the worker (two tests read them)."""
    cu, nh, ng, bs, density, budget = CASES[case]
    sel = _selection(cu, nh, ng, 16, bs, density, **budget)
    return sel, _lists(sel)


def check_lists_equal_the_selection_and_its_transpose(case):
    ng = CASES[case][2]
    sel, (q_num, q_idx, kv_num, kv_idx) = _case(case)
    lay, nb = sel.layout, sel.layout.num_blocks
    kmax = sel.kv_indices.shape[-1]
    assert q_idx.shape == (ng, nb, max(1, kmax - 1))
    assert kv_idx.shape == (ng, nb, max(1, lay.max_doc_blocks - 1))
    for x in (q_num, q_idx, kv_num, kv_idx):
        assert x.dtype == torch.int32 and x.is_contiguous()
    assert int(q_idx.min()) >= 0 and int(q_idx.max()) < nb       # unread entries in range too
    assert int(kv_idx.min()) >= 0 and int(kv_idx.max()) < nb
    kept = sel.block_mask() & ~torch.eye(nb, dtype=torch.bool)   # the diagonal is implicit
    for g in range(ng):
        for i in range(nb):
            assert q_idx[g, i, :int(q_num[g, i])].tolist() == \
                torch.nonzero(kept[g, i]).flatten().tolist()     # ascending
            assert kv_idx[g, i, :int(kv_num[g, i])].tolist() == \
                torch.nonzero(kept[g, :, i]).flatten().tolist()


def check_fa4_tensors_keep_the_selection_token_mask_each_pair_once(case):
    """Forward (per query block) and backward (per key block) tensors as FA4 reads them give
    exactly the selection's token mask over the real tokens, no pair twice: the diagonal is the
    only partial block, it is not in the full lists, and causality inside it is right for every
    real query of a document's short last block."""
    ng, bs = CASES[case][2], CASES[case][3]
    sel, (q_num, q_idx, kv_num, kv_idx) = _case(case)
    lay, nb = sel.layout, sel.layout.num_blocks
    want = token_mask(sel, ng)                                        # [ng, t, t]
    for tensors, transposed in ((fa4_sparse_tensors(q_num, q_idx), False),
                                (fa4_sparse_tensors(kv_num, kv_idx), True)):
        mask_cnt, mask_idx, full_cnt, full_idx = tensors
        assert mask_cnt.shape == (1, 1, nb) and mask_idx.shape == (1, 1, nb, 1)
        assert torch.equal(mask_cnt.flatten(), torch.ones(nb, dtype=torch.int32))
        assert torch.equal(mask_idx.flatten(), torch.arange(nb, dtype=torch.int32))
        assert full_cnt.shape == (ng, 1, nb) and full_idx.dim() == 4
        assert all(x.dtype == torch.int32 and x.stride(-1) == 1 for x in tensors)
        assert full_idx.data_ptr() == (kv_idx if transposed else q_idx).data_ptr()  # no copy
        counts = _kernel_view(tensors, ng, bs, lay, transposed)
        assert int(counts.max()) == 1
        assert torch.equal(counts == 1, want)


def check_custom_op_autograd_on_fake_tensors():
    """The op pair's fake implementations and autograd wiring: shapes of out and of the three
    gradients, without FA4 or a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    sel = _selection([0, 300, 1024], 4, 2, 16, 128, 0.5)
    lists = _lists(sel)
    t = sel.layout.padded_tokens                   # 9 blocks: the documents' own, 3 + 6
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(t, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(t, 2, 64, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        out = fa4_block_sparse_attention(q, k, v, *lists, block_size=128, softmax_scale=0.125)
        assert out.shape == q.shape and out.dtype == q.dtype
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def check_list_refusals_name_the_tensor():
    q = torch.randn(256, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(256, 2, 64, dtype=torch.bfloat16)
    sel = _selection([0, 256], 4, 2, 16, 128, 0.5)
    q_num, q_idx, kv_num, kv_idx = _lists(sel)
    with pytest.raises(ValueError, match=r"q_idx: expected a 3-D int32 tensor, got torch.int64"):
        fa4_block_sparse_attention(q, k, v, q_num, q_idx.long(), kv_num, kv_idx,
                                   block_size=128, softmax_scale=0.125)
    with pytest.raises(ValueError, match=r"kv_num has shape \(1, 2\): expected \[2, 2, ...\]"):
        fa4_block_sparse_attention(q, k, v, q_num, q_idx, kv_num[:1], kv_idx,
                                   block_size=128, softmax_scale=0.125)
    with pytest.raises(ValueError, match=r"q has 200 rows: expected a multiple of block_size"):
        fa4_block_sparse_attention(q[:200], k[:200], v[:200], q_num, q_idx, kv_num, kv_idx,
                                   block_size=128, softmax_scale=0.125)


def check_backend_hands_the_fused_lists_to_fa4():
    """The runtime path (``triton_block_sparse(kernel="fa4")``, what ``backend='fa4'`` calls)
    passes FA4 the layout's block-aligned tokens and the fused selection's four lists, equal to
    ``build_block_lists`` of the selection it returns, in the contract's order, with the
    layout's block; FA4's output comes back unpadded."""
    from sparsebalance_megatron.attention import build_layout, fa4_cute
    from sparsebalance_megatron.attention.blocks import check_density
    from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
    cu, t = [0, 300, 1024], 1024
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, 64, generator=g).half() for h in (4, 2, 2))
    lay = build_layout(cu, t, 128, "cpu")
    dens, host = check_density(0.5, lay.num_docs, "cpu")
    seen = {}

    def record(qp, kp, vp, *lists, block_size, softmax_scale):
        seen.update(rows=qp.shape[0], lists=lists, block_size=block_size,
                    softmax_scale=softmax_scale, q=qp)
        return qp * 2

    with mock.patch.object(fa4_cute, "fa4_block_sparse_attention", record):
        out, sel = triton_block_sparse(
            q, k, v, lay, dens, density_host=host, estimator="pooled", softmax_scale=0.125,
            sink_blocks=1, local_blocks=0, selection_mode="density", mass_threshold=0.9,
            min_density=0.125, max_density=1.0, kernel="fa4")
    assert seen["block_size"] == 128 and seen["softmax_scale"] == 0.125
    assert seen["rows"] == lay.num_blocks * 128 and torch.equal(seen["q"], lay.pad(q))
    for got, want in zip(seen["lists"], _lists(sel), strict=True):
        assert torch.equal(got, want)
    assert int(seen["lists"][2][0, 3]) == 5             # the second document's sink column
    assert torch.equal(out, q * 2)                      # unpadded: each token its own row


def check_fa4_takes_the_generic_selection_where_the_fused_one_cannot():
    """``backend='fa4'`` takes triton's fused selection where its tiles serve the head dim (a
    power of two), the generic selection at head dims FA4 takes and they do not (96): FA4
    gets the block-aligned tokens and ``build_block_lists`` of the selection either way."""
    from sparsebalance_megatron.attention import api, fa4_cute
    from sparsebalance_megatron.attention import sparse_triton_select as fused
    cu, t = [0, 300, 1024], 1024
    budget = dict(sink_blocks=1, local_blocks=0, selection_mode="density", mass_threshold=0.9,
                  min_density=0.125, max_density=1.0)
    for hn, want_fused in ((64, True), (96, False)):
        g = torch.Generator().manual_seed(hn)
        q, k, v = (torch.randn(t, h, hn, generator=g).half() for h in (4, 2, 2))
        seen, fused_calls = {}, []

        def record(qp, kp, vp, *lists, block_size, softmax_scale):
            seen.update(rows=qp.shape[0], lists=lists, q=qp)
            return qp * 2

        real = fused.triton_block_sparse

        def spy(*a, **kw):
            fused_calls.append(kw["kernel"])
            return real(*a, **kw)

        with mock.patch.object(fa4_cute, "fa4_block_sparse_attention", record), \
                mock.patch.object(fused, "triton_block_sparse", spy):
            out, sel = api._sparse_attention(
                q, k, v, cu, 0.5, None, num_groups=2, block_size=128, backend="fa4",
                estimator="pooled", softmax_scale=0.1, query_chunk_blocks=16,
                compile_backend=None, reduce_shares=None, budget=budget)
        assert fused_calls == (["fa4"] if want_fused else []), hn
        assert seen["rows"] == sel.layout.num_blocks * 128
        assert torch.equal(seen["q"], sel.layout.pad(q)) and torch.equal(out, q * 2)
        for got, want in zip(seen["lists"], _lists(sel), strict=True):
            assert torch.equal(got, want)


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(len(CASES)))
def test_lists_equal_the_selection_and_its_transpose(interp, case):
    interp("check_lists_equal_the_selection_and_its_transpose", case=case)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fa4_tensors_keep_the_selection_token_mask_each_pair_once(interp, case):
    interp("check_fa4_tensors_keep_the_selection_token_mask_each_pair_once", case=case)


def test_custom_op_autograd_on_fake_tensors(interp):
    interp("check_custom_op_autograd_on_fake_tensors")


def test_backend_hands_the_fused_lists_to_fa4(interp):
    interp("check_backend_hands_the_fused_lists_to_fa4")


def test_fa4_takes_the_generic_selection_where_the_fused_one_cannot(interp):
    interp("check_fa4_takes_the_generic_selection_where_the_fused_one_cannot")


def test_refusals_name_the_backend_and_value(interp):
    q = torch.randn(256, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(256, 2, 64, dtype=torch.bfloat16)
    assert fa4_missing("cpu") == "it needs a CUDA device"
    with pytest.raises(ValueError, match=r"backend='fa4': it needs a CUDA device; use backend"):
        block_sparse_attention(q, k, v, [0, 256], 0.5, block_size=128, backend="fa4")
    assert "block_size=64: expected 128" in fa4_shape_problem(torch.bfloat16, 64, 64)
    assert "head dim 96" not in str(fa4_shape_problem(torch.bfloat16, 96, 128))
    assert "head dim 192: expected a multiple of 8 up to 128" in \
        fa4_shape_problem(torch.float16, 192, 128)
    assert "dtype torch.float32" in fa4_shape_problem(torch.float32, 64, 128)
    interp("check_list_refusals_name_the_tensor")


def test_missing_cutlass_names_the_dsl_packages_folder():
    """flash-attn-4 found but not CuTe DSL's ``cutlass``: a ``pip --target`` install on
    PYTHONPATH, whose ``.pth`` file adding ``nvidia_cutlass_dsl/dsl_packages`` is not read."""
    from sparsebalance_megatron.attention import fa4_cute
    find_spec = importlib.util.find_spec

    def spec(name, *args):
        return None if name == "cutlass" else find_spec(name, *args)

    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "get_device_capability", return_value=(9, 0)), \
            mock.patch.object(fa4_cute, "have_fa4", return_value=True), \
            mock.patch.object(importlib.util, "find_spec", spec):
        why = fa4_cute.fa4_missing("cuda")
    assert "cutlass package is not importable" in why and "nvidia_cutlass_dsl/dsl_packages" in why


# --- compile-only check of FA4's Hopper kernels (needs flash_attn.cute, not a GPU) -------------

def compile_check(shapes) -> None:
    """Compile FA4's sm_90 forward and backward on our lists for each ``(np, ng, hn)``: a
    FakeTensorMode (FA4 compiles and skips the launch) and ``cute.compile`` without its JIT
    engine (which needs a CUDA driver). Run in a fresh process: the arch variables are read
    when CuTe DSL loads (and TRITON_INTERPRET=1: the lists are built on CPU). Prints the tiles
    FA4 chose for each kernel it built."""
    import cutlass.cute as cute
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn.cute import flash_bwd_sm90, flash_fwd_sm90, interface
    from sparsebalance_megatron.attention import fa4_cute

    tiles = []

    def record(init):
        def wrapped(self, *args, **kw):
            init(self, *args, **kw)
            tiles.append(f"{type(self).__name__[len('FlashAttention'):]} "
                         f"{self.tile_m}x{self.tile_n}"
                         f"{' pack_gqa' if getattr(self, 'pack_gqa', False) else ''}")
        return wrapped

    for cls in (flash_fwd_sm90.FlashAttentionForwardSm90,
                flash_bwd_sm90.FlashAttentionBackwardSm90):
        cls.__init__ = record(cls.__init__)
    compile_og = cute.compile

    class NoJit:
        def __getitem__(self, options):
            return compile_og[options]

        def __call__(self, *args, **kw):
            return compile_og(*args, no_jit_engine=True, **kw)

    interface.cute.compile = NoJit()
    sel = _selection([0, 300, 301, 1100, 2048], 2, 1, 16, 128, [0.3, 1.0, 0.5, 0.25],
                     local_blocks=1)
    t = sel.layout.padded_tokens                   # 19 blocks: 3 + 1 + 7 + 8
    for nh, ng, hn in shapes:
        lists = [x.expand(ng, *x.shape[1:]).contiguous() for x in _lists(sel)]
        with FakeTensorMode(allow_non_fake_inputs=True):
            q_num, q_idx, kv_num, kv_idx = (x.to("cuda") for x in lists)
            q = torch.empty(t, nh, hn, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.empty(t, ng, hn, dtype=torch.bfloat16, device="cuda")
                    for _ in range(2))
            out, lse = fa4_cute.forward_kernel(q, k, v, q_num, q_idx, 128, hn ** -0.5)
            assert lse.shape == (ng, nh // ng, t)
            for per_head in (False, True):       # GQA accumulated, and per query head
                fa4_cute.backward_kernel(torch.empty_like(out), q, k, v, out, lse, kv_num,
                                         kv_idx, 128, hn ** -0.5, per_head=per_head)
        print(f"compiled fwd+bwd np={nh} ng={ng} hn={hn}: {', '.join(tiles)}", flush=True)
        tiles.clear()


def test_fa4_compiles_our_lists_for_hopper():
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed (docs/GPU.md: "
                        "the FA4 wheels and PYTHONPATH for the compile-only check)")
    # FA4 takes the SM count it plans for from FLASH_ATTENTION_NUM_SMS when no GPU of the
    # target arch is there (132: H100 SXM and H200)
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a",
               FLASH_ATTENTION_NUM_SMS="132", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    code = ("from tests.unit.test_fa4_cute import compile_check; "
            "compile_check([(14, 2, 64), (32, 8, 128)])")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("compiled fwd+bwd") == 2, r.stdout


def _reference_fa4_bwd(q, k, v, out, dout, lse, *, softmax_scale, mask_mod,
                       block_sparse_tensors, dq, dk, dv):
    """FA4's ``_flash_attn_bwd`` as its GQA contract reads (q ``[B, T, Hq, d]``, k/v ``[B, T,
    Hk, d]``, query head h on KV head ``h // (Hq / Hk)``, gradients written into dq/dk/dv, dK/dV
    summed over a KV head's query heads), dense causal in float64: the lists do not matter to
    what the wrapper does around it."""
    rep = q.shape[2] // k.shape[2]
    x = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(rep, dim=2) for t in x[1:])
    s = torch.einsum("bqhd,bkhd->bhqk", x[0], kk) * softmax_scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    grads = torch.autograd.grad(o, x, dout.double())
    for dst, g in zip((dq, dk, dv), grads):
        dst.copy_(g)


def test_the_backward_per_query_head_gives_the_accumulated_gradients():
    """``bwd_per_head`` hands FA4's backward K and V repeated per query head (no GQA
    accumulation in the kernel) and sums the group's dK/dV after: the same gradients as the
    accumulated form, for 2 KV groups of 3 query heads (a reference backward in FA4's place)."""
    import types
    from sparsebalance_megatron.attention import fa4_cute
    cute = types.SimpleNamespace(jit=lambda f: f)
    modules = {"cutlass": types.SimpleNamespace(cute=cute), "cutlass.cute": cute,
               "flash_attn": types.ModuleType("flash_attn"),
               "flash_attn.cute": types.SimpleNamespace(interface=types.SimpleNamespace(
                   _flash_attn_bwd=_reference_fa4_bwd)),
               "flash_attn.cute.block_sparsity": types.SimpleNamespace(
                   BlockSparseTensorsTorch=lambda *a, block_size: (a, block_size))}
    calls = []

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape, k.shape))
        return _reference_fa4_bwd(q, k, v, *a, **kw)
    modules["flash_attn.cute"].interface._flash_attn_bwd = spy
    g = torch.Generator().manual_seed(3)
    t, ng, rep, hn = 64, 2, 3, 8
    q, dout, out = (torch.randn(t, ng * rep, hn, generator=g) for _ in range(3))
    k, v = (torch.randn(t, ng, hn, generator=g) for _ in range(2))
    lists = (torch.zeros(ng, 2, dtype=torch.int32), torch.zeros(ng, 2, 1, dtype=torch.int32))
    fa4_cute._causal_mask_mod.cache_clear()
    try:
        with mock.patch.dict(sys.modules, modules):
            acc, per_head = (fa4_cute.backward_kernel(dout, q, k, v, out, None, *lists, 32,
                                                      0.3, per_head=p) for p in (False, True))
            acc, per_head = list(acc), list(per_head)
    finally:
        fa4_cute._causal_mask_mod.cache_clear()
    # the accumulated form: one KV head per group; per head: a KV head per query head
    assert calls == [((ng, t, rep, hn), (ng, t, 1, hn)), ((ng, t, rep, hn), (ng, t, rep, hn))]
    torch.testing.assert_close(per_head[0], acc[0], rtol=0, atol=0)            # dQ as it was
    for a, b in zip(per_head[1:], acc[1:]):
        assert a.shape == (t, ng, hn)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
