"""Length-mix families of the robustness study (issue 27): deterministic per seed, the shapes
their docstrings promise, clear errors."""

import numpy as np
import pytest

from sparsebalance_megatron.experiments import mixes
from sparsebalance_megatron.experiments.mixes import mix_lengths

TOK = 1 << 20


@pytest.mark.parametrize("name", mixes.SYNTHETIC_MIXES)
def test_synthetic_mixes_are_deterministic_per_seed_and_reach_their_tokens(name):
    a, b, c = (mix_lengths(name, s, total_tokens=TOK) for s in (3, 3, 4))
    assert a.dtype == np.int64 and np.array_equal(a, b)
    assert not np.array_equal(a, c)                       # another seed, another mix
    assert a.sum() >= TOK and a.min() >= 1
    assert a[:-1].sum() < TOK or name == "both"           # stops at the first prefix that reaches it


def test_family_shapes():
    short = mix_lengths("lognormal_short", 0, total_tokens=TOK)
    assert short.min() >= mixes.SHORT_MIN and short.max() <= mixes.SHORT_MAX
    assert 0.8 * mixes.SHORT_MEDIAN <= np.median(short) <= 1.2 * mixes.SHORT_MEDIAN
    assert np.percentile(short, 99) > 5 * np.median(short)            # a tail, not a spike
    long = mix_lengths("long_tail", 0, total_tokens=TOK * 8)
    assert long.min() >= mixes.LONG_MIN and long.max() <= mixes.LONG_MAX
    # log-uniform: the geometric midpoint splits the documents about in half
    mid = np.sqrt(mixes.LONG_MIN * mixes.LONG_MAX)
    assert 0.3 <= np.mean(long < mid) <= 0.7
    mix = mix_lengths("both", 0, total_tokens=TOK * 4)
    longs = mix[mix >= mixes.LONG_MIN]
    assert 0.4 <= longs.sum() / mix.sum() <= 0.6                      # half the tokens long
    assert longs.size < 0.05 * mix.size                               # a few long documents
    assert np.any(np.diff((mix >= mixes.LONG_MIN).astype(int)) != 0)  # interleaved, not blocks


def test_both_long_share_bounds():
    assert mixes.both(1, TOK, long_share=0.0).max() <= mixes.SHORT_MAX
    assert mixes.both(1, TOK, long_share=1.0).min() >= mixes.LONG_MIN
    with pytest.raises(ValueError, match="long_share=1.5"):
        mixes.both(1, TOK, long_share=1.5)


@pytest.mark.parametrize("kw, msg", [(dict(name="zipf"), "length mix 'zipf': expected one of "
                                      "file, section, lognormal_short, long_tail, both"),
                                     (dict(name="long_tail", seed=-1), "seed=-1"),
                                     (dict(name="long_tail", total_tokens=0), "total_tokens=0")])
def test_bad_input_is_named(kw, msg):
    kw = dict(dict(seed=0), **kw)
    with pytest.raises(ValueError, match=msg):
        mix_lengths(kw.pop("name"), kw.pop("seed"), **kw)
