"""The dense/sparse crossover: from which document length the sparse kernel beats the dense one.

Routing (``attention.routing``) sends documents shorter than the crossover through one dense
varlen call. The crossover is a property of the device, the kernels and the head shape, so it is
measured (``megatron/launch/crossover.py`` times packed micro-batches of equal documents of
increasing block counts, dense vs sparse at the base density, forward + backward) or derived
from an analytic table's own cost terms (``analytic.py``), and stored with the latency table:

- ``dense_crossover_tokens``: the crossover (0: no routing; a table without it routes nothing);
- ``dense_crossover``: what it was measured with and the times (kernels, head shape, dtype,
  density, lengths, seconds);
- ``dense_coefficients``: the fitted seconds per causal block pair of a dense document, per stage
  kind and pass (``dense_work``'s coefficient; without it ``dense_coefficient`` falls back to
  the sparse kernel's per-pair cost).

- ``call_coefficients`` (format 3): the per-call fixed seconds of the sparse call and of the
  dense varlen call (``features.CALL_FEATURES``), per stage kind and pass (``call_coefficient``;
  absent: 0, the table's ``const`` holds them).

``crossover_tokens`` is the one rule that turns timings into the crossover. Pure Python + numpy;
must not import torch or megatron.
"""

from __future__ import annotations

import math
from typing import Sequence

from .features import CALL_FEATURES, FEATURES


def crossover_lengths(block_size: int, max_tokens: int) -> list[int]:
    """Document lengths to time: 1, 2, 3, 4, 6, 8, 12, ... blocks (about x1.5 apart), up to
    ``max_tokens`` (the longest document a micro-batch holds), which is always included."""
    blocks = sorted({m << k for k in range(max(int(max_tokens).bit_length(), 1))
                     for m in (1, 3)})
    return [n * block_size for n in blocks if n * block_size < max_tokens] + [int(max_tokens)]


def crossover_tokens(lengths: Sequence[int], dense_s: Sequence[float],
                     sparse_s: Sequence[float]) -> int:
    """The smallest measured length from which sparse is faster at every longer measured length:
    documents shorter than it run dense. 0 (never route) when sparse wins from the first length;
    ``lengths[-1] + 1`` (every measured length runs dense) when sparse never wins."""
    if not (len(lengths) == len(dense_s) == len(sparse_s)) or not lengths:
        raise ValueError(f"lengths, dense_s and sparse_s have {len(lengths)}, {len(dense_s)} and "
                         f"{len(sparse_s)} entries: expected the same number, at least one")
    if any(b <= a for a, b in zip(lengths[:-1], lengths[1:])):
        raise ValueError(f"lengths={list(lengths)[:8]}: expected strictly increasing")
    cut = len(lengths)
    for i in range(len(lengths) - 1, -1, -1):
        if not sparse_s[i] < dense_s[i]:
            break
        cut = i
    if cut == 0:
        return 0
    return int(lengths[cut]) if cut < len(lengths) else int(lengths[-1]) + 1


def crossover_entries(record: dict) -> dict:
    """A crossover record (measured or derived, with ``tokens``) as latency-table entries."""
    return {"dense_crossover_tokens": int(record["tokens"]),
            "dense_crossover": {k: v for k, v in record.items() if k != "tokens"}}


def table_crossover(table: dict) -> int:
    """Documents shorter than this many tokens ran dense in the table's measurements: its
    ``dense_crossover_tokens``, 0 (no routing) when it has none."""
    return int(table.get("dense_crossover_tokens", 0))


def dense_coefficient(table: dict, coefficients: dict, kind: str, part: str) -> float:
    """Seconds per causal block pair of a routed (dense) document on stage ``kind``, pass
    ``part``: the table's fitted ``dense_coefficients``, else the sparse kernel's per-pair cost
    (the ``attention_work`` coefficient: a document priced as sparse attention at density 1),
    so that a table measured without routing still prices a run that routes."""
    fitted = (table.get("dense_coefficients") or {}).get(kind)
    if fitted is not None:
        return float(fitted[part])
    return float(coefficients[kind][part][FEATURES.index("attention_work")])


def validate_routing(table: dict, err, kinds: Sequence[str], max_s: float) -> None:
    """The optional routing entries (``err(field, problem)`` raises): the crossover, its record,
    and dense coefficients for measured stage ``kinds`` in [0, ``max_s``]."""
    n = table.get("dense_crossover_tokens", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        err("dense_crossover_tokens", f"{n!r}: expected an integer >= 0 (0: no routing)")
    rec = table.get("dense_crossover")
    if rec is not None and not isinstance(rec, dict):
        err("dense_crossover", f"{str(rec)[:60]}: expected an object (the measurement the "
            f"crossover comes from)")
    dense = table.get("dense_coefficients")
    if dense is None:
        return
    if not isinstance(dense, dict):
        err("dense_coefficients", f"{str(dense)[:60]}: expected {{kind: {{fwd: c, bwd: c}}}}")
    for kind, parts in dense.items():
        if kind not in kinds:
            err(f"dense_coefficients.{kind}", f"expected one of the measured stage kinds "
                f"{list(kinds)}")
        for part in ("fwd", "bwd"):
            c = parts.get(part) if isinstance(parts, dict) else None
            ok = isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
            if not ok or not 0 <= c <= max_s:
                err(f"dense_coefficients.{kind}.{part}", f"{c!r}: expected a finite number >= 0 "
                    f"(seconds per causal block pair of a dense document)")


def call_coefficient(table: dict, kind: str, part: str, name: str) -> float:
    """Seconds per call of ``name`` (one of ``CALL_FEATURES``) on stage ``kind``, pass ``part``:
    the table's ``call_coefficients``, 0 where it has none (its ``const`` holds the cost)."""
    return float(((table.get("call_coefficients") or {}).get(kind) or {}).get(part, {})
                 .get(name, 0.0))


def validate_calls(table: dict, err, kinds: Sequence[str], max_s: float) -> None:
    """The optional ``call_coefficients``: format 3 only, measured kinds, finite seconds >= 0."""
    calls = table.get("call_coefficients")
    if calls is None:
        return
    if table["format_version"] < 3:
        err("call_coefficients", f"in a format_version {table['format_version']} table: expected "
            f"format_version 3 (a table with per-call costs)")
    if not isinstance(calls, dict):
        err("call_coefficients", f"{str(calls)[:60]}: expected {{kind: {{fwd: {{name: s}}, "
            f"bwd: {{...}}}}}}")
    for kind, parts in calls.items():
        if kind not in kinds:
            err(f"call_coefficients.{kind}", f"expected one of the measured stage kinds "
                f"{list(kinds)}")
        for part in ("fwd", "bwd"):
            per = parts.get(part) if isinstance(parts, dict) else None
            if not isinstance(per, dict):
                err(f"call_coefficients.{kind}.{part}", f"{per!r}: expected {{name: seconds}} "
                    f"with names from {list(CALL_FEATURES)}")
            for name, c in per.items():
                if name not in CALL_FEATURES:
                    err(f"call_coefficients.{kind}.{part}.{name}", f"expected one of "
                        f"{list(CALL_FEATURES)}")
                ok = isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                if not ok or not 0 <= c <= max_s:
                    err(f"call_coefficients.{kind}.{part}.{name}", f"{c!r}: expected a finite "
                        f"number >= 0 (seconds per call)")
