"""The training process's reader-thread CPU per step where a rank settles its DST per DP rank
(``Drafter.settle``), for ``planner_cost --reader``: settled on the reader thread (``agree``: how
the rank ran it before the relay) against settled in the planner process with the reader thread
relaying its collectives (``settle``: ``step/relay.py``). The reader thread's own CPU time
(``PendingDraft.reader_s``: reading the draft back, and the settle's compute or its relaying) is
what a launch-bound training thread beside it pays for the GIL. The DP group is a stand-in
(``Twins``: every rank this one's twin, so that one process plans at any DP size; its arithmetic,
on the reader thread, stands in for the collective's); the settle's compute is this rank's at that
DP size.

    .venv/bin/python scripts/bench.py planner_cost --reader --repeats 8 --json out/reader.json
"""

from __future__ import annotations

import time

import numpy as np


class Twins:
    """A DP group of ``dp`` ranks that are all this rank's twins (``DPReducer``'s interface)."""

    def __init__(self, dp: int):
        self.dp = dp

    def __call__(self, parts):
        out = {k: v * self.dp for k, v in parts["sum"].items()}
        out.update(parts["max"])
        for k, v in parts.get("cat", {}).items():
            out[k] = np.tile(np.asarray(v).reshape(-1), self.dp)
        return out

    def max(self, x):
        return float(x)

    def gather(self, row):
        return np.tile(np.asarray(row, dtype=np.float64).reshape(1, -1), (self.dp, 1))


def reader_cpu(sb, dp: int = 64, m: int = 16, seq: int = 32768, layout: str = "best",
               steps: int = 6, rank: int = 0, step_s: float = 1.0) -> dict:
    """Median reader-thread CPU ms per step (after one warm-up step) with the settle on the
    reader thread (``agree``) and in the planner process (``settle``), alternated step by step,
    each step's draft made while a stand-in step sleeps ``step_s`` (the GIL released); with the
    settle's own thread CPU in either place and both plans' equality."""
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.ahead import PlannerProcess, PlannerProcessError

    from ._drafts import make_drafter

    corpus = corpus_steps(dp, m, sb.density, steps + 1, seq=seq, layout=layout, pp=4)
    drafter = make_drafter(corpus.lm, sb, dp, seq)
    proc = PlannerProcess(drafter)
    got = {"agree": [], "settle": []}
    recv = {"agree": [], "settle": []}
    rounds, late = [], []
    settle_ms, same = [], True
    try:
        proc.wait_ready()
        for k, segs in enumerate(corpus.segments):
            plans = {}
            for how in ("agree", "settle") if k % 2 else ("settle", "agree"):
                spent = []

                def agree(draft):
                    c0 = time.thread_time()
                    out = drafter.settle(draft, rank=rank, agree=Twins(dp))
                    spent.append(time.thread_time() - c0)
                    return out
                kw = dict(agree=agree) if how == "agree" else dict(settle=(rank, Twins(dp)))
                pending = proc.submit(k, 0, segs, m, with_dst=False,
                                      latency_state=drafter.latency.calibration_state(),
                                      tracker_sync=("reset", drafter.tracker.state_dict()),
                                      basis={}, **kw)
                time.sleep(step_s)
                try:
                    plans[how] = pending.result().agreed
                except PlannerProcessError as e:     # a loaded host starves it: not counted
                    late.append(f"step {k} {how}: {e}")
                    pending._thread.join()
                    plans[how] = drafter.settle(drafter.draft(**pending.request), rank=rank,
                                                agree=pending.rounds.replaying()
                                                if how == "settle" else Twins(dp))
                    continue
                if k:
                    got[how].append(pending.reader_s * 1e3)
                    recv[how].append(pending.recv_s * 1e3)
                    if how == "settle":
                        rounds.append(len(pending.rounds.done))
                    if spent:
                        settle_ms.append(spent[0] * 1e3)
            same &= np.array_equal(np.asarray(plans["agree"][0]), np.asarray(plans["settle"][0]))
    finally:
        proc.close()
    med = {k: float(np.median(v)) for k, v in got.items()}
    return {"shape": f"{dp} DP x {m} micro-batches x PP4, {seq} tokens, {layout} layout, rank "
                     f"{rank}", "steps": steps,
            "reader_ms_settle_on_reader": med["agree"],
            "reader_ms_settle_in_process": med["settle"],
            "reader_ms_each": {k: [round(x, 2) for x in v] for k, v in got.items()},
            "recv_ms_settle_on_reader": float(np.median(recv["agree"])),
            "recv_ms_settle_in_process": float(np.median(recv["settle"])),
            "rounds_relayed": int(np.median(rounds)),
            "settle_ms_on_reader": float(np.median(settle_ms)), "same_plans": bool(same),
            "late": late}
