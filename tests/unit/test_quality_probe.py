"""The quality refresh's runtime side without a run (``megatron/step/quality_probe.py``,
``launch/data_checks.quality_conflicts``): the statistics every rank sums give the documents'
loss change and its ratio-estimator error whatever the split over ranks; the refresh is due
every N-th iteration but the last; a launch it cannot serve is refused naming the flag; its
held-out batch is the valid split's first K rows (``step/data.held_out_batch``)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

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
    assert SparseBalanceConfig().quality_refresh_microbatches == 1
    assert SparseBalanceConfig(quality_refresh_microbatches=8).quality_refresh_microbatches == 8
    for v in (0, -2, 2.0, True, "4"):
        with pytest.raises(ConfigError) as e:
            SparseBalanceConfig(quality_refresh_microbatches=v)
        assert f"--sb-quality-refresh-microbatches={v!r}: expected an integer >= 1" in str(e.value)


def _held_out_data(n_docs: int):
    from sparsebalance_megatron.data.corpus import DocumentCorpus
    from sparsebalance_megatron.megatron.step.data import PluginData

    rng = np.random.default_rng(5)
    lengths = rng.integers(5, 25, size=n_docs)
    corpus = DocumentCorpus(rng.integers(1, 100, size=int(lengths.sum())),
                            np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths,
                            vocab_size=128, eod_id=0, name="held-out")
    none = np.arange(0)
    return PluginData(corpus, {"train": [none], "valid": [np.arange(n_docs)], "test": [none]},
                      None, "byte")


def _held_out(data, k: int, dp: int, rank: int):
    from sparsebalance_megatron.megatron.step.data import held_out_batch

    sb = SparseBalanceConfig(quality_refresh_interval=2, quality_refresh_microbatches=k)
    return held_out_batch(data, sb, capacity=64, dp=dp, dp_rank=rank, device="cpu",
                          mb_args={"pad_multiple": 1})


def test_held_out_batch_is_the_valid_splits_first_k_rows():
    """--sb-quality-refresh-microbatches K: each DP rank's K micro-batches are what Megatron's
    evaluation reads first (``EvalIterator``, row after row), and the lengths are every rank's
    documents over all K rows."""
    from sparsebalance_megatron.megatron.step.data import EvalIterator

    data, dp, k = _held_out_data(200), 2, 3
    docs = []
    for rank in range(dp):
        mbs, lengths = _held_out(data, k, dp, rank)
        ev = EvalIterator(data.sampler("valid", capacity=64, seed=1234,
                                       long_sample_policy="split"),
                          data.corpus, capacity=64, dp=dp, dp_rank=rank, device="cpu",
                          mb_args={"pad_multiple": 1})
        assert len(mbs) == k
        for mb in mbs:
            want = next(ev)
            assert torch.equal(mb["tokens"], want["tokens"])
            psp = mb["packed_seq_params"]
            assert psp.sb_doc_ids == want["packed_seq_params"].sb_doc_ids
            n = len(psp.sb_doc_ids)
            docs += np.diff(psp.local_cu_seqlens().numpy())[:n].tolist()
        assert np.array_equal(lengths, _held_out(data, k, dp, 1 - rank)[1])   # every rank's
    assert len(docs) > 2 * dp * k                    # short documents: several per row
    assert sorted(lengths.tolist()) == sorted(docs)
    one = _held_out(data, 1, dp, 0)
    assert len(one[0]) == 1 and 0 < one[1].size < lengths.size
    assert torch.equal(one[0][0]["tokens"], _held_out(data, k, dp, 0)[0][0]["tokens"])


def test_held_out_batch_refuses_what_it_cannot_measure():
    from sparsebalance_megatron.megatron.errors import LaunchError

    with pytest.raises(LaunchError, match="--sb-quality-refresh-microbatches 40: the valid "
                                          "split's documents fill fewer than 40 rows of 2"):
        _held_out(_held_out_data(30), 40, 2, 0)        # it would re-read the split
    empty = _held_out_data(30)
    empty.splits["valid"] = [np.arange(0)]
    with pytest.raises(LaunchError, match="--sb-quality-refresh-interval 2: the valid split "
                                          "holds no documents"):
        _held_out(empty, 1, 2, 0)
