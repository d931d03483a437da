"""Launch settings that cannot work end the launch with one line naming the flag and value,
before any process group starts (``launch.check_launch``), plus one real torchrun launch of the
training entry that must stop with that line and nothing of Megatron's set-up after it."""

from __future__ import annotations

import dataclasses
import types

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig, flag_name
from sparsebalance_megatron.megatron.launch.checks import (CPU_DEFAULTS, LaunchError, check_launch,
                                                           cpu_parser_defaults)
from tests.conftest import TINY_MODEL, run_entry

SPARSE = SparseBalanceConfig(sparse_attention=True, block_size=64)


def _case(kw: dict, sb, plugin_data: bool, needle: str):
    """One refused launch setting, marked for RELIABILITY.md: Megatron's args that differ from
    ``launch_args``'s, then the plugin's settings that differ from the defaults (flag names)."""
    base = SparseBalanceConfig()
    plugin = [flag_name(f.name) + ("" if getattr(sb, f.name) is True
                                   else f" {getattr(sb, f.name)}")
              for f in dataclasses.fields(sb) if f.name != "sparse_attention"
              and getattr(sb, f.name) != getattr(base, f.name)]
    case = ", ".join([f"{k}={v!r}" for k, v in kw.items()] + plugin
                     + ([] if plugin_data else ["Megatron's data path"]))
    return pytest.param(kw, sb, plugin_data, needle, id=case, marks=pytest.mark.reliability(
        area="launch", case=case, expect=f"refused before any process group: '{needle}'"))


FULL = SparseBalanceConfig(sparse_balance=True, block_size=64)
CP_A2A = dict(context_parallel_size=2, cp_comm_type=["a2a"], num_attention_heads=4)


def launch_args(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, seq_length=256, micro_batch_size=1, num_layers=4,
                transformer_impl="local", distributed_backend="gloo", world_size=1)
    base.update(kw)
    return types.SimpleNamespace(**base)


def refused(args, sb=SPARSE, plugin_data=True) -> str:
    with pytest.raises(LaunchError) as e:
        check_launch(args, sb, plugin_data=plugin_data)
    msg = str(e.value)
    assert msg.startswith("cannot launch: ") and "\n" not in msg
    return msg


def test_a_good_launch_passes():
    check_launch(launch_args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                 FULL, plugin_data=True)
    check_launch(launch_args(pipeline_model_parallel_size=2,            # interleaved schedule
                             num_layers_per_virtual_pipeline_stage=1), FULL, plugin_data=True)
    check_launch(launch_args(seq_length=64), SPARSE, plugin_data=True)  # exactly one block
    check_launch(launch_args(train_data_path=["a"], valid_data_path=["b"]), SPARSE,
                 plugin_data=True)                              # each split its own data
    check_launch(launch_args(seq_length=16), SparseBalanceConfig(), plugin_data=True)  # dense
    check_launch(launch_args(), SparseBalanceConfig(batching=True, dense_kernel="sdpa"),
                 plugin_data=True)                              # dense + SAB, local spec
    check_launch(launch_args(), SparseBalanceConfig(sparse_attention=True, dense_kernel="sdpa"),
                 plugin_data=False)                             # routed documents


