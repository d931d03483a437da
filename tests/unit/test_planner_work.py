"""The planner's work per step and DP rank, counted (not timed): a guard against a planner that
becomes twice as slow (issue 44), which a wall-clock test on a shared machine cannot be.

The runtime's draft (``step/drafting.py``: SAB's and the baseline's packing, their features, DST
under the do-no-harm rule with the default flags, and with DST on the chosen packing only) is run
on fixed steps of the built-in corpus, and what its time goes into is counted at the compiled
kernels' doors: the event passes' cells (events x columns: ``EventGraph``'s earliest
finishes, a band pass's rows cut, their floats and every raise try's rows), the band
pass's rows, and the units the descent's rounds search (its cuts' and raises'). Each must stay
within [0.5, 1.5] x ``REFERENCE``: a change that doubles the work fails; one that halves it
fails too, and then ``REFERENCE`` is updated with the figures the failure prints (the drop is
worth a commit message). Wall-clock figures of the same draft are ``scripts/bench.py
planner_cost``'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron import kernels
from sparsebalance_megatron.sim import pipeline

# (dp, m, layout, --sb-stand-down-compare) -> counts per step and DP rank (the mean over STEPS
# steps of the whole step's draft, every rank's rounds made in-process, divided by dp: what one
# rank of a run plans) with the default flags otherwise; the default compare ('planned') plans
# DST on both packings, 'static' on one (about half the work). The decomposed DST plans every
# band candidate at once and descends toward 64 probes in up to three chains: against the
# central draft's whole-step counts (163264, 65408, 83968, 40960 cells) a rank's are 0.4-1.7x.
REFERENCE = {
    (16, 16, "even", "planned"): {"cells": 66100, "rows": 286, "searched": 3338},
    (16, 16, "best", "planned"): {"cells": 114240, "rows": 236, "searched": 7334},
    (16, 16, "even", "static"): {"cells": 31940, "rows": 131, "searched": 1684},
    (16, 16, "best", "static"): {"cells": 42312, "rows": 66, "searched": 2699},
}
STEPS = 2


def _count(monkeypatch) -> dict:
    n = {"cells": 0, "rows": 0, "searched": 0}

    def counted(cls, name, count):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            count(self, args, out)
            return out
        monkeypatch.setattr(cls, name, wrapped)

    def cells(k):
        return lambda self, args, out: n.__setitem__("cells", n["cells"] + k(self, args, out))

    counted(pipeline.EventGraph, "earliest_finish", cells(lambda g, args, out: np.size(args[0])))
    band = kernels.band.BandPass

    def rows(self, args, out):
        r = out[1].size
        n["rows"] += r
        n["cells"] += r * self.graph.prev.size
    counted(band, "cut", rows)
    counted(band, "raise_try", rows)
    counted(band, "floats", cells(lambda self, args, out: np.size(args[0])))
    rnd = kernels.descent.Round
    counted(rnd, "cut", lambda self, args, out: n.__setitem__("searched",
                                                              n["searched"] + out[1][0].size))
    counted(rnd, "raise_fit", lambda self, args, out: n.__setitem__(
        "searched", n["searched"] + args[0].up.size))
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
    got = {k: v / STEPS / dp for k, v in n.items()}
    for key, want in REFERENCE[(dp, m, layout, compare)].items():
        assert 0.5 * want <= got[key] <= 1.5 * want, (
            f"{key}: {got[key]:.0f} per step against the reference {want:.0f} (x "
            f"{got[key] / want:.2f}); all counts: {got}")
