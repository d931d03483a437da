"""Host round trips of the attention's per-layer path, counted on CPU (``_host_syncs.py``: the
Python calls, the aten ops below them and inside custom ops, torch.cuda's waits).

- After the micro-batch's setup (its first layer), a layer's forward and backward make none, for
  every backend that runs on a GPU: torch and flex (their kernel call stubbed for the flex
  backward), triton (selection, lists and kernels in Triton's interpreter) and fa4 (the fused
  selection and lists in the interpreter, FA4's own kernels stubbed: our wrapper around them
  runs, its GQA forms and the per-head backward included, and the generic selection a head dim
  the fused one does not take), through ``block_sparse_attention`` and ``SparseCoreAttention``.
- The setup's own: one read (``cu_seqlens`` on the device) and one upload (every table the layers
  read, ``blocks.upload``: on CUDA from pinned memory without blocking); no read where the
  data path handed the host's boundaries over (``SparsePackedSeqParams.sb_cu_seqlens_host``).
- The counter fails such a test: a round trip planted in a custom op's backward (where a
  ``TorchFunctionMode`` alone never looks) is counted.
"""

import sys
import types
from contextlib import contextmanager

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention
from tests.unit._host_syncs import HostSyncCounter

# block 16: short last blocks, a 1-token document, a 5-block one (sparse at density 0.4); few
# blocks, as the interpreter runs every program in Python
CU_16 = [0, 21, 22, 99]
CU_128 = [0, 300, 301, 813]            # block 128 (fa4's)
SETUP_FROM_TENSOR = {"reads": ["tolist"], "writes": ["aten.lift_fresh"], "waits": []}
NONE = {"reads": [], "writes": [], "waits": []}


def _qkv(t, nh, ng, hn, seed, grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, hn, generator=g).to(dtype).requires_grad_(grad)
                 for h in (nh, ng, ng))


# --- the counter ---------------------------------------------------------------------------------

def test_counter_sees_the_syncs_it_must_catch():
    x = torch.arange(6.0)
    with HostSyncCounter() as c:
        x.sum().item()
        x.tolist()
        bool(x.any())
        x[x > 2]
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]))
    assert c.reads == ["item", "tolist", "__bool__", "__getitem__[bool]", "repeat_interleave"]
    assert c.writes == ["tensor"]


