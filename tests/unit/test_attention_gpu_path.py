"""The GPU path's contracts, checked on CPU: one compiled graph, mask sizes (host round trips:
``test_attention_host_syncs.py``).

- Compile once: the flex call compiled with Dynamo's ``eager`` backend (Dynamo's guards decide
  recompiles, whatever the backend) over micro-batches of one token count with different
  documents and densities makes one graph per grad mode.
- BlockMask: per KV group, lists sized by the kept counts, transposed lists equal to a dense
  transposition; eager flex (mask_mod only) with the fixed-length layout equals the reference.
- The Triton maxkey kernel (interpreter, CPU: the ``interp`` worker of ``tests/unit/conftest.py``)
  equals the PyTorch estimator.
"""

import sys

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention, build_layout
from sparsebalance_megatron.attention.blocks import fixed_padded_blocks


def _qkv(t, nh, ng, hn, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, hn, generator=g).requires_grad_(grad) for h in (nh, ng, ng))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_fixed_padded_length_depends_on_the_token_count_only():
    t, bs = 4096, 64
    mixes = [[t], [1000, 3096], [7] * 10 + [t - 70], [100] * 10 + [t - 1000]]
    padded = {build_layout([0, *torch.tensor(m).cumsum(0).tolist()], t, bs, "cpu",
                           fixed_length=True).padded_blocks for m in mixes}
    assert padded == {fixed_padded_blocks(t, 64, bs)} == {80}
    many = [1] * 100 + [t - 100]                      # 100 one-token documents overflow
    lay = build_layout([0, *torch.tensor(many).cumsum(0).tolist()], t, bs, "cpu", True)
    assert lay.padded_blocks >= lay.num_blocks > 80 and lay.padded_blocks % 8 == 0


def _dense_lists(num, idx, cols):
    """Dense [G, R, cols] bool from row lists."""
    g, r, k = idx.shape
    d = torch.zeros(g, r, cols, dtype=torch.bool)
    for a in range(g):
        for i in range(r):
            d[a, i, idx[a, i, :num[a, i]].long()] = True
    return d


@pytest.mark.parametrize("split", [0, 4])
def test_block_mask_is_per_kv_group_and_sized_by_the_kept_blocks(split):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention.flex import mask_tensors, split_capacity
    cu = [0, 500, 520, 1024]
    q, k, v = _qkv(1024, 6, 2, 16, seed=2, grad=False)
    _, sel = block_sparse_attention(q, k, v, cu, 0.25, block_size=32, backend="flex",
                                    compile_backend=None, sink_blocks=1)
    lay = sel.layout
    m = mask_tensors(sel, split_blocks=split)
    ng, nbp, kmax = 2, lay.padded_blocks, sel.kv_indices.shape[-1]
    nbk = nbp + split_capacity(nbp, split)          # key blocks: padded space + sink copies
    # the partial lists hold the diagonal only, but are as wide as the full lists of their side
    assert m["kv_indices"].shape == m["full_kv_indices"].shape
    assert m["q_indices"].shape == m["full_q_indices"].shape
    assert bool((m["kv_num_blocks"] <= 1).all()) and m["kv_indices"] is not m["q_indices"]
    assert m["full_kv_indices"].shape == (ng, 1, nbk, kmax - 1)       # kept count, not NB
    assert m["full_q_indices"].shape == (ng, 1, nbk, lay.max_doc_blocks - 1)
    assert kmax - 1 < lay.num_blocks // 2
    full = _dense_lists(m["full_kv_num_blocks"][:, 0], m["full_kv_indices"][:, 0], nbk)
    part = _dense_lists(m["kv_num_blocks"][:, 0], m["kv_indices"][:, 0], nbk)
    nb = lay.num_blocks
    assert not (full & part).any() and not full[:, nb:].any()
    full_q = _dense_lists(m["full_q_num_blocks"][:, 0], m["full_q_indices"][:, 0], nbk)
    assert torch.equal(full_q, full.transpose(1, 2))
    bits = m["selected_bits"]
    # the causal-only mask_mod (flash) reads no bits: none are built for it
    assert "selected_bits" not in mask_tensors(sel, split_blocks=split, with_bits=False)
    unpacked = ((bits.int()[..., None] >> torch.arange(8)) & 1).flatten(-2)[..., :nbk] == 1
    assert torch.equal(unpacked, full | part)
    kept = full | part
    if split:
        # each copy block repeats one sink's rows and serves at most `split` query blocks;
        # folded back onto its sink, the lists are the selection again
        rows = m["key_rows"]
        assert rows.shape == (nbk * 32,) and torch.equal(rows[:nbp * 32], torch.arange(nbp * 32))
        src = rows.view(nbk, 32)[:, 0] // 32
        assert torch.equal(rows.view(nbk, 32), src[:, None] * 32 + torch.arange(32))
        copies = kept[:, :, nbp:]
        assert copies.any() and int(copies.sum(1).max()) <= split
        for c in range(nbk - nbp):
            if copies[:, :, c].any():
                s0 = int(src[nbp + c])
                assert s0 in lay.doc_block_start          # a document's first block
                assert not (copies[:, :, c] & kept[:, :, s0]).any()
        assert not kept[:, nbp:].any()              # the copies' query rows stay empty
        folded = kept[:, :nbp, :nbp].clone()
        folded.index_put_((torch.arange(ng)[:, None, None], torch.arange(nbp)[None, :, None],
                           src[nbp:].view(1, 1, -1).expand(ng, nbp, -1)),
                          copies[:, :nbp], accumulate=True)
        kept = folded
    else:
        assert "key_rows" not in m
    assert torch.equal(kept[:, :nb, :nb], sel.block_mask())


