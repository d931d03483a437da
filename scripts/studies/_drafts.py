"""One planner's draft as the runtime makes it (the runtime's ``Drafter`` on a latency model, and
step ``k``'s draft submitted to a thread or a planner process), for the studies that time drafts.

Private and apart: ``planner_ab`` imports it in another checkout's tree (every checkout since
9a6f65d has it under this name).
"""

from __future__ import annotations


def make_drafter(lm, sb, dp: int, seq: int):
    """The runtime's ``Drafter`` for ``sb`` on ``lm`` (``dp`` ranks, ``seq`` tokens a
    micro-batch), with a fresh sensitivity tracker."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    return Drafter(sb, lm, SensitivityTracker(signal=sb.sensitivity_signal), dp=dp,
                   capacity=seq, attention_layers=lm.layout.attention_layers)


def submit_draft(planner: str, drafter, proc, k: int, segs, m: int, with_dst: bool = True):
    """Start the draft of step ``k`` on ``planner`` ('process': ``proc``, a PlannerProcess);
    ``with_dst``: as the rank that plans DST (else as any other rank)."""
    from sparsebalance_megatron.megatron.step.ahead import Planner

    if planner == "thread":
        return Planner(lambda: drafter.draft(k, 0, segs, m, with_dst=with_dst), basis={})
    return proc.submit(k, 0, segs, m, with_dst=with_dst,
                       latency_state=drafter.latency.calibration_state(),
                       tracker_sync=("updates", []) if k else
                       ("reset", drafter.tracker.state_dict()), basis={})
