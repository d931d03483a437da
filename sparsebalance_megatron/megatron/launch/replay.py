"""``--sb-replay-plans``: the callback trains on another run's recorded plans instead of its own.

Given the same plan (the same documents in the same micro-batch slots of the same DP ranks, the
same densities per unit), a CP=N run computes the numbers of a CP=1 run with CP=N's document
padding; but each plans with its own latency model (the CP=N one adapted by
``LatencyModel.with_context_parallel``), so SAB may pack and DST budget differently. Replaying the
CP=1 run's ``--sb-metrics-file`` gives the CP=N run the CP=1 plans (``batching/replay.py``).

Two checks: ``launch_problems`` (preflight, before the tokenizer and the process group) compares
the file's first step with the launch's flags; ``PlanReplay.step`` (every step, on the callback's
draft) checks that the run drew the recorded documents and has the recorded shape. Every refusal
is a ``LaunchError`` naming the flag and the file (on the first step one ``error:`` line; later
the step's exception).
No torch.distributed; megatron only inside functions.
"""

from __future__ import annotations

import os
from typing import Optional

from ...batching.replay import RecordedPlans, ReplayError, StepShape
from ...config import SparseBalanceConfig, flag_name
from ..errors import LaunchError


def launch_problems(args, sb: SparseBalanceConfig) -> list[str]:
    """What makes the recorded plans unusable by this launch's flags (the seed, the steps
    --train-iters needs, the shape of the first step), one entry each; the file's own problems
    are ``preflight.config_problems``'."""
    if not sb.replay_plans:
        return []
    if sb.metrics_file and os.path.abspath(sb.metrics_file) == os.path.abspath(sb.replay_plans):
        return [f"{flag_name('replay_plans')} {sb.replay_plans}: the same file as "
                f"{flag_name('metrics_file')} (the run would append to the plans it replays); "
                f"record this run elsewhere"]
    try:
        recorded = RecordedPlans.read(sb.replay_plans)
    except ReplayError:
        return []                      # config_problems names it
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    dp = world // (tp * pp * cp) if world and world % (tp * pp * cp) == 0 else None
    mbs = getattr(args, "micro_batch_size", None) or 1
    gbs = getattr(args, "global_batch_size", None)
    m = gbs // (mbs * dp) if dp and gbs and not getattr(args, "rampup_batch_size", None) \
        and not getattr(args, "step_batch_size_schedule", None) else None
    seq = getattr(args, "seq_length", None)
    virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None) \
        or getattr(args, "num_virtual_stages_per_pipeline_rank", None) \
        or getattr(args, "pipeline_model_parallel_layout", None)
    want = StepShape(dp=dp, num_microbatches=m, max_tokens=seq * mbs if seq else None,
                     pad_multiple=sb.pad_multiple(cp), length_multiple=sb.length_multiple,
                     stages=(None if virtual else pp) if sb.sparse_attention_enabled else 0)
    out = recorded.check_run(sb.seed, getattr(args, "train_iters", None))
    try:
        recorded.check_shape(want)
    except ReplayError as e:
        out.append(str(e))
    return out


class PlanReplay:
    """The recorded plans, served to one rank's callback step by step."""

    def __init__(self, sb: SparseBalanceConfig, *, dp: int, max_tokens: int, pad_multiple: int,
                 stages: int):
        try:
            self.recorded = RecordedPlans.read(sb.replay_plans)
        except ReplayError as e:
            raise LaunchError(str(e)) from None
        self.dp, self.max_tokens, self.pad_multiple = dp, max_tokens, pad_multiple
        self.length_multiple = sb.length_multiple
        self.stages = stages if sb.sparse_attention_enabled else 0

    def step(self, iteration: int, first_bin: int, segments, num_microbatches: int):
        """(BatchPlan, densities [dp, m, stages] or None) recorded for ``iteration``."""
        shape = StepShape(self.dp, num_microbatches, self.max_tokens, self.pad_multiple,
                          self.length_multiple, self.stages)
        try:
            return self.recorded.step(iteration, first_bin, segments, shape)
        except ReplayError as e:
            raise LaunchError(str(e)) from None


def plan_replay(sb: SparseBalanceConfig, **kw) -> Optional[PlanReplay]:
    return PlanReplay(sb, **kw) if sb.replay_plans else None
