"""The plugin's data path with Megatron's data semantics: --data-path lists and weighted blends,
--split, --tokenizer-type, the vocabulary check, and the per-step metrics on Megatron's writers."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.megatron.step.data import (check_vocab, data_blend, load_data,
                                                       megatron_text_tokenizer)
from sparsebalance_megatron.megatron.launch.checks import LaunchError
from tests.conftest import stdlib_texts

pytestmark = pytest.mark.integration


def _jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    texts = stdlib_texts(80, max_chars=2000)
    return _jsonl(d / "a.jsonl", texts[:40]), _jsonl(d / "b.jsonl", texts[40:]), d


def _args(data_path, split="1,0,0", tokenizer_type=None, **per_split):
    return argparse.Namespace(data_path=data_path, split=split, tokenizer_type=tokenizer_type,
                              tokenizer_model=None, vocab_file=None, **per_split)


def _sb(tmp):
    return SparseBalanceConfig(sparse_balance=True, tokenizer="byte", data_cache_dir=str(tmp))


def _token_share(data, n_bins=200, capacity=256):
    sampler = data.sampler("train", capacity=capacity, seed=3, long_sample_policy="split")
    segs = sampler.next_bins(n_bins)
    part = np.array([data.corpus.part_of(d)[0] for d, _, _ in segs])
    size = np.array([e - s for _, s, e in segs])
    return np.bincount(part, weights=size, minlength=2) / size.sum()


def test_several_paths_are_one_union_weighted_by_size(two_sets):
    a, b, tmp = two_sets
    data = load_data(_args([a, b]), _sb(tmp))
    assert len(data.corpus.parts) == 2 and len(data.corpus) == sum(len(p) for p in data.corpus.parts)
    sizes = np.array([p.lengths.sum() + len(p) for p in data.corpus.parts], dtype=float)
    assert np.allclose(_token_share(data), sizes / sizes.sum(), atol=0.05)


def test_weighted_blend_gives_each_data_set_its_share_of_tokens(two_sets):
    a, b, tmp = two_sets
    data = load_data(_args(["0.2", a, "0.8", b]), _sb(tmp))
    assert data.weights == [0.2, 0.8]
    assert np.allclose(_token_share(data), [0.2, 0.8], atol=0.03)


@pytest.mark.parametrize("bad", [["0.5"], ["0.5", "a.jsonl", "b.jsonl", "0.5"]])
def test_malformed_blend_is_refused_naming_it(bad):
    with pytest.raises(LaunchError, match="--data-path"):
        data_blend(bad)


def test_missing_file_of_a_blend_is_named(two_sets, tmp_path):
    a, _, _ = two_sets
    with pytest.raises(ValueError, match="nope.jsonl"):
        load_data(_args(["0.5", a, "0.5", str(tmp_path / "nope.jsonl")]), _sb(tmp_path))


def test_split_divides_every_data_set(two_sets):
    a, b, tmp = two_sets
    data = load_data(_args([a, b], split="80,10,10"), _sb(tmp))
    for k in range(2):
        parts = [data.splits[s][k] for s in ("train", "valid", "test")]
        ids = np.concatenate(parts)
        assert sorted(ids.tolist()) == data.corpus.part_doc_ids(k).tolist()   # each doc once
        assert [p.size for p in parts] == [32, 4, 4]


def _train_docs(data, n_bins=60):
    sampler = data.sampler("train", capacity=256, seed=3, long_sample_policy="split")
    return [(data.corpus.tokens(d)[s:e].tolist()) for d, s, e in sampler.next_bins(n_bins)]


def test_each_split_its_own_data_sets(two_sets, tmp_path):
    """--train-data-path A --valid-data-path B: A wholly trains, B wholly validates, and the
    training documents come in the order --data-path A --split 1,0,0 gives them (a run that adds
    a valid set trains on the same batches); --per-split-data-args-path says the same."""
    a, b, tmp = two_sets
    whole = load_data(_args([a]), _sb(tmp))
    data = load_data(_args(None, split=None, train_data_path=[a], valid_data_path=[b]), _sb(tmp))
    parts = data.corpus.parts
    assert [s.size for s in data.splits["train"]] == [len(parts[0]), 0]
    assert [s.size for s in data.splits["valid"]] == [0, len(parts[1])]
    assert data.sampler("test", capacity=256, seed=3, long_sample_policy="split") is None
    assert _train_docs(data) == _train_docs(whole)
    valid = data.sampler("valid", capacity=256, seed=3, long_sample_policy="split")
    assert {data.corpus.part_of(d)[0] for d, _, _ in valid.next_bins(20)} == {1}
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": [a], "valid": b, "test": []}))
    again = load_data(_args(None, split=None, per_split_data_args_path=str(spec)), _sb(tmp))
    assert _train_docs(again) == _train_docs(data)


def test_a_splits_blend_weighs_its_own_data_sets(two_sets):
    a, b, tmp = two_sets
    data = load_data(_args(None, split=None, train_data_path=["0.2", a, "0.8", b],
                           valid_data_path=[a]), _sb(tmp))
    assert data.weights == [0.2, 0.8, None]
    assert np.allclose(_token_share(data)[:2], [0.2, 0.8], atol=0.03)
    assert data.sampler("valid", capacity=256, seed=3, long_sample_policy="split") is not None


def test_data_args_path_is_data_path_in_a_file(two_sets, tmp_path):
    a, b, tmp = two_sets
    listed = tmp_path / "data_args.txt"
    listed.write_text(f"0.2 {a}\n0.8 {b}\n")
    data = load_data(_args(None, data_args_path=str(listed)), _sb(tmp))
    assert data.weights == [0.2, 0.8]


@pytest.mark.parametrize("text, needle", [
    ("{not json", "JSONDecodeError"), ('{"train": ["x"]}', "KeyError"),
    ('{"train": [0.5, "a"], "valid": [], "test": []}', "TypeError: 'train' is [0.5, 'a']"),
    ('{"train": ["0.5"], "valid": [], "test": []}', "'train' = 0.5: '0.5' looks like a blend weight"),
])
def test_bad_per_split_file_is_named(tmp_path, text, needle):
    spec = tmp_path / "splits.json"
    spec.write_text(text)
    with pytest.raises(LaunchError, match=f"--per-split-data-args-path {spec}") as e:
        load_data(_args(None, split=None, per_split_data_args_path=str(spec)), _sb(tmp_path))
    assert needle in str(e.value)


def test_no_training_data_of_its_own_is_refused(two_sets):
    a, _, tmp = two_sets
    with pytest.raises(ValueError, match="--train-data-path: no document left for training"):
        load_data(_args(None, split=None, valid_data_path=[a]), _sb(tmp))


def test_builtin_corpus_refuses_a_megatron_tokenizer(tmp_path):
    with pytest.raises(LaunchError, match="--tokenizer-type GPT2BPETokenizer: the built-in corpus"):
        load_data(_args(None, tokenizer_type="GPT2BPETokenizer"), _sb(tmp_path))


def test_megatron_tokenizer_tokenizes_text_data(two_sets, monkeypatch, tmp_path):
    """--tokenizer-type X: text is tokenized by Megatron's tokenizer (here a stand-in object with
    its interface), EOD from it, the cache keyed by it."""
    import megatron.training.global_vars as gv

    class Words:
        vocab_size, eod = 1000, 999

        def tokenize(self, text):
            return [hash(w) % 998 + 1 for w in text.split()]

        def detokenize(self, ids):
            return " ".join(map(str, ids))

    monkeypatch.setattr(gv, "get_tokenizer", lambda: Words())
    a, _, _ = two_sets
    args = _args([a], tokenizer_type="HuggingFaceTokenizer")
    args.tokenizer_model = "words"
    data = load_data(args, _sb(tmp_path), text_tokenizer=megatron_text_tokenizer(args))
    assert data.corpus.eod_id == 999 and data.tokenizer.startswith("megatron:HuggingFaceTokenizer")
    first = json.loads(open(a).readline())["text"]
    assert data.corpus.tokens(0).tolist() == Words().tokenize(first)
    check_vocab(data, 1024)
    with pytest.raises(LaunchError, match="pass --vocab-size 1024"):
        check_vocab(data, 512)


def test_metrics_go_to_megatrons_writers_under_one_prefix(monkeypatch, tmp_path):
    import megatron.training.global_vars as gv

    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.megatron.step.planning import PreparedStep
    from sparsebalance_megatron.megatron.step.reporting import StepReporter
    from sparsebalance_megatron.plan import BudgetPlan

    class Writer:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

        def log(self, values, step):
            self.calls.extend((k, v, step) for k, v in values.items())

    tb, wandb = Writer(), Writer()
    monkeypatch.setattr(gv, "_GLOBAL_TENSORBOARD_WRITER", tb)
    monkeypatch.setattr(gv, "_GLOBAL_WANDB_WRITER", wandb)
    args = argparse.Namespace(log_interval=2, train_iters=4, tensorboard_log_interval=1)
    sb = SparseBalanceConfig(sparse_attention=True, metrics_file=str(tmp_path / "m.jsonl"))
    batch = sequential_plan([(0, 0, 100), (1, 0, 50), (2, 0, 200)], dp=2, num_microbatches=1,
                            max_tokens=256)
    step = PreparedStep(0, 0, batch, BudgetPlan.static(0, 0.5, 2, 1, 1), None)
    from sparsebalance_megatron.megatron.step.record import StepSummary

    gathered = StepSummary(step_s=0.4, loss=(20.0, 10.0),
                           unit_times={(r, 0): ([(0, 0)], [0.1], [0.2]) for r in range(2)})
    rec = StepReporter(args, sb, dp=2).report(1, step, gathered,
                                                    np.full((2, 1), 0.3), {}, overhead_s=0.01)
    assert rec["loss"] == 2.0 and rec["samples"] == 2 and rec["consumed_samples"] == 2
    assert rec["tokens"] == 350 and rec["positions"] == 512      # segments whole, fixed length
    for writer in (tb, wandb):
        tags = {t for t, _, s in writer.calls if s == 1}
        assert {"sparsebalance/density/mean", "sparsebalance/density/rank_max",
                "sparsebalance/step_time/measured_s", "sparsebalance/overhead_s"} <= tags
        assert all(t.startswith("sparsebalance/") for t, _, _ in writer.calls)
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert line["densities"] == [[[0.5]], [[0.5]]] and len(line["attn_work"]) == 2
    assert line["microbatch_fwd_s"] == [[[0.1]], [[0.1]]]
    # the line records the plan, which --sb-replay-plans reads back as it was
    from sparsebalance_megatron.megatron.launch.replay import RecordedPlans, StepShape
    replayed, dens = RecordedPlans.read(str(tmp_path / "m.jsonl")).step(
        0, 0, batch.segments(), StepShape(2, 1, 256, 1, 0, 1))
    assert replayed.micro_batches == batch.micro_batches and dens.tolist() == line["densities"]
    # with the corpus' lengths, per-document padding (CP) is not counted as tokens: document 2
    # has 190 tokens + EOD, its segment 200 positions
    reporter = StepReporter(args, SparseBalanceConfig(sparse_attention=True), dp=2,
                            doc_positions=np.array([99, 50, 190]) + 1)
    rec = reporter.report(2, step, gathered, np.full((2, 1), 0.3), {}, overhead_s=0.01)
    assert rec["tokens"] == 100 + 50 + 191 and rec["tokens_per_s"] == pytest.approx(341 / 0.4)


def test_unit_timings_of_model_chunks_land_on_their_virtual_stages():
    """Interleaved schedule (pp 2 x vp 2, 2 micro-batches): rank 0 runs forwards in Megatron's
    schedule-table order (micro-batches 0, 1 of chunk 0, then of chunk 1) and backwards with the
    chunks reversed; each interval lands on its (micro-batch, virtual stage)."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.latency.layout import PipelineLayout
    from sparsebalance_megatron.megatron.step.checks import unit_order
    from sparsebalance_megatron.megatron.step.planning import PreparedStep
    from sparsebalance_megatron.megatron.step.reporting import unit_details
    from sparsebalance_megatron.plan import BudgetPlan

    layout = PipelineLayout.from_counts(4, 2, 2)
    order = get_schedule_table(2, 2, 2)                       # [(micro-batch, chunk)] forwards
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1)]
    batch = sequential_plan([(0, 0, 100), (1, 0, 50)], dp=1, num_microbatches=2, max_tokens=256)
    step = PreparedStep(0, 0, batch, BudgetPlan.static(0, 0.5, 1, 2, 4), None)
    from sparsebalance_megatron.megatron.step.record import StepSummary

    gathered = StepSummary(unit_times={(0, 0): (unit_order(order, layout, 0), [1.0, 2.0, 3.0, 4.0],
                                                [10.0, 20.0, 30.0, 40.0])})
    out = unit_details(step, gathered, np.ones((1, 2)), dp=1, layout=layout)
    fwd, bwd = out["microbatch_fwd_s"][0], out["microbatch_bwd_s"][0]   # [m][virtual stage]
    assert fwd == [[1.0, None, 3.0, None], [2.0, None, 4.0, None]]
    assert bwd == [[30.0, None, 10.0, None], [40.0, None, 20.0, None]]
