"""The latency table: JSON format, strict validation, and the "same device / model / software" check.

A table (written by the profiler or by ``analytic.py``) looks like::

    {"format": "sparsebalance-latency-table", "format_version": 2,
     "source": "profiled" | "analytic",
     "device": "cpu: ...", "software": {"torch": "2.13.0", "megatron_core": "0.19.2"},
     "model": {"num_layers": ..., "hidden_size": ..., ...},
     "execution": {"tensor_model_parallel_size": 1, "transformer_impl": "local",
                   "recompute_granularity": "none"},                  # since format_version 2
     "attention": {"block_size": 64, "sink_blocks": 1, "local_blocks": 0,
                   "work": "kept" | "chunked", "query_chunk_blocks": 16},
     "pipeline": {"pp": 2, "stage_kinds": ["first", "last"], "layers_per_stage": [2, 2]},
     # measurements may also hold kind "middle" when pp >= 2 (one layer's cost, for layouts)
     "features": ["const", "tokens", "attention_work", "selection_work", "sequences"],
     "measurements": [{"kind": "first", "doc_lengths": [...], "density": 0.5,
                       "fwd_s": ..., "bwd_s": ...}, ...],
     "coefficients": {"first": {"fwd": [c0, c1, c2, c3], "bwd": [...]}, ...},   # optional
     "p2p_s": 0.0, "notes": "..."}                                               # optional
     # routing (optional; absent: no routing): documents shorter than the crossover ran dense
     # in the measurements, and the dense kernel's seconds per causal block pair are fitted
     "dense_crossover_tokens": 1536,
     "dense_crossover": {"source": "profiled", "sparse_kernel": "flex", "dense_kernel": "auto",
                         "num_attention_heads": 14, "num_query_groups": 2, "head_dim": 64,
                         "dtype": "bfloat16", "block_size": 64, "density": 0.5,
                         "lengths": [...], "dense_s": [...], "sparse_s": [...]},
     "dense_coefficients": {"first": {"fwd": c5, "bwd": c5}, ...}               # optional
     # per-call fixed costs (optional, since format_version 3): seconds per call of the sparse
     # kernel and of the dense varlen call (``features.CALL_FEATURES``), per stage kind and pass
     "call_coefficients": {"first": {"fwd": {"sparse_calls": c6, "dense_calls": c7},
                                     "bwd": {...}}, ...}

A table without ``dense_coefficients`` prices a routed document as the sparse kernel at density
1 (its ``attention_work`` coefficient per block pair): ``crossover.dense_coefficient``. A table
without ``call_coefficients`` (every format 1 and 2 table) has no separate per-call cost: its
``const`` holds it (0 for both calls), so it predicts what it predicted before. Format 3 marks
the tables that may hold them, so that an older plugin, which would ignore them, refuses them.

Every problem raises ``LatencyTableError`` naming the file, the field and the value; a table from
another device, model shape, execution setup (TP size, transformer implementation, activation
recomputation) or software version raises ``LatencyTableMismatch`` unless forced. Degenerate
values are refused, not just malformed ones: times and coefficients must be finite, times > 0,
coefficients of work features >= 0, not all zero, and no micro-batch of the table's own grid may
be predicted at <= 0 s or above ``MAX_MICROBATCH_S``. A file over ``MAX_TABLE_BYTES`` is refused
before it is read. Format 1 tables (no ``execution`` section) are still read, so that
``--sb-latency-table-force`` can use them; a run that checks the execution setup refuses them.
JSON only (never pickle). Pure Python + numpy; must not import torch or megatron.

Why this is long: the format's description and its validation stay in one file, field by field.
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from typing import Any, Optional

import numpy as np

from .crossover import (call_coefficient, dense_coefficient, table_crossover, validate_calls,
                        validate_routing)
from .features import CALL_FEATURES, FEATURES, UnitFeatures
from .layout import PipelineLayout

FORMAT = "sparsebalance-latency-table"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)   # 1: before the execution section; read, refused by a checking
# run. 3: may hold ``call_coefficients`` (a 2 reads the same without them)
STAGE_KINDS = ("only", "first", "middle", "last")
REQUIRED = ("format", "format_version", "source", "device", "software", "model", "attention",
            "pipeline", "features", "measurements")
# What a stage's time depends on besides the model shape, recorded since format_version 2.
EXECUTION = {"tensor_model_parallel_size": None,          # an integer >= 1
             "transformer_impl": ("local", "transformer_engine"),
             "recompute_granularity": ("none", "selective", "full")}
MAX_TABLE_BYTES = 16 * 2**20
"""Largest table file read (a profiled table is well under 1 MiB)."""
MAX_MICROBATCH_S = 1e6
"""Largest time of one micro-batch on one stage a table may hold or predict (11.6 days)."""
MAX_BLOCKS_PER_MICROBATCH = 2**20
"""Largest micro-batch of a measurement, in attention blocks (the grid check builds its work)."""


class LatencyTableError(ValueError):
    """A latency table is unreadable or malformed; the message names the file and the field."""


class LatencyTableMismatch(LatencyTableError):
    """A latency table was measured on another device, model shape, execution setup (TP size,
    transformer implementation, recomputation) or software version."""


def stage_kinds_for(pp: int) -> list[str]:
    """Stage kind of every stage: the first carries the embedding, the last the LM head + loss."""
    if pp == 1:
        return ["only"]
    return ["first"] + ["middle"] * (pp - 2) + ["last"]


def measured_kinds(table: dict) -> list[str]:
    """Stage kinds with measurements: the pipeline's, plus ``middle`` in a pp >= 2 table
    profiled for layouts (a middle stage gives one layer's cost)."""
    return sorted({m["kind"] for m in table["measurements"]})


def table_layout(table: dict) -> PipelineLayout:
    """The layout the table was measured on (``pipeline.layers_per_stage``, else the model's
    layers split evenly)."""
    pipe = table["pipeline"]
    pp = len(pipe["stage_kinds"])
    layers = pipe.get("layers_per_stage")
    if layers is None:
        n = int(table.get("model", {}).get("num_layers", pp))
        layers = [max(n // pp, 1)] * pp
    return PipelineLayout(pp, 1, tuple(int(x) for x in layers))


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A JSON number that is a finite float (an integer of 400 digits is not)."""
    try:
        return _num(v) and math.isfinite(v)
    except OverflowError:
        return False


def validate_table(table: Any, where: str = "<table>") -> dict:
    """Check every field a ``LatencyModel`` needs; returns the table unchanged."""
    def err(field, problem):
        raise LatencyTableError(f"latency table {where}: field '{field}': {problem}")

    if not isinstance(table, dict):
        err("<root>", f"expected a JSON object, got {type(table).__name__}")
    for k in REQUIRED:
        if k not in table:
            err(k, "missing")
    if table["format"] != FORMAT:
        err("format", f"{table['format']!r}: expected {FORMAT!r}")
    version = table["format_version"]
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        err("format_version", f"{version!r}: expected {FORMAT_VERSION} (or 2, before the "
            f"per-call costs, or 1, before the execution section)")
    if table["source"] not in ("profiled", "analytic"):
        err("source", f"{table['source']!r}: expected 'profiled' or 'analytic'")
    if not isinstance(table["device"], str) or not table["device"]:
        err("device", f"{table['device']!r}: expected a non-empty string")
    sw = table["software"]
    if not isinstance(sw, dict) or "torch" not in sw or "megatron_core" not in sw:
        err("software", f"{sw!r}: expected an object with 'torch' and 'megatron_core'")
    if not isinstance(table["model"], dict):
        err("model", "expected an object describing the model shape")
    _validate_execution(table, err)
    att = table["attention"]
    for k in ("block_size", "sink_blocks", "local_blocks"):
        if not isinstance(att, dict) or k not in att:
            err(f"attention.{k}", "missing")
        if isinstance(att[k], bool) or not isinstance(att[k], int) \
                or att[k] < (1 if k == "block_size" else 0):
            err(f"attention.{k}", f"{att[k]!r}: expected an integer >= "
                f"{1 if k == 'block_size' else 0}")
    if att["block_size"] & (att["block_size"] - 1):
        err("attention.block_size", f"{att['block_size']!r}: expected a power of two")
    if att.get("work", "kept") not in ("kept", "chunked"):
        err("attention.work", f"{att.get('work')!r}: expected 'kept' or 'chunked'")
    qc = att.get("query_chunk_blocks", 16)
    if isinstance(qc, bool) or not isinstance(qc, int) or qc < 1:
        err("attention.query_chunk_blocks", f"{qc!r}: expected an integer >= 1")
    pipe = table["pipeline"]
    if not isinstance(pipe, dict) or not isinstance(pipe.get("stage_kinds"), list) \
            or not pipe["stage_kinds"]:
        err("pipeline.stage_kinds", "missing or empty: expected e.g. ['first', 'last']")
    kinds = pipe["stage_kinds"]
    for i, k in enumerate(kinds):
        if k not in STAGE_KINDS:
            err(f"pipeline.stage_kinds[{i}]", f"{k!r}: expected one of {STAGE_KINDS}")
    if pipe.get("pp", len(kinds)) != len(kinds):
        err("pipeline.pp", f"{pipe.get('pp')!r} != len(stage_kinds) = {len(kinds)}")
    if kinds != stage_kinds_for(len(kinds)):
        err("pipeline.stage_kinds", f"{kinds!r}: expected {stage_kinds_for(len(kinds))} for "
            f"{len(kinds)} stage(s)")
    lps = pipe.get("layers_per_stage")
    if lps is not None and (not isinstance(lps, list) or len(lps) != len(kinds) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in lps)):
        err("pipeline.layers_per_stage", f"{lps!r}: expected {len(kinds)} integers >= 1 (one "
            f"per stage)")
    allowed = set(kinds) | ({"middle"} if len(kinds) >= 2 else set())
    feats = table["features"]
    if feats != list(FEATURES):
        err("features", f"{feats!r}: expected {list(FEATURES)}")
    meas = table["measurements"]
    if not isinstance(meas, list) or not meas:
        err("measurements", "empty grid: expected at least one measurement")
    for i, m in enumerate(meas):
        f = f"measurements[{i}]"
        if not isinstance(m, dict):
            err(f, "expected an object")
        for k in ("kind", "doc_lengths", "density", "fwd_s", "bwd_s"):
            if k not in m:
                err(f"{f}.{k}", "missing")
        if m["kind"] not in allowed:
            err(f"{f}.kind", f"{m['kind']!r}: expected one of the pipeline's kinds {sorted(allowed)}")
        dl = m["doc_lengths"]
        if not isinstance(dl, list) or not dl or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in dl):
            err(f"{f}.doc_lengths", f"{str(dl)[:60]}: expected a non-empty list of positive integers")
        bs = att["block_size"]
        if sum((x + bs - 1) // bs for x in dl) > MAX_BLOCKS_PER_MICROBATCH:
            err(f"{f}.doc_lengths", f"{sum(dl)} tokens in {len(dl)} document(s): expected at most "
                f"{MAX_BLOCKS_PER_MICROBATCH} blocks of {bs} tokens per micro-batch")
        d = m["density"]
        if not _num(d) or not (0 < d <= 1):
            err(f"{f}.density", f"{d!r}: expected a number in (0, 1]")
        for k in ("fwd_s", "bwd_s"):
            v = m[k]
            if not _finite(v) or not (0 < v <= MAX_MICROBATCH_S):
                err(f"{f}.{k}", f"{v!r}: expected a measured time in seconds in "
                    f"(0, {MAX_MICROBATCH_S:g}]")
    missing = sorted(set(kinds) - {m["kind"] for m in meas})
    if missing:
        err("measurements", f"no measurement for stage kind(s) {missing}: expected at least one "
            f"for every stage kind of the pipeline {sorted(set(kinds))}")
    p2p = table.get("p2p_s", 0.0)
    if not _finite(p2p) or not (0 <= p2p <= MAX_MICROBATCH_S):
        err("p2p_s", f"{p2p!r}: expected a time in seconds in [0, {MAX_MICROBATCH_S:g}]")
    validate_routing(table, err, measured_kinds(table), MAX_MICROBATCH_S)
    validate_calls(table, err, measured_kinds(table), MAX_MICROBATCH_S)
    if table.get("coefficients") is not None:
        check_coefficients(table, table["coefficients"], where)
    return table


def _validate_execution(table: dict, err) -> None:
    """The ``execution`` section: required since format 2, absent in format 1."""
    ex = table.get("execution")
    if ex is None and table["format_version"] < 2:
        return
    if not isinstance(ex, dict):
        err("execution", f"{ex!r}: expected an object with {sorted(EXECUTION)} (format_version "
            f"{FORMAT_VERSION} tables record them: re-profile with sparsebalance-profile)")
    for k, allowed in EXECUTION.items():
        if k not in ex:
            err(f"execution.{k}", "missing")
        v = ex[k]
        if allowed is None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            err(f"execution.{k}", f"{v!r}: expected an integer >= 1")
        if allowed is not None and v not in allowed:
            err(f"execution.{k}", f"{v!r}: expected one of {allowed}")


def check_coefficients(table: dict, coefficients: Any, where: str = "<table>") -> None:
    """Refuse coefficients that are malformed or degenerate (stored, or just fitted): every one
    finite, work features' >= 0, not all zero, and every micro-batch of the table's own grid
    predicted in (0, ``MAX_MICROBATCH_S``] s. ``table`` must already be valid otherwise."""
    def err(field, problem):
        raise LatencyTableError(f"latency table {where}: field '{field}': {problem}")

    feats = table["features"]
    if not isinstance(coefficients, dict):
        err("coefficients", f"{str(coefficients)[:60]}: expected an object "
            f"{{kind: {{fwd: [...], bwd: [...]}}}}")
    att = table["attention"]
    for kind in measured_kinds(table):
        per_kind = coefficients.get(kind)
        total = None
        idx = [i for i, m in enumerate(table["measurements"]) if m["kind"] == kind]
        rows = [table["measurements"][i] for i in idx]
        units = UnitFeatures.build([m["doc_lengths"] for m in rows], att["block_size"],
                                   att["sink_blocks"], att["local_blocks"],
                                   att.get("work", "kept"), int(att.get("query_chunk_blocks", 16)),
                                   table_crossover(table))
        x = units.matrix(np.asarray([m["density"] for m in rows]))              # [n, 5]
        for part in ("fwd", "bwd"):
            f = f"coefficients.{kind}.{part}"
            c = per_kind.get(part) if isinstance(per_kind, dict) else None
            if isinstance(c, (tuple, np.ndarray)):        # built in code rather than read
                c = np.asarray(c).tolist()
            if not isinstance(c, list) or len(c) != len(feats) or not all(
                    _finite(v) for v in c):
                err(f, f"{str(c)[:80]}: expected {len(feats)} finite numbers (one per feature)")
            if not any(c):
                err(f, f"{c!r}: all zero: every micro-batch would be predicted to take 0 s, so "
                    f"balancing and DST have nothing to act on; expected a fitted, positive cost")
            for j in range(1, len(c)):
                if c[j] < 0:
                    err(f"{f}[{j}]", f"{c[j]!r} (seconds per unit of {feats[j]}): expected >= 0 "
                        f"(a cost cannot shrink with more work)")
            if abs(c[0]) > MAX_MICROBATCH_S:
                err(f"{f}[0]", f"{c[0]!r} s (const): expected at most {MAX_MICROBATCH_S:g} s")
            with np.errstate(over="ignore", invalid="ignore"):
                pred = x @ np.asarray(c, dtype=np.float64)                       # [n]
                if units.dense_work.any():
                    pred = pred + units.dense_work * dense_coefficient(table, coefficients,
                                                                       kind, part)
                for name in CALL_FEATURES:
                    pred = pred + getattr(units, name) * call_coefficient(table, kind, part, name)
            worst = int(np.argmax(np.where(np.isnan(pred), np.inf, pred)))
            if not pred[worst] <= MAX_MICROBATCH_S:
                err(f, f"{str(c)[:80]} predicts {pred[worst]:.3g} s for "
                    f"{_describe(table, idx[worst])}: expected at most {MAX_MICROBATCH_S:g} s "
                    f"per micro-batch")
            total = pred if total is None else total + pred
        low = int(np.argmin(total))
        if total[low] <= 0:
            err(f"coefficients.{kind}", f"predict {total[low]:.3g} s (forward + backward) for "
                f"{_describe(table, idx[low])}: expected more than 0 s")


def _describe(table: dict, i: int) -> str:
    m = table["measurements"][i]
    return (f"measurements[{i}] ({len(m['doc_lengths'])} document(s), "
            f"{sum(m['doc_lengths'])} tokens, density {m['density']:g})")


def _too_large(path: str, size: str) -> LatencyTableError:
    return LatencyTableError(f"latency table {path}: {size} is over the {MAX_TABLE_BYTES} bytes "
                             f"({MAX_TABLE_BYTES // 2**20} MiB) limit of a latency table (a "
                             f"profiled table is well under 1 MiB): not read. Is it the right "
                             f"file?")


def read_table(path: str) -> dict:
    """Read and validate a JSON table; every failure is a ``LatencyTableError`` naming ``path``.
    The size is checked before reading, and at most ``MAX_TABLE_BYTES + 1`` bytes are read."""
    if not os.path.exists(path):
        raise LatencyTableError(f"latency table {path}: file not found")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise LatencyTableError(f"latency table {path}: not a regular file")
        if st.st_size > MAX_TABLE_BYTES:
            raise _too_large(path, f"{st.st_size} bytes ({st.st_size / 2**20:.1f} MiB)")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TABLE_BYTES + 1)
        if len(raw) > MAX_TABLE_BYTES:      # grew after the stat
            raise _too_large(path, f"more than {MAX_TABLE_BYTES} bytes")
        table = json.loads(raw.decode("utf-8"), parse_constant=lambda c: float(c))
    except json.JSONDecodeError as e:
        raise LatencyTableError(f"latency table {path}: not valid JSON (truncated or malformed) "
                                f"at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:
        raise LatencyTableError(f"latency table {path}: not UTF-8 text: {e}") from e
    except ValueError as e:              # e.g. an integer literal of thousands of digits
        raise LatencyTableError(f"latency table {path}: unreadable JSON value: {e}") from e
    except RecursionError as e:
        raise LatencyTableError(f"latency table {path}: JSON nested too deeply") from e
    except OSError as e:
        raise LatencyTableError(f"latency table {path}: cannot be read: {e}") from e
    return validate_table(table, path)


def write_table(table: dict, path: str) -> None:
    validate_table(table, path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)


def _strip_local(v: str) -> str:
    return str(v).split("+")[0]


def table_differences(table: dict, expect: dict) -> list[str]:
    """What differs between a table and the run: ``expect`` may hold device, torch,
    megatron_core, sparsebalance_megatron (the plugin's kernels and data layout change its
    timings), model, execution, attention, pipeline (dicts); absent keys are not checked."""
    diffs = []
    if "device" in expect and expect["device"] != table["device"]:
        diffs.append(f"device: table {table['device']!r}, this run {expect['device']!r}")
    for k in ("torch", "megatron_core", "sparsebalance_megatron"):
        if k == "sparsebalance_megatron" and k not in table["software"]:
            continue   # hand-written / analytic tables do not say which plugin measured them
        if k in expect and _strip_local(expect[k]) != _strip_local(table["software"].get(k)):
            diffs.append(f"{k} version: table {table['software'].get(k)!r}, this run {expect[k]!r}")
    for section in ("model", "execution", "attention", "pipeline"):
        want = expect.get(section)
        if not want:
            continue
        have = table.get(section) or {}
        for k, v in want.items():
            if k in have and have[k] != v:
                diffs.append(f"{section}.{k}: table {have[k]!r}, this run {v!r}")
            elif k not in have:
                old = (f" (a format_version {table['format_version']} table predates it: "
                       f"re-profile with sparsebalance-profile)"
                       if section == "execution" and table["format_version"] < 2 else "")
                diffs.append(f"{section}.{k}: missing in the table{old}, this run {v!r}")
    return diffs


def check_compatible(table: dict, expect: Optional[dict], where: str, force: bool) -> None:
    if not expect:
        return
    diffs = table_differences(table, expect)
    if not diffs:
        return
    msg = (f"latency table {where} does not match this run: " + "; ".join(diffs))
    if force:
        warnings.warn(msg + " (used anyway: --sb-latency-table-force)", stacklevel=3)
        return
    raise LatencyTableMismatch(msg + ". Profile this setup with sparsebalance-profile, or pass "
                               "--sb-latency-table-force to use the table anyway.")
