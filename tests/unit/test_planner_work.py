"""The planner's work per step, counted (not timed): a guard against a planner that becomes
twice as slow (issue 44), which a wall-clock test on a shared machine cannot be.

The runtime's draft (``step/drafting.py``: SAB's and the baseline's packing, their features, DST
under the do-no-harm rule with the default flags, and with DST on the chosen packing only) is run
on fixed steps of the built-in corpus, and what its time goes into is counted: the simulator's and
the float pass's Python steps over events (``EventGraph.earliest_finish``, ``slack.latest_finish``:
events x calls), the cells
they write (events x columns) and the grid searches' gathered elements (``highest_at_most``,
``level_search``). Each must stay within [0.5, 1.5] x ``REFERENCE``: a change that doubles the work
fails; one that halves it fails too, and then ``REFERENCE`` is updated with the figures the failure
prints (the drop is worth a commit message). The counts are taken on the numpy paths
(``kernels`` off): the planning algorithm's work, event by event, which the compiled kernels
do in fewer steps and the same numbers. Wall-clock figures of the same draft are ``scripts/bench.py
planner_cost``'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron.policy import grid_search
from sparsebalance_megatron.policy import critical_path, dst_moves, slack
from sparsebalance_megatron import kernels
from sparsebalance_megatron.sim import pipeline

# (dp, m, layout, --sb-stand-down-compare) -> counts per step (the mean over STEPS steps) of the
# draft with the default flags otherwise; the default compare ('planned') plans DST on both
# packings, 'static' on one (about half the work)
REFERENCE = {
    (16, 16, "even", "planned"): {"event_steps": 11392, "cells": 460288, "searched": 41977},
    (16, 16, "best", "planned"): {"event_steps": 14848, "cells": 478208, "searched": 35811},
    (16, 16, "even", "static"): {"event_steps": 5760, "cells": 249024, "searched": 19102},
    (16, 16, "best", "static"): {"event_steps": 6400, "cells": 271744, "searched": 19500},
}
STEPS = 2


def _count(monkeypatch) -> dict:
    n = {"event_steps": 0, "cells": 0, "searched": 0}

    ef = pipeline.EventGraph.earliest_finish

    def earliest_finish(self, dur, p2p_s, start=None):
        n["event_steps"] += self.size
        n["cells"] += dur.size
        return ef(self, dur, p2p_s, start)

    lf = slack.latest_finish

    def latest_finish(g, dur, deadline_s, p2p_s):
        n["event_steps"] += g.size
        n["cells"] += dur.size
        return lf(g, dur, deadline_s, p2p_s)

    ham = grid_search.highest_at_most

    def highest_at_most(table, units, limit, lo, hi):
        out = ham(table, units, limit, lo, hi)
        n["searched"] += out.size
        return out

    ls = grid_search.level_search

    def level_search(lo, hi, ok):
        def counted(mid):
            n["searched"] += np.size(mid)
            return ok(mid)
        return ls(lo, hi, counted)

    monkeypatch.setattr(kernels, "enabled", lambda: False)      # the algorithm's own steps
    monkeypatch.setattr(pipeline.EventGraph, "earliest_finish", earliest_finish)
    monkeypatch.setattr(slack, "latest_finish", latest_finish)
    for mod in (critical_path, dst_moves):
        monkeypatch.setattr(mod, "highest_at_most", highest_at_most)
    monkeypatch.setattr(dst_moves, "level_search", level_search)
    return n


@pytest.mark.parametrize("dp, m, layout, compare", list(REFERENCE))
def test_the_drafts_work_per_step_stays_near_its_reference(monkeypatch, dp, m, layout, compare):
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    sb = SparseBalanceConfig(sparse_balance=True, stand_down_compare=compare)
    corpus = corpus_steps(dp, m, sb.density, STEPS, seq=32768, layout=layout, pp=4)
    drafter = Drafter(sb, corpus.lm, SensitivityTracker(), dp=dp, capacity=32768,
                      attention_layers=corpus.lm.layout.attention_layers)
    n = _count(monkeypatch)
    for k, segs in enumerate(corpus.segments):
        draft = drafter.draft(k, 0, segs, m, with_dst=True)
        assert draft.payload is not None and draft.baseline is not None   # 2 packings
    got = {k: v / STEPS for k, v in n.items()}
    for key, want in REFERENCE[(dp, m, layout, compare)].items():
        assert 0.5 * want <= got[key] <= 1.5 * want, (
            f"{key}: {got[key]:.0f} per step against the reference {want:.0f} (x "
            f"{got[key] / want:.2f}); all counts: {got}")