@torch.library.custom_op("sb_test::reads_in_backward", mutates_args=())
def _reads_in_backward(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _planted_backward(ctx, grad):
    return grad * float(grad.sum())            # a device value read inside the backward


_reads_in_backward.register_autograd(_planted_backward)


def test_counter_sees_what_the_python_calls_hide():
    """Below the Python calls: a composite op's read, the C++ backward of boolean indexing, a
    read inside a custom op's autograd (the old function-mode counter saw none of them), a
    host array made a tensor, torch.cuda's waits; each counted once."""
    x = torch.arange(6.0, requires_grad=True)
    with HostSyncCounter() as c:
        torch.allclose(x, x)
        x[torch.tensor([True, False] * 3)].sum().backward()
        _reads_in_backward(x).sum().backward()
        torch.from_numpy(x.detach().numpy())
        torch.cuda.synchronize()
        torch.cuda.Event().synchronize()
    assert c.reads == ["aten.allclose", "__getitem__[bool]", "aten.index_put[bool]",
                       "aten._local_scalar_dense", "numpy"]
    assert c.writes == ["tensor", "aten.lift_fresh"] and c.count == 9
    assert c.waits == ["cuda.synchronize", "Event.synchronize"]
    # the Python calls alone (the counter as it was) miss both reads in the backward
    from tests.unit._host_syncs import _Calls, _State
    calls = _State()
    with _Calls(calls):
        _reads_in_backward(x).sum().backward()
        x[torch.tensor([True, False] * 3)].sum().backward()
    assert calls.reads == ["__getitem__[bool]"]


def test_counter_sees_printing_and_numpy_arrays():
    import numpy as np
    x = torch.arange(4.0)
    with HostSyncCounter() as c:
        np.asarray(x)
        f"{x[0]:.1f} {x}"
    assert c.reads == ["__array__", "__format__", "__format__"] and c.count == 3


def test_the_setup_uploads_its_tables_in_one_copy_of_aligned_views():
    from sparsebalance_megatron.attention.blocks import build_layout, doc_bounds, upload
    with HostSyncCounter() as c:
        a, b, e = upload([[1, 2, 3], range(5), []], "cpu")
    assert c.events() == dict(NONE, writes=["aten.lift_fresh"])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [0, 1, 2, 3, 4] and e.numel() == 0
    assert a.dtype == torch.int64 and a.untyped_storage().data_ptr() == \
        b.untyped_storage().data_ptr()
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    lay = build_layout(CU_16, CU_16[-1], 16, "cpu")
    blocks, tokens = doc_bounds(lay)
    assert blocks.tolist() == lay.doc_block_start and tokens.tolist() == CU_16
    lay.memo.clear()                           # a layout built elsewhere: uploaded once here
    assert doc_bounds(lay)[1].tolist() == CU_16 and doc_bounds(lay) is doc_bounds(lay)


# --- torch and flex (no interpreter) -----------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "flex", "flex-split"])
@pytest.mark.parametrize("mode", ["density", "mass"])
def test_per_layer_path_makes_no_host_syncs_after_setup(backend, mode, monkeypatch):
    if backend.startswith("flex"):
        pytest.importorskip("torch.nn.attention.flex_attention")
        from sparsebalance_megatron.attention import flex
        # flex-split: the sink split with copies in play (the 129-token document has 9 blocks)
        monkeypatch.setitem(flex._TUNING, "split_blocks", 2 if backend == "flex-split" else 16)
        backend = "flex"
        # the CPU cannot run flex backward; the kernel call itself is checked on the GPU with
        # torch.cuda.set_sync_debug_mode (tests/gpu): here, everything around it
        monkeypatch.setattr(flex, "_flex_fn", lambda backend: lambda q, k, v, **kw: q * 1.0)
    cu = torch.tensor([0, 70, 71, 200, 333])          # a tensor, as Megatron hands it over
    q, k, v = _qkv(333, 4, 2, 16, seed=0)
    cache = {}
    kw = dict(block_size=16, backend=backend, selection_mode=mode, local_blocks=1, cache=cache,
              compile_backend=None)
    block_sparse_attention(q, k, v, cu, 0.4, **kw)    # layer 1: the per-micro-batch setup
    with HostSyncCounter() as c:
        for layer in range(3):                        # the other layers, forward and backward
            out, sel = block_sparse_attention(q, k, v, cu, 0.4, **kw)
            out.sum().backward()
    assert c.reads == [] and c.writes == [] and c.waits == []
    assert sel.layout is cache[next(iter(cache))]


def _megatron_layers(backend, block_size, n=2):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.budget import BudgetContext
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    hn = 32 if backend == "fa4" else 16
    cfg = TransformerConfig(num_layers=n, hidden_size=4 * hn, num_attention_heads=4,
                            num_query_groups=2, kv_channels=hn, attention_dropout=0.0)
    sb = SparseBalanceConfig(density=0.5, block_size=block_size, attention_backend=backend)
    budget = BudgetContext(0.5)
    return [SparseCoreAttention(cfg, i + 1, AttnMaskType.causal, sb_config=sb, budget=budget)
            for i in range(n)], budget, hn


def _psp(cu, host):
    from sparsebalance_megatron.megatron.model.budget import SparsePackedSeqParams
    t = torch.tensor(cu, dtype=torch.int32)
    return SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t,
                                 max_seqlen_q=cu[-1], max_seqlen_kv=cu[-1], sb_microbatch=None,
                                 sb_cu_seqlens_host=tuple(cu) if host else None)


