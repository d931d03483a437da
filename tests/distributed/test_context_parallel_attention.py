"""Context parallelism of the sparse core attention alone: CP=2 on gloo equals CP=1.

Two gloo processes (``conftest.spawn``) form the CP group. Each builds the same packed
micro-batch (documents shorter and longer than 2 x CP tokens), runs ``SparseCoreAttention`` with
CP=1 on the whole unpadded micro-batch (the reference), then with CP=2 on its share of the padded
micro-batch in Megatron's per-document zigzag order (padding filled with noise that differs per
rank), and compares outputs and q/k/v gradients at every real token, in fp32: GQA with as many
KV groups as CP ranks and with fewer (replicated KV heads, block shares averaged over the ranks
that share a group), densities that differ per micro-batch (a plan) and per document, routing
(short documents through the dense kernel, every rank alike); and the dense baseline's core
attention through the same path.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.conftest import spawn

pytestmark = pytest.mark.distributed

CP = 2
HN = 8
LENGTHS = [37, 3, 130, 1, 64, 21, 6]      # three documents shorter than 2 x CP chunks' worth
RTOL, ATOL = 1e-5, 1e-6


def _modules(nh, ng, plan, dense_below_tokens=0):
    """(CP=1 attention, CP=2 attention) sharing one budget context with ``plan`` installed."""
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.budget import BudgetContext
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention

    sb = SparseBalanceConfig(density=0.5, min_density=0.1, block_size=16,
                             attention_backend="torch")
    budget = BudgetContext(sb.density, dense_below_tokens)
    budget.set_plan(plan, dp_rank=0)
    out = []
    for cp in (1, CP):
        cfg = TransformerConfig(num_layers=1, hidden_size=nh * HN, num_attention_heads=nh,
                                num_query_groups=ng, kv_channels=HN, attention_dropout=0.0,
                                context_parallel_size=cp)
        out.append(SparseCoreAttention(cfg, 1, AttnMaskType.causal, cp_comm_type="a2a",
                                       sb_config=sb, budget=budget,
                                       pg_collection=types.SimpleNamespace(cp=dist.group.WORLD)))
    return out


def _case(rank, nh, ng, microbatch, attend=None, dense_below_tokens=0):
    """Reference (CP=1, unpadded) vs CP=2 (padded, split) on one micro-batch; asserts."""
    from sparsebalance_megatron.data.context_parallel import padded_length, zigzag_positions
    from sparsebalance_megatron.megatron.model.budget import SparsePackedSeqParams

    g = torch.Generator().manual_seed(10 * nh + ng + microbatch)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, HN, generator=g) for h in (nh, ng, ng))
    w = torch.randn(total, nh * HN, generator=g)                   # d loss / d out
    cu = torch.tensor(np.cumsum([0] + LENGTHS), dtype=torch.int32)
    padded = np.cumsum([0] + [padded_length(n, 2 * CP) for n in LENGTHS])
    real = np.concatenate([np.arange(s, s + n) for s, n in zip(padded[:-1], LENGTHS)])

    def psp(cp):
        extra = {} if cp == 1 else dict(
            cu_seqlens_q_padded=torch.tensor(padded, dtype=torch.int32),
            cu_seqlens_kv_padded=torch.tensor(padded, dtype=torch.int32), sb_cp_size=cp)
        return SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     sb_step=0, sb_microbatch=microbatch, **extra)

    noise = torch.Generator().manual_seed(1000 + rank)   # padding differs per rank: unread

    def to_padded(x):
        y = torch.randn((int(padded[-1]),) + tuple(x.shape[1:]), generator=noise)
        y[torch.from_numpy(real)] = x
        return y

    keep = torch.from_numpy(zigzag_positions(padded, CP, rank))
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    mine = [to_padded(x)[keep].requires_grad_(True) for x in (q, k, v)]
    if attend is None:
        ref_mod, cp_mod = _modules(nh, ng, _plan(), dense_below_tokens)
        ref = ref_mod(*ref_in, None, packed_seq_params=psp(1))
        out = cp_mod(*mine, None, packed_seq_params=psp(CP))
    else:
        ref = attend(*ref_in, psp(1), None).flatten(1)
        out = attend(*mine, psp(CP), _world()).flatten(1)
    (ref * w).sum().backward()
    (out * to_padded(w)[keep]).sum().backward()

    slot = {int(p): i for i, p in enumerate(keep.tolist())}       # position -> local row
    here = [j for j, p in enumerate(real.tolist()) if p in slot]   # real tokens on this rank
    local = torch.tensor([slot[int(real[j])] for j in here])
    here = torch.tensor(here)
    torch.testing.assert_close(out[local], ref[here].detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mine, ref_in):
        torch.testing.assert_close(a.grad[local], b.grad[here], rtol=RTOL, atol=ATOL)
    pad_rows = torch.tensor(sorted(set(range(keep.numel())) - set(local.tolist())))
    assert pad_rows.numel() > 0
    assert torch.count_nonzero(out[pad_rows]) == 0                 # padding: zero output
    for a in mine:                                                 # ... and no gradient
        assert torch.count_nonzero(a.grad[pad_rows]) == 0


def _plan():
    from sparsebalance_megatron.plan import BudgetPlan
    return BudgetPlan(0, np.array([[[0.25], [0.75]]]))            # [dp 1, m 2, pp 1]


def _world():
    import torch.distributed as dist
    return dist.group.WORLD


def _per_document_density(q, k, v, psp, group):
    """``attend_whole_documents`` with a density per document (the kernel's own API)."""
    from sparsebalance_megatron.attention import block_sparse_attention
    from sparsebalance_megatron.megatron.model.context_parallel import attend_whole_documents

    dens = torch.tensor([0.2, 1.0, 0.35, 0.5, 0.6, 0.9, 0.3], dtype=torch.float64)

    def attend(q_, k_, v_, cu, reduce_shares):
        return block_sparse_attention(q_, k_, v_, cu, dens, block_size=16, backend="torch",
                                      reduce_shares=reduce_shares)[0]

    return attend_whole_documents(q, k, v, psp, group, attend)


def _dense(q, k, v, psp, group):
    """The dense baseline's core attention (exact per-document SDPA) through the same path."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance_megatron.megatron.model.dense_attention import DenseVarlenCoreAttention

    nh, ng = q.shape[1], k.shape[1]
    cfg = TransformerConfig(num_layers=1, hidden_size=nh * HN, num_attention_heads=nh,
                            num_query_groups=ng, kv_channels=HN, attention_dropout=0.0,
                            context_parallel_size=1 if group is None else CP)
    module = DenseVarlenCoreAttention(cfg, 1, cp_comm_type="a2a",
                                      pg_collection=types.SimpleNamespace(cp=group))
    return module(q, k, v, None, packed_seq_params=psp)


def _worker(rank, init_file):
    import torch.distributed as dist

    # a file rendezvous: no TCP port to pick (and lose to another process) between runs
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=CP)
    try:
        torch.manual_seed(0)
        for nh, ng in ((4, 2), (4, 1)):             # ng == CP; ng < CP: KV heads replicated
            for microbatch in (0, 1):               # the plan's densities 0.25 and 0.75
                _case(rank, nh, ng, microbatch)
            _case(rank, nh, ng, 0, attend=_per_document_density)
            _case(rank, nh, ng, 1, dense_below_tokens=40)   # 130 and 64 tokens stay sparse
            _case(rank, nh, ng, 1, attend=_dense)
    finally:
        dist.destroy_process_group()


def test_cp2_equals_cp1_outputs_and_gradients(tmp_path):
    # a failed assertion in either process fails the job (its traceback in the error)
    spawn(_worker, CP, str(tmp_path / "rendezvous"), cwd=tmp_path)