@pytest.mark.parametrize("kw, sb, plugin_data, needle", [
    _case(dict(context_parallel_size=2), SPARSE, True, "--cp-comm-type p2p with --context-parallel-size 2: the sparse attention implements only a2a"),
    _case(dict(context_parallel_size=2, cp_comm_type=["all_gather"]), SPARSE, True, "--cp-comm-type all_gather with --context-parallel-size 2"),
    _case(dict(context_parallel_size=2, cp_comm_type=["a2a", "p2p", "a2a", "a2a"]), SPARSE, True, "--cp-comm-type p2p with"),
    _case(dict(context_parallel_size=2, cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[2, 1]), SPARSE, True, "--hierarchical-context-parallel-sizes with --context-parallel-size 2"),
    _case(dict(CP_A2A, hybrid_context_parallel=True), SPARSE, True, "--hybrid-context-parallel"),
    _case(CP_A2A, SPARSE, False, "--context-parallel-size 2 on Megatron's data path"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, attention_backend="flex"), True, "--context-parallel-size 2 with the flex attention backend"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, attention_backend="flash"), True, "--context-parallel-size 2 with the flash attention backend"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="flash"), True, "--sb-attention-backend flash: it needs a CUDA device (use flex, torch or auto on this machine)"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, attention_backend="fa4", block_size=128), True, "--context-parallel-size 2 with the fa4 attention backend"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="fa4", block_size=128), True, "--sb-attention-backend fa4: it needs a CUDA device (use flex, torch or auto on this machine)"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="fa4"), True, "--sb-attention-backend fa4 with --sb-block-size 64: expected 128 (FA4's Hopper tiles)"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, attention_backend="triton"), True, "--context-parallel-size 2 with the triton attention backend"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="triton"), True, "--sb-attention-backend triton: the Triton kernels need CUDA (use torch or auto on this machine)"),
    _case(dict(kv_channels=24), SparseBalanceConfig(sparse_attention=True, attention_backend="triton"), True, "--sb-attention-backend triton with head dim 24 (--kv-channels): expected a power of two in 16..256"),
    _case(dict(CP_A2A, num_attention_heads=6, context_parallel_size=4), SPARSE, True, "6 attention heads per tensor-parallel rank do not split over 4 CP ranks"),
    _case(dict(CP_A2A, num_attention_heads=12, group_query_attention=True, num_query_groups=3), SPARSE, True, "3 query groups per tensor-parallel rank and 2 CP ranks"),
    _case(dict(CP_A2A, seq_length=250), SPARSE, True, "--seq-length 250: expected a multiple of 4"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, seq_pad_multiple=6), True, "--sb-seq-pad-multiple 6 with --context-parallel-size 2: expected a multiple of 2 x 2"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, seq_pad_multiple=4), False, "--sb-seq-pad-multiple 4 on Megatron's data path"),
    _case(CP_A2A, SparseBalanceConfig(sparse_attention=True, microbatch_multiple=6), True, "--sb-microbatch-multiple 6: expected a multiple of 4"),
    _case(dict(tensor_model_parallel_size=4, sequence_parallel=True), SparseBalanceConfig(sparse_attention=True, microbatch_multiple=6), True, "--sb-microbatch-multiple 6: expected a multiple of 4"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, microbatch_multiple=64), False, "--sb-microbatch-multiple 64 on Megatron's data path"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="flex", microbatch_multiple=64), True, "--sb-microbatch-multiple 64 with the flex attention backend"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="flash", microbatch_multiple=64), True, "--sb-microbatch-multiple 64 with the flash attention backend"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, attention_backend="flash", block_size=128, microbatch_multiple=128), True, "--sb-microbatch-multiple 128 with the flash attention backend (each micro-batch length would compile its own kernel: add --sb-attention-backend fa4 or triton on a GPU"),
    _case(dict(cuda_graph_impl="local"), SparseBalanceConfig(sparse_attention=True, microbatch_multiple=64), True, "--sb-microbatch-multiple 64 with CUDA graphs"),
    _case(dict(), SparseBalanceConfig(sparse_attention=True, batching=True, attention_backend="flex", stand_down="dp_balanced"), True, "--sb-stand-down dp_balanced (micro-batches of their documents only) with the flex attention backend"),
    _case(dict(cuda_graph_impl="local"), SparseBalanceConfig(sparse_attention=True, batching=True, stand_down="dp_balanced"), True, "--sb-stand-down dp_balanced (micro-batches of their documents only) with CUDA graphs"),
    _case(dict(virtual_pipeline_model_parallel_size=2), SPARSE, True, "vp=2 needs pp >= 2"),
    _case(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3), FULL, True, "pipeline rank 0 holds 2 layers: not divisible by the 3 virtual stages per rank"),
    _case(dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tmL"), FULL, True, "multi-token prediction layers ('m') are not supported"),
    _case(dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tEt|ttL"), FULL, True, "the embedding 'E' must appear once, first in the first stage"),
    _case(dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=4), FULL, True, "the 0 remaining layer(s) of --num-layers=4 cannot fill the 1 other pipeline stage(s)"),
    _case(dict(micro_batch_size=2), SPARSE, True, "--micro-batch-size 2"),
    _case(dict(seq_length=16), SPARSE, True, "--seq-length 16 is smaller than --sb-block-size 64"),
    _case(dict(mock_data=True), SPARSE, True, "--mock-data"),
    _case(dict(train_data_path=["a"], split="99,1,0"), SPARSE, True, "--split 99,1,0 with --train-data-path: each split has its own data sets"),
    _case(dict(data_path=["a"], valid_data_path=["b"]), SPARSE, True, "--data-path with --valid-data-path: one data source"),
    _case(dict(data_path=["a"], data_args_path="f"), SPARSE, True, "--data-path with --data-args-path: give the data one way"),
    _case(dict(train_data_path=["a"], per_split_data_args_path="f"), SPARSE, True, "--train-data-path with --per-split-data-args-path: give the data one way"),
    _case(dict(iterations_to_skip=[3]), SPARSE, True, "--iterations-to-skip"),
    _case(dict(num_experts=8), SPARSE, False, "--num-experts 8"),
    _case(dict(spec=["my", "spec"]), SPARSE, False, "--spec"),
    _case(dict(attention_backend="AttnBackend.local"), SPARSE, False, "--attention-backend local"),
    _case(dict(reset_attention_mask=True), SPARSE, False, "--dataloader-inter-document-masking"),
    _case(dict(use_distributed_optimizer=True), SPARSE, True, "--use-distributed-optimizer on CPU"),
    _case(dict(distributed_backend="nccl"), SPARSE, True, "--distributed-backend nccl on CPU"),
    _case(dict(transformer_impl="transformer_engine"), SPARSE, True, "transformer-engine is not installed"),
    _case(dict(transformer_impl="transformer_engine"), SparseBalanceConfig(batching=True, dense_kernel="sdpa"), True, "--sb-dense-kernel sdpa with --transformer-impl transformer_engine: Transformer Engine's attention runs the dense layers"),
    _case(dict(), SparseBalanceConfig(dense_kernel="varlen"), False, "--sb-dense-kernel varlen without sparse attention or --sb-batching"),
])
def test_refused_settings_name_the_flag(kw, sb, plugin_data, needle):
    assert needle in refused(launch_args(**kw), sb, plugin_data)


