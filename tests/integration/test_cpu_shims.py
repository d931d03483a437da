"""The CPU shims (megatron/launch/compat.py) on the installed megatron-core: every target they
replace exists, the checkpoint writers' results queue is made in the ``fork`` context (a
spawned one re-imports the training script at every run's first save: 5-10 s per rank here),
and ``pretrain()``'s JIT warm-up is skipped (an inductor build in every rank of every launch)."""

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


def test_pretrains_jit_warmup_runs_nothing_on_the_cpu():
    """Megatron's ``set_jit_fusion_options`` (called by ``pretrain()``) reaches the warm-up by
    its module global, which the shims replace: nothing is compiled and nothing drawn (the
    warm-up's random tensors come from the CPU generator, the model's initialisation next)."""
    import torch
    from megatron.training import initialize as minit

    from sparsebalance_megatron.megatron.launch import compat

    assert compat.activate_cpu_shims() is True
    assert minit._warmup_jit_function is compat._skip_jit_warmup
    before = torch.get_rng_state()
    minit.set_jit_fusion_options(tp_size=1)
    assert torch.equal(torch.get_rng_state(), before)


EXIT_EARLY = """
import os
from sparsebalance_megatron.megatron.launch import compat
compat.activate_cpu_shims()
print(compat._results_manager._process.pid, flush=True)
os._exit(3)            # no finaliser runs: as a rank the watchdog ends, or one killed
"""


def test_the_forked_results_server_ends_with_its_rank(tmp_path):
    """A rank that ends without finalisers (``os._exit``, SIGKILL) must not leave the server
    behind: it would hold the job's output pipe open, and torchrun, the test harness or a
    user's ``| tee`` would wait for it. The rank is a plain process forked from the suite's
    server (``run_python``'s launcher: megatron-core imported once; a fresh interpreter spent
    about 5 s of CPU importing it), writing to a pipe of this test's, which must reach EOF."""
    import os
    import select
    import subprocess
    import sys
    import time

    from tests.conftest import LAUNCHER, _forked_ranks
    from tests.forked_ranks import launch

    read_end, write_end = os.pipe()
    if LAUNCHER == "fork":
        server = _forked_ranks()
        server.start()
        rc = launch(server.path, "-c " + EXIT_EARLY, [], 0, tmp_path, dict(os.environ),
                    write_end, write_end, timeout=120)
    else:
        rc = subprocess.run([sys.executable, "-c", EXIT_EARLY], stdout=write_end,
                            stderr=subprocess.DEVNULL, timeout=120).returncode
    os.close(write_end)
    assert rc == 3
    out, deadline = b"", time.monotonic() + 30   # a generous bound for a loaded machine
    while True:              # EOF once no process holds the pipe: the server is gone too
        if not select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.close(read_end)
            raise AssertionError(f"the results server {out.split()} outlived its rank: it "
                                 f"holds the rank's output pipe after 30 s")
        chunk = os.read(read_end, 4096)
        if not chunk:
            break
        out += chunk
    os.close(read_end)
    server = int(out.split()[-1])
    for _ in range(300):               # reaped, not a zombie holding its pid
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the results server {server} outlived its rank")
