"""HybridModel stack specs and the post-build check that no budgeted layer runs dense attention.

The swap must change the attention layers' core attention and nothing else, in Megatron's own
(transformer-engine) stack spec and in the plugin's local one; ``hooks.install`` must put the
spec where ``HybridModelBuilder`` reads it and refuse, in one line, what it cannot serve; the
check on the built model must name the first budgeted layer that is not ours. No process group
is needed here (the model-building tests are in tests/integration/test_sparse_hybrid_model.py).
"""

from __future__ import annotations

import types

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig


def _core():
    from sparsebalance_megatron.megatron.model.spec import sparse_core_attention_spec

    return sparse_core_attention_spec(SparseBalanceConfig(sparse_attention=True))


def _transformer(**kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{**dict(num_layers=4, hidden_size=64, num_attention_heads=4,
                                       num_query_groups=2, transformer_impl="local",
                                       normalization="RMSNorm",
                                       pipeline_model_parallel_size=1), **kw})


def test_swap_changes_only_the_attention_layers_core_attention():
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from sparsebalance_megatron.megatron.model.hybrid import get_hybrid_stack_local_spec
    from sparsebalance_megatron.megatron.model.spec import swap_hybrid_core_attention

    core = _core()
    for base in (hybrid_stack_spec, get_hybrid_stack_local_spec(_transformer())):
        before = repr(base)
        out = swap_hybrid_core_attention(base, core)
        att = out.submodules.attention_layer.submodules.self_attention.submodules
        assert att.core_attention is core
        assert repr(base) == before, "the base spec was modified"
        for slot in ("mamba_layer", "gdn_layer", "dsa_layer", "mla_layer", "mlp_layer",
                     "moe_layer", "mtp_block_spec"):
            assert getattr(out.submodules, slot) is getattr(base.submodules, slot), slot
        old = base.submodules.attention_layer.submodules.self_attention.submodules
        assert (att.linear_qkv, att.linear_proj) == (old.linear_qkv, old.linear_proj)
        assert out.module is base.module


def test_swap_refuses_a_spec_without_the_attention_slot():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from sparsebalance_megatron.megatron.model.spec import swap_hybrid_core_attention

    with pytest.raises(ValueError, match="no submodules.attention_layer"):
        swap_hybrid_core_attention(get_gpt_layer_local_spec(), _core())


def test_local_spec_is_free_of_transformer_engine_and_megatrons_is_not():
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.ssm.mlp_layer import MLPLayer

    from sparsebalance_megatron.megatron.model.hybrid import (LocalHybridStack,
                                                              get_hybrid_stack_local_spec,
                                                              transformer_engine_parts)

    local = get_hybrid_stack_local_spec(_transformer())
    assert transformer_engine_parts(local) == []
    assert local.module is LocalHybridStack and local.submodules.mlp_layer.module is MLPLayer
    # the MLP layer has no attention, the attention layer no MLP
    assert local.submodules.mlp_layer.submodules.self_attention.__name__ == "IdentityOp"
    assert local.submodules.attention_layer.submodules.mlp.__name__ == "IdentityOp"
    te = transformer_engine_parts(hybrid_stack_spec)
    assert "HybridStack's final norm (TENorm)" in te and len(te) >= 2


# --- hooks.install on a HybridModelConfig ------------------------------------------------------

def _args(argv):
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks

    # as pretrain_hybrid.py's parser: the launch conflicts the flags show end it at parse
    parser = hooks.extra_args_provider(None, model="hybrid")(
        add_megatron_arguments(argparse.ArgumentParser()))
    return parser.parse_args(["--seq-length", "256", *argv])


def _hybrid_cfg(spec=None, pattern="*-*-"):
    from megatron.training.models.hybrid import HybridModelConfig

    return HybridModelConfig(transformer=_transformer(), hybrid_layer_pattern=pattern,
                             vocab_size=512, hybrid_stack_spec=spec)


def test_install_puts_the_swapped_local_stack_spec_where_the_hybrid_builder_reads(monkeypatch):
    from sparsebalance_megatron.megatron import hooks
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    from sparsebalance_megatron.megatron.model.hybrid import LocalHybridStack

    monkeypatch.setattr(hooks, "_run", hooks._Integration())
    cfg = _hybrid_cfg()
    hooks.install(_args(["--hybrid-layer-pattern", "*-*-", "--sb-sparse-attention"]), cfg)
    spec = cfg.hybrid_stack_spec
    assert spec.module is LocalHybridStack
    core = spec.submodules.attention_layer.submodules.self_attention.submodules.core_attention
    assert core.module is SparseCoreAttention
    assert hooks._on_model_built in cfg.post_wrap_hooks