@pytest.mark.parametrize("kw", [
    dict(decoder_first_pipeline_num_layers=3),
    dict(decoder_last_pipeline_num_layers=1),
    dict(pipeline_model_parallel_layout="Ettt|tL"),
    dict(account_for_loss_in_pipeline_split=True, num_layers=3),
    dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
         num_layers=2),
])
def test_uneven_pipeline_layouts_launch_with_dst_and_sab(kw):
    """Megatron's uneven splits are planned per stage (the latency model scales one layer's
    cost): they launch with the whole of SparseBalance on."""
    check_launch(launch_args(pipeline_model_parallel_size=2, **kw), FULL, plugin_data=True)


@pytest.mark.parametrize("kw", [
    CP_A2A, dict(CP_A2A, pipeline_model_parallel_size=2),
    dict(CP_A2A, group_query_attention=True, num_query_groups=1),      # KV heads replicated
    dict(CP_A2A, tensor_model_parallel_size=2, num_attention_heads=8, group_query_attention=True,
         num_query_groups=2),
])
def test_context_parallel_a2a_launches_with_sparse_balance(kw):
    check_launch(launch_args(**kw), FULL, plugin_data=True)
    check_launch(launch_args(**kw), SparseBalanceConfig(sparse_attention=True, seq_pad_multiple=8),
                 plugin_data=True)
    check_launch(launch_args(**kw), SparseBalanceConfig(), plugin_data=True)   # dense attention


@pytest.mark.parametrize("kw, k", [(dict(), 1), (dict(), 96), (CP_A2A, 4),
                                   (dict(CP_A2A, tensor_model_parallel_size=2,
                                         sequence_parallel=True), 8)])
def test_variable_length_microbatches_launch(kw, k):
    check_launch(launch_args(**kw), SparseBalanceConfig(sparse_balance=True,
                                                        microbatch_multiple=k), plugin_data=True)


def test_reset_attention_mask_is_served_by_the_plugins_data_path():
    check_launch(launch_args(reset_attention_mask=True), SPARSE, plugin_data=True)


def test_mass_selection_would_ignore_the_dst_plan():
    sb = SparseBalanceConfig(sparse_balance=True, selection_mode="mass")
    assert "--sb-selection-mode mass with DST" in refused(launch_args(), sb)
    check_launch(launch_args(), SparseBalanceConfig(sparse_attention=True, selection_mode="mass"),
                 plugin_data=True)   # static sparse attention may use it


@pytest.mark.reliability(area="launch", case="--sb-dst-objective quality with a missing or bad "
                         "--sb-quality-cost", expect="refused before any process group, naming "
                         "the file and the field")
