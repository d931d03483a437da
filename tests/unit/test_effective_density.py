"""A planned density becomes a kept block count by ``ceil(d x available)`` per query block, never
below the forced sink and diagonal blocks; on short documents most densities keep the same
blocks. DST plans at effective densities (``UnitCosts.effective_index``): a move that keeps no
other block is no move, and cannot pay for a real cut in the density floors (issue 62)."""

import numpy as np
import pytest
import torch

from sparsebalance_megatron.attention.api import block_sparse_attention
from sparsebalance_megatron.latency.features import UnitFeatures
from sparsebalance_megatron.latency.work import attention_work
from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
from sparsebalance_megatron.policy.dst_rounds import plan_dst
from sparsebalance_megatron.policy.dst_settings import DSTSettings

BLOCK = 32


def _kernel_kept(blocks: list, density: float) -> list:
    """Kept key blocks of each document as the attention's selection keeps them."""
    torch.manual_seed(0)
    lens = [BLOCK * n for n in blocks]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 2, 8)
    k, v = torch.randn(cu[-1], 1, 8), torch.randn(cu[-1], 1, 8)
    _, sel = block_sparse_attention(q, k, v, cu, density, block_size=BLOCK, backend="torch")
    causal = torch.tensor([n * (n + 1) / 2 for n in blocks])
    return (sel.density_kept.double() * causal).round().long().tolist()


