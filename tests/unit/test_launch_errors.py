"""Launch settings that cannot work give a clear error naming the values, before any model is built.

``check_launch(args, sb)`` directly (world size vs TP x PP, --seq-length vs --sb-block-size,
--micro-batch-size), plus one real torchrun launch of the training entry that must stop with the
message before Megatron builds anything.
"""

from __future__ import annotations

import types

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.initialize import LaunchError, check_launch
from tests.conftest import TINY_MODEL, run_entry


def launch_args(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seq_length=256,
                micro_batch_size=1, num_layers=4)
    base.update(kw)
    return types.SimpleNamespace(**base)


SPARSE = SparseBalanceConfig(sparse_attention=True, block_size=64)


def test_launch_error_is_a_value_error():
    assert issubclass(LaunchError, ValueError)


def test_a_good_launch_passes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_launch(launch_args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), SPARSE)
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_launch(launch_args(seq_length=64), SPARSE)  # exactly one block


@pytest.mark.parametrize("world, tp, pp", [(1, 2, 1), (6, 2, 2), (3, 1, 2)])
def test_world_size_not_divisible_by_tp_x_pp(monkeypatch, world, tp, pp):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(LaunchError) as e:
        check_launch(launch_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                     SPARSE)
    msg = str(e.value)
    assert f"world size {world}" in msg
    assert f"--tensor-model-parallel-size {tp}" in msg
    assert f"--pipeline-model-parallel-size {pp}" in msg and f"= {tp * pp}" in msg


def test_seq_length_smaller_than_block_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(LaunchError, match=r"--seq-length=16 .*--sb-block-size=64"):
        check_launch(launch_args(seq_length=16), SPARSE)
    # Dense attention has no blocks: the same length is fine.
    check_launch(launch_args(seq_length=16), SparseBalanceConfig(block_size=64))


def test_micro_batch_size_must_be_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(LaunchError, match=r"--micro-batch-size=2"):
        check_launch(launch_args(micro_batch_size=2), SPARSE)


def test_entry_stops_before_building_a_model(tmp_path):
    proc = run_entry(1, [*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "1",
                         "--seq-length", "16", "--max-position-embeddings", "16",
                         "--sb-sparse-attention", "--sb-block-size", "64"],
                     cwd=tmp_path, timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "--seq-length=16 is smaller than --sb-block-size=64" in out, out[-3000:]
    for sign in ("GPTModel", "building", "sparse attention on", "step    1"):
        assert sign not in out, f"{sign!r} in the output: the run got past the launch checks"
