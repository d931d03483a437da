"""Device memory of every pipeline rank of a layout: what keeps the layout search on the device.

A simple, documented estimate (megatron-core 0.19's ``training/theoretical_memory_usage.py``
counts the same terms; TP = 1, no recomputation, flash/flex attention: no s^2 scores kept):

- weights, gradients and optimizer state: ``bytes_per_param`` per parameter (Megatron's 18:
  bf16 weights 2 + fp32 gradients 4 + Adam's fp32 master copy, momentum and variance 12; with
  the distributed optimizer it is ``6 + 12 / dp``) of the rank's decoder layers, plus the
  embedding on the rank holding virtual stage 0 and the LM head (its own matrix:
  ``--untie-embeddings-and-output-weights``; a tied one is counted too, as Megatron keeps a copy
  on the last stage) and the final norm on the rank holding the last virtual stage;
- activations: one decoder layer keeps ``tokens * hidden * (18 + 4 * ffn / hidden)`` bytes for
  its backward (Megatron's count, bf16; a gated MLP's third projection adds ``2 * ffn`` per
  token); the micro-batches in flight are read off the schedule itself: the peak, over the
  rank's event order (1F1B, or interleaved 1F1B for vp > 1, ``sim.pipeline``), of the layers'
  activations stored by forwards not yet freed by their backwards; the embedding's output
  (``2 * tokens * hidden``) travels with virtual stage 0's;
- logits: the LM head's rank holds one micro-batch's inputs to the output layer and the loss,
  ``logit_bytes * tokens * (hidden + vocab)`` bytes while its loss runs: 4, Megatron's count
  (fp32 logits); 6 where the bf16 logits and their fp32 copy live together, as in
  megatron-core 0.19's cross entropy (``vocab_parallel_cross_entropy`` takes ``.float()`` of
  the output layer's bf16 logits and keeps it for its backward);
- full activation recomputation (``recompute_granularity == "full"``, one layer per checkpoint):
  a layer keeps only its input (``2 * tokens * hidden``), and the rank holds one layer's whole
  activations besides while it recomputes it in the backward.

Allocator fragmentation, communication buffers and the CUDA context are not counted: give the
search a limit below the device's size (``--device-memory-gib``) to leave room for them.

Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import PipelineLayout
from .shape import ModelShape

GIB = float(1 << 30)
MEGATRON_BYTES_PER_PARAM = 18.0
"""bf16 weights + fp32 gradients + Adam (fp32 master, momentum, variance), no distributed optimizer."""


@dataclass(frozen=True)
class MemoryModel:
    """Bytes of the model's pieces: its ``ModelShape`` (from a latency table's ``model`` section)
    at ``bytes_per_param`` for weights, gradients and optimizer state."""

    shape: ModelShape
    bytes_per_param: float = MEGATRON_BYTES_PER_PARAM
    logit_bytes: float = 4.0

    @classmethod
    def from_table_model(cls, model: dict, bytes_per_param: float = MEGATRON_BYTES_PER_PARAM
                         ) -> "MemoryModel":
        try:
            return cls(ModelShape.from_table_model(model), float(bytes_per_param))
        except ValueError as e:
            raise ValueError(f"cannot estimate memory: {e}") from e

    def layer_params(self) -> int:
        """Parameters of one decoder layer: QKV and output projections, the MLP, two norms."""
        s = self.shape
        h, q = s.hidden_size, s.num_attention_heads * s.head_dim
        kv = 2 * s.num_query_groups * s.head_dim
        mlp = (3 if s.swiglu else 2) * h * s.ffn_hidden_size
        return h * (q + kv) + q * h + mlp + 2 * h

    def layer_activation_bytes(self, tokens: int) -> float:
        """Activations one decoder layer keeps for its backward, for ``tokens`` tokens."""
        h, f = self.shape.hidden_size, self.shape.ffn_hidden_size
        return tokens * (h * (18.0 + 4.0 * f / h) + (2.0 * f if self.shape.swiglu else 0.0))

    @property
    def recomputes(self) -> bool:
        return self.shape.recompute_granularity == "full"

    def rank_bytes(self, layout: PipelineLayout, tokens: int, num_microbatches: int) -> list:
        """[pp] estimated bytes of every pipeline rank (see the module docstring)."""
        from ..sim.pipeline import FWD, stage_order

        pp, vp, nv = layout.pp, layout.vp, layout.num_stages
        whole_layer = self.layer_activation_bytes(tokens)
        h, vocab = self.shape.hidden_size, self.shape.vocab_size
        per_layer_act = 2.0 * tokens * h if self.recomputes else whole_layer
        embed_act = 2.0 * tokens * h
        out = []
        for r in range(pp):
            stages = [layout.stage_of(r, c) for c in range(vp)]
            params = sum(layout.layers[v] for v in stages) * self.layer_params()
            if 0 in stages:
                params += vocab * h
            if nv - 1 in stages:
                params += vocab * h + h
            act = {c: layout.layers[stages[c]] * per_layer_act
                   + (embed_act if stages[c] == 0 else 0.0) for c in range(vp)}
            held = peak = 0.0
            for kind, _, c in stage_order(num_microbatches, pp, r, vp):
                held += act[c] if kind == FWD else -act[c]
                peak = max(peak, held)
            logits = self.logit_bytes * tokens * (h + vocab) if nv - 1 in stages else 0.0
            out.append(params * self.bytes_per_param + peak + logits
                       + (whole_layer if self.recomputes else 0.0))
        return out

    def peak_gib(self, layout: PipelineLayout, tokens: int, num_microbatches: int) -> float:
        """The fullest rank's estimate in GiB."""
        return max(self.rank_bytes(layout, tokens, num_microbatches)) / GIB
