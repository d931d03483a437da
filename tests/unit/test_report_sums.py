"""The step report's figures from the DP group's sums (megatron/step/report_sums.py, issue 77):
each DP rank sums its own micro-batches (``rank_parts``), one all-reduce adds them, and the
record's figures (``step_figures``) equal a brute-force oracle over the whole step's
[dp, m, stages] arrays: exactly for the integer sums (pairs, tokens), to float rounding for the
means. The reporter on one-row steps (k DP ranks in threads, a fake reduce and gather) reports
what one reporter of the whole plan reports."""

from __future__ import annotations

import argparse
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sparsebalance_megatron.batching.packing import sequential_plan
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.step.report_sums import (document_tokens, kept_work,
                                                              rank_parts, step_figures,
                                                              summed_parts, unit_work)
from sparsebalance_megatron.plan import BudgetPlan

DP, M, BLOCK = 4, 2, 16
LAYERS, ATTENTION = (3, 2), (2, 1)        # a hybrid layout: attention layers per stage
ROUTING = 48                              # documents shorter than this run dense


def _step(seed=0, dp=DP):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 200, 24)
    batch = sequential_plan([(i, 0, int(n)) for i, n in enumerate(lengths)], dp=dp,
                            num_microbatches=M, max_tokens=512)
    densities = rng.choice([0.25, 0.375, 0.5, 0.75, 1.0], (dp, M, len(LAYERS)))
    return batch, densities, np.asarray(lengths) + 1


def _oracle(batch, d, doc_positions, busy, routing=ROUTING):
    """The figures from the whole step's arrays, by hand: attention-layer-weighted work, routed
    work at density 1 (every stage's attention layers), per DP rank over its units and stages."""
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    att = np.asarray(ATTENTION, dtype=np.float64)
    work, dense = unit_work(batch, sb, routing)                      # [dp, m] each
    w = work[:, :, None] * att                                       # [dp, m, stages]
    dw = np.zeros_like(w) if dense is None else dense[:, :, None] * att
    kept = kept_work(batch, sb, d, routing) * att
    rank = ((d * w).sum(axis=(1, 2)) + dw.sum(axis=(1, 2))) / (w + dw).sum(axis=(1, 2))
    return {"mean_density": ((d * w).sum() + dw.sum()) / (w + dw).sum(),
            "density_per_stage": list(((d * w).sum(axis=(0, 1)) + dw.sum(axis=(0, 1)))
                                      / (w + dw).sum(axis=(0, 1))),
            "density_rank_min": rank.min(), "density_rank_max": rank.max(),
            "kept_density": (kept.sum() + dw.sum()) / (w + dw).sum(),
            "tokens": document_tokens(batch, doc_positions),
            "positions": int(batch.packed_lengths().sum()),
            "busy_max_s": busy.max(), "busy_mean_s": busy.mean(),
            "measured_imbalance": busy.max() / busy.mean()}


def _figures(batch, d, doc_positions, busy, routing=ROUTING):
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    parts = [rank_parts(batch.row_plan(r), sb, d[r:r + 1], layers=LAYERS,
                        attention_layers=ATTENTION, dense_below_tokens=routing,
                        doc_positions=doc_positions, busy=busy[r]) for r in range(batch.dp)]
    return step_figures(summed_parts(parts), layers=LAYERS, attention_layers=ATTENTION), parts