def check_sparse_core_attention_setup_and_layers(backend, block_size, cu, dtype=torch.float32):
    """Through Megatron's core-attention slot: the first layer is the setup (one read of the
    device ``cu_seqlens``, none with the data path's host copy; one upload), the others and
    the whole backward make no round trip. Returns the setup's events per form."""
    layers, budget, hn = _megatron_layers(backend, block_size)
    setups = {}
    for host in (False, True):
        psp = _psp(cu, host)
        q, k, v = _qkv(cu[-1], 4, 2, hn, seed=1, dtype=dtype)
        with HostSyncCounter() as first:
            x = layers[0](q, k, v, packed_seq_params=psp)      # first layer: setup
        with HostSyncCounter() as rest:
            for layer in layers[1:]:
                x = x + layer(q, k, v, packed_seq_params=psp)
            x.float().sum().backward()
        assert rest.events() == NONE, rest.events()
        setups[host] = first.events()
    assert setups == {False: SETUP_FROM_TENSOR, True: dict(SETUP_FROM_TENSOR, reads=[])}, setups
    assert len(budget.pop_stats()) == 2 * len(layers)   # one record a layer and form
    return setups


def test_sparse_core_attention_layers_share_the_micro_batch_setup():
    check_sparse_core_attention_setup_and_layers("torch", 16, [0, 90, 160])
    layers, _, _ = _megatron_layers("torch", 16)
    q, k, v = _qkv(160, 4, 2, 16, seed=1)
    # unpacked input and a plain PackedSeqParams still work
    out = layers[0](q.view(160, 1, 4, 16), k.view(160, 1, 2, 16), v.view(160, 1, 2, 16))
    assert out.shape == (160, 1, 64)


# --- triton and fa4 (the interpreter; FA4's kernels stubbed) ------------------------------------

def _fa4_interface(calls, fill=True):
    """FlashAttention-4's two entry points as FA4 fills their outputs (in place, no value read
    back; ``fill=False``: left as they are, no op at all); ``calls`` records the shapes they
    were handed."""
    def fwd(q, k, v, *, softmax_scale, mask_mod, return_lse, out, block_sparse_tensors):
        calls.append(("fwd", tuple(q.shape), tuple(k.shape)))
        if fill:
            out.copy_(q)
        lse = q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        return out, lse, None, None, None

    def bwd(q, k, v, out, dout, lse, *, softmax_scale, mask_mod, block_sparse_tensors, dq, dk,
            dv):
        calls.append(("bwd", tuple(q.shape), tuple(k.shape)))
        if fill:
            dq.copy_(dout)
            dk.zero_()
            dv.zero_()
    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


@contextmanager
def fa4_stubbed(calls=None, fill=True):
    """The ``fa4`` backend on CPU: its device check passes, FA4's kernels are stand-ins
    (``_fa4_interface``), everything of ours around them runs."""
    from sparsebalance_megatron.attention import api, fa4_cute
    cute = types.SimpleNamespace(jit=lambda f: f)
    iface = _fa4_interface([] if calls is None else calls, fill)
    stubs = {"cutlass": types.SimpleNamespace(cute=cute), "cutlass.cute": cute,
             "flash_attn": types.ModuleType("flash_attn"),
             "flash_attn.cute": types.SimpleNamespace(interface=iface),
             "flash_attn.cute.block_sparsity": types.SimpleNamespace(
                 BlockSparseTensorsTorch=lambda *a, block_size: (a, block_size))}
    saved = {k: sys.modules.get(k) for k in stubs}
    missing = api.backend_missing
    api.backend_missing = lambda b, d, **kw: None if b == "fa4" else missing(b, d, **kw)
    sys.modules.update(stubs)
    fa4_cute._causal_mask_mod.cache_clear()
    try:
        yield
    finally:
        for k, mod in saved.items():
            if mod is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = mod
        api.backend_missing = missing
        fa4_cute._causal_mask_mod.cache_clear()


