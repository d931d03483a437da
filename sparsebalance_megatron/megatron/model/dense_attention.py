"""Dense causal attention over packed (THD) documents: the dense baseline on the local spec.

megatron-core's local ``DotProductAttention`` refuses packed sequences, and transformer-engine
(whose attention accepts them) is unavailable on CPU. Dense runs therefore swap in this module:
exact causal softmax attention within documents, same contract as ``DotProductAttention``, through
``attention.dense.dense_varlen_attention``: on CUDA in half precision ONE fused call over the
packed documents (``dense_kernel``, ``--sb-dense-kernel``: torch's varlen call, or cuDNN SDPA over
the documents grouped by length, a long document alone in its call as in a transformer-engine
user's THD cuDNN call), elsewhere the exact per-document SDPA loop. The documents are read on the host once per micro-batch (``sb_cache``).
Packed input goes through ``context_parallel.attend_whole_documents`` like the sparse attention's:
padded sequences (``cu_seqlens_q_padded``) leave their padding out, and with context parallelism
(``--cp-comm-type a2a``) the documents are gathered whole for this rank's heads.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ...attention.dense import dense_varlen_attention, packed_docs
from ...config import DENSE_KERNELS
from .context_parallel import attend_whole_documents, cp_group_of


class DenseVarlenCoreAttention(MegatronModule):
    """Exact causal attention that never crosses a document boundary (cu_seqlens)."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 dense_kernel="auto", **kwargs):
        super().__init__(config=config)
        if dense_kernel not in DENSE_KERNELS:
            raise ValueError(f"dense_kernel={dense_kernel!r}: expected one of "
                             f"{', '.join(DENSE_KERNELS)}")
        self.dense_kernel = dense_kernel
        self.layer_number = layer_number
        hn = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
        self.cp_group = cp_group_of(config, cp_comm_type, pg_collection,
                                    "DenseVarlenCoreAttention")

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:  # [s, b, np, hn] -> each batch row is one document
            if self.cp_group is not None:
                raise ValueError("DenseVarlenCoreAttention supports context parallelism on packed "
                                 "(THD) micro-batches only")
            s, b, np_, hn = query.shape
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
        # THD: [t, np, hn] / [t, ng, hn] (megatron squeezes the batch dim for packed input)
        q, k, v = (x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value))
        cache = getattr(packed_seq_params, "sb_cache", None)

        def attend(q_, k_, v_, cu, _):                 # whole documents, natural order
            docs = packed_docs(cu, q_.shape[0], q_.device, cache)
            return dense_varlen_attention(q_, k_, v_, docs, self.softmax_scale,
                                          kernel=self.dense_kernel)

        out = attend_whole_documents(q, k, v, packed_seq_params, self.cp_group, attend, cache)
        return out.reshape(out.shape[0], -1)
