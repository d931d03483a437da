"""The quality refresh's runtime side without a run (``megatron/step/quality_probe.py``,
``launch/data_checks.quality_conflicts``): the statistics every rank sums give the documents'
loss change and its ratio-estimator error whatever the split over ranks; the refresh is due
every N-th iteration but the last; a launch it cannot serve is refused naming the flag."""

from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.megatron.launch.data_checks import quality_conflicts
from sparsebalance_megatron.megatron.step.quality_probe import QualityProbe, changes, pass_stats


def test_summed_statistics_give_the_documents_change_and_its_error():
    rng = np.random.default_rng(3)
    n, groups = 9, 3
    tokens = rng.integers(20, 300, n).astype(float)
    base = tokens * rng.uniform(2.0, 4.0, n)
    passes = [np.stack([base, tokens], 1)] + [
        np.stack([base + tokens * rng.normal(0.01 * (g + 1), 0.005, n), tokens], 1)
        for g in range(groups)]
    # two ranks' documents, summed as the DP all-reduce sums them
    row = pass_stats([p[:4] for p in passes]) + pass_stats([p[4:] for p in passes])
    change, se, loss = changes(row, groups)
    assert loss == pytest.approx(base.sum() / tokens.sum())
    for g in range(groups):
        diff = passes[g + 1][:, 0] - base
        c = diff.sum() / tokens.sum()
        want = np.sqrt(((diff - c * tokens) ** 2).sum() * n / (n - 1)) / tokens.sum()
        assert change[g] == pytest.approx(c) and se[g] == pytest.approx(want)
        assert 0 < se[g] < abs(change[g])
    one = changes(pass_stats([p[:1] for p in passes]), groups)
    assert np.all(np.isinf(one[1]))         # one document: no spread, the error unknown


def test_due_every_nth_iteration_but_the_last():
    probe = QualityProbe.__new__(QualityProbe)
    probe.sb = SimpleNamespace(quality_refresh_interval=2)
    probe.args = SimpleNamespace(train_iters=6)
    assert [i + 1 for i in range(6) if probe.due(i)] == [2, 4]
    probe.sb.quality_refresh_interval = 0
    assert not any(probe.due(i) for i in range(6))


def _args(**kw):
    return SimpleNamespace(**{"context_parallel_size": 1,
                              "virtual_pipeline_model_parallel_size": None, **kw})


@pytest.mark.parametrize("sb,args,plugin_data,needle", [
    (dict(sparse_balance=True, dst_objective="density"), {}, True, "quality objective"),
    (dict(batching=True), {}, True, "quality objective"),
    (dict(sparse_balance=True, replay_plans="/tmp/plans.jsonl"), {}, True, "replay"),
    (dict(sparse_balance=True), {}, False, "data path"),
    (dict(sparse_balance=True), dict(context_parallel_size=2), True, "context-parallel-size 2"),
    (dict(sparse_balance=True), dict(virtual_pipeline_model_parallel_size=2), True,
     "interleaved"),
])
def test_a_launch_it_cannot_serve_is_refused(sb, args, plugin_data, needle):
    cfg = SparseBalanceConfig(quality_refresh_interval=3, **sb)
    bad = quality_conflicts(_args(**args), cfg, plugin_data)
    assert len(bad) == 1 and needle in bad[0]
    assert bad[0].startswith("--sb-quality-refresh-interval 3")
    assert quality_conflicts(_args(**args), SparseBalanceConfig(**sb), plugin_data) == []


def test_served_launch_and_bad_values():
    assert quality_conflicts(_args(), SparseBalanceConfig(sparse_balance=True,
                                                          quality_refresh_interval=5), True) == []
    for v in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="quality-refresh-interval"):
            SparseBalanceConfig(quality_refresh_interval=v)