def check_gpu_backend_layers(backend, hn, per_head=False, mode="density", cu_tensor=True):
    """Setup (first layer) and two more layers, forward and backward, through
    ``block_sparse_attention``: the setup's events, and none after it."""
    from sparsebalance_megatron.attention import fa4_cute
    bs, cu = (128, CU_128) if backend == "fa4" else (16, CU_16)
    dtype = torch.float16 if backend == "fa4" else torch.float32
    nh = 6 if backend == "fa4" else 4       # fa4: the per-head backward's 3 K/V copies a group
    q, k, v = _qkv(cu[-1], nh, 2, hn, seed=2, dtype=dtype)
    cu_in = torch.tensor(cu) if cu_tensor else cu
    kw = dict(block_size=bs, backend=backend, cache={}, local_blocks=1, selection_mode=mode,
              estimator="maxkey", mass_threshold=0.5, max_density=0.6)
    calls = []
    saved = fa4_cute.BWD_PER_HEAD
    fa4_cute.BWD_PER_HEAD = per_head
    try:
        with fa4_stubbed(calls):
            with HostSyncCounter() as setup:
                out, _ = block_sparse_attention(q, k, v, cu_in, 0.4, **kw)
                out.float().sum().backward()
            with HostSyncCounter() as layers:
                for _ in range(2):
                    out, sel = block_sparse_attention(q, k, v, cu_in, 0.4, **kw)
                    out.float().sum().backward()
    finally:
        fa4_cute.BWD_PER_HEAD = saved
    assert layers.events() == NONE, layers.events()
    want = SETUP_FROM_TENSOR if cu_tensor else dict(SETUP_FROM_TENSOR, reads=[])
    assert setup.events() == want, setup.events()
    if backend == "fa4":        # FA4 was called: 3 forwards, 3 backwards, GQA as configured
        rep = 3 if per_head else 1                        # K/V heads FA4 gets per group
        assert [c[0] for c in calls] == ["fwd", "bwd"] * 3
        assert calls[1][2][2] == rep and calls[0][2][2] == 1
    assert float(sel.density_kept.min()) < 1.0             # a sparse document


def check_planted_sync_in_the_backward_is_caught():
    """A ``float(t)`` planted in the fa4 wrapper's backward (inside the custom op's body, which
    the function-mode counter alone never saw) is counted once a layer: the per-layer check
    above can fail."""
    from sparsebalance_megatron.attention import fa4_cute
    real = fa4_cute.backward_kernel

    def syncing(dout, *a, **kw):
        float(dout.sum())
        return real(dout, *a, **kw)
    fa4_cute.backward_kernel = syncing
    try:
        check_gpu_backend_layers("fa4", 32)
    except AssertionError as e:
        assert str(e).startswith("{'reads': ['__float__', '__float__']"), str(e)
    else:
        raise AssertionError("a read in the backward went uncounted")
    finally:
        fa4_cute.backward_kernel = real


def check_sparse_core_attention_gpu_backends():
    check_sparse_core_attention_setup_and_layers("triton", 16, CU_16)
    with fa4_stubbed():
        check_sparse_core_attention_setup_and_layers("fa4", 128, CU_128, torch.float16)


@pytest.mark.parametrize("backend,hn,per_head,mode,cu_tensor", [
    ("triton", 16, False, "density", True),
    ("triton", 16, False, "mass", False),
    ("fa4", 32, False, "density", True),     # the fused selection and lists
    ("fa4", 32, True, "density", False),     # the backward on K/V repeated per query head
    ("fa4", 48, False, "mass", True),        # the generic selection (head dim 48)
], ids=["triton", "triton-mass-host-cu", "fa4", "fa4-per-head-host-cu", "fa4-generic-mass"])
def test_gpu_backends_make_no_host_syncs_after_setup(interp, backend, hn, per_head, mode,
                                                     cu_tensor):
    interp("check_gpu_backend_layers", backend=backend, hn=hn, per_head=per_head, mode=mode,
           cu_tensor=cu_tensor)


def test_a_sync_planted_in_the_backward_fails_the_check(interp):
    interp("check_planted_sync_in_the_backward_is_caught")


def test_sparse_core_attention_on_triton_and_fa4_syncs_in_its_setup_only(interp):
    interp("check_sparse_core_attention_gpu_backends")
