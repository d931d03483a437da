"""``SparseCoreAttention`` on unpacked input ``[sq, b, np, hn]`` (no ``packed_seq_params``).

Every batch row is one causal document; at density 1.0 the output equals dense causal attention
of each row, for equal query/KV heads (the kernels may then return a non-contiguous
``[b*sq, np, hn]``) and for GQA, block-aligned and not, forward and backward.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.integration


def _core_attention(nh, ng, hn, backend, density):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    cfg = TransformerConfig(num_layers=1, hidden_size=nh * hn, num_attention_heads=nh,
                            num_query_groups=ng, kv_channels=hn, attention_dropout=0.0)
    sb = SparseBalanceConfig(density=density, block_size=16, attention_backend=backend)
    return SparseCoreAttention(cfg, 1, AttnMaskType.causal, sb_config=sb)


@pytest.mark.parametrize("nh,ng,sq", [
    pytest.param(4, 4, 64, marks=pytest.mark.reliability(
        area="attention", case="unpacked [sq, b, np, hn] input, np == ng, block-aligned sq",
        expect="runs (torch backend); density 1.0 equals dense causal attention per row")),
    (4, 4, 40), (4, 2, 64), (4, 2, 40)])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_unpacked_rows_are_causal_documents(nh, ng, sq, backend):
    hn, b = 16, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sq, b, h, hn, generator=g).requires_grad_(True) for h in (nh, ng, ng))
    out = _core_attention(nh, ng, hn, backend, 1.0)(q, k, v, None)
    assert out.shape == (sq, b, nh * hn)
    rep = nh // ng
    # [sq, b, h, hn] -> [b, h, sq, hn]
    want = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
        v.repeat_interleave(rep, 2).permute(1, 2, 0, 3), is_causal=True)
    want = want.permute(2, 0, 1, 3).reshape(sq, b, nh * hn)
    assert float((out - want).abs().max()) < 1e-5
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for got, exp in zip(grads, want_grads):
        assert float((got - exp).abs().max()) < 1e-4


def test_every_layer_runs_the_backend_the_latency_table_picked(monkeypatch):
    """``auto`` with a profiled table: the budget context carries the measured pick
    (``BudgetContext.set_backend``) and the core attention calls that kernel."""
    from sparsebalance_megatron.megatron.model import core_attention
    core = _core_attention(4, 2, 16, "auto", 0.5)
    seen = []
    real = core_attention.block_sparse_attention

    def spy(*a, **kw):
        seen.append(kw["backend"])
        return real(*a, **kw)
    monkeypatch.setattr(core_attention, "block_sparse_attention", spy)
    q, k, v = (torch.randn(32, 1, h, 16) for h in (4, 2, 2))
    core(q, k, v, None)
    core.budget.set_backend("reference")
    core(q, k, v, None)
    assert seen == ["auto", "reference"]


def test_unpacked_setup_is_kept_for_one_shape_and_density_at_a_time():
    """The module keeps the setup (layout and what derives from it) of its last (b, sq,
    density) only: a call alike reuses it, another length or density replaces it, so scoring
    inputs of many lengths and densities holds one setup, not one each (a cache per shape grew
    without bound and its small tensors fragmented the host heap)."""
    core = _core_attention(4, 2, 16, "torch", 0.5)
    g = torch.Generator().manual_seed(0)

    def run(sq):
        core(*(torch.randn(sq, 2, h, 16, generator=g) for h in (4, 2, 2)), None)
        cache = core._unpacked_cache
        layouts = [(key, lay) for key, lay in cache.items() if key[0] == "layout"]
        assert len(layouts) == 1 and layouts[0][0][1] == 2 * sq     # this shape's, alone
        dens = [key for key in layouts[0][1].memo if key[0] == "density"]
        return len(cache), layouts[0][1], dens

    entries, first, _ = run(48)
    assert run(48)[1] is first                  # the same shape again: its layout reused
    for sq in range(17, 80, 7):                 # many lengths: one setup at a time
        n, lay, dens = run(sq)
        assert n == entries and lay is not first and dens == [("density", 0.5)]
    last = run(79)[1]
    core.budget.set_layer_densities({1: 0.25})  # another density at the same shape
    n, lay, dens = run(79)
    assert n == entries and lay is not last and dens == [("density", 0.25)]
