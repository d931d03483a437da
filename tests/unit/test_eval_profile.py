"""--sb-eval-density trained (``megatron/step/eval_profile.py``): evaluation reads each decoder
layer at the mean density DST planned its stage at, scaled to uniform d0's kept work; the
profile survives a checkpoint on any layout; a launch without DST is refused."""

from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.latency.layout import PipelineLayout
from sparsebalance_megatron.latency.work import attention_work, scaled_to_work
from sparsebalance_megatron.megatron.launch.data_checks import quality_conflicts
from sparsebalance_megatron.megatron.step.eval_profile import TrainedProfile


def _brute_factor(profile, work, target):
    """The factor found on a fine grid (the oracle of the bisection)."""
    grid = np.linspace(1e-5, 3.0, 300001)
    sums = [sum(work(min(1.0, c * p)) for p in profile) for c in grid[::100]]
    k = int(np.searchsorted(sums, target)) * 100
    fine = grid[max(0, k - 100):k + 1]
    return fine[np.searchsorted([sum(work(min(1.0, c * p)) for p in profile) for c in fine],
                                target)]


@pytest.mark.parametrize("work", [lambda d: d, lambda d: attention_work([300, 700, 1500], d, 32)],
                         ids=["planned", "kept-pairs"])
def test_scaled_to_work_keeps_the_shape_at_the_target_cost(work):
    profile = [0.62, 0.48, 0.41, 0.95]
    target = len(profile) * work(0.5)
    got = scaled_to_work(profile, work, 0.5)
    c = _brute_factor(profile, work, target)
    assert got == pytest.approx([min(1.0, c * p) for p in profile], abs=2e-4)
    assert sum(work(d) for d in got) == pytest.approx(target, rel=2e-3)


def test_the_profile_is_the_mean_of_the_steps_at_d0s_work():
    prof = TrainedProfile(PipelineLayout.even(6, pp=3), 0.5)
    assert prof.layer_densities() is None and prof.stage_densities() is None
    prof.add([0.6, 0.5, 0.4])
    prof.add(None)                                   # a step without a plan adds nothing
    prof.add([0.8, 0.5, 0.4])
    assert prof.steps == 2
    mean = np.array([0.7, 0.5, 0.4])
    want = mean * 0.5 * 3 / mean.sum()                # no layer capped: one factor, closed form
    layers = prof.layer_densities()
    assert sorted(layers) == [1, 2, 3, 4, 5, 6]
    assert [layers[n] for n in (1, 3, 5)] == pytest.approx(want, abs=1e-4)
    assert [layers[n] for n in (2, 4, 6)] == pytest.approx(want, abs=1e-4)
    assert prof.stage_densities() == pytest.approx(want, abs=1e-4)
    with pytest.raises(ValueError, match="expected 3 stages"):
        prof.add([0.5, 0.5])


def test_with_the_documents_kept_work_the_profile_keeps_d0s_kept_pairs():
    """The kept pairs of the documents trained on, counted at the grid: the scaled profile
    keeps (to the grid's interpolation) what uniform d0 keeps of them, the study's reading."""
    lengths, block = [40, 90, 200, 300, 700, 1500], 32
    prof = TrainedProfile(PipelineLayout.even(3, pp=3), 0.5)

    def kept(d):
        return attention_work(lengths, d, block)
    curve = [kept(g) for g in TrainedProfile.GRID]
    prof.add([0.62, 0.5, 0.41], curve)
    prof.add([0.60, 0.5, 0.43], curve)
    got = list(prof.layer_densities().values())
    assert sum(kept(d) for d in got) == pytest.approx(3 * kept(0.5), rel=5e-3)
    assert np.array(got) / got[1] == pytest.approx(np.array([0.61, 0.5, 0.42]) / 0.5, abs=1e-3)
    planned = TrainedProfile(PipelineLayout.even(3, pp=3), 0.5)
    planned.add([0.61, 0.5, 0.42])
    assert sum(kept(d) for d in planned.layer_densities().values()) > 3 * kept(0.5) * 1.005


def test_a_capped_layer_leaves_the_work_to_the_others():
    prof = TrainedProfile(PipelineLayout.even(2, pp=2), 0.8)
    prof.add([1.0, 0.2])
    assert prof.layer_densities() == {1: 1.0, 2: pytest.approx(0.6, abs=1e-4)}


def test_a_hybrid_models_attention_layers_only():
    prof = TrainedProfile(PipelineLayout.from_hybrid_pattern("*-|-*", pp=2), 0.5)
    prof.add([0.7, 0.3])
    assert prof.layer_densities() == {1: pytest.approx(0.7), 4: pytest.approx(0.3)}
    assert prof.stage_densities() == pytest.approx([0.7, 0.3])


def test_the_profile_survives_a_checkpoint_on_another_layout():
    saved = TrainedProfile(PipelineLayout.even(4, pp=2), 0.5)
    saved.add([0.6, 0.4])
    state = saved.state_dict()
    other = TrainedProfile(PipelineLayout.even(4, pp=4), 0.5)   # per layer: any layout's
    assert other.load_state_dict(state) is None
    assert other.layer_densities() == saved.layer_densities()
    assert other.curve.tolist() == saved.curve.tolist()
    other.add([0.5, 0.5, 0.5, 0.5])
    assert other.steps == 2
    deeper = TrainedProfile(PipelineLayout.even(6, pp=2), 0.5)
    note = deeper.load_state_dict(state)
    assert "covers 4 decoder layers, this model has 6" in note and deeper.steps == 0
    assert other.load_state_dict(None) is None and other.steps == 0   # none saved: afresh


def test_trained_needs_dst_and_a_bad_value_is_refused():
    args = SimpleNamespace(context_parallel_size=1)
    assert quality_conflicts(args, SparseBalanceConfig(sparse_attention=True,
                                                       eval_density="trained"), True) == [
        "--sb-eval-density trained without DST (the profile is the densities DST's plans give "
        "each stage: --sparse-balance or --sb-dst)"]
    assert quality_conflicts(args, SparseBalanceConfig(sparse_balance=True,
                                                       eval_density="trained"), True) == []
    with pytest.raises(ConfigError, match="--sb-eval-density='profile': expected one of d0, trained"):
        SparseBalanceConfig(eval_density="profile")