@pytest.mark.parametrize("nh,ng,mode,split", [(4, 2, "density", 16), (3, 3, "mass", 16),
                                              (4, 2, "density", 2), (3, 3, "mass", 3)])
def test_flex_fixed_length_eager_equals_reference(nh, ng, mode, split):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention.flex import set_flex_tuning
    set_flex_tuning(split_blocks=split)      # 2, 3: the sink split with copies in play
    try:
        _check_flex_fixed_length_eager(nh, ng, mode)
    finally:
        set_flex_tuning()


def _check_flex_fixed_length_eager(nh, ng, mode):
    cu = [0, 100, 101, 300, 333]
    q, k, v = _qkv(333, nh, ng, 32, seed=3, grad=False)
    kw = dict(block_size=16, selection_mode=mode, local_blocks=1, mass_threshold=0.6)
    ref, sel_r = block_sparse_attention(q, k, v, cu, 0.3, backend="reference", **kw)
    out, sel_f = block_sparse_attention(q, k, v, cu, 0.3, backend="flex", compile_backend=None,
                                        **kw)
    assert sel_f.layout.padded_blocks > sel_f.layout.num_blocks          # a padded tail
    assert torch.equal(sel_f.block_mask(), sel_r.block_mask())
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("split", [16, 3])
def test_flex_compiles_one_graph_per_grad_mode_across_micro_batches(split, monkeypatch):
    pytest.importorskip("torch.nn.attention.flex_attention")
    import torch._dynamo

    from sparsebalance_megatron.attention import flex
    monkeypatch.setitem(flex._TUNING, "split_blocks", split)   # 3: copies in most mixes
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    t, gen = 512, torch.Generator().manual_seed(4)
    for step in range(6):
        cuts = sorted(torch.randperm(t - 1, generator=gen)[:step % 4].add(1).tolist())
        cu = [0, *cuts, t]
        q, k, v = _qkv(t, 4, 2, 16, seed=step, grad=False)  # CPU flex refuses requires_grad
        density = [1.0, 0.5, 0.25, 0.125, 0.3, 0.7][step]
        with torch.set_grad_enabled(step % 2 == 1):       # training forward / recompute pass
            block_sparse_attention(q, k, v, cu, density, block_size=16, backend="flex",
                                   compile_backend="eager", cache={})
    assert counters["stats"]["unique_graphs"] == 2   # grad and no-grad, nothing per mix/density
    torch._dynamo.reset()


def check_triton_maxkey_kernel_equals_the_torch_estimator():
    """In the ``interp`` worker (``TRITON_INTERPRET=1``)."""
    from tests.maxkey_check import maxkey_pair
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(333, 6, 16, generator=g), torch.randn(333, 2, 16, generator=g)
    a, b, ok, lay = maxkey_pair([0, 70, 71, 200, 333], 333, 16, q, k, "cpu")
    assert torch.allclose(a[ok], b[ok], atol=1e-5), (a[ok] - b[ok]).abs().max()
    nb = lay.num_blocks
    later = (torch.arange(nb)[None, :] > torch.arange(nb)[:, None])[None, :, None, :]
    assert bool((a[later.expand_as(a)] == float("-inf")).all())


def test_triton_maxkey_kernel_equals_the_torch_estimator(interp):
    interp("check_triton_maxkey_kernel_equals_the_torch_estimator")


