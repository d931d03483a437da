"""``--sb-stand-down dp_balanced`` (issue 76): the runtime's draft packs Megatron's dp_balanced
with its own micro-batch count, the do-no-harm rule commits it only where predicted faster, and
the draft carries each candidate's count."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance_megatron.batching import SensitivityTracker
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.megatron.step.drafting import Drafter

CAP, DP, M = 4096, 2, 8


def _step(seed: int, longest: int = 1000) -> list:
    """A step's documents as the sampler draws them: Megatron's dp x m bins of CAP tokens,
    filled in order (a document that does not fit starts the next bin)."""
    lengths = np.random.default_rng(seed).integers(50, longest, 2000)
    segs, used, b = [], 0, 0
    for i, n in enumerate(lengths):
        if used + n > CAP:
            b, used = b + 1, 0
            if b == DP * M:
                break
        segs.append((i, 0, int(n)))
        used += n
    return segs


def _drafter(tracker=None, dst: bool = False) -> Drafter:
    lm = LatencyModel.analytic(ModelShape(num_layers=4, seq_length=CAP), pp=2)
    flags = dict(sparse_balance=True) if dst else dict(batching=True, sparse_attention=True)
    sb = SparseBalanceConfig(density=0.5, stand_down="dp_balanced", **flags)
    return Drafter(sb, lm, tracker, dp=DP, capacity=CAP, attention_layers=[2, 2])


@pytest.mark.parametrize("seed, longest, committed", [(5, 1000, 1), (37, 1000, 1),
                                                     (11, 600, 0), (19, 600, 0)])
def test_dp_balanceds_own_count_is_committed_only_where_predicted_faster(seed, longest,
                                                                         committed):
    """Megatron's dp_balanced packs these steps into 9 micro-batches per DP rank (8 for SAB, filled
    to CAP): committed where the latency model predicts its step faster (its micro-batches hold
    their documents only), SAB's kept where not."""
    draft = _drafter().draft(1, 0, _step(seed, longest), M, with_dst=False)
    sab, own = draft.packing(0)[0], draft.packing(1)[0]
    assert draft.counts == (M, own.num_microbatches) and own.num_microbatches == M + 1
    assert own.method == "dp_balanced" and own.length_multiple == 1      # no fill
    assert sab.method == "sab" and sab.length_multiple == 0              # fixed length
    stand = draft.stand_down
    assert stand["packing_index"] == committed
    fast, slow = stand["predicted_step_s"][committed], stand["predicted_step_s"][1 - committed]
    assert fast <= slow                           # the committed packing is the faster one
    assert draft.num_microbatches == M            # Megatron's samples stay dp x m bins


def test_a_step_dp_balanceds_rule_cannot_pack_keeps_sabs_alone():
    """Three whole-bin documents cannot make a multiple of dp x m groups by Megatron's rule (it
    would stop): the stand-down has no baseline for that step and SAB's packing is the one
    candidate, on every rank alike."""
    draft = _drafter().draft(1, 0, [(i, 0, CAP - 96) for i in range(3)], M, with_dst=False)
    assert draft.options == 1 and draft.counts == (M,) and draft.packing(0)[0].method == "sab"


def test_the_draft_carries_each_candidates_count():
    draft = _drafter(SensitivityTracker(), dst=True).draft(1, 0, _step(5), M, with_dst=True)
    dens, report = draft.payload
    index = report["stand_down"]["packing_index"]
    assert index == 1 and draft.counts == (M, M + 1)     # dp_balanced committed, its count
    assert np.shape(dens) == (DP, draft.counts[index], 2)
    assert np.shape(report["unit_sensitivity"]) == (DP, draft.counts[index])


def test_megatrons_loop_sees_its_own_count_and_the_schedule_the_steps():
    """``StepMicrobatches`` in megatron-core 0.19.2's order of calls: a checkpoint's load
    (``update`` checked), then per iteration the loop's unchecked ``update`` and its "never
    fewer" check, the checked ``update``, ``train_step`` (the schedule's count), the step's end,
    the consumed samples and learning-rate increment."""
    from sparsebalance_megatron.megatron.step.microbatches import StepMicrobatches

    class Megatrons:
        def update(self, consumed, check, verbose=False):
            self.seen = consumed

        def get(self):
            return 8

    class Steps:                  # the committed steps by first sample: 7, then 8, then 9
        counts, done = {16: 7, 32: 8, 48: 9}, set()

        def microbatches_at(self, consumed):
            return None if consumed in self.done else self.counts.get(consumed)

    steps = Steps()
    calc = StepMicrobatches(Megatrons(), steps)
    calc.update(16, True)                        # load_checkpoint at the resumed position
    assert calc.get() == 8
    for consumed in (16, 32, 48):
        calc.update(consumed, False)
        assert calc.get() == 8                   # the loop's check and checkpoint-on-change
        calc.update(consumed, True)
        assert calc.get() == steps.counts[consumed]      # train_step -> the schedule
        steps.done.add(consumed)                 # finalize_model_grads: the step ended
        assert calc.get() == 8                   # consumed samples, the LR schedule
    assert calc.inner.seen == 48
