"""SAB's sensitivity estimates (``batching.SensitivityTracker``): a measured sample, else its
length bucket, else (loss) the mean over all or the length prior; the bulk look-up is the
per-segment rule; the loss and recall signals; the state a run resumes from."""

import numpy as np
import pytest

from sparsebalance_megatron.batching import SensitivityTracker


def test_sensitivity_tracker_prefers_sample_then_bucket_then_prior():
    t = SensitivityTracker(ema=0.5, signal="recall")
    prior = t.estimate([1, 2], [1000, 8000])
    assert prior[0] > prior[1] > 0                  # shorter documents are more sensitive
    t.update([1], [1000], [0.6])
    est = t.estimate([1, 3, 2], [1000, 1010, 8000])
    assert est[0] == pytest.approx(0.4)             # measured sample
    assert est[1] == pytest.approx(0.4)             # same length bucket
    assert est[2] == pytest.approx(prior[1])        # untouched bucket keeps the prior
    t.update([3], [1010], [0.8])
    assert t.estimate([9], [1020])[0] == pytest.approx(1 - (0.5 * 0.6 + 0.5 * 0.8))
    t.update([4], [64], [float("nan")])             # missing measurement: ignored
    assert t.estimate([4], [64])[0] == pytest.approx(t.estimate([5], [64])[0])
    with pytest.raises(ValueError, match="recall"):
        t.update([1], [10], [1.5])
    t2 = SensitivityTracker(signal="recall")
    t2.load_state_dict(t.state_dict())
    assert np.array_equal(t2.estimate([1, 9], [1000, 1020]), t.estimate([1, 9], [1000, 1020]))


@pytest.mark.parametrize("signal", ["loss", "recall"])
def test_estimates_are_the_per_segment_look_ups(signal):
    # the estimate looks buckets and samples up in bulk: bit for bit the per-segment rule
    # (sample, else bucket, else the mean over all (loss), else the length prior)
    from sparsebalance_megatron.batching.sensitivity import length_bucket, prior_sensitivity

    rng = np.random.default_rng(4)
    t = SensitivityTracker(signal=signal)
    ids, lengths = rng.integers(0, 400, 300), rng.integers(1, 40_000, 300)
    t.update(ids[:150], lengths[:150], rng.random(150))
    q_ids, q_len = rng.integers(0, 400, 500), rng.integers(1, 80_000, 500)
    want = []
    for i, n in zip(q_ids.tolist(), q_len.tolist()):
        v = t._sample.get(i, t._bucket.get(int(length_bucket([n])[0])))
        if v is None and signal == "loss":
            v = t._all
        want.append(float(prior_sensitivity([n])[0]) if v is None else
                    (1.0 - v if signal == "recall" else -v))
    got = t.estimate(q_ids, q_len)
    assert got.tolist() == want
    assert len(set(got.tolist())) > 50                  # samples, buckets and priors all hit


def test_loss_signal_lower_loss_is_more_sensitive_and_unmeasured_take_the_mean():
    """The default signal: minus a document's mean training loss (well-predicted text loses most
    when sparsified); unmeasured documents take their bucket, else the EMA over all documents,
    so measured and unmeasured estimates share one scale."""
    t = SensitivityTracker(ema=0.5)
    assert t.signal == "loss"
    prior = t.estimate([1, 2], [1000, 8000])
    assert prior[0] > prior[1]                      # before any measurement: the length prior
    t.update([1, 2], [1000, 8000], [2.0, 3.5])      # 1 is code-like (low loss): more sensitive
    est = t.estimate([1, 2, 3, 4], [1000, 8000, 1010, 100_000])
    assert est[0] == -2.0 and est[1] == -3.5 and est[0] > est[1]
    assert est[2] == -2.0                           # 1's length bucket
    assert est[3] == pytest.approx(-(0.5 * 2.0 + 0.5 * 3.5))   # EMA over all samples
    with pytest.raises(ValueError, match="loss must lie in"):
        t.update([5], [10], [-0.1])
    saved = t.state_dict()
    t2 = SensitivityTracker()
    t2.load_state_dict(saved)
    assert np.array_equal(t2.estimate([1, 3, 4], [1000, 1010, 7]), t.estimate([1, 3, 4],
                                                                              [1000, 1010, 7]))
    with pytest.raises(ValueError, match="resume with --sb-sensitivity-signal loss"):
        SensitivityTracker(signal="recall").load_state_dict(saved)
    old = {k: v for k, v in saved.items() if k not in ("signal", "all")}   # an older state
    with pytest.raises(ValueError, match="measured 'recall'"):
        SensitivityTracker().load_state_dict(old)
    with pytest.raises(ValueError, match="--sb-sensitivity-signal='x'"):
        SensitivityTracker(signal="x")