@pytest.mark.parametrize("routing", [ROUTING, 0])
def test_the_figures_from_the_groups_sums_are_the_whole_steps(routing):
    from sparsebalance_megatron.policy.density_means import weighted_mean_density
    from tests.unit._bands import stage_mean_densities

    batch, d, pos = _step()
    busy = np.array([1.0, 1.5, 0.75, 1.25])
    got, parts = _figures(batch, d, pos, busy, routing)
    want = _oracle(batch, d, pos, busy, routing)
    for key in ("tokens", "positions", "busy_max_s"):                 # integers, a maximum
        assert got[key] == want[key], key
    for key in ("mean_density", "kept_density", "density_rank_min", "density_rank_max",
                "busy_mean_s", "measured_imbalance"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=0), key
    assert got["density_per_stage"] == pytest.approx(want["density_per_stage"], rel=1e-12)
    assert got["density_rank_min"] < got["density_rank_max"]          # the ranks differ
    assert got["layers_per_stage"] == [3, 2] and got["attention_layers_per_stage"] == [2, 1]
    # the same numbers the plan's own means give (policy/density_means.py, the whole arrays)
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    work, dense = unit_work(batch, sb, routing)
    att = np.asarray(ATTENTION, dtype=np.float64)
    w, dw = work[:, :, None] * att, None if dense is None else dense[:, :, None] * att
    assert (dense is None) == (routing == 0) and work.sum() > 0
    assert dense is None or dense.sum() > 0                 # routed and sparse documents both
    assert got["mean_density"] == pytest.approx(weighted_mean_density(d, w, dw), rel=1e-12)
    assert got["density_per_stage"] == pytest.approx(stage_mean_densities(d, w, dw), rel=1e-12)
    # the weights' sums are integers (block pairs), exact in float64 over any order
    total = summed_parts(parts)
    assert np.array_equal(total["work_s"], w.sum(axis=(0, 1)))
    assert total["dense"] == (0 if dense is None else dense.sum())
    # a fixed size: the reduced vectors hold stages, not DP ranks or micro-batches
    floats = {op: sum(np.size(v) for v in parts[0][op].values()) for op in ("sum", "max")}
    assert floats == {"sum": 3 * len(LAYERS) + 7, "max": 4}


def test_an_untimed_rank_leaves_the_busy_figures_out():
    batch, d, pos = _step()
    got, _ = _figures(batch, d, pos, np.array([1.0, np.nan, 1.0, 1.0]))
    assert "busy_max_s" not in got and "measured_imbalance" not in got
    assert "mean_density" in got


def test_the_calibration_figures_are_the_ranks_mean_error_and_factor_range():
    """Each DP rank calibrates its own pipeline: the record's latency error is the mean over
    the ranks with an error this step (NaN: none), its factors' least and greatest, reduced
    with the report's sums; no rank with an error: None."""
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    batch, d, pos = _step()
    cal = [(0.1, 1.2), (np.nan, 0.8), (0.3, 1.0), (0.2, 1.5)]

    def figures(cal):
        return step_figures(summed_parts([rank_parts(batch.row_plan(r), sb, d[r:r + 1],
                                                     calibration=cal[r])
                                          for r in range(batch.dp)]))
    got = figures(cal)
    assert got["latency_error"] == pytest.approx(0.2, rel=1e-12)
    assert (got["calibration_min"], got["calibration_max"]) == (0.8, 1.5)
    assert figures([(np.nan, f) for _, f in cal])["latency_error"] is None
    assert "latency_error" not in figures([None] * batch.dp)


def test_weight_totals_of_sums_are_the_arrays_means_with_zero_weights():
    """A stage whose weights are all zero falls back to its plain mean, from the sums as from
    the arrays."""
    from sparsebalance_megatron.policy.density_means import WeightTotals
    from tests.unit._bands import stage_mean_densities

    rng = np.random.default_rng(1)
    d = rng.uniform(0.1, 1.0, (3, 4, 3))
    w = rng.integers(0, 50, (3, 4, 3)).astype(float)
    w[:, :, 1] = 0.0
    got = WeightTotals.of_sums(w.sum(axis=(0, 1))).stage((d * w).sum(axis=(0, 1)),
                                                         lambda: d.sum(axis=(0, 1)) / 12)
    assert got == pytest.approx(stage_mean_densities(d, w), rel=1e-12)


