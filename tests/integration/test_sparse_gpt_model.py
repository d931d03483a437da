"""SparseCoreAttention inside a tiny megatron-core GPTModel on CPU (1-process gloo group).

GQA (4 heads, 2 groups), RMSNorm, SwiGLU, RoPE; 2 layers, hidden 64. Checks: the spec swaps only
core attention; a packed THD micro-batch equals each document run alone (sparse selection is per
document); unpacked batch rows are documents; the plan's density reaches the attention and the
statistics come back; a few optimizer steps lower the loss.
"""

import copy

import pytest
import numpy as np
import torch
import torch.nn.functional as F

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.plan import BudgetPlan

pytestmark = [pytest.mark.integration,
              pytest.mark.usefixtures("megatron_single_process")]   # tests/conftest.py
VOCAB, BLOCK = 64, 16


def _sb(**kw):
    base = dict(sparse_attention=True, density=0.5, block_size=BLOCK, sink_blocks=1,
                attention_backend="torch", query_chunk_blocks=2)
    base.update(kw)
    return SparseBalanceConfig(**base)


def _model(sb, seed=0, budget=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from sparsebalance_megatron.megatron.model.spec import get_sparsebalance_layer_spec
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=96, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
                            bias_dropout_fusion=False, masked_softmax_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            persist_layer_norm=False, pipeline_model_parallel_size=1,
                            use_cpu_initialization=True)
    spec = get_sparsebalance_layer_spec(sb, normalization="RMSNorm", budget=budget)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=512, position_embedding_type="rope",
                    share_embeddings_and_output_weights=True)


def _packed(lens, **ids):
    from sparsebalance_megatron.megatron.model.budget import SparsePackedSeqParams
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    psp = SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                max_seqlen_q=max(lens), max_seqlen_kv=max(lens), **ids)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    return psp, pos


def test_spec_swaps_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    from sparsebalance_megatron.megatron.model.spec import get_sparsebalance_layer_spec
    sb = _sb()
    ours = get_sparsebalance_layer_spec(sb, normalization="RMSNorm")
    stock = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    core = ours.submodules.self_attention.submodules.core_attention
    assert core.module is SparseCoreAttention and core.params["sb_config"] is sb
    assert copy.deepcopy(ours).submodules.self_attention.submodules.core_attention.params[
        "budget"] is core.params["budget"]      # the budget context is shared, never copied
    stock.submodules.self_attention.submodules.core_attention = core
    assert repr(ours) == repr(stock)
    with pytest.raises(ValueError, match="transformer_impl='bogus'"):
        get_sparsebalance_layer_spec(sb, transformer_impl="bogus")


def test_transformer_engine_spec_needs_te_or_says_what_to_install():
    from sparsebalance_megatron.megatron.model.spec import (get_sparsebalance_layer_spec,
                                                            have_transformer_engine)
    if have_transformer_engine():
        spec = get_sparsebalance_layer_spec(_sb(), transformer_impl="transformer_engine")
        assert spec.submodules.self_attention.submodules.core_attention.params["sb_config"]
    else:
        with pytest.raises(ImportError, match="pip install 'transformer-engine"):
            get_sparsebalance_layer_spec(_sb(), transformer_impl="transformer_engine")


def test_packed_thd_equals_each_document_alone_and_records_stats():
    from sparsebalance_megatron.megatron.model.budget import BudgetContext
    budget = BudgetContext(0.3)
    model = _model(_sb(density=0.3), budget=budget).eval()
    lens = [70, 33, 150]
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    psp, pos = _packed(lens, sb_doc_ids=(11, 12, 13))
    with torch.enable_grad():  # stats are recorded for grad-enabled forwards
        packed = model(ids, pos, attention_mask=None, packed_seq_params=psp).detach()
    stats = budget.pop_stats()
    assert {s[1] for s in stats} == {(11, 12, 13)}             # the micro-batch's documents
    assert [s[2] for s in stats] == [1, 2]                     # one record per layer
    for _, _, _, density_kept, recall in stats:
        assert len(density_kept) == 3 and len(recall) == 3
        assert density_kept[2] < 0.7 and all(0 < r <= 1.0 + 1e-6 for r in recall)
    start = 0
    with torch.no_grad():
        for n in lens:
            alone = model(ids[:, start:start + n], pos[:, start:start + n], attention_mask=None)
            assert torch.allclose(packed[:, start:start + n], alone, atol=2e-5, rtol=1e-4)
            start += n
    assert budget.pop_stats() == []                            # no_grad forwards record nothing
    # unpacked batch: each row is one document
    rows = ids[:, :2 * 64].view(2, 64)
    with torch.no_grad():
        batched = model(rows, torch.arange(64).expand(2, 64), attention_mask=None)
        for r in range(2):
            alone = model(rows[r:r + 1], torch.arange(64)[None], attention_mask=None)
            assert torch.allclose(batched[r:r + 1], alone, atol=2e-5, rtol=1e-4)


