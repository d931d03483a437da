"""The dense runs' core attention on the local spec (``--sb-batching`` without sparse attention):
``--sb-dense-kernel`` reaches it through the spec the launch installs, as it reaches routed
documents, so a dense + SAB run can be measured through cuDNN SDPA as well as torch's varlen
call. On CPU every kernel runs the exact loop; the fused kernels are compared on a GPU in
tests/gpu/test_dense_attention.py."""

from __future__ import annotations

import pytest
import torch

from sparsebalance_megatron.config import SparseBalanceConfig

CU = [0, 5, 16, 24]
NH, NG, HN = 4, 2, 8


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=NH * HN, num_attention_heads=NH,
                             num_query_groups=NG, kv_channels=HN, attention_dropout=0.0)


def _psp():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(CU, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=11, max_seqlen_kv=11)


def test_the_installed_spec_carries_the_flags_dense_kernel_into_every_call(monkeypatch):
    from megatron.core.transformer.spec_utils import build_module

    from sparsebalance_megatron.megatron.model import dense_attention
    from sparsebalance_megatron.megatron.model.spec import dense_core_attention_spec

    spec = dense_core_attention_spec(SparseBalanceConfig(batching=True, dense_kernel="sdpa"))
    assert spec.module is dense_attention.DenseVarlenCoreAttention
    assert spec.params == {"dense_kernel": "sdpa"}
    module = build_module(spec, config=_config(), layer_number=1)
    seen = []
    real = dense_attention.dense_varlen_attention

    def spy(*args, kernel="auto", **kw):
        seen.append(kernel)
        return real(*args, kernel=kernel, **kw)

    monkeypatch.setattr(dense_attention, "dense_varlen_attention", spy)
    torch.manual_seed(0)
    q = torch.randn(CU[-1], NH, HN)
    k, v = torch.randn(CU[-1], NG, HN), torch.randn(CU[-1], NG, HN)
    out = module(q, k, v, None, packed_seq_params=_psp())
    assert seen == ["sdpa"]
    default = build_module(dense_core_attention_spec(SparseBalanceConfig(batching=True)),
                           config=_config(), layer_number=1)
    assert default.dense_kernel == "auto"
    # on CPU both resolve to the exact loop: the same numbers
    torch.testing.assert_close(out, default(q, k, v, None, packed_seq_params=_psp()),
                               rtol=0, atol=0)


def test_a_bad_dense_kernel_names_the_value():
    from sparsebalance_megatron.megatron.model.dense_attention import DenseVarlenCoreAttention

    with pytest.raises(ValueError, match=r"dense_kernel='cudnn': expected one of auto, varlen, "
                                         r"sdpa"):
        DenseVarlenCoreAttention(_config(), 1, dense_kernel="cudnn")
    with pytest.raises(ValueError, match="expected a SparseBalanceConfig"):
        from sparsebalance_megatron.megatron.model.spec import dense_core_attention_spec
        dense_core_attention_spec({"dense_kernel": "sdpa"})