class Group:
    """k DP ranks in threads of one process: the DP group's reduce and row gather."""

    def __init__(self, k: int):
        self.k, self.slots, self.barrier = k, [None] * k, threading.Barrier(k, timeout=60)
        self.local = threading.local()

    def _all(self, value) -> list:
        self.slots[self.local.rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def reduce(self, parts: dict) -> dict:
        every = self._all(parts)
        out = {k: sum(p["sum"][k] for p in every) for k in parts["sum"]}
        out.update({k: max(p["max"][k] for p in every) for k in parts["max"]})
        return out

    def gather_rows(self, row) -> np.ndarray:
        return np.stack(self._all(np.asarray(row, dtype=np.float64)))


def _reporter(sb, layout, r, pos):
    from sparsebalance_megatron.megatron.step.reporting import StepReporter

    args = argparse.Namespace(log_interval=1, train_iters=1, tensorboard_log_interval=1)
    return StepReporter(args, sb, dp=DP, dp_rank=r, layout=layout, doc_positions=pos,
                        dense_below_tokens=ROUTING)


def test_one_row_steps_report_the_whole_plans_figures(monkeypatch, tmp_path):
    """Each DP rank reports its one-row step with the group's reduce: every rank's record holds
    the whole plan's figures, and the metrics file's per-unit detail (rank 0, the rows
    gathered) is the whole plan's."""
    import json

    from sparsebalance_megatron.latency.layout import PipelineLayout
    from sparsebalance_megatron.megatron.runtime import comm
    from sparsebalance_megatron.megatron.step.planning import PreparedStep
    from sparsebalance_megatron.megatron.step.record import StepSummary

    layout = PipelineLayout(2, 1, LAYERS, pattern="*M*" + "M*")
    assert layout.attention_layers == ATTENTION
    batch, d, pos = _step()
    plan = BudgetPlan(0, d)
    measured = np.array([[0.5, 0.5], [0.75, 0.75], [0.25, 0.5], [0.5, 0.75]])
    summary = StepSummary(step_s=2.0, loss=(20.0, 10.0))
    whole_sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK,
                                   metrics_file=str(tmp_path / "whole.jsonl"))
    whole = _reporter(whole_sb, layout, 0, pos).report(
        1, PreparedStep(0, 0, batch, plan, None), summary, measured, {}, overhead_s=0.0)
    want = _oracle(batch, d, pos, measured.sum(axis=1))
    assert whole["density_rank_max"] == pytest.approx(want["density_rank_max"], rel=1e-12)
    assert whole["busy_max_s"] == 1.5 and whole["measured_imbalance"] == pytest.approx(1.5 / 1.125)

    group = Group(DP)
    monkeypatch.setattr(comm, "rank", lambda: group.local.rank)
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK,
                             metrics_file=str(tmp_path / "rows.jsonl"))

    def rank(r):
        group.local.rank = r
        step = PreparedStep(0, 0, batch.row_plan(r), plan, None)
        return _reporter(sb, layout, r, pos).report(
            1, step, summary, measured[r:r + 1], {}, overhead_s=0.0,
            reduce=group.reduce, gather=group.gather_rows)

    with ThreadPoolExecutor(DP) as pool:
        recs = list(pool.map(rank, range(DP)))
    keys = ("tokens", "positions", "mean_density", "density_per_stage", "density_rank_min",
            "density_rank_max", "kept_density", "busy_max_s", "busy_mean_s",
            "measured_imbalance")
    for rec in recs:
        for key in keys:
            assert rec[key] == pytest.approx(whole[key], rel=1e-12), key
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("whole.jsonl", "rows.jsonl"))
    for key in ("attn_work", "dense_work", "densities", "plan"):
        assert a[key] == b[key], key


def test_a_one_row_step_without_the_groups_reduce_is_refused():
    from sparsebalance_megatron.megatron.step.planning import PreparedStep
    from sparsebalance_megatron.megatron.step.record import StepSummary

    batch, d, pos = _step()
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    step = PreparedStep(0, 0, batch.row_plan(1), BudgetPlan(0, d), None)
    with pytest.raises(ValueError, match="1 of 4 DP ranks"):
        _reporter(sb, None, 1, pos).report(1, step, StepSummary(loss=(1.0, 1.0)),
                                           np.ones((1, 2)), {}, overhead_s=0.0)


def test_the_rank_parts_alone_make_no_plan_figures_without_a_plan():
    batch, _, pos = _step()
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    parts = [rank_parts(batch.row_plan(r), sb, None, doc_positions=pos) for r in range(DP)]
    got = step_figures(summed_parts(parts))
    assert got == {"tokens": document_tokens(batch, pos),
                   "positions": int(batch.packed_lengths().sum())}
    assert got["tokens"] > 0


def test_the_kept_curve_summed_over_the_group_is_the_steps_kept_pairs_at_each_density():
    """``kept_curve`` (--sb-eval-density trained): every DP rank's units at each density of
    the grid, summed by the reduce, as ``kept_work`` counts the whole step at that density
    (routed documents left out)."""
    batch, d, _ = _step(3)
    sb = SparseBalanceConfig(sparse_attention=True, block_size=BLOCK)
    grid = np.array([0.1, 0.5, 0.77, 1.0])
    parts = [rank_parts(batch.row_plan(r), sb, d[r:r + 1], dense_below_tokens=ROUTING,
                        kept_curve_grid=grid) for r in range(DP)]
    want = [kept_work(batch, sb, np.full((DP, M, 1), g), ROUTING).sum() for g in grid]
    assert summed_parts(parts)["kept_curve"].tolist() == want
