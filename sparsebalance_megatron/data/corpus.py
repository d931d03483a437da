"""Token documents with O(1) access, memory-mapped from an on-disk cache; ``load_corpus`` builds it.

Three kinds of input, one ``DocumentCorpus`` out:
- ``None``: the built-in real-text corpus (``sources.py``: CPython stdlib sources, Shakespeare),
  tokenized on first use and cached under ``cache_dir`` (default ~/.cache/sparsebalance_megatron).
  Offline: a source that is not on disk is an error naming the set-up command that fetches it.
- ``*.jsonl``: one document per line, its ``"text"`` field; tokenized once and cached.
- anything else: a Megatron indexed data set prefix (``PREFIX.bin`` + ``PREFIX.idx``), read in
  place by ``indexed.py`` (Megatron's on-disk format, parsed with numpy).
Cache builds are atomic (built in a temporary directory, then ``os.replace``) and serialized by a
file lock, so two torchrun ranks racing on first use build once and never read a half-written
cache. Documents are stored without EOD; packing appends it.
Must not depend on torch, torch.distributed or megatron.

Why this is long: the three kinds of input share one cache format and one atomic,
file-locked build; split, the build's guarantees would be stated in two places.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np

from ..config import DOC_UNITS
from . import sources as _sources
from .indexed import read_indexed_documents
from .tokenizers import TOKENIZER_NAMES, TextTokenizer, get_tokenizer

CACHE_VERSION = 1
VOCAB_PAD_MULTIPLE = 128
DEFAULT_SOURCES = ("stdlib", "shakespeare")


class DataError(ValueError):
    """The data input is missing or malformed; the message names the path and what is wrong."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    pass


class DocumentIndexError(DataError, IndexError):
    pass


