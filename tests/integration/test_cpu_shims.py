"""The CPU shims (megatron/launch/compat.py) on the installed megatron-core: every target they
replace exists, and the checkpoint writers' results queue is made in the ``fork`` context (a
spawned one re-imports the training script at every run's first save: 5-10 s per rank here)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("megatron.core")


def test_the_shims_find_their_targets_and_fork_the_checkpoint_results_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from sparsebalance_megatron.megatron.launch import compat

    assert compat.activate_cpu_shims() is True
    assert compat.check_shim_targets() == []
    queue = fa._results_queue
    assert queue is not None and fa.get_write_results_queue() is queue   # made once, reused
    # the queue's Manager server is a forked child of this process, not a spawned one
    assert "ForkProcess" in {type(p).__name__ for p in mp.active_children()}
    assert "SpawnProcess" not in {type(p).__name__ for p in mp.active_children()}