def test_plan_density_reaches_the_attention():
    from sparsebalance_megatron.megatron.model.budget import BudgetContext, BudgetError
    budget = BudgetContext(1.0)
    model = _model(_sb(density=1.0, min_density=0.125), budget=budget).eval()
    ids = torch.randint(0, VOCAB, (1, 256), generator=torch.Generator().manual_seed(2))
    kept = {}
    # plan[dp 1, micro-batch m, stage 0]: this rank is DP rank 1 of 2
    densities = torch.tensor([[[1.0], [1.0]], [[0.25], [1.0]]]).numpy()
    budget.set_plan(BudgetPlan(3, densities), dp_rank=1, stage=0)
    for mb in (0, 1):
        psp, pos = _packed([256], sb_step=3, sb_microbatch=mb)
        with torch.enable_grad():
            model(ids, pos, attention_mask=None, packed_seq_params=psp)
        kept[mb] = [s[3][0] for s in budget.pop_stats()]
    assert budget.pop_served() == {(0, 0): 0.25, (1, 0): 1.0}
    assert kept[1] == [1.0, 1.0]
    assert all(0.25 <= x < 0.45 for x in kept[0])
    # evaluation micro-batches (no slot) run at the static density; a stale step is refused
    psp, pos = _packed([256])
    with torch.enable_grad():
        model(ids, pos, attention_mask=None, packed_seq_params=psp)
    assert [s[3][0] for s in budget.pop_stats()] == [1.0, 1.0] and budget.pop_served() == {}
    psp, pos = _packed([256], sb_step=2, sb_microbatch=0)
    with pytest.raises(BudgetError, match="step 2 ran under the plan of step 3"):
        model(ids, pos, attention_mask=None, packed_seq_params=psp)


def test_static_per_layer_densities_reach_each_layer():
    """Evaluation of a per-layer allocation (scripts/bench.py quality_cost): without a plan,
    each layer serves its own density; layers not named serve the default."""
    from sparsebalance_megatron.megatron.model.budget import BudgetContext, BudgetError
    budget = BudgetContext(1.0)
    model = _model(_sb(density=1.0, min_density=0.125), budget=budget).eval()
    ids = torch.randint(0, VOCAB, (1, 256), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(256).unsqueeze(0)
    for setting, want in (({2: 0.25}, {1: (1.0, 1.0), 2: (0.25, 0.45)}),
                          ({1: 0.25, 2: 1.0}, {1: (0.25, 0.45), 2: (1.0, 1.0)}),
                          (None, {1: (1.0, 1.0), 2: (1.0, 1.0)})):
        budget.set_layer_densities(setting)
        with torch.enable_grad():
            model(ids, pos, attention_mask=None)
        kept = {layer: k[0] for _, _, layer, k, _ in budget.pop_stats()}
        assert set(kept) == {1, 2}
        for layer, (lo, hi) in want.items():
            assert lo <= kept[layer] <= hi, (setting, kept)
    with pytest.raises(BudgetError, match="density 0 of layer 1: expected a number in"):
        budget.set_layer_densities({1: 0})
    with pytest.raises(BudgetError, match="layer number 0: expected an integer >= 1"):
        budget.set_layer_densities({0: 0.5})


def test_document_losses_split_the_packed_loss_by_document():
    """The loss function's per-document sums (the default sensitivity signal): each document's
    share of the packed micro-batch's masked loss, trailing padding excluded, no host sync."""
    from sparsebalance_megatron.megatron.model.loss import document_sums
    model = _model(_sb()).eval()
    lens = [100, 60, 96]                                # two documents, then padding
    psp, pos = _packed(lens, sb_doc_ids=(7, 8))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 256), generator=g)
    labels = torch.randint(0, VOCAB, (1, 256), generator=g)
    with torch.no_grad():
        losses = model(ids, pos, attention_mask=None, labels=labels,
                       packed_seq_params=psp).view(-1)
    mask = torch.ones(256)
    mask[95:100] = 0.0                                  # masked tokens count nowhere
    sums, tokens = document_sums(losses * mask, mask, psp.cu_seqlens_q, 2)
    want = torch.stack([(losses * mask)[:100].sum(), (losses * mask)[100:160].sum()])
    torch.testing.assert_close(sums, want)
    assert tokens.tolist() == [95.0, 60.0]


