"""Scoring of the long-context tasks: greedy exact match and teacher-forced token accuracy.

With teacher forcing the model reads prompt + gold answer once; at each answer position the
argmax is the greedy choice given a correct prefix. So greedy decoding reproduces the gold answer
token for token exactly when every teacher-forced argmax is right: one forward pass gives both
``greedy_exact_match`` and ``answer_token_accuracy`` (the softer score that suits base models).
``string_match`` scores free-running generations the RULER way (all / any gold strings present).
Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple


def _check_same_length(pred_ids: Sequence[int], answer_ids: Sequence[int]) -> None:
    if len(pred_ids) != len(answer_ids) or not answer_ids:
        raise ValueError(f"pred_ids has {len(pred_ids)} tokens, answer_ids {len(answer_ids)}: "
                         f"expected the same, non-zero number")


def answer_token_accuracy(pred_ids: Sequence[int], answer_ids: Sequence[int]) -> float:
    """Share of answer tokens whose teacher-forced argmax equals the gold token."""
    _check_same_length(pred_ids, answer_ids)
    return sum(int(p) == int(a) for p, a in zip(pred_ids, answer_ids)) / len(answer_ids)


def greedy_exact_match(pred_ids: Sequence[int], answer_ids: Sequence[int]) -> bool:
    """True iff greedy decoding would emit the gold answer (all teacher-forced argmaxes right)."""
    _check_same_length(pred_ids, answer_ids)
    return all(int(p) == int(a) for p, a in zip(pred_ids, answer_ids))


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


def string_match(generated: str, answers: Sequence[str], mode: str = "all") -> float:
    """RULER-style: share of gold strings found in the output ('all') or 1 if any is ('any')."""
    if mode not in ("all", "any"):
        raise ValueError(f"mode={mode!r}: expected 'all' or 'any'")
    g = normalize(generated)
    hits = [normalize(a) in g for a in answers]
    return float(any(hits)) if mode == "any" else sum(hits) / len(hits)


def mean_by(records: Iterable[dict], keys: Tuple[str, ...], value: str) -> Dict[tuple, float]:
    """Mean of ``record[value]`` grouped by ``keys`` (records without the value are skipped)."""
    sums: Dict[tuple, List[float]] = defaultdict(list)
    for r in records:
        if r.get(value) is not None:
            sums[tuple(r[k] for k in keys)].append(float(r[value]))
    return {k: sum(v) / len(v) for k, v in sorted(sums.items(), key=lambda kv: str(kv[0]))}