def test_flex_compile_failure_at_small_blocks_names_the_block_size(monkeypatch):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention import flex

    def refuse(backend):
        def fn(*a, **kw):
            raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select")
        return fn
    monkeypatch.setattr(flex, "_flex_fn", refuse)
    q, k, v = _qkv(256, 4, 2, 16, seed=6, grad=False)
    with pytest.raises(ValueError, match="block_size=64"):
        block_sparse_attention(q, k, v, [0, 256], 0.5, block_size=64, backend="flex")


def test_flash_backend_says_why_it_cannot_run(monkeypatch):
    from sparsebalance_megatron.attention import flex
    q, k, v = _qkv(256, 4, 2, 16, seed=5, grad=False)
    with pytest.raises(ValueError, match=r"backend='flash': it needs a CUDA device; use "
                                         r"backend 'flex', 'torch' or 'auto'"):
        block_sparse_attention(q, k, v, [0, 256], 0.5, block_size=32, backend="flash")
    assert flex.flash_kernel_missing("cpu") == "it needs a CUDA device"
    # a CUDA machine as the probe sees it: an Ampere GPU, then a Hopper without flash-attn-4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Hopper or newer GPU (compute capability 9.0+, this one is 8.x)" in \
        flex.flash_kernel_missing("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flex.importlib.util, "find_spec", lambda name: None)
    assert "flash-attn-4 is not installed" in flex.flash_kernel_missing("cuda")
    monkeypatch.setattr(flex.importlib.util, "find_spec", lambda name: object())
    assert flex.flash_kernel_missing("cuda") is None


@pytest.mark.parametrize("kernel,block_size", [("flash", 32), ("flash", 128), ("triton", 32)])
def test_flex_kernel_choice_reaches_flex_kernel_options(kernel, block_size, monkeypatch):
    """'flash' asks flex for its FlashAttention-4 kernel (BACKEND=FLASH) and none of the Triton
    tile options; 'triton' keeps the tiles that divide a small block. The kernel itself runs on
    the GPU only (tests/gpu)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention import flex
    seen = {}

    def fake_flex(q, k, v, **kw):
        seen.update(kw)
        return q * 1.0
    monkeypatch.setattr(flex, "_flex_fn", lambda backend: fake_flex)
    # the compiled FLASH kernel loads FlashAttention-4's interface; stand in for it here
    monkeypatch.setitem(sys.modules, flex.FLASH_MODULE, object())
    t = 2 * block_size + 7
    q, k, v = _qkv(t, 4, 2, 16, seed=6, grad=False)
    _, sel = block_sparse_attention(q, k, v, [0, t], 0.5, block_size=block_size, backend="flex",
                                    compile_backend=None)
    lay = sel.layout
    out = flex.flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel, 0.25,
                                     "inductor", kernel)
    assert out.shape == lay.pad(q).shape
    opts = seen["kernel_options"]
    if kernel == "flash":
        assert opts == {"BACKEND": "FLASH"}
    else:
        assert "BACKEND" not in opts and opts["BLOCK_M"] == block_size
    with pytest.raises(ValueError, match="kernel='flash' with compile_backend=None"):
        flex.flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel, 0.25, None, "flash")
    with pytest.raises(ValueError, match=r"kernel='cutlass': expected 'triton' or 'flash'"):
        flex.flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel, 0.25, "inductor",
                                   "cutlass")


def test_flash_backend_refuses_a_torch_that_ignored_the_option(monkeypatch):
    """A torch release without kernel_options BACKEND='FLASH' runs its Triton kernel silently;
    the flash backend notices that FlashAttention-4 was never loaded and says so."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention import flex
    monkeypatch.setattr(flex, "_flex_fn", lambda backend: lambda q, k, v, **kw: q * 1.0)
    monkeypatch.delitem(sys.modules, flex.FLASH_MODULE, raising=False)
    q, k, v = _qkv(300, 4, 2, 16, seed=7, grad=False)
    _, sel = block_sparse_attention(q, k, v, [0, 300], 0.5, block_size=128, backend="flex",
                                    compile_backend=None)
    lay = sel.layout
    with pytest.raises(RuntimeError, match=r"ran flex's Triton kernel, not FlashAttention-4 "
                                           r"\(flash_attn.cute.interface was never loaded"):
        flex.flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel, 0.25, "inductor",
                                   "flash")