def test_each_model_chunk_reads_its_own_virtual_stage():
    """The interleaved schedule: a rank holds several model chunks, each its own virtual stage
    of the plan; a layer finds its stage by its global layer number."""
    from sparsebalance_megatron.megatron.model.budget import BudgetContext, BudgetError
    budget = BudgetContext(1.0)
    model = _model(_sb(density=1.0, min_density=0.125), budget=budget).eval()
    ids = torch.randint(0, VOCAB, (1, 256), generator=torch.Generator().manual_seed(3))
    # pp 2 x vp 2, one layer per virtual stage; this rank (pipeline rank 1) would hold virtual
    # stages 1 and 3: the two layers of this model stand for them
    densities = np.array([[[1.0, 0.25, 1.0, 0.5]]])
    budget.set_plan(BudgetPlan(0, densities), dp_rank=0, stage=1, layer_stages=[1, 3])
    psp, pos = _packed([256], sb_step=0, sb_microbatch=0)
    with torch.enable_grad():
        model(ids, pos, attention_mask=None, packed_seq_params=psp)
    assert budget.pop_served() == {(0, 1): 0.25, (0, 3): 0.5}
    kept = {layer: k[0] for _, _, layer, k, _ in budget.pop_stats()}
    assert 0.25 <= kept[1] < 0.45 and 0.5 <= kept[2] < 0.7
    budget.set_plan(BudgetPlan(0, densities), dp_rank=0, stage=1, layer_stages=[1])
    with pytest.raises(BudgetError, match="layer number 2: the pipeline layout has 1 decoder"):
        model(ids, pos, attention_mask=None, packed_seq_params=psp)


def test_a_few_steps_lower_the_loss_with_packed_micro_batches():
    model = _model(_sb(density=0.5), seed=3).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    lens = [96, 40, 120]
    g = torch.Generator().manual_seed(4)
    # learnable: each document repeats a short random pattern
    docs = [torch.randint(0, VOCAB, (7,), generator=g).repeat(n // 7 + 1)[:n] for n in lens]
    ids = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([d[1:], d[:1]]) for d in docs])[None]
    psp, pos = _packed(lens)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(ids, pos, attention_mask=None, labels=labels, packed_seq_params=psp).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


def test_core_attention_contract_shapes_and_errors():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, attention_dropout=0.0,
                            pipeline_model_parallel_size=1)
    sb = _sb(density=0.5)
    core = SparseCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self", cp_comm_type=None, softmax_scale=None,
                               pg_collection=None, sb_config=sb)
    g = torch.Generator().manual_seed(5)
    t = 80
    q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=50, max_seqlen_kv=50)
    want, _ = block_sparse_attention(q, k, v, cu, 0.5, block_size=BLOCK, backend="torch",
                                     query_chunk_blocks=2)
    for args in ((q, k, v), (q[:, None], k[:, None], v[:, None])):   # [t, h, hn] or [t, 1, h, hn]
        out = core(*args, None, attn_mask_type=AttnMaskType.causal, attention_bias=None,
                   packed_seq_params=psp)
        assert out.shape == (t, 64) and torch.allclose(out, want.reshape(t, 64), atol=1e-6)
    sq_b = core(q.view(40, 2, 4, 16), k.view(40, 2, 2, 16), v.view(40, 2, 2, 16), None)
    assert sq_b.shape == (40, 2, 64)
    row0, _ = block_sparse_attention(q.view(40, 2, 4, 16)[:, 0], k.view(40, 2, 2, 16)[:, 0],
                                     v.view(40, 2, 2, 16)[:, 0], [0, 40], 0.5, block_size=BLOCK)
    assert torch.allclose(sq_b[:, 0], row0.reshape(40, 64), atol=1e-6)
    with pytest.raises(ValueError, match="attention_bias"):
        core(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=psp)
    with pytest.raises(ValueError, match="attn_mask_type"):
        SparseCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask,
                            sb_config=sb)
    with pytest.raises(ValueError, match="sb_config"):
        SparseCoreAttention(config=cfg, layer_number=1)
