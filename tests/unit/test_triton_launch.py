"""The ``triton`` backend's launch-settings table on CPU: every candidate is a config the kernels
take, and a bad field is refused by name."""

from dataclasses import replace

import pytest

from sparsebalance_megatron.attention import triton_launch
from sparsebalance_megatron.attention.triton_launch import (candidates, default_config,
                                                            launch_config)


def test_defaults_until_pinned_and_the_sweep_is_valid(monkeypatch):
    base = default_config(128, 128, 4)
    assert launch_config(128, 128, 4) == triton_launch.PINNED[(128, 128, 4)]   # the H200's
    assert launch_config(64, 128, 7) == default_config(64, 128, 7)             # none pinned
    # hn 128: 64 rows x 64 keys (every backward GEMM on wgmma, no spill: compile gate)
    assert (base.bwd_block_m, base.bwd_block_n, base.bwd_warps) == (64, 64, 8)
    assert default_config(64, 128, 7).bwd_block_n == 128      # hn 64: the whole key block
    assert default_config(64, 128, 7).fwd_warps == 8          # 4 warps spilled
    pinned = replace(base, bwd_warps=4)
    monkeypatch.setitem(triton_launch.PINNED, (128, 128, 4), pinned)
    assert launch_config(128, 128, 4) == pinned and launch_config(64, 128, 4) != pinned
    for key in ((128, 128, 4), (64, 128, 7), (256, 64, 1), (16, 16, 3)):
        cands = candidates(*key)
        assert cands[0] == default_config(*key) and len(set(cands)) == len(cands)
        assert 1 < len(cands) <= 64               # one device step covers them
        for c in cands:
            c.check(key[1])
            assert triton_launch.refused(c, key[0]) is None, (key, c)
    # what the gate refused is not swept: 128 backward rows, 64 x 128 at hn 128, 4-warp
    # 128-row forwards
    cands = candidates(128, 128, 4)
    assert all(c.bwd_block_m <= 64 for c in cands)
    assert not any(c.bwd_block_m == 64 and c.bwd_block_n == 128 for c in cands)
    assert not any(c.fwd_block_m == 128 and c.fwd_warps == 4 for c in cands)
    # the split backward comes right after the default: 32 rows over the whole key block
    # at hn 128 (64 x 128 spills on triton 3.6, split or not), 32 and 64 at hn 64; dQ tiles of
    # 64 and 128 rows
    split = [(c.bwd_block_m, c.bwd_block_n, c.dq_block_m) for c in cands[1:3]]
    assert split == [(32, 128, 64), (32, 128, 128)]
    assert all(c.dq_block_m == 0 for c in cands[3:]) and cands[0].dq_block_m == 0
    split64 = [(c.bwd_block_m, c.dq_block_m) for c in candidates(64, 128, 7) if c.dq_block_m]
    assert split64 == [(32, 64), (32, 128), (64, 64), (64, 128)]
    # 3 heads x block 16: 48 stacked rows, so one dQ tile size (64: the rows past 48 masked)
    assert {c.dq_block_m for c in candidates(16, 16, 3) if c.dq_block_m} == {64}


@pytest.mark.reliability(area="attention", case="a triton launch config the kernels cannot "
                         "take", expect="ValueError naming the field and what it must be")
@pytest.mark.parametrize("field,value,needle", [
    ("bwd_block_n", 48, "bwd_block_n=48: expected a power of two"),
    ("bwd_block_n", 256, "bwd_block_n=256: expected a power of two >= 16 dividing the block"),
    ("fwd_block_m", 8, "fwd_block_m=8: expected >= 16"),
    ("bwd_warps", 6, "bwd_warps=6: expected a power of two"),
    ("kv_chunk", 0, "kv_chunk=0: expected an integer >= 1"),
    ("dq_block_m", -1, "dq_block_m=-1: expected an integer >= 0"),
    ("dq_block_m", 96, "dq_block_m=96: expected a power of two"),
    ("dq_block_m", 8, "dq_block_m=8: expected >= 16"),
])
def test_bad_config_is_named(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        replace(default_config(128, 128, 4), **{field: value}).check(128)