def _kernel_view(bm, key_rows, p, t, token_slot):
    """What a compiled flex kernel computes from a BlockMask, as ``[ng, t, t, copies]``
    counts over the real tokens: full blocks are kept whole, mask_mod is evaluated on the
    partial blocks only, and a key slot past ``p`` is a copy of the key row ``key_rows`` names."""
    bs = bm.BLOCK_SIZE[0]
    ng, _, rows = bm.kv_num_blocks.shape
    pk = rows * bs
    view = torch.zeros(ng, pk, pk, dtype=torch.bool)
    ar = torch.arange(bs)
    for g in range(ng):
        for i in range(rows):
            for lists, nums, partial in ((bm.full_kv_indices, bm.full_kv_num_blocks, False),
                                         (bm.kv_indices, bm.kv_num_blocks, True)):
                for j in lists[g, 0, i, :int(nums[g, 0, i])].tolist():
                    q_idx, kv_idx = (i * bs + ar)[:, None], (j * bs + ar)[None, :]
                    keep = bm.mask_mod(g, 0, q_idx, kv_idx) if partial else True
                    view[g, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs] |= keep
    src = torch.arange(pk) if key_rows is None else key_rows      # key slot -> padded key row
    slot_token = torch.full((pk,), -1, dtype=torch.long)
    slot_token[token_slot] = torch.arange(t)
    counts = torch.zeros(ng, t, t, dtype=torch.int64)
    kt = slot_token[src]                                          # key slot -> real token or -1
    for g in range(ng):
        rows_q = view[g, token_slot][:, kt >= 0]                  # [t, real key slots]
        counts[g].index_add_(1, kt[kt >= 0], rows_q.long())
    return counts


@pytest.mark.parametrize("split,static", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("causal_only", [False, True])
def test_compiled_kernels_see_the_selection_with_either_mask_mod(split, static, causal_only):
    """The BlockMask as a compiled kernel reads it (lists, mask_mod on the partial blocks only,
    sink copies folded back) keeps exactly the selection's token mask for every real query, each
    key once: with the full mask_mod (the flex kernel, GPU-verified) and with causality alone
    (what the flash backend passes); with the lists at their kept width or padded to the block
    space (``dynamic_lists=False``)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention.flex import build_block_mask
    from sparsebalance_megatron.attention.kernels import token_mask
    cu = [0, 300, 301, 333, 700, 1024]
    q, k, v = _qkv(1024, 4, 2, 16, seed=8, grad=False)
    _, sel = block_sparse_attention(q, k, v, cu, torch.tensor([0.3, 1.0, 0.5, 0.25, 0.6]),
                                    block_size=32, backend="flex", compile_backend=None,
                                    sink_blocks=1, local_blocks=1)
    lay = sel.layout
    bm, key_rows = build_block_mask(sel, split_blocks=split, causal_only=causal_only,
                                    static_width=static)
    assert (key_rows is not None) == (split > 0)
    rows = bm.kv_num_blocks.shape[-1]
    widths = {x.shape[-1] for x in (bm.kv_indices, bm.full_kv_indices, bm.q_indices,
                                    bm.full_q_indices)}
    assert widths == {rows - 1} if static else rows - 1 not in widths
    slots = lay.token_slot if lay.token_slot is not None else torch.arange(lay.num_tokens)
    counts = _kernel_view(bm, key_rows, lay.padded_tokens, lay.num_tokens, slots)
    assert int(counts.max()) == 1                      # no key row reached twice (copy + sink)
    assert torch.equal(counts == 1, token_mask(sel, 2))


def test_static_list_widths_turn_off_the_dynamic_marks(monkeypatch):
    """dynamic_lists=False: the lists' widths are the block space's whatever the budget, and
    nothing is marked dynamic; the default marks the four list widths."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from sparsebalance_megatron.attention import flex
    q, k, v = _qkv(1024, 4, 2, 16, seed=9, grad=False)
    sels = [block_sparse_attention(q, k, v, [0, 1024], d, block_size=32, backend="flex",
                                   compile_backend=None)[1] for d in (0.25, 0.75)]
    marked, seen = [], []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, d: marked.append(d))
    monkeypatch.setattr(flex, "_flex_fn", lambda backend: lambda q, k, v, **kw: (
        seen.append(kw["block_mask"].full_kv_indices.shape), q * 1.0)[1])
    try:
        for dynamic in (True, False):
            flex.set_flex_tuning(dynamic_lists=dynamic)
            for sel in sels:
                lay = sel.layout
                flex.flex_attention_padded(lay.pad(q), lay.pad(k), lay.pad(v), sel, 0.25)
        with pytest.raises(ValueError, match="dynamic_lists=1: expected True or False"):
            flex.set_flex_tuning(dynamic_lists=1)
    finally:
        flex.set_flex_tuning()
    assert marked == [3] * 8                           # two calls with dynamic lists
    assert seen[0] != seen[1] and seen[2] == seen[3]   # kept widths differ; static ones do not
    assert seen[2][-1] == seen[2][-2] - 1
