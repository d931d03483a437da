"""``SparseCoreAttention``: budgeted block-sparse attention behind megatron-core's core-attention slot.

Meets ``CoreAttentionInterface`` / ``CoreAttentionBuilder`` of megatron-core 0.19
(``megatron/core/transformer/attention.py``): built with the keywords ``config, layer_number,
attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection`` plus ``sb_config`` and
``budget`` (a ``budget.BudgetContext``, both from the layer spec's ``params``), called as ``forward(query, key, value, attention_mask, *,
attn_mask_type, attention_bias, packed_seq_params)``.

- Packed (THD) micro-batches: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (megatron squeezes the batch
  dim; a leading ``[t, 1, ...]`` is accepted too), documents from ``packed_seq_params.cu_seqlens_q``;
  returns ``[t, np*hn]`` (megatron reshapes it to ``[t, 1, np*hn]``).
- Unpacked: q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]``, plain causal: every batch row is one
  document; ``attention_mask`` is ignored (it must be the causal mask); returns
  ``[sq, b, np*hn]``.
- Tensor parallel: ``np``/``ng`` are this rank's heads; selection is per key/value head, so TP ranks
  share nothing but the density (the plan is identical on every rank).
- Context parallel (``--cp-comm-type a2a`` only, packed input only): q/k/v hold this CP rank's
  share of every sequence in Megatron's per-document zigzag order; ``context_parallel`` gathers
  the sequence and scatters the heads (one all-to-all over ``pg_collection.cp``), the attention
  runs on whole documents for ``np / cp`` heads, and the output goes back the same way.
- Padded THD (``cu_seqlens_q_padded``, the data path's padding for CP): each sequence's padding
  is left out of the attention and gets zeros (transformer-engine's semantics).
- Pipeline parallel: nothing here depends on the stage; the budget context knows it (with the
  interleaved schedule, from the layer's global number: each model chunk is its own plan stage).

The density of a micro-batch is ``budget.density(packed_seq_params, layer_number)``: the plan's
unit for the micro-batch that ``SparsePackedSeqParams`` names, else the static ``sb_config.density``
(evaluation, unpacked input). After each forward *with grad enabled* (training forwards, and the
recomputation of activation checkpointing, which runs its first pass without grad), the
per-document kept density and estimated recall go to ``budget.record``: one record per layer and
micro-batch, detached device tensors; evaluation forwards under ``torch.no_grad()`` record nothing.
Routing: documents shorter than ``budget.dense_below_tokens`` (the latency table's measured
crossover, or ``--sb-dense-below-tokens``) run through one dense varlen call, the others through
the selection and the sparse kernel; with CP every rank holds whole documents for its heads, so
all ranks route alike. Dense documents report kept density and recall 1.0.
What depends only on the micro-batch's documents (the chosen ``cu_seqlens``, the route, the block
layout and everything derived from it) is computed by the first layer and kept in
``packed_seq_params.sb_cache``, so the other layers and the recomputed forward read nothing back
from the device (no host synchronisation in the per-layer path). The first layer itself reads
``cu_seqlens`` once (not at all where ``SparsePackedSeqParams.sb_cu_seqlens_host`` holds the data
path's host copy) and sends its tables to the device in one non-blocking upload.
Attention dropout is not applied (the sparse kernels have none); a nonzero
``config.attention_dropout`` is logged once and ignored.
Part of the megatron adapter layer; CP's collectives go through ``comm`` (TP/PP need none here).
"""

from __future__ import annotations

import logging
import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ...attention import block_sparse_attention
from ...config import SparseBalanceConfig
from .budget import BudgetContext
from .context_parallel import attend_whole_documents, cp_group_of

