"""The document corpus: jsonl and built-in inputs, cache, compact vocabulary, clear errors."""

import json
import os
import threading

import numpy as np
import pytest

from sparsebalance_megatron.data import corpus as corpus_mod
from sparsebalance_megatron.data import (DataError, DataFileNotFoundError, GlobalBatchSampler,
                                         get_tokenizer, length_stats, load_corpus, materialize,
                                         pad_vocab_size, sequential_pack)
from sparsebalance_megatron.data.tokenizers import TokenizerUnavailableError

TEXTS = ["short", "a" * 40, "héllo wörld " * 10, "", "x" * 17, "def f():\n    return 1\n" * 30]


def write_jsonl(path, texts, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
        f.write("\n")   # blank lines are skipped
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def test_jsonl_documents_round_trip_with_byte_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    c = load_corpus(path, tokenizer="byte", cache_dir=str(tmp_path / "cache"), min_doc_tokens=16)
    kept = [t for t in TEXTS if len(t.encode()) >= 16]
    assert len(c) == len(kept) == 4
    for i, t in enumerate(kept):
        assert bytes(c.tokens(i).astype(np.uint8)).decode() == t
    assert list(c.lengths) == [len(t.encode()) for t in kept]
    assert c.eod_id == 256 and c.vocab_size == pad_vocab_size(257) == 384
    assert c.name == os.path.abspath(path)
    s = c.stats()
    assert s["n_docs"] == 4 and s["total_tokens"] == sum(len(t.encode()) for t in kept)
    with pytest.raises(IndexError, match="doc_id=4"):
        c.tokens(4)


def test_jsonl_cache_is_reused_and_invalidated_when_the_file_changes(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    cache = str(tmp_path / "cache")
    load_corpus(path, tokenizer="byte", cache_dir=cache)
    calls = []
    real_build = corpus_mod._build_jsonl
    monkeypatch.setattr(corpus_mod, "_build_jsonl",
                        lambda *a, **k: calls.append(1) or real_build(*a, **k))
    load_corpus(path, tokenizer="byte", cache_dir=cache)
    assert calls == [], "second load opens the cache"
    write_jsonl(path, TEXTS + ["another document of enough bytes"])
    c = load_corpus(path, tokenizer="byte", cache_dir=cache)
    assert calls == [1] and len(c) == 5
    assert not [n for n in os.listdir(cache) if n.startswith(".build-")], "no temp dir left"


def test_concurrent_first_use_builds_once_and_agrees(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    cache = str(tmp_path / "cache")
    calls = []
    real_build = corpus_mod._build_jsonl
    monkeypatch.setattr(corpus_mod, "_build_jsonl",
                        lambda *a, **k: calls.append(1) or real_build(*a, **k))
    out = [None] * 4

    def worker(i):
        out[i] = load_corpus(path, tokenizer="byte", cache_dir=cache)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]
    for c in out:
        assert list(c.lengths) == list(out[0].lengths)
        assert np.array_equal(c.tokens(3), out[0].tokens(3))


def test_compact_vocab_maps_used_ids_to_a_dense_range(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    full = load_corpus(path, tokenizer="byte", cache_dir=str(tmp_path / "c"))
    comp = load_corpus(path, tokenizer="byte", cache_dir=str(tmp_path / "c"), compact_vocab=True)
    used = np.unique(np.concatenate([full.tokens(i) for i in range(len(full))]))
    assert comp.eod_id == used.size and comp.vocab_size >= used.size + 1
    assert comp.vocab_size < full.vocab_size
    for i in range(len(full)):
        assert comp.tokens(i).max() < used.size
        assert np.array_equal(comp.id_map[comp.tokens(i)], full.tokens(i))
    assert comp.id_map[comp.eod_id] == full.eod_id


@pytest.mark.parametrize("line, match", [
    ("{not json", r"d\.jsonl:8: not valid JSON"),
    ('{"txt": "x"}', r"d\.jsonl:8: expected a JSON object with a \"text\" field.*'txt'"),
    ('["text"]', r"d\.jsonl:8: expected a JSON object .* got list"),
    ('{"text": 5}', r"d\.jsonl:8: \"text\" must be a string, got int"),
])
def test_malformed_jsonl_names_path_and_line(tmp_path, line, match):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS, extra_lines=[line])
    with pytest.raises(DataError, match=match):
        load_corpus(path, tokenizer="byte", cache_dir=str(tmp_path / "cache"))


def test_missing_inputs_give_clear_errors(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(DataFileNotFoundError, match="no such .jsonl file"):
        load_corpus(str(tmp_path / "nope.jsonl"), tokenizer="byte", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="indexed data set prefix"):
        load_corpus(str(tmp_path / "nothing"), tokenizer="byte", cache_dir=cache)
    (tmp_path / "half.bin").write_bytes(b"\0" * 8)
    with pytest.raises(DataError, match=r"half\.idx is missing"):
        load_corpus(str(tmp_path / "half"), tokenizer="byte", cache_dir=cache)
    empty = write_jsonl(tmp_path / "e.jsonl", ["tiny"])
    with pytest.raises(DataError, match="no document with at least 16 tokens"):
        load_corpus(empty, tokenizer="byte", cache_dir=cache)
    with pytest.raises(DataError, match="expected one path"):
        load_corpus(["0.5", empty], tokenizer="byte", cache_dir=cache)
    assert len(load_corpus([write_jsonl(tmp_path / "f.jsonl", TEXTS)], tokenizer="byte",
                           cache_dir=cache)) == 4
    with pytest.raises(ValueError, match="tokenizer='bpe'"):
        load_corpus(empty, tokenizer="bpe", cache_dir=cache)


def test_builtin_corpus_subset_is_real_text_and_packs(tmp_path):
    """The real builder (Qwen2 BPE over the CPython stdlib), limited to a few documents."""
    c = load_corpus(None, tokenizer="qwen", cache_dir=str(tmp_path), sources=("stdlib",),
                    max_docs=12, verbose=True)
    assert len(c) == 12 and c.name == "builtin:qwen:stdlib:max12"
    assert c.vocab_size == 151936 and c.eod_id == 151643
    tok = get_tokenizer("qwen")
    assert all(n.startswith("stdlib/") and n.endswith(".py") for n in c.doc_names)
    assert c.doc_names == sorted(c.doc_names)
    text = tok.decode(c.tokens(0))
    import sysconfig
    with open(os.path.join(sysconfig.get_paths()["stdlib"], c.doc_names[0][len("stdlib/"):]),
              encoding="utf-8") as f:
        assert text == f.read()
    assert int(c.tokens(0).max()) < c.vocab_size
    # Packs end to end: every label of a real micro-batch is a real id or EOD.
    s = GlobalBatchSampler(c.lengths, capacity=512, dp=1, num_microbatches=2, seed=0)
    for mb_segs in sequential_pack(s.next_global_batch(), capacity=512, dp=1,
                                   num_microbatches=2)[0]:
        mb = materialize(mb_segs, c, 512)
        assert mb.loss_mask.sum() > 0 and int(mb.labels.max()) < c.vocab_size


def test_length_stats_percentiles():
    s = length_stats(np.arange(1, 101))
    assert (s["n_docs"], s["total_tokens"], s["p50"], s["p90"], s["p99"], s["max"]) == \
        (100, 5050, 50, 90, 99, 100)


def test_tokenizers_byte_round_trip_and_errors(monkeypatch, tmp_path):
    b = get_tokenizer("byte")
    assert b.decode(b.encode("héllo")) == "héllo" and b.n_vocab == 257
    with pytest.raises(ValueError, match="tokenizer='x'"):
        get_tokenizer("x")
    monkeypatch.setenv("SPARSEBALANCE_GPT2_RANKS", str(tmp_path / "missing.tiktoken"))
    monkeypatch.setattr("sparsebalance_megatron.data.tokenizers._CACHE", {})
    with pytest.raises(TokenizerUnavailableError, match="SPARSEBALANCE_GPT2_RANKS=.*missing"):
        get_tokenizer("gpt2")


def test_split_sections_of_python_and_plays():
    from sparsebalance_megatron.data.sources import split_sections

    py = ('"""doc"""\nimport os\n\n# about f\n@dec\n@dec2\ndef f():\n    return 1\n\n'
          'X = 1\nclass C:\n    def m(self):\n        pass\nasync def g():\n    pass\n')
    parts = split_sections("stdlib/m.py", py)
    assert "".join(parts) == py
    assert [p.splitlines()[0] for p in parts] == ['"""doc"""', "# about f", "class C:",
                                                  "async def g():"]
    play = ("TITLE\n\nPERSONS\n\nACT I.\n\nScene I. A room.\n\nA.\nHi.\n\nSCENE 2. Hall.\n\nB.\n"
            "Yo.\n\nACT II.\n\nScene I. Out.\n\nC.\nBye.\n")
    parts = split_sections("shakespeare/x", play)
    assert "".join(parts) == play
    assert [p.strip().splitlines()[0] for p in parts] == ["TITLE", "ACT I.", "SCENE 2. Hall.",
                                                          "ACT II."]
    assert split_sections("shakespeare/sonnets", "I\n\nFrom fairest\n") == ["I\n\nFrom fairest\n"]


def test_builtin_section_documents_are_shorter_and_named(tmp_path):
    kw = dict(tokenizer="byte", cache_dir=str(tmp_path), sources=("stdlib",), max_docs=40,
              min_doc_tokens=1)
    files = load_corpus(None, **kw)
    sections = load_corpus(None, doc_unit="section", **kw)
    assert sections.name.endswith(":section:max40")
    assert all("#" in n for n in sections.doc_names)
    assert np.median(sections.lengths) < np.median(files.lengths)
    # The sections of the first file concatenate back to that file.
    first = files.doc_names[0]
    own = [i for i, n in enumerate(sections.doc_names) if n.split("#")[0] == first]
    text = b"".join(bytes(sections.tokens(i).astype(np.uint8)) for i in own)
    assert text == bytes(files.tokens(0).astype(np.uint8))
    with pytest.raises(ValueError, match="doc_unit='line'"):
        load_corpus(None, doc_unit="line", **kw)


def test_shakespeare_texts_from_a_directory(tmp_path, monkeypatch):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "tempest_gut.txt").write_text("THE TEMPEST\n\nACT I.\n\nSCENE 1. Ship.\n\n" + "Boats" * 9
                                       + "\n\nSCENE 2. Isle.\n\n" + "Prospero " * 9 + "\n")
    (d / "tempest_gut_f.txt").write_text("the Folio edition is not used")
    (d / "metadata.txt").write_text("not a play")
    monkeypatch.setenv("SPARSEBALANCE_SHAKESPEARE_DIR", str(d))
    c = load_corpus(None, tokenizer="byte", sources=("shakespeare",), doc_unit="section",
                    cache_dir=str(tmp_path / "cache"), min_doc_tokens=1)
    assert c.doc_names == ["shakespeare/tempest#0", "shakespeare/tempest#1",
                           "shakespeare/tempest#2"]
    assert bytes(c.tokens(2).astype(np.uint8)).startswith(b"SCENE 2. Isle.\n")


def _load_in_child(args):
    cache, queue = args
    c = load_corpus(None, tokenizer="byte", sources=("stdlib",), max_docs=30, cache_dir=cache)
    queue.put((c.name, c.lengths.tolist(), int(c.tokens(len(c) - 1).sum())))


def test_two_processes_racing_on_first_use_build_one_cache(tmp_path):
    """What two torchrun ranks do on a fresh machine: both load the built-in corpus at once."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=((str(tmp_path), queue),)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] and len(results[0][1]) == 30
    entries = os.listdir(tmp_path)
    assert len([e for e in entries if e.startswith("corpus-") and not e.endswith(".lock")]) == 1
    assert not [e for e in entries if e.startswith(".build-")]
