"""The GPT training entry with slow work injected, for tests/distributed/test_watchdog.py: proves
that Megatron's own evaluation and checkpoint save reach the watchdog as progress phases.

    torchrun --nproc_per_node=2 tests/distributed/watchdog_megatron_entry.py SAVE EVAL STAGE \\
        <the entry's flags>

Before the entry runs: global rank 0 sleeps SAVE seconds at the start of every checkpoint save
(inside Megatron's ``save_checkpoint_and_time``, so inside its 'save-checkpoint' timer), and the
last pipeline stage sleeps EVAL seconds before every evaluation forward and STAGE seconds before
every training forward (the forward step ``hooks.forward_step`` hands Megatron). Nothing else
changes: the loop, the timers and the watchdog are the entry's.
"""

from __future__ import annotations

import functools
import runpy
import sys
import time
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt_sparsebalance.py"


def _inject(save_s: float, eval_s: float, stage_s: float) -> None:
    import megatron.training.training as training
    from megatron.core import parallel_state as ps

    from sparsebalance_megatron.megatron.runtime import comm
    from sparsebalance_megatron.megatron import hooks

    real_save, real_forward = training.save_checkpoint, hooks._forward_step

    @functools.wraps(real_save)
    def slow_save(*args, **kwargs):
        if comm.rank() == 0:
            print(f"[test] rank 0 sleeps {save_s:g} s in its checkpoint save", flush=True)
            time.sleep(save_s)
        return real_save(*args, **kwargs)

    def slow_forward(data_iterator, model, *args, **kwargs):
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            time.sleep(stage_s if model.training else eval_s)
        return real_forward(data_iterator, model, *args, **kwargs)

    training.save_checkpoint = slow_save
    hooks._forward_step = slow_forward


if __name__ == "__main__":
    save, evaluation, stage = map(float, sys.argv[1:4])
    sys.argv = [str(ENTRY), *sys.argv[4:]]
    _inject(save, evaluation, stage)
    runpy.run_path(str(ENTRY), run_name="__main__")