def test_kept_blocks_per_document_at_d0_and_above():
    # (blocks, kept at 0.125, 0.25, 0.28, 0.30, 0.5): the selection's counts, the latency
    # model's, and the figures QUALITY.md quotes
    want = {4: (7, 7, 7, 7, 7), 7: (13, 13, 13, 14, 17), 8: (15, 15, 16, 17, 21),
            12: (23, 27, 30, 31, 43), 16: (31, 43, 48, 50, 73)}
    densities = (0.125, 0.25, 0.28, 0.30, 0.5)
    for j, d in enumerate(densities):
        got = _kernel_kept(list(want), d)
        assert got == [w[j] for w in want.values()], d
        assert got == [attention_work([BLOCK * n], d, BLOCK) for n in want]
    # a document of up to 7 blocks keeps its forced blocks (1 + 2 x (n - 1)) at every density
    # from 0.125 to 2/7: raising or cutting it from d0 = 0.25 inside that keeps no other block
    for n in range(1, 8):
        kept = {attention_work([BLOCK * n], d, BLOCK) for d in np.arange(0.125, 2 / 7, 1 / 64)}
        assert kept == {float(min(n * (n + 1) // 2, 2 * n - 1))}


def test_kept_grid_is_the_selection_rule_whatever_the_work_mode():
    lens = [[96, 96, 64], [512], [224, 288]]
    grid = density_grid(0.25, 0.125, 1.0)
    for mode in ("kept", "chunked"):
        feats = UnitFeatures.build(lens, BLOCK, work_mode=mode)
        want = [[attention_work(u, d, BLOCK) for d in grid] for u in lens]
        assert np.array_equal(feats.kept_grid(grid), want)


def _costs(kept_grid: bool) -> UnitCosts:
    """Rank 0: one 16-block document (a straggler); rank 1: ten 3-block documents, which keep
    their forced blocks at every density up to 2/3. Seconds affine in kept pairs."""
    grid = density_grid(0.25, 0.125, 0.6)
    kept = np.array([[[attention_work([BLOCK * 16], d, BLOCK) for d in grid]],
                     [[attention_work([BLOCK * 3] * 10, d, BLOCK) for d in grid]]])  # [2, 1, g]
    t = np.array([3.0, 1.0])[:, None, None, None] + 0.05 * kept[:, :, None, :]
    work = np.array([136.0, 60.0])[:, None, None]                  # causal pairs
    return UnitCosts(grid, t / 3, 2 * t / 3, work, kept_grid=kept if kept_grid else None)


def test_a_raise_that_keeps_no_block_pays_for_no_cut():
    plan = {}
    for kept_grid in (False, True):
        costs = _costs(kept_grid)
        p = plan_dst(costs, None, DSTSettings(0.25, 0.125, 0.6, density_floor=1.0,
                                                         stage_density_floor=0.0))
        kept = [attention_work([BLOCK * 16], p.densities[0, 0, 0], BLOCK),
                attention_work([BLOCK * 3] * 10, p.densities[1, 0, 0], BLOCK)]
        plan[kept_grid] = (p.densities.reshape(-1).tolist(), kept, p.report.mean_density)
    # at nominal densities the free raise of rank 1 (no block kept) met the floor for a real
    # cut of the straggler: planned density up, kept blocks down (43 + 50 -> fewer + 50)
    dens, kept, mean = plan[False]
    assert dens[1] > 0.25 and dens[0] < 0.25 and mean >= 0.25
    assert kept[1] == 50 and kept[0] < 43
    # at effective densities the raise is none and the floor allows no cut
    dens, kept, mean = plan[True]
    assert dens == [0.25, 0.25] and kept == [43, 50] and mean == 0.25


def test_effective_index_moves_to_the_nearest_index_keeping_as_many():
    grid = np.array([0.125, 0.25, 0.375, 0.5, 0.75, 1.0])
    kept = np.array([[[5.0, 5.0, 5.0, 7.0, 7.0, 9.0]]])             # [1, 1, g]
    t = 1.0 + kept[:, :, None, :]
    costs = UnitCosts(grid, t, t, t[..., 0], kept_grid=kept)
    i0 = 1
    got = [int(costs.effective_index(np.array([[[i]]]), i0)[0, 0, 0]) for i in range(6)]
    # 0 and 2 keep what d0 keeps: back to d0; 4 keeps what 3 does (the lowest); 5 stays
    assert got == [1, 1, 1, 3, 3, 5]
    # where the seconds differ (a table whose cost is not the kept blocks': padding) a raise
    # still comes down, as it costs no more, and a cut stays, as it saves time
    t2 = t.copy()
    t2[..., 0] -= 0.5
    t2[..., 2] += 0.5
    costs = UnitCosts(grid, t2, t2, t2[..., 0], kept_grid=kept)
    assert int(costs.effective_index(np.array([[[2]]]), i0)[0, 0, 0]) == 1
    assert int(costs.effective_index(np.array([[[0]]]), i0)[0, 0, 0]) == 0
    assert np.array_equal(UnitCosts(grid, t, t, t[..., 0]).effective_index(np.array([[[4]]]), i0), [[[4]]])


def test_a_raise_that_keeps_only_padding_blocks_pays_for_no_cut():
    """A micro-batch's padding runs through the attention as pieces of its own, so it costs
    time at every density; its kept blocks are no document's. ``from_latency`` tabulates the
    seconds with the padding and ``kept_grid`` from the documents alone (``kept_units``): rank
    1 (a 3-block document, then 125 blocks of padding in pieces of 16) keeps no other document
    block at any density up to 2/3, so raising it pays for no cut of rank 0's 128-block
    document (analytic model, block 64: rank 0 is the straggler)."""
    from sparsebalance_megatron.latency import LatencyModel
    b = 64
    lm = LatencyModel.analytic(pp=1, block_size=b)
    grid = density_grid(0.25, 0.125, 0.6)
    padded = [np.array([b * 128]), np.array([b * 3] + [b * 16] * 7 + [b * 13])]
    docs = [np.array([b * 128]), np.array([b * 3])]
    settings = DSTSettings(0.25, 0.125, 0.6, density_floor=1.0, stage_density_floor=0.0)
    plans = {}
    for name, kept_units in (("padding counted", None), ("documents", docs)):
        costs = UnitCosts.from_latency(lm, padded, 2, 1, grid, kept_units=kept_units)
        plans[name] = plan_dst(costs, None, settings).densities.reshape(-1)
    # counted with its padding, rank 1's raise keeps more blocks and lets rank 0 be cut
    assert plans["padding counted"][1] > 0.25 and plans["padding counted"][0] < 0.25
    # with the documents' blocks the raise keeps nothing more: no raise, no cut
    assert plans["documents"].tolist() == [0.25, 0.25]
    with pytest.raises(ValueError, match="kept_units has 1 micro-batches"):
        UnitCosts.from_latency(lm, padded, 2, 1, grid, kept_units=docs[:1])


def test_effective_index_of_a_small_slice_is_one_gather_with_the_same_answers():
    """A small costs object (a DP rank's slice, at most 2^15 table entries) answers from every
    (unit, index)'s answer made once; a larger one moves the units it is given: a rank's slice
    answers as the whole step's costs do for its rows, whatever the plans' leading axes."""
    from sparsebalance_megatron.policy.dst_ranks import rank_slice
    rng = np.random.default_rng(3)
    dp, m, pp, g = 9, 16, 4, 57
    grid = np.linspace(0.125, 1.0, g)
    kept = np.cumsum(rng.random((dp, m, g)) < 0.3, axis=-1).astype(float)   # runs of equals
    f = 1.0 + kept[:, :, None, :] + np.where(rng.random((dp, m, pp, g)) < 0.2, 0.5, 0.0)
    f = np.maximum.accumulate(f, axis=-1)               # padding: some runs' seconds differ
    whole = UnitCosts(grid, f, 2 * f, f[..., 0], kept_grid=kept)
    assert whole.fwd_s.size > 1 << 15
    for i0 in (0, 20, g - 1):
        idx = rng.integers(0, g, (5, dp, m, pp))
        want = whole.effective_index(idx, i0)
        assert whole._effective[i0][2] is None                      # moved unit by unit
        for r in range(dp):
            part = rank_slice(whole, r)
            got = part.effective_index(idx[:, r:r + 1], i0)
            assert part._effective[i0][2] is not None               # one gather
            assert np.array_equal(got, want[:, r:r + 1])
            assert np.array_equal(part.effective_index(idx[0, r:r + 1], i0), want[0, r:r + 1])
        assert not rank_slice(whole, 0)._effective                  # made per costs object