def test_quality_objective_needs_a_readable_quality_cost(tmp_path):
    sb = SparseBalanceConfig(sparse_balance=True, dst_objective="quality",
                             quality_cost=str(tmp_path / "none.json"))
    assert f"--sb-quality-cost {tmp_path / 'none.json'}: file not found" \
        in refused(launch_args(), sb)
    # quality is the default objective: a bad cost file refuses a plain --sparse-balance launch
    # too, and the line names the objective that needs no cost file
    sb = SparseBalanceConfig(sparse_balance=True, quality_cost=str(tmp_path / "none.json"))
    msg = refused(launch_args(), sb)
    assert f"--sb-quality-cost {tmp_path / 'none.json'}: file not found" in msg
    assert "quality is the default objective; --sb-dst-objective density plans without" in msg
    check_launch(launch_args(), SparseBalanceConfig(sparse_balance=True, dst_objective="density",
                                                    quality_cost=str(tmp_path / "none.json")),
                 plugin_data=True)                 # the density objective never reads it
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "sparsebalance-quality-cost", "version": 7}')
    sb = SparseBalanceConfig(sparse_balance=True, dst_objective="quality", quality_cost=str(bad))
    assert "version=7: expected 2" in refused(launch_args(), sb)
    check_launch(launch_args(), SparseBalanceConfig(sparse_balance=True, dst_objective="quality"),
                 plugin_data=True)                 # the shipped default
    check_launch(launch_args(), SparseBalanceConfig(sparse_balance=True),
                 plugin_data=True)                 # the default objective with the shipped cost


def test_flex_backend_needs_cuda():
    sb = SparseBalanceConfig(sparse_attention=True, attention_backend="flex")
    assert "--sb-attention-backend flex: FlexAttention needs CUDA" in refused(launch_args(), sb)


def test_triton_backend_takes_variable_length_microbatches(monkeypatch):
    """Unlike flex, the Triton kernels compile nothing per micro-batch length (the interpreter
    stands in for CUDA here, as the attention API accepts it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sb = SparseBalanceConfig(sparse_attention=True, attention_backend="triton",
                             microbatch_multiple=64)
    check_launch(launch_args(kv_channels=64), sb, plugin_data=True)
    assert "--sb-block-size 8: expected >= 16" in refused(
        launch_args(seq_length=64), dataclasses.replace(sb, block_size=8))


def test_straggler_rank_must_be_a_data_parallel_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    sb = SparseBalanceConfig(sparse_balance=True, straggler_rank=5, straggler_slowdown=2.0)
    assert "--sb-straggler-rank 5: this launch has 2 data-parallel rank(s)" in \
        refused(launch_args(), sb)
    check_launch(launch_args(), SparseBalanceConfig(sparse_balance=True, straggler_rank=1),
                 plugin_data=True)


def test_straggler_stage_must_be_a_pipeline_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    sb = SparseBalanceConfig(sparse_balance=True, straggler_rank=1, straggler_stage=2,
                             straggler_slowdown=1.1)
    assert "--sb-straggler-stage 2: this launch has 2 pipeline rank(s) (0..1)" in \
        refused(launch_args(pipeline_model_parallel_size=2), sb)
    check_launch(launch_args(pipeline_model_parallel_size=2),
                 dataclasses.replace(sb, straggler_stage=1), plugin_data=True)
    assert "--sb-straggler-stage 1: needs --sb-straggler-rank" in refused(
        launch_args(pipeline_model_parallel_size=2),
        SparseBalanceConfig(sparse_balance=True, straggler_stage=1))


def test_every_problem_of_a_launch_in_one_line():
    msg = refused(launch_args(context_parallel_size=2, micro_batch_size=4, mock_data=True))
    assert "--context-parallel-size 2" in msg and "--micro-batch-size 4" in msg
    assert "--mock-data" in msg


def test_cpu_defaults_are_defaults_a_flag_still_overrides():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--transformer-impl", default="transformer_engine")
    p.add_argument("--distributed-backend", default="nccl")
    set_ = cpu_parser_defaults(p)
    assert "transformer_impl=local" in set_ and "distributed_backend=gloo" in set_
    assert p.parse_args([]).transformer_impl == "local"
    assert p.parse_args(["--transformer-impl", "x"]).transformer_impl == "x"
    assert CPU_DEFAULTS["gradient_accumulation_fusion"] is False


def test_entry_stops_with_one_line_before_any_process_group(tmp_path):
    proc = run_entry(2, [*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "1",
                         "--seq-length", "16", "--max-position-embeddings", "16",
                         "--context-parallel-size", "2", "--sb-tokenizer", "byte",
                         "--sb-sparse-attention", "--sb-block-size", "64"],
                     cwd=tmp_path, timeout=180, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("error: cannot launch:")]
    assert lines, out[-3000:]   # one line (per rank that printed before torchrun stopped it)
    assert "--seq-length 16 is smaller than --sb-block-size 64" in lines[0]
    assert "--context-parallel-size 2" in lines[0]
    for sign in ("initializing torch distributed", "GPTModel", "[rank0]: Traceback",
                 "sparsebalance_megatron/megatron/"):
        assert sign not in out, f"{sign!r} in the output: the run got past the launch checks"
