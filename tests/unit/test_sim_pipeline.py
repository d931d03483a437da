"""1F1B simulator against hand-computed schedules (sparsebalance_megatron.sim.pipeline)."""

import numpy as np
import pytest

from sparsebalance_megatron.sim import pipeline_makespan_s, simulate_1f1b, stage_order
from sparsebalance_megatron.sim.pipeline import BWD, FWD


def _times(dp, m, pp, f, b):
    return np.full((dp, m, pp), float(f)), np.full((dp, m, pp), float(b))


def test_stage_order_matches_megatron_warmup_steady_cooldown():
    def order(m, pp, stage):                     # one model chunk: chunk 0 throughout
        out = stage_order(m, pp, stage)
        assert {c for _, _, c in out} == {0}
        return [(k, i) for k, i, _ in out]

    assert order(4, 4, 0) == [(FWD, 0), (FWD, 1), (FWD, 2), (FWD, 3), (BWD, 0), (BWD, 1),
                              (BWD, 2), (BWD, 3)]
    assert order(4, 4, 3) == [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1), (FWD, 2), (BWD, 2),
                              (FWD, 3), (BWD, 3)]
    assert order(2, 4, 0) == [(FWD, 0), (FWD, 1), (BWD, 0), (BWD, 1)]


def test_pp1_is_the_sum_of_all_work():
    f = np.array([[[1.0], [2.0], [3.0]]])
    b = 2 * f
    sim = simulate_1f1b(f, b)
    assert sim.step_time_s == pytest.approx(18.0)
    assert sim.bubble_fraction == pytest.approx(0.0)
    assert sim.imbalance == pytest.approx(1.0)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_uniform_pp2_matches_closed_form(m):
    f, b = _times(1, m, 2, 1.0, 2.0)
    sim = simulate_1f1b(f, b)
    # (m + pp - 1) * (f + b) for uniform stages, bubble (pp-1)/(m+pp-1)
    assert sim.step_time_s == pytest.approx((m + 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(1 / (m + 1))


def test_unequal_stages_and_p2p_hand_computed():
    f = np.array([[[1.0, 2.0], [1.0, 2.0]]])  # [dp=1, m=2, pp=2]
    b = np.array([[[2.0, 4.0], [2.0, 4.0]]])
    # F0s0 0-1, F0s1 1-3, B0s1 3-7, F1s0 1-2, B0s0 7-9, F1s1 7-9, B1s1 9-13, B1s0 13-15
    assert simulate_1f1b(f, b).step_time_s == pytest.approx(15.0)
    # p2p 0.5 on every cross-stage edge: ... B1s1 9.5-13.5, B1s0 14-16
    sim = simulate_1f1b(f, b, p2p_s=0.5, record=True)
    assert sim.step_time_s == pytest.approx(16.0)
    assert sim.start_s[0, 1, 1, FWD] == pytest.approx(7.5)  # F1 on stage 1 waits for B0 there
    assert sim.start_s[0, 0, 0, BWD] == pytest.approx(8.0)  # B0 on stage 0 waits for p2p


def test_straggler_microbatch_and_dp_imbalance():
    f, b = _times(2, 3, 2, 1.0, 2.0)
    f[0, 1, 1], b[0, 1, 1] = 3.0, 6.0  # rank 0, micro-batch 1, last stage is slow
    sim = simulate_1f1b(f, b, record=True)
    # hand schedule of rank 0 ends with B2s0 16-18; rank 1 is uniform: 4 * 3 = 12
    np.testing.assert_allclose(sim.rank_time_s, [18.0, 12.0])
    assert sim.step_time_s == pytest.approx(18.0)
    assert sim.imbalance == pytest.approx(18.0 / 15.0)
    np.testing.assert_allclose(sim.busy_s, [[9.0, 15.0], [9.0, 9.0]])
    assert sim.bubble_fraction == pytest.approx(1 - 42.0 / 72.0)
    assert sim.end_s[0, 2, 0, BWD] == pytest.approx(18.0)
    assert sim.start_s[0, 2, 1, FWD] == pytest.approx(13.0)  # F2s1 waits behind B1s1


def test_fewer_microbatches_than_stages_is_serial():
    f = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    sim = simulate_1f1b(f, 2 * f)
    assert sim.step_time_s == pytest.approx(30.0)


def test_vectorised_dp_equals_rank_by_rank_and_respects_dependencies():
    rng = np.random.default_rng(0)
    f = rng.uniform(0.5, 2.0, size=(5, 6, 3))
    b = f * rng.uniform(1.5, 2.5, size=f.shape)
    sim = simulate_1f1b(f, b, p2p_s=0.1, record=True)
    for r in range(5):
        one = pipeline_makespan_s(f[r:r + 1], b[r:r + 1], 0.1)
        assert one[0] == pytest.approx(sim.rank_time_s[r])
    s, e = sim.start_s, sim.end_s
    np.testing.assert_allclose(e - s, np.stack([f, b], -1))
    assert np.all(s[:, :, 1:, FWD] >= e[:, :, :-1, FWD] + 0.1 - 1e-12)
    assert np.all(s[:, :, :-1, BWD] >= e[:, :, 1:, BWD] + 0.1 - 1e-12)
    # no stage runs two events at once
    for r in range(5):
        for st in range(3):
            iv = sorted(zip(s[r, :, st].ravel(), e[r, :, st].ravel()))
            assert all(a[1] <= b_[0] + 1e-12 for a, b_ in zip(iv, iv[1:]))


@pytest.mark.parametrize("bad", [
    dict(fwd_s=np.ones((2, 2)), bwd_s=np.ones((2, 2))),
    dict(fwd_s=np.ones((1, 2, 2)), bwd_s=np.ones((1, 2, 3))),
    dict(fwd_s=-np.ones((1, 2, 2)), bwd_s=np.ones((1, 2, 2))),
    dict(fwd_s=np.full((1, 2, 2), np.nan), bwd_s=np.ones((1, 2, 2))),
    dict(fwd_s=np.ones((1, 2, 2)), bwd_s=np.ones((1, 2, 2)), p2p_s=-1.0),
])
def test_bad_input_raises_value_error(bad):
    with pytest.raises(ValueError):
        simulate_1f1b(**bad)


def test_interleaved_schedule_table_matches_megatrons_example():
    from sparsebalance_megatron.sim.pipeline import interleaved_schedule_table
    # schedules.py: "PP2 N3M5 with VP2": micro-batch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1
    table = interleaved_schedule_table(5, 2, 3)
    assert [i for i, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("pp,vp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_uniform_matches_closed_form(pp, vp, m):
    from sparsebalance_megatron.sim import simulate_1f1b
    f = np.full((1, m, pp * vp), 1.0 / vp)   # a stage's f=1, b=2 split over vp chunks
    sim = simulate_1f1b(f, 2 * f, pp=pp)
    # bubble shrinks by vp: m (f + b) + (pp - 1) (f + b) / vp
    assert sim.step_time_s == pytest.approx(3.0 * m + 3.0 * (pp - 1) / vp)
    assert sim.step_time_s < simulate_1f1b(np.ones((1, m, pp)), 2 * np.ones((1, m, pp))).step_time_s


def test_interleaved_with_one_chunk_is_plain_1f1b_and_respects_dependencies():
    from sparsebalance_megatron.sim import simulate_1f1b
    rng = np.random.default_rng(3)
    f = rng.uniform(0.5, 2.0, size=(3, 5, 2))
    b = 2 * f
    np.testing.assert_allclose(simulate_1f1b(f, b, 0.1, pp=2).rank_time_s,
                               simulate_1f1b(f, b, 0.1).rank_time_s)
    f = rng.uniform(0.5, 2.0, size=(2, 6, 6))   # pp=3, vp=2
    sim = simulate_1f1b(f, 2 * f, 0.05, pp=3, record=True)
    s, e = sim.start_s, sim.end_s
    assert np.all(s[:, :, 1:, FWD] >= e[:, :, :-1, FWD] - 1e-12)
    assert np.all(s[:, :, :-1, BWD] >= e[:, :, 1:, BWD] - 1e-12)
    np.testing.assert_allclose(sim.busy_s.sum(axis=1), (3 * f).sum(axis=(1, 2)))
    with pytest.raises(ValueError, match="the interleaved schedule needs pp=3 <="):
        simulate_1f1b(f[:, :2], 2 * f[:, :2], pp=3)


def test_interleaved_counts_megatron_refuses_are_refused_and_never_searched():
    """Megatron's interleaved schedule refuses a last micro-batch group smaller than pp (9
    micro-batches at pp 4: dp_balanced's variable count); the simulator says so rather than
    simulating a schedule Megatron cannot run, and the layout search skips that vp."""
    from sparsebalance_megatron.sim.pipeline import interleaved_refusal, simulate_1f1b

    assert interleaved_refusal(8, 4) is None and interleaved_refusal(12, 4) is None
    assert "last group of 1" in interleaved_refusal(9, 4)
    assert "pp=4 <=" in interleaved_refusal(3, 4)          # fewer micro-batches than stages
    f = np.ones((1, 9, 8))
    with pytest.raises(ValueError, match="9 micro-batches"):
        simulate_1f1b(f, f, 0.0, pp=4)
    simulate_1f1b(np.ones((1, 8, 8)), np.ones((1, 8, 8)), 0.0, pp=4)


def test_a_run_megatron_cannot_interleave_is_no_layout_candidate():
    from sparsebalance_megatron.experiments.study_rows import VariantAccumulator
    class Costs:        # the two attributes the refusal reads before anything is simulated
        vp, pipeline_ranks, shape = 2, 4, (1, 9, 8, 1)

    acc = VariantAccumulator()
    acc.add(Costs(), np.full((1, 9, 8), 0.5), 0.0)
    row = acc.row(1.0, 1.0)
    assert row["step_time_s"] == float("inf") and "last group of 1" in row["refused"]
    assert row["speedup_vs_static_net"] == 0.0
