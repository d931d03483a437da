"""What a HybridModel stage costs, from a latency table of GPT layers of the same shape.

A GPT layer is an attention half (norm, QKV, core attention, output projection) and an MLP half
(norm, MLP); a HybridModel layer is one half: ``*`` (attention) or ``-`` (MLP). The profiler
measures GPT stages, so a hybrid layer's coefficients come from ONE GPT layer's
(``LatencyModel.layer_coefficients``) split in two:

- the attention-only features (``attention_work``, ``selection_work``, ``sequences``: the kept
  block pairs, the block scoring, the per-document set-up of the core attention) belong to the
  attention half alone: an MLP layer has no attention term;
- the intercept and the per-token term (the matmuls, norms and elementwise work, and in a table
  profiled at one token total the token work folded into the intercept) are split by the two
  halves' matmul FLOPs per token (``attention_share``), the dominant per-token cost.

A stage of a hybrid layout is then its kind's measured coefficients without the table's layers
of that kind (what stays is the embedding on the first stage, the LM head and loss on the last),
plus its own layers' halves. The split is an estimate, not a measurement: online calibration
corrects each rank's scale, and a table profiled on the hybrid model itself would replace it.
Layer kinds without a cost model here (Mamba, GDN, MLA, DSA, MoE) raise ``LayoutError``.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .features import MODEL_FEATURES
from .layout import ATTENTION, HYBRID_SYMBOLS, MLP, LayoutError, PipelineLayout

ATTENTION_FEATURES = ("attention_work", "selection_work", "sequences", "dense_work",
                      "sparse_calls", "dense_calls")
"""Features only an attention layer has (routed documents' dense attention and the attention
kernels' per-call costs included)."""
_ATT = [MODEL_FEATURES.index(f) for f in ATTENTION_FEATURES]
_SHARED = [j for j in range(len(MODEL_FEATURES)) if j not in _ATT]


def attention_share(model: Mapping) -> float:
    """Share of one GPT layer's matmul FLOPs per token in its attention half (QKV and output
    projection; ``model`` is a latency table's ``model`` section); the rest is the MLP's."""
    h = int(model["hidden_size"])
    nq = int(model["num_attention_heads"])
    ng = int(model.get("num_query_groups") or nq)
    hd = int(model.get("kv_channels") or h // nq)
    ffn = int(model["ffn_hidden_size"])
    attn = 2 * h * (nq + 2 * ng) * hd + 2 * nq * hd * h
    mlp = 2 * h * ffn * (3 if model.get("swiglu", True) else 2)
    return attn / (attn + mlp)


def layer_kind_coefficients(per_layer: Mapping, share: float) -> dict:
    """{``*``, ``-``: {fwd, bwd: [n_features]}}: one attention layer's and one MLP layer's
    coefficients from ONE GPT layer's ``per_layer``."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share={share!r}: expected a number in (0, 1)")
    out = {ATTENTION: {}, MLP: {}}
    for p in ("fwd", "bwd"):
        c = np.asarray(per_layer[p], dtype=np.float64)
        att, mlp = c.copy(), np.zeros_like(c)
        att[_SHARED] = share * c[_SHARED]
        mlp[_SHARED] = (1.0 - share) * c[_SHARED]
        out[ATTENTION][p], out[MLP][p] = att, mlp
    return out


def hybrid_stage_coefficients(coef: Mapping, kind_layers: Mapping, per_layer: Mapping,
                              model: Mapping, layout: PipelineLayout) -> list:
    """[{fwd, bwd}] per virtual stage of the hybrid ``layout``.

    ``coef``: the table's coefficients per stage kind; ``kind_layers``: the table's GPT layers
    on a stage of each kind; ``per_layer``: one GPT layer's coefficients; ``model``: the
    table's model section (for the FLOP split)."""
    if layout.pattern is None:
        raise LayoutError("hybrid_stage_coefficients: a GPT layout (no layer pattern)")
    unsupported = sorted(set(layout.pattern) - {ATTENTION, MLP})
    if unsupported:
        s = unsupported[0]
        raise LayoutError(f"--hybrid-layer-pattern: layer '{s}' ({HYBRID_SYMBOLS[s]}) has no "
                          f"latency model (supported: '{ATTENTION}' attention, '{MLP}' MLP)")
    parts = layer_kind_coefficients(per_layer, attention_share(model))
    out = []
    for kind, seg in zip(layout.kinds(), layout.stage_patterns()):
        c = {}
        for p in ("fwd", "bwd"):
            # the stage kind's own cost (embedding, LM head + loss) without its GPT layers
            x = np.asarray(coef[kind][p], dtype=np.float64) - \
                kind_layers[kind] * np.asarray(per_layer[p], dtype=np.float64)
            x[_ATT] = 0.0   # attention work is the attention layers' alone
            x = x + seg.count(ATTENTION) * parts[ATTENTION][p] + seg.count(MLP) * parts[MLP][p]
            x[1:] = np.maximum(x[1:], 0.0)   # fewer layers cannot make work cost negative
            c[p] = x
        out.append(c)
    return out
