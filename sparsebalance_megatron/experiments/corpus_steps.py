"""Steps of the built-in corpus packed the way the runtime packs them, at any scale: the set-up
the planning studies share (``scripts/bench.py planner_cost``, ``planner_ab``,
``control_plane``, ``plugin_cost``).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUTS = ("even", "best")


@dataclass
class CorpusSteps:
    lm: object          # LatencyModel: the analytic table, on the chosen layout
    segments: list      # every step's global batch of document segments (sampler order)
    plans: list         # every step's SAB plan (BatchPlan), packed at d0
    tracker: object     # the SensitivityTracker the plans were packed with (fresh)


def corpus_steps(dp: int, m: int, d0: float, steps: int = 1, *, seq: int = 32768,
                 layout: str = "even", pp: int = 4, seed: int = 1) -> CorpusSteps:
    """``steps`` global batches of the built-in corpus (Qwen tokenizer, long documents split)
    for ``dp`` ranks x ``m`` micro-batches of ``seq`` tokens, SAB-packed with the analytic
    Qwen2.5-0.5B table's latency cost at d0. ``layout``: ``even`` (Megatron's default split) or
    ``best`` (the fastest static layout of the first step, ``layout_gap``: the configuration
    the benchmarks compare with)."""
    from ..batching import SensitivityTracker, latency_sample_cost_fn, sab_plan
    from ..data import GlobalBatchSampler, load_corpus
    from ..latency import LatencyModel
    from .layout_search import layout_gap

    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
    lm = LatencyModel.analytic(pp=pp)
    lengths = np.asarray(load_corpus(tokenizer="qwen").lengths, dtype=np.int64)
    sampler = GlobalBatchSampler(lengths, capacity=seq, dp=dp, num_microbatches=m, seed=seed,
                                 long_sample_policy="split")
    tracker = SensitivityTracker()
    cost_fn = latency_sample_cost_fn(lm, d0)
    segments = [sampler.next_global_batch() for _ in range(steps)]
    plans = [sab_plan(s, dp=dp, num_microbatches=m, max_tokens=seq, cost_fn=cost_fn,
                      sensitivity=tracker, seed=seed) for s in segments]
    if layout == "best":
        _, best = layout_gap(lm, plans[0].unit_csr(True), dp, m, lm.layout, d0)
        lm = lm.with_layout(best)
    return CorpusSteps(lm, segments, plans, tracker)