log = logging.getLogger(__name__)
_warned_dropout = False
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SparseCoreAttention(MegatronModule):
    """Causal block-sparse attention within documents, with a per-micro-batch density budget."""

    def __init__(self, config, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 attention_type: str = "self", cp_comm_type=None, softmax_scale=None,
                 pg_collection=None, sb_config: SparseBalanceConfig = None,
                 budget: BudgetContext = None, attention_dropout=None):
        super().__init__(config=config)
        if sb_config is None:
            raise ValueError("SparseCoreAttention needs sb_config (pass it through the layer "
                             "spec: get_sparsebalance_layer_spec(sb_config))")
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: SparseCoreAttention supports "
                             f"only causal self-attention")
        if attn_mask_type not in _CAUSAL_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type}: expected a causal mask type "
                             f"({', '.join(str(t) for t in _CAUSAL_TYPES)})")
        self.cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
        self.cp_group = cp_group_of(config, cp_comm_type, pg_collection, "SparseCoreAttention")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"window_size={config.window_size}: sliding-window attention is "
                             f"not supported by SparseCoreAttention (use local_blocks)")
        global _warned_dropout
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and not _warned_dropout:
            log.warning("attention_dropout=%s is ignored by SparseCoreAttention", dropout)
            _warned_dropout = True
        self.sb_config = sb_config
        self.budget = budget if budget is not None else BudgetContext.for_config(sb_config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        # DotProductAttention's query-key layer scaling divides and re-multiplies by the layer
        # number: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(head_dim)
        self._unpacked_key, self._unpacked_cache = None, {}

    def _attend(self, q, k, v, cu_seqlens, packed_seq_params=None, cache=None,
                reduce_shares=None):
        sb = self.sb_config
        density = self.budget.density(packed_seq_params, self.layer_number)

        def call(backend, q, k, v):   # a GPU kernel that fails falls back (backend_fallback)
            return block_sparse_attention(
                q, k, v, cu_seqlens, density,
                block_size=sb.block_size, sink_blocks=sb.sink_blocks, local_blocks=sb.local_blocks,
                selection_mode=sb.selection_mode, mass_threshold=sb.mass_threshold,
                min_density=sb.min_density, max_density=sb.max_density, estimator=sb.estimator,
                backend=backend,
                softmax_scale=self.softmax_scale, query_chunk_blocks=sb.query_chunk_blocks,
                cache=cache, reduce_shares=reduce_shares, dense_below_tokens=self.budget.dense_below_tokens, dense_kernel=sb.dense_kernel)

        out, sel = self.budget.fallback.run(self.budget, sb.attention_backend, q, k, v, call,
                                            block_size=sb.block_size,
                                            documents=len(cu_seqlens) - 1,
                                            probe=reduce_shares is None)
        if torch.is_grad_enabled():
            self.budget.record(self.layer_number, packed_seq_params, sel.density_kept, sel.recall)
        return out                                                # [t, np, hn]

    def _unpacked_setup(self, b: int, sq: int) -> dict:
        """The setup cache (layout and what derives from it) of unpacked input: it depends on
        (b, sq) and the density alone, so it is kept on the module for the next call alike (the
        recomputed forward, evaluation at one length), and replaced when either changes. One at
        a time: a cache per shape and density seen grows without bound over inputs of varying
        length, and its small long-lived tensors fragment the host heap far beyond their size
        (a 6-layer SmolLM2 cut scoring 2-4K-token samples grew ~30 MB of RSS a forward)."""
        key = (b, sq, self.budget.density(None, self.layer_number))
        if key != self._unpacked_key:
            self._unpacked_key, self._unpacked_cache = key, {}
        return self._unpacked_cache

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SparseCoreAttention (got a "
                             f"tensor of shape {tuple(attention_bias.shape)}; expected None)")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type}: expected a causal mask type")
        if packed_seq_params is not None:
            if getattr(packed_seq_params, "qkv_format", "thd") != "thd":
                raise ValueError(f"packed_seq_params.qkv_format="
                                 f"{packed_seq_params.qkv_format!r}: expected 'thd'")
            # [t, heads, hn]; megatron squeezes the batch dim, accept [t, 1, heads, hn] too
            q, k, v = (x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value))
            # per-micro-batch scratch shared by every layer (None for a plain PackedSeqParams)
            cache = getattr(packed_seq_params, "sb_cache", None)

            def attend(q_, k_, v_, cu, reduce_shares):   # whole documents, natural order
                return self._attend(q_, k_, v_, cu, packed_seq_params, cache, reduce_shares)

            out = attend_whole_documents(q, k, v, packed_seq_params, self.cp_group, attend, cache)
            return out.reshape(out.shape[0], -1)                  # [t, np*hn]
        if self.cp_size > 1:
            raise ValueError(f"context_parallel_size={self.cp_size}: SparseCoreAttention "
                             f"supports context parallelism on packed (THD) micro-batches only "
                             f"(packed_seq_params=None here)")
        # [sq, b, np, hn] -> [b*sq, np, hn], one document per batch row
        sq, b, nh, hn = query.shape
        if key.shape[0] != sq:
            raise ValueError(f"key has {key.shape[0]} positions, query {sq}: expected equal "
                             f"(self-attention without a KV cache)")
        q, k, v = (x.transpose(0, 1).reshape(b * sq, x.shape[2], hn) for x in (query, key, value))
        cu = list(range(0, (b + 1) * sq, sq))                     # host list: no device read
        out = self._attend(q, k, v, cu, cache=self._unpacked_setup(b, sq))   # [b*sq, np, hn]
        # reshape, not view: the kernels may return a non-contiguous [b*sq, np, hn] (np == ng)
        return out.reshape(b, sq, nh * hn).transpose(0, 1).contiguous()   # [sq, b, np*hn]