@pytest.mark.parametrize("argv, spec, needle", [
    (["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"],
     "te", "transformer-engine is not installed: drop --spec"),
    (["--hybrid-layer-pattern", "M*M-"], None,
     "layer kind(s) 'M' (Mamba) not supported with SparseBalance"),
    (["--hybrid-layer-pattern", "E-E-"], None, "has no attention layer ('*')"),
    (["--hybrid-layer-pattern", "*-*-", "--context-parallel-size", "2"], None,
     "--context-parallel-size 2 with a HybridModel"),
    (["--hybrid-layer-pattern", "*-*-", "--sb-batching", "--sb-stand-down", "dp_balanced"], None,
     "--sb-stand-down dp_balanced with a HybridModel"),
])
def test_install_refuses_a_hybrid_launch_in_one_line(argv, spec, needle):
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from sparsebalance_megatron.megatron import hooks

    if "--hybrid-layer-pattern" not in argv:
        argv = ["--hybrid-layer-pattern", "*-*-", *argv]
    cfg = _hybrid_cfg(hybrid_stack_spec if spec == "te" else None)
    with pytest.raises(SystemExit) as e:
        hooks.install(_args([*argv, "--sb-sparse-attention"]), cfg)
    msg = str(e.value)
    assert msg.startswith("error: cannot launch: ") and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("pattern", ["M*M*", "*-*-/*-"])
def test_install_leaves_a_stock_hybrid_run_alone(pattern):
    """Without the plugin's switches a patched pretrain_hybrid.py is stock Megatron: Mamba
    layers, MTP and the TE spec are not the plugin's business then."""
    from sparsebalance_megatron.megatron import hooks

    cfg = _hybrid_cfg(pattern=pattern)
    args = _args(["--hybrid-layer-pattern", pattern, "--num-layers", "4"])
    assert hooks.install(args, cfg) is cfg
    assert cfg.hybrid_stack_spec is None and cfg.post_wrap_hooks == []


def test_a_gpt_launch_with_a_hybrid_pattern_is_refused():
    from sparsebalance_megatron.megatron import hooks

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    with pytest.raises(SystemExit, match="--hybrid-layer-pattern '.-.-' with a GPT model"):
        hooks.install(_args(["--hybrid-layer-pattern", "*-*-", "--sb-sparse-attention"]), cfg)


# --- the check on the built model ----------------------------------------------------------------

def _fake_model(cores: list, numbers=None):
    """A wrapped model chunk (DDP -> Float16Module -> model) whose decoder layers hold ``cores``
    (None: a layer without attention, such as a HybridModel MLP layer)."""
    layers = [types.SimpleNamespace(layer_number=n,
                                    self_attention=types.SimpleNamespace(core_attention=c))
              for n, c in zip(numbers or range(1, len(cores) + 1), cores)]
    inner = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers))
    return types.SimpleNamespace(module=types.SimpleNamespace(module=inner))


def _sparse_core():
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention

    return SparseCoreAttention.__new__(SparseCoreAttention)   # an instance, no config needed


def test_check_passes_when_every_budgeted_layer_is_ours():
    from sparsebalance_megatron.megatron.model.attention_check import check_sparse_attention

    ours = _sparse_core()
    gpt = types.SimpleNamespace(pipeline_model_parallel_size=1, num_layers=2)
    assert check_sparse_attention([_fake_model([ours, ours])], gpt) == 2
    hybrid = types.SimpleNamespace(pipeline_model_parallel_size=2, num_layers=4,
                                   hybrid_layer_pattern="*-*-")
    # pipeline rank 1 holds layers 3 ('*') and 4 ('-', no attention at all)
    assert check_sparse_attention([_fake_model([ours, None], [3, 4])], hybrid, pp_rank=1) == 1


def test_check_names_the_first_budgeted_layer_that_runs_dense_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from sparsebalance_megatron.megatron.model.attention_check import check_sparse_attention
    from sparsebalance_megatron.megatron.launch.checks import LaunchError

    ours, dense = _sparse_core(), DotProductAttention.__new__(DotProductAttention)
    gpt = types.SimpleNamespace(pipeline_model_parallel_size=1, num_layers=2)
    with pytest.raises(LaunchError) as e:
        check_sparse_attention([_fake_model([ours, dense])], gpt)
    assert "GPT decoder layer 2 (model chunk 0, decoder.layers.1)" in str(e.value)
    assert "DotProductAttention, not SparseCoreAttention" in str(e.value)
    hybrid = types.SimpleNamespace(pipeline_model_parallel_size=1, num_layers=4,
                                   hybrid_layer_pattern="*-*-")
    with pytest.raises(LaunchError, match=r"attention layer \('\*'\) 3 .*decoder.layers.2"):
        check_sparse_attention([_fake_model([ours, None, dense, None])], hybrid)
    # a model whose layers the plan does not know: refused, not skipped
    with pytest.raises(LaunchError, match="holds 1 attention layer.* budgets 2"):
        check_sparse_attention([_fake_model([ours, None])], hybrid)
