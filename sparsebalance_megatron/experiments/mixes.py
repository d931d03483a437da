"""Length-mix families for the robustness study (issue 27): document lengths the planners were not
tuned on, deterministic per seed.

A *mix* is a 1-D array of document lengths (tokens, without EOD) that ``GlobalBatchSampler`` cuts
into global batches (documents longer than a micro-batch are split by it). Families:

- ``file``: the built-in corpus, whole files and plays (662 documents, median about 2.1K tokens,
  p99 about 43K; the mix the study was developed on). The seed does not change the lengths, only
  the sampler's shuffle (the study passes it on).
- ``section``: the built-in corpus cut into top-level definitions and scenes (about 6.7K documents,
  median about 150 tokens): a heavy tail at short lengths.
- ``lognormal_short``: many short documents, log-normal with median ``SHORT_MEDIAN`` tokens and
  log-sd ``SHORT_SIGMA`` (p99 about 10x the median), clipped to [``SHORT_MIN``, ``SHORT_MAX``]:
  chat turns, web pages, code snippets.
- ``long_tail``: only long documents, log-uniform on [``LONG_MIN``, ``LONG_MAX``] = 16K-128K
  tokens (books, repositories, long-context benchmark sequences such as MagiAttention's).
- ``both``: the two above in one stream, ``BOTH_LONG_SHARE`` of the tokens from long documents
  (a few long documents among very many short ones, as in a pre-training mix with a long-context
  share).

Every synthetic family draws documents until ``total_tokens`` is reached (default
``DEFAULT_TOKENS``, about the built-in corpus's 4.2M), from ``numpy.random.default_rng`` seeded by
(seed, family): the same (family, seed, total_tokens) gives the same array on every machine.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import numpy as np

CORPUS_MIXES = ("file", "section")
SYNTHETIC_MIXES = ("lognormal_short", "long_tail", "both")
MIXES = CORPUS_MIXES + SYNTHETIC_MIXES

DEFAULT_TOKENS = 1 << 22
"""Tokens drawn per synthetic mix (4,194,304; the built-in corpus has about 4.16M)."""
SHORT_MEDIAN, SHORT_SIGMA, SHORT_MIN, SHORT_MAX = 512, 1.0, 16, 32768
LONG_MIN, LONG_MAX = 16384, 131072
BOTH_LONG_SHARE = 0.5
_FAMILY_ID = {name: i for i, name in enumerate(SYNTHETIC_MIXES)}


def _check(seed, total_tokens) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected an integer >= 0")
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, (int, np.integer)) \
            or total_tokens < 1:
        raise ValueError(f"total_tokens={total_tokens!r}: expected an integer >= 1")


def _draw(rng, total_tokens: int, sample) -> np.ndarray:
    """Documents from ``sample(rng, n) -> lengths`` until their sum reaches ``total_tokens``."""
    parts, have = [], 0
    while have < total_tokens:
        x = sample(rng, 1024)
        parts.append(x)
        have += int(x.sum())
    out = np.concatenate(parts)
    n = int(np.searchsorted(np.cumsum(out), total_tokens)) + 1   # first prefix that reaches it
    return out[:n]


def _short(rng, n) -> np.ndarray:
    x = np.exp(rng.normal(np.log(SHORT_MEDIAN), SHORT_SIGMA, n))
    return np.clip(np.round(x), SHORT_MIN, SHORT_MAX).astype(np.int64)


def _long(rng, n) -> np.ndarray:
    x = np.exp(rng.uniform(np.log(LONG_MIN), np.log(LONG_MAX), n))
    return np.clip(np.round(x), LONG_MIN, LONG_MAX).astype(np.int64)


def lognormal_short(seed: int, total_tokens: int = DEFAULT_TOKENS) -> np.ndarray:
    """[n] lengths of many short documents (log-normal, median ``SHORT_MEDIAN``)."""
    _check(seed, total_tokens)
    return _draw(np.random.default_rng([int(seed), _FAMILY_ID["lognormal_short"]]),
                 int(total_tokens), _short)


def long_tail(seed: int, total_tokens: int = DEFAULT_TOKENS) -> np.ndarray:
    """[n] lengths of long documents, log-uniform on [``LONG_MIN``, ``LONG_MAX``]."""
    _check(seed, total_tokens)
    return _draw(np.random.default_rng([int(seed), _FAMILY_ID["long_tail"]]),
                 int(total_tokens), _long)


def both(seed: int, total_tokens: int = DEFAULT_TOKENS,
         long_share: float = BOTH_LONG_SHARE) -> np.ndarray:
    """[n] lengths: ``long_share`` of the tokens from ``long_tail`` documents, the rest from
    ``lognormal_short`` ones, interleaved in a seeded random order."""
    _check(seed, total_tokens)
    if not (0.0 <= float(long_share) <= 1.0):
        raise ValueError(f"long_share={long_share!r}: expected a fraction in [0, 1]")
    rng = np.random.default_rng([int(seed), _FAMILY_ID["both"]])
    n_long = int(round(total_tokens * float(long_share)))
    parts = [_draw(rng, n_long, _long)] if n_long else []
    if total_tokens - n_long > 0:
        parts.append(_draw(rng, int(total_tokens) - n_long, _short))
    out = np.concatenate(parts)
    return out[rng.permutation(out.size)]


_GENERATORS = {"lognormal_short": lognormal_short, "long_tail": long_tail, "both": both}


def mix_lengths(name: str, seed: int = 0, *, total_tokens: int = DEFAULT_TOKENS,
                tokenizer: str = "qwen") -> np.ndarray:
    """[n] int64 document lengths of mix ``name`` (one of ``MIXES``) for ``seed``.

    The corpus mixes load the built-in corpus with ``tokenizer`` (cached after the first call);
    their lengths do not depend on the seed or ``total_tokens``.
    """
    if name in _GENERATORS:
        return _GENERATORS[name](seed, total_tokens)
    if name in CORPUS_MIXES:
        from ..data import load_corpus
        return np.asarray(load_corpus(tokenizer=tokenizer, doc_unit=name).lengths,
                          dtype=np.int64)
    raise ValueError(f"length mix {name!r}: expected one of {', '.join(MIXES)}")
