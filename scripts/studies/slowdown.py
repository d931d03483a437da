"""What a planner drafting beside it costs a launch-bound training thread (issue 44), for
``planner_cost``: the ops per second of planner windows against no-planner windows
(``slowdown``), and within each window during the draft against after it (``local``)."""

from __future__ import annotations

import time

import numpy as np


def local_share(during: tuple, after: tuple, elapsed_s: float) -> float:
    """The ``local`` estimate of one window: (bursts, seconds) while the draft was being made
    and after it; the during-draft bursts' seconds beyond the after-draft bursts' mean pace,
    as a share of the window's ``elapsed_s`` (NaN with no burst after the draft)."""
    if not after[0]:
        return float("nan")
    return (during[1] - during[0] * after[1] / after[0]) / elapsed_s


def launch_slowdown(sb, dp: int = 64, m: int = 16, seq: int = 32768, layout: str = "best",
                    window_s: float = 2.0, rounds: int = 6, ops: int = 200) -> dict:
    """The training thread's speed beside each planner (module docstring): windows of ``window_s``
    seconds of bursts of ``ops`` small torch ops, each planner window drafting the next step, the
    no-planner windows alternating with the planners' (``rounds`` each). Returns ops per second,
    each planner's ``slowdown`` and ``local`` slowdown, the draft's wall time and the join's
    wait."""
    import torch

    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.ahead import PlannerProcess

    from .drafts import make_drafter, submit_draft

    corpus = corpus_steps(dp, m, sb.density, 3, seq=seq, layout=layout, pp=4)
    a, b, c = torch.randn(64), torch.randn(64), torch.empty(64)

    def window(planner, drafter, proc, k, split_s: float) -> dict:
        """One window: its ops/s, the join's ms, the draft's wall s and the local excess share
        (a no-planner window is split at ``split_s``)."""
        pending = submit_draft(planner, drafter, proc, k, corpus.segments[k % 3], m) \
            if planner else None
        n, t0 = 0, time.perf_counter()
        t_end, last, split = t0 + window_s, t0, None
        during = [0, 0.0]                  # bursts and seconds while the draft was being made
        after = [0, 0.0]
        while last < t_end:
            for _ in range(ops):
                torch.add(a, b, out=c)
            now = time.perf_counter()
            part = during if split is None else after
            part[0] += 1
            part[1] += now - last
            last, n = now, n + ops
            if split is None and (pending.done() if pending is not None
                                  else now - t0 >= split_s):
                split = now - t0
        rate = n / (last - t0)
        t1 = time.perf_counter()
        if pending is not None:
            pending.result()
        join_ms = (time.perf_counter() - t1) * 1e3
        return {"rate": rate, "join_ms": join_ms, "draft_s": split if split is not None
                else last - t0, "local": local_share(during, after, last - t0)}

    drafter = make_drafter(corpus.lm, sb, dp, seq)
    proc = PlannerProcess(drafter)
    runs = {None: [], "thread": [], "process": []}
    try:
        window(None, None, None, 0, 0.1)                # warm-up: torch's first calls ...
        split = window("process", drafter, proc, 0, 0.0)["draft_s"]   # ... the first draft
        for r in range(rounds):
            for planner in (None, "thread", None, "process"):
                w = window(planner, drafter, proc, r + 1, split)
                runs[planner].append(w)
                if planner == "process":
                    split = w["draft_s"]
    finally:
        proc.close()

    def median(planner, key):
        return float(np.median([w[key] for w in runs[planner]]))

    base, control = median(None, "rate"), median(None, "local")
    out = {"window_s": window_s, "ops_per_burst": ops, "rounds": rounds,
           "shape": f"{dp} DP x {m} micro-batches x PP4, {layout} layout",
           "baseline_ops_per_s": base, "baseline_ops_per_s_each": [w["rate"] for w in runs[None]],
           "control_local": control, "control_local_each": [w["local"] for w in runs[None]]}
    for planner in ("thread", "process"):
        out[planner] = {"ops_per_s": median(planner, "rate"),
                        "slowdown": 1.0 - median(planner, "rate") / base,
                        "local": median(planner, "local") - control,
                        "ops_per_s_each": [w["rate"] for w in runs[planner]],
                        "local_each": [w["local"] for w in runs[planner]],
                        "draft_wall_ms": 1e3 * median(planner, "draft_s"),
                        "join_ms": median(planner, "join_ms")}
    return out
