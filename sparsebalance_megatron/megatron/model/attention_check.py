"""No silent dense attention: every layer the plan budgets must run ``SparseCoreAttention``.

``hooks.install`` swaps the core attention in the spec it hands Megatron's builder; a spec set
later (a ``--spec`` read after install, ModelOpt, a custom builder or ``model_provider``) would
build Megatron's own attention, which trains dense while the log and metrics report the planned
densities. ``check_sparse_attention(model, args)`` runs on the built model (the post-wrap hook,
every rank, its own pipeline stage's layers) and refuses the launch with one line naming the
first layer that is not ours.

The layers the plan budgets come from the run's layout (``PipelineLayout.from_megatron_args``): a
GPT's every decoder layer, a HybridModel's ``*`` layers (``--hybrid-layer-pattern``), found in the
model by Megatron's global 1-based ``layer_number``. Must not touch torch.distributed.
"""

from __future__ import annotations

from typing import Iterator

from ...latency.layout import ATTENTION, PipelineLayout
from ..errors import LaunchError
from .core_attention import SparseCoreAttention


def _decoder(chunk):
    """The decoder (TransformerBlock / HybridStack) of a model chunk inside its wrappers
    (DDP, Float16Module); None for a chunk without one."""
    seen = 0
    while chunk is not None and not hasattr(chunk, "decoder") and seen < 8:
        chunk, seen = getattr(chunk, "module", None), seen + 1
    return getattr(chunk, "decoder", None)


def budgeted_layers(model: list, layout: PipelineLayout) -> Iterator[tuple]:
    """(model chunk, index in its decoder, global layer number, core attention or None) of
    every layer of ``model`` (this rank's chunks) that ``layout`` budgets."""
    for c, chunk in enumerate(model):
        decoder = _decoder(chunk)
        for i, layer in enumerate(getattr(decoder, "layers", ())):
            n = int(getattr(layer, "layer_number", 0))
            if layout.pattern is not None and not (
                    1 <= n <= len(layout.pattern) and layout.pattern[n - 1] == ATTENTION):
                continue
            attention = getattr(layer, "self_attention", None)
            yield c, i, n, getattr(attention, "core_attention", None)


def check_sparse_attention(model: list, args, pp_rank: int = 0) -> int:
    """``LaunchError`` naming the first budgeted layer whose core attention is not
    ``SparseCoreAttention``, or when this pipeline rank's chunks (``model``) hold another number
    of budgeted layers than the plan's stages of ``pp_rank``; returns that number."""
    layout = PipelineLayout.from_megatron_args(args)
    want = sum(layout.attention_layers[layout.stage_of(pp_rank, c)] for c in range(len(model)))
    seen = 0
    for c, i, n, core in budgeted_layers(model, layout):
        seen += 1
        if isinstance(core, SparseCoreAttention):
            continue
        what = "no core attention" if core is None else \
            f"{type(core).__module__}.{type(core).__name__}"
        kind = "HybridModel attention layer ('*')" if layout.pattern is not None else \
            "GPT decoder layer"
        raise LaunchError(
            f"cannot launch: {kind} {n} (model chunk {c}, decoder.layers.{i}) runs {what}, "
            f"not SparseCoreAttention: the plan budgets it, so the run would train dense "
            f"attention while reporting sparse densities (was the layer spec replaced after "
            f"hooks.install: --spec, ModelOpt, a custom model builder?)")
    if seen != want:
        raise LaunchError(f"cannot launch: pipeline rank {pp_rank} holds {seen} attention "
                          f"layer(s) with a core attention where the plan ("
                          f"{layout.describe()}) budgets {want}")
    return seen