def pad_vocab_size(n_ids: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Smallest multiple of ``multiple`` >= ``n_ids`` (Qwen2's 151851 ids -> 151936)."""
    return -(-int(n_ids) // multiple) * multiple


def length_stats(lengths: np.ndarray) -> dict:
    """Number of documents, total tokens and length percentiles (tokens, without EOD)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return {"n_docs": 0, "total_tokens": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"n_docs": int(lengths.size), "total_tokens": int(lengths.sum()),
            "mean": round(float(lengths.mean()), 1), "p50": int(round(p50)),
            "p90": int(round(p90)), "p99": int(round(p99)), "min": int(lengths.min()),
            "max": int(lengths.max())}


class DocumentCorpus:
    """Token documents (integer arrays) with O(1) access; memory-mapped from the cache.

    ``flat`` holds all tokens back to back; document ``i`` is ``flat[starts[i]:starts[i]+lengths[i]]``,
    mapped through ``token_map`` (a lookup table old id -> model id) when the vocabulary is compacted
    lazily (indexed data sets, which are read in place).
    """

    def __init__(self, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *,
                 vocab_size: int, eod_id: int, name: str,
                 doc_names: Optional[Sequence[str]] = None,
                 token_map: Optional[np.ndarray] = None, id_map: Optional[np.ndarray] = None,
                 notes: Sequence[str] = ()):
        self.flat = flat
        self.starts = np.asarray(starts, dtype=np.int64)              # [n_docs]
        self.lengths = np.asarray(lengths, dtype=np.int64)            # [n_docs], without EOD
        if self.starts.shape != self.lengths.shape:
            raise DataError(f"{name}: starts {self.starts.shape} != lengths {self.lengths.shape}")
        self.vocab_size = int(vocab_size)
        self.eod_id = int(eod_id)
        self.name = name
        self.doc_names = list(doc_names) if doc_names is not None else None
        self.token_map = token_map
        # Compacted vocabulary: id_map[model_id] = the tokenizer's id (decode with it).
        self.id_map = None if id_map is None else np.asarray(id_map, dtype=np.int64)
        self.notes = list(notes)   # e.g. a built-in source that could not be had

    def __len__(self) -> int:
        return int(self.lengths.size)

    def tokens(self, doc_id: int) -> np.ndarray:
        """Tokens of document ``doc_id``: ``[lengths[doc_id]]``, no EOD."""
        if not 0 <= doc_id < len(self):
            raise DocumentIndexError(f"doc_id={doc_id}: expected 0 <= doc_id < {len(self)}")
        s = int(self.starts[doc_id])
        out = self.flat[s:s + int(self.lengths[doc_id])]
        return self.token_map[out] if self.token_map is not None else out

    def doc_name(self, doc_id: int) -> str:
        return self.doc_names[doc_id] if self.doc_names is not None else f"{self.name}#{doc_id}"

    def stats(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, **length_stats(self.lengths)}

    def __repr__(self) -> str:
        s = self.stats()
        return (f"DocumentCorpus({self.name}: {s['n_docs']} docs, {s['total_tokens']} tokens, "
                f"vocab {self.vocab_size})")


class ConcatCorpus:
    """Several corpora as one: document ids run through them in order (``offsets``).

    The parts of a Megatron blend. They must agree on the EOD id (one tokenizer made them); the
    vocabulary is the largest part's.
    """

    def __init__(self, parts: Sequence[DocumentCorpus]):
        if not parts:
            raise DataError("no data set to concatenate")
        eods = {int(p.eod_id) for p in parts}
        if len(eods) != 1:
            raise DataError(f"the data sets of the blend end documents with different EOD ids "
                            f"{sorted(eods)} ({', '.join(p.name for p in parts)}): they must "
                            f"come from one tokenizer")
        self.parts = list(parts)
        self.eod_id = eods.pop()
        self.vocab_size = max(int(p.vocab_size) for p in parts)
        self.lengths = np.concatenate([p.lengths for p in parts]).astype(np.int64)
        self.offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)  # [n_parts+1]
        self.name = " + ".join(p.name for p in parts)
        self.notes = [n for p in parts for n in p.notes]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def part_of(self, doc_id: int) -> tuple[int, int]:
        """(part index, document id within that part)."""
        if not 0 <= doc_id < len(self):
            raise DocumentIndexError(f"doc_id={doc_id}: expected 0 <= doc_id < {len(self)}")
        k = int(np.searchsorted(self.offsets, doc_id, side="right") - 1)
        return k, int(doc_id - self.offsets[k])

    def tokens(self, doc_id: int) -> np.ndarray:
        k, i = self.part_of(doc_id)
        return self.parts[k].tokens(i)

    def doc_name(self, doc_id: int) -> str:
        k, i = self.part_of(doc_id)
        return self.parts[k].doc_name(i)

    def part_doc_ids(self, k: int) -> np.ndarray:
        """Document ids of part ``k`` (a source of the blend)."""
        return np.arange(self.offsets[k], self.offsets[k + 1], dtype=np.int64)

    def stats(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, **length_stats(self.lengths)}

    def __repr__(self) -> str:
        s = self.stats()
        return (f"ConcatCorpus({len(self.parts)} data sets: {s['n_docs']} docs, "
                f"{s['total_tokens']} tokens, vocab {self.vocab_size})")


def format_stats(stats: dict) -> str:
    """One line for logs and the README."""
    if not stats.get("n_docs"):
        return f"{stats.get('name', 'corpus')}: empty"
    return (f"{stats.get('name', 'corpus')}: {stats['n_docs']} documents, "
            f"{stats['total_tokens']} tokens; length p50 {stats['p50']}, p90 {stats['p90']}, "
            f"p99 {stats['p99']}, max {stats['max']}; vocab {stats.get('vocab_size', '?')}")


# --- cache ------------------------------------------------------------------------------------

def _cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _write_cache(dest: str, docs: list[np.ndarray], names: list[str], meta: dict) -> None:
    """Write ``docs`` to ``dest`` atomically: a temp dir in the same parent, then rename."""
    parent = os.path.dirname(dest)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".build-")
    try:
        lengths = np.array([d.size for d in docs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        flat = np.concatenate(docs).astype(np.uint32) if docs else np.zeros(0, np.uint32)
        flat.tofile(os.path.join(tmp, "tokens.u32"))
        np.save(os.path.join(tmp, "starts.npy"), starts)
        np.save(os.path.join(tmp, "lengths.npy"), lengths)
        with open(os.path.join(tmp, "names.json"), "w") as f:
            json.dump(names, f)
        with open(os.path.join(tmp, "meta.json"), "w") as f:  # written last: marks completeness
            json.dump(meta, f, indent=1)
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another process finished first (a file system without working locks): use its.
            if not os.path.exists(os.path.join(dest, "meta.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _open_cache(dest: str) -> DocumentCorpus:
    with open(os.path.join(dest, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(dest, "names.json")) as f:
        names = json.load(f)
    tok_path = os.path.join(dest, "tokens.u32")
    flat = (np.memmap(tok_path, dtype=np.uint32, mode="r") if os.path.getsize(tok_path)
            else np.zeros(0, np.uint32))
    return DocumentCorpus(flat, np.load(os.path.join(dest, "starts.npy")),
                          np.load(os.path.join(dest, "lengths.npy")),
                          vocab_size=meta["vocab_size"], eod_id=meta["eod_id"], name=meta["name"],
                          doc_names=names, notes=meta.get("notes", ()),
                          id_map=meta.get("original_ids"))


def _cached(cache_dir: str, key_parts: dict, build) -> DocumentCorpus:
    """Open the cache entry of ``key_parts``, building it with ``build() -> (docs, names, meta)``."""
    os.makedirs(cache_dir, exist_ok=True)
    dest = os.path.join(cache_dir, "corpus-" + _cache_key(key_parts))
    if not os.path.exists(os.path.join(dest, "meta.json")):
        with _sources.file_lock(dest + ".lock"):
            if not os.path.exists(os.path.join(dest, "meta.json")):
                docs, names, meta = build()
                meta["key"] = key_parts
                _write_cache(dest, docs, names, meta)
    return _open_cache(dest)


def _finish(docs: list[np.ndarray], names: list[str], tok, *, name: str, compact_vocab: bool,
            notes: Sequence[str] = ()) -> tuple[list[np.ndarray], list[str], dict]:
    """Vocabulary of the tokenized documents: the tokenizer's, or compacted to the ids used."""
    meta = {"name": name, "tokenizer": tok.name, "notes": list(notes)}
    if compact_vocab:
        used = np.unique(np.concatenate(docs)) if docs else np.zeros(0, np.int64)
        # Text ids become 0..K-1 in their original order; EOD becomes K.
        docs = [np.searchsorted(used, d).astype(np.uint32) for d in docs]
        meta.update(eod_id=int(used.size), vocab_size=pad_vocab_size(used.size + 1),
                    original_ids=[int(i) for i in used] + [tok.eod_id])
    else:
        meta.update(eod_id=tok.eod_id, vocab_size=pad_vocab_size(tok.n_vocab))
    return docs, names, meta


# --- the three inputs -------------------------------------------------------------------------

def _build_builtin(files, missing, tok, *, min_doc_tokens, max_docs, compact_vocab, name,
                   doc_unit):
    docs, names = [], []
    chunk = 64  # tokenize in chunks so a max_docs subset reads and encodes only what it needs
    for i in range(0, len(files), chunk):
        units = []
        for doc_name, path in files[i:i + chunk]:
            text = _sources.read_text(path)
            if doc_unit == "section":
                units += [(f"{doc_name}#{k}", t)
                          for k, t in enumerate(_sources.split_sections(doc_name, text))]
            else:
                units.append((doc_name, text))
        for (doc_name, _), ids in zip(units, tok.encode_batch([t for _, t in units])):
            if ids.size >= min_doc_tokens and (max_docs is None or len(docs) < max_docs):
                docs.append(ids)
                names.append(doc_name)
        if max_docs is not None and len(docs) >= max_docs:
            break
    if not docs:
        raise DataError(f"{name}: no document with at least {min_doc_tokens} tokens "
                        f"({len(files)} files read)")
    return _finish(docs, names, tok, name=name, compact_vocab=compact_vocab, notes=missing)


def _read_jsonl(path: str) -> list[str]:
    texts = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise DataError(f"{path}:{line_no}: expected a JSON object with a \"text\" field, "
                                f"got {type(obj).__name__}"
                                + (f" with keys {sorted(obj)[:5]}" if isinstance(obj, dict) else ""))
            if not isinstance(obj["text"], str):
                raise DataError(f"{path}:{line_no}: \"text\" must be a string, "
                                f"got {type(obj['text']).__name__}")
            texts.append(obj["text"])
    return texts


def _build_jsonl(path, tok, *, min_doc_tokens, compact_vocab):
    texts = _read_jsonl(path)
    docs, names = [], []
    for i, ids in enumerate(tok.encode_batch(texts)):
        if ids.size >= min_doc_tokens:
            docs.append(ids)
            names.append(f"{os.path.basename(path)}#{i}")
    if not docs:
        raise DataError(f"{path}: no document with at least {min_doc_tokens} tokens "
                        f"({len(texts)} lines read)")
    return _finish(docs, names, tok, name=path, compact_vocab=compact_vocab)


def _load_indexed(prefix: str, tok, *, min_doc_tokens: int, compact_vocab: bool) -> DocumentCorpus:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    have_idx, have_bin = os.path.isfile(idx_path), os.path.isfile(bin_path)
    if not have_idx and not have_bin:
        raise DataFileNotFoundError(
            f"--data-path {prefix!r}: no such file; expected a .jsonl file or a Megatron indexed "
            f"data set prefix with {bin_path} and {idx_path}")
    if not (have_idx and have_bin):
        raise DataFileNotFoundError(
            f"--data-path {prefix!r}: Megatron indexed data set is incomplete: "
            f"{idx_path if not have_idx else bin_path} is missing")
    flat, starts, lengths = read_indexed_documents(prefix)
    # Documents preprocessed with --append-eod end with EOD; packing appends its own.
    if lengths.size and flat.size:
        last = np.asarray(flat[np.maximum(starts + lengths - 1, 0)])
        lengths = lengths - ((last == tok.eod_id) & (lengths > 0)).astype(np.int64)
    keep = lengths >= min_doc_tokens
    starts, lengths = starts[keep], lengths[keep]
    if not lengths.size:
        raise DataError(f"{prefix}: no document with at least {min_doc_tokens} tokens")
    token_map, id_map, eod_id = None, None, tok.eod_id
    if compact_vocab:
        used = np.unique(np.concatenate([flat[s:s + n] for s, n in zip(starts, lengths)]))
        token_map = np.zeros(int(max(used.max(), 0)) + 1, dtype=np.int64)
        token_map[used] = np.arange(used.size)
        id_map = np.concatenate([used, [tok.eod_id]])
        eod_id, vocab_size = int(used.size), pad_vocab_size(used.size + 1)
    else:
        max_id = int(flat.max()) if flat.size and flat.size < (1 << 28) else 0
        vocab_size = pad_vocab_size(max(tok.n_vocab, max_id + 1))
    return DocumentCorpus(flat, starts, lengths, vocab_size=vocab_size, eod_id=eod_id,
                          name=prefix, token_map=token_map, id_map=id_map)


def load_corpus(data_path: Optional[str | Sequence[str]] = None, *,
                tokenizer: "str | TextTokenizer" = "qwen",
                cache_dir: Optional[str] = None, min_doc_tokens: int = 16,
                compact_vocab: bool = False, sources: Sequence[str] = DEFAULT_SOURCES,
                doc_unit: str = "file", max_docs: Optional[int] = None,
                verbose: bool = False) -> DocumentCorpus:
    """The documents of ``data_path`` (None: built-in corpus; ``*.jsonl``; indexed prefix).

    ``compact_vocab`` remaps the token ids that occur to 0..K-1 (EOD = K) so tiny models need only a
    K-row embedding. ``tokenizer`` is a name of ``tokenizers.TOKENIZER_NAMES`` or a ``TextTokenizer``
    (e.g. Megatron's tokenizer wrapped by the adapter; its ``name`` keys the cache).
    ``sources`` and ``max_docs`` select the built-in corpus (a subset for tests);
    ``doc_unit`` its documents: whole files ("file") or their natural sections ("section": top-level
    definitions of a Python file, scenes of a play), a heavy tail at short context lengths.
    """
    if doc_unit not in DOC_UNITS:
        raise ValueError(f"doc_unit={doc_unit!r}: expected one of {', '.join(DOC_UNITS)}")
    if isinstance(data_path, (list, tuple)):   # Megatron's --data-path is a list
        if len(data_path) != 1:
            raise DataError(f"--data-path {list(data_path)!r}: expected one path (a .jsonl file "
                            f"or an indexed prefix); weighted blends are not supported")
        data_path = data_path[0]
    if not isinstance(min_doc_tokens, int) or min_doc_tokens < 1:
        raise ValueError(f"min_doc_tokens={min_doc_tokens!r}: expected an integer >= 1")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise ValueError(f"max_docs={max_docs!r}: expected None or an integer >= 1")
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or _sources.default_cache_dir()))
    if isinstance(tokenizer, TextTokenizer):
        given, tokenizer = tokenizer, tokenizer.name
    elif tokenizer not in TOKENIZER_NAMES:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
    else:
        given = None

    def tok():  # built only when a cache entry is built or an indexed data set is read
        return given if given is not None else get_tokenizer(tokenizer, cache_dir=cache_dir)

    if data_path is None:
        sources = tuple(sources)
        files, missing = _sources.list_source_files(sources, cache_dir)
        if missing:   # never a smaller corpus than asked for: that would be another data set
            raise DataError(f"built-in corpus (sources {', '.join(sources)}): "
                            f"{'; '.join(missing)}")
        if not files:
            raise DataError(f"built-in corpus: no source file found (sources {sources})")
        name = (f"builtin:{tokenizer}:{'+'.join(sources)}"
                + ("" if doc_unit == "file" else f":{doc_unit}")
                + ("" if max_docs is None else f":max{max_docs}"))
        key = {"v": CACHE_VERSION, "kind": "builtin", "tokenizer": tokenizer, "sources": sources,
               "files": _sources.fingerprint(files), "n_files": len(files),
               "python": sys.version.split()[0], "min_doc_tokens": min_doc_tokens,
               "max_docs": max_docs, "compact": compact_vocab, "doc_unit": doc_unit}
        corpus = _cached(cache_dir, key, lambda: _build_builtin(
            files, missing, tok(), min_doc_tokens=min_doc_tokens, max_docs=max_docs,
            compact_vocab=compact_vocab, name=name, doc_unit=doc_unit))
    elif str(data_path).endswith(".jsonl"):
        path = os.path.abspath(os.path.expanduser(str(data_path)))
        if not os.path.isfile(path):
            raise DataFileNotFoundError(f"--data-path {data_path!r}: no such .jsonl file")
        st = os.stat(path)
        key = {"v": CACHE_VERSION, "kind": "jsonl", "path": path, "size": st.st_size,
               "mtime_ns": st.st_mtime_ns, "tokenizer": tokenizer,
               "min_doc_tokens": min_doc_tokens, "compact": compact_vocab}
        corpus = _cached(cache_dir, key, lambda: _build_jsonl(
            path, tok(), min_doc_tokens=min_doc_tokens, compact_vocab=compact_vocab))
    else:
        corpus = _load_indexed(os.path.expanduser(str(data_path)), tok(),
                               min_doc_tokens=min_doc_tokens, compact_vocab=compact_vocab)
    if verbose:
        print(f"[sparsebalance data] {format_stats(corpus.stats())}", file=sys.stderr)
    return corpus
