"""Per-(DP rank, pipeline rank) calibration (issue 27): one GPU of a pipeline slower than its
peers is learned from its measured share and reaches the costs DST plans with."""

import numpy as np
import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.policy import UnitCosts


@pytest.fixture
def lm():
    return LatencyModel.analytic(ModelShape(num_layers=8, seq_length=4096), pp=2)


def test_a_slow_pipeline_rank_is_learned_apart_from_its_dp_rank(lm):
    predicted = np.array([[1.0, 2.0], [1.0, 2.0]])          # [dp, pp] uncorrected busy seconds
    measured = predicted * np.array([[1.0, 1.1], [1.0, 1.0]])   # GPU (dp 0, stage 1) 10% slow
    for _ in range(30):
        for r in range(2):
            lm.calibrate(r, predicted[r], measured[r])
            lm.calibrate_stages(r, predicted[r], measured[r])
    grid = lm.correction_grid(2, 2)
    assert grid == pytest.approx(np.array([[1.0, 1.1], [1.0, 1.0]]), rel=2e-3)
    assert lm.correction(0) == pytest.approx(3.2 / 3.0, rel=1e-3)   # the DP rank's total


def test_unusable_or_single_stage_samples_keep_the_factors(lm):
    lm.calibrate_stages(0, [1.0, 1.0], [1.0, 1.5])
    before = lm.correction_grid(1, 2).copy()
    for p, m in (([1.0, 1.0], [np.nan, 1.0]), ([1.0, 0.0], [1.0, 1.0]), ([1.0], [2.0]),
                 ([1.0, 1.0], [1.0])):
        lm.calibrate_stages(0, p, m)
    assert np.array_equal(lm.correction_grid(1, 2), before)
    assert lm.stage_correction(None, 1) == 1.0


def test_stage_factors_reach_the_planned_costs_and_survive_a_resume(lm):
    lens = [[4096]] * 4                                     # dp 2 x m 2
    grid = np.array([0.5, 1.0])
    before = UnitCosts.from_latency(lm, lens, 2, 2, grid)
    for _ in range(30):
        lm.calibrate(1, [1.0, 1.0], [1.0, 1.2])
        lm.calibrate_stages(1, [1.0, 1.0], [1.0, 1.2])
    after = UnitCosts.from_latency(lm, lens, 2, 2, grid)
    ratio = after.fwd_s / before.fwd_s                      # [dp, m, pp, g]
    assert ratio[0] == pytest.approx(1.0)
    assert ratio[1, :, 1] == pytest.approx(1.2, rel=2e-3) and ratio[1, :, 0] == pytest.approx(
        1.0, rel=2e-3)
    raw = UnitCosts.from_latency(lm, lens, 2, 2, grid, calibrated=False)
    assert np.array_equal(raw.fwd_s, before.fwd_s)
    state = lm.calibration_state()
    assert set(state["stage_corrections"]) == {"1,0", "1,1"}
    fresh = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=4096), pp=2)
    fresh.load_calibration_state(state)
    assert np.array_equal(fresh.correction_grid(2, 2), lm.correction_grid(2, 2))
    with pytest.raises(ValueError, match="stage correction 1,1: nan"):
        fresh.load_calibration_state({"stage_corrections": {"1,1": float("nan")}})


def test_straggler_stage_flag_is_checked():
    with pytest.raises(ConfigError, match="--sb-straggler-stage=-2: expected -1 or a pipeline"):
        SparseBalanceConfig(straggler_rank=0, straggler_stage=-2)


def test_calibrate_ranks_is_every_ranks_update_and_keeps_a_rank_without_a_time(lm):
    """One step's calibration of every DP rank (what the runtime's end of step calls) updates
    exactly as the per-rank calls do; a DP rank whose measured row has a NaN keeps its factor
    (and its stage factors), the others move."""
    ref = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=4096), pp=2)
    predicted = np.array([[1.0, 2.0], [1.5, 1.0], [2.0, 2.0]])
    measured = predicted * np.array([[1.2, 1.0], [0.9, 1.1], [1.0, np.nan]])
    with pytest.warns(UserWarning, match="unusable measurement"):
        lm.calibrate_ranks(predicted, measured)
    with pytest.warns(UserWarning, match="unusable measurement"):
        for r in range(3):
            ok = np.isfinite(measured[r]).all()
            ref.calibrate(r, predicted[r] if ok else None, measured[r] if ok else None)
            ref.calibrate_stages(r, predicted[r], measured[r])
    assert lm.calibration_state() == ref.calibration_state()
    assert lm.correction(2) == 1.0 and lm.correction(0) != 1.0 and lm.correction(1) != 1.0
    assert lm.correction_grid(3, 2)[2].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("pp", [1, 2, 4, 7, 16])
def test_calibrate_ranks_as_arrays_is_the_per_rank_loop_bit_for_bit(pp):
    """Every DP rank at once (``_calibrate_all``, the runtime's common step) moves every factor
    and records every error exactly as the per-rank calls do, over steps that start from
    learned factors, with a zero-time stage (no stage update for that rank) and with clipped
    updates after the first clip warned; a step the array form cannot take (an unusable time)
    falls back to the loop."""
    import warnings

    shape = ModelShape(num_layers=8, seq_length=4096)
    fast, ref = LatencyModel.analytic(shape, pp=2), LatencyModel.analytic(shape, pp=2)
    rng = np.random.default_rng(pp)
    dp = 9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(8):
            predicted = rng.uniform(0.5, 3.0, (dp, pp))
            measured = predicted * rng.uniform(0.7, 1.4, (dp, pp))
            if step == 3:
                measured[2, 0] = 0.0              # one stage took no time: rank 2's stages keep
            if step in (4, 6):
                measured[5] *= 50.0               # clipped (warned at the first)
            if step == 7:
                measured[1, -1] = np.nan          # the loop's case
            fast.calibrate_ranks(predicted, measured)
            for r in range(dp):
                ok = np.isfinite(measured[r]).all()
                ref.calibrate(r, predicted[r] if ok else None, measured[r] if ok else None)
                ref.calibrate_stages(r, predicted[r], measured[r])
            assert fast.calibration_state() == ref.calibration_state(), f"step {step}"
    took = LatencyModel.analytic(shape, pp=2)
    ok = np.ones((3, pp))
    assert took._calibrate_all(ok, ok * 1.1) and not took._calibrate_all(ok, ok * np.nan)


def test_the_grid_is_every_cells_rank_times_stage_factor(lm):
    # the one-pass grid against the per-cell look-ups it replaced, bit for bit, with factors
    # learned for some cells only and one DP rank outside the grid asked for
    rng = np.random.default_rng(3)
    for r in range(4):
        p = rng.random(2) + 0.5
        lm.calibrate(r, p, p * rng.uniform(0.7, 1.4, 2))
        if r % 2:
            lm.calibrate_stages(r, p, p * rng.uniform(0.7, 1.4, 2))
    for dp, pp in ((3, 2), (5, 3)):
        cells = np.array([[lm.correction(r) * lm.stage_correction(r, s) for s in range(pp)]
                          for r in range(dp)])
        assert np.array_equal(lm.correction_grid(dp, pp), cells)
    assert lm.correction_grid(5, 3)[4].tolist() == [1.0, 1.0, 1.0]
