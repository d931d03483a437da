"""Never two packers: Megatron-LM dev's sequence packing scheduler with the plugin's packing is
refused, in one line naming which to drop and why, at every point a launch passes (the parsed
flags, the validated arguments at ``hooks.install``, the built model's config the step reads);
with one packer (Megatron's alone, or the plugin's) nothing is refused."""

from __future__ import annotations

import types

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron import hooks
from sparsebalance_megatron.megatron.launch.checks import LaunchError, check_launch

FULL = SparseBalanceConfig(sparse_balance=True, block_size=64)


def launch_args(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, seq_length=256, micro_batch_size=1, num_layers=4,
                transformer_impl="local", distributed_backend="gloo", world_size=1)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("megatron, named", [
    (dict(sequence_packing_scheduler="dp_balanced"), "--sequence-packing-scheduler dp_balanced"),
    (dict(sequence_packing_scheduler="default_dynamic_cp"),
     "--sequence-packing-scheduler default_dynamic_cp"),
    (dict(dynamic_context_parallel=True), "--dynamic-context-parallel (it packs with Megatron's "
                                          "default_dynamic_cp scheduler)"),
    (dict(use_varlen_dataset=True), "--use-varlen-dataset (it packs with Megatron's dp_balanced "
                                    "scheduler)"),
])
@pytest.mark.parametrize("sb, ours", [
    (FULL, "--sparse-balance"),
    (SparseBalanceConfig(batching=True), "--sb-batching"),
    (SparseBalanceConfig(dst=True), "--sb-dst"),
    (SparseBalanceConfig(packing="token_balanced"), "--sb-packing token_balanced"),
    (SparseBalanceConfig(), "the plugin's entry, which always packs"),
])
def test_two_packers_are_refused(megatron, named, sb, ours):
    with pytest.raises(LaunchError) as e:
        check_launch(launch_args(**megatron), sb, plugin_data=True)
    msg = str(e.value)
    assert msg.startswith("cannot launch: ") and "\n" not in msg
    assert f"{named} with the plugin's packing ({ours}): two packers" in msg, msg
    assert f"drop {named.split(' (')[0]}" in msg and "or drop the plugin's packing" in msg


def test_one_packer_is_left_alone():
    # Megatron's alone: no plugin data path (stock, or static sparse attention beside it)
    for sb in (SparseBalanceConfig(), SparseBalanceConfig(sparse_attention=True, block_size=64)):
        check_launch(launch_args(sequence_packing_scheduler="dp_balanced"), sb, plugin_data=False)
    # the plugin's alone; SBHD validation of the varlen data set uses no scheduler
    check_launch(launch_args(sequence_packing_scheduler=None), FULL, plugin_data=True)
    check_launch(launch_args(use_varlen_dataset=True, varlen_sbhd_validation=True), FULL,
                 plugin_data=True)


def test_a_scheduler_on_the_built_models_config_is_refused():
    """The config train_step reads (a hand-wired config past the flag checks)."""
    with pytest.raises(SystemExit) as e:
        hooks._check_one_packer(types.SimpleNamespace(sequence_packing_scheduler="dp_balanced"))
    msg = str(e.value)
    assert msg.startswith("error: cannot launch: the model config's sequence_packing_scheduler "
                          "'dp_balanced' with the plugin's packing: two packers") and "\n" not in msg
    hooks._check_one_packer(types.SimpleNamespace(sequence_packing_scheduler=None))
    hooks._check_one_packer(types.SimpleNamespace())    # megatron-core without the field
