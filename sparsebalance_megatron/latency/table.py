"""The latency table: JSON format, strict validation, and the "same device / model / software" check.

A table (written by the profiler or by ``analytic.py``) looks like::

    {"format": "sparsebalance-latency-table", "format_version": 1,
     "source": "profiled" | "analytic",
     "device": "cpu: ...", "software": {"torch": "2.13.0", "megatron_core": "0.19.2"},
     "model": {"num_layers": ..., "hidden_size": ..., ...},
     "attention": {"block_size": 64, "sink_blocks": 1, "local_blocks": 0,
                   "work": "kept" | "chunked", "query_chunk_blocks": 16},
     "pipeline": {"pp": 2, "stage_kinds": ["first", "last"], "layers_per_stage": [2, 2]},
     "features": ["const", "tokens", "attention_work", "selection_work"],
     "measurements": [{"kind": "first", "doc_lengths": [...], "density": 0.5,
                       "fwd_s": ..., "bwd_s": ...}, ...],
     "coefficients": {"first": {"fwd": [c0, c1, c2, c3], "bwd": [...]}, ...},   # optional
     "p2p_s": 0.0, "notes": "..."}                                               # optional

Every problem raises ``LatencyTableError`` naming the file and the field; a table from another
device, model shape or software version raises ``LatencyTableMismatch`` unless forced.
JSON only (never pickle). Pure Python + numpy; must not import torch or megatron.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Optional

FORMAT = "sparsebalance-latency-table"
FORMAT_VERSION = 1
STAGE_KINDS = ("only", "first", "middle", "last")
REQUIRED = ("format", "format_version", "source", "device", "software", "model", "attention",
            "pipeline", "features", "measurements")


class LatencyTableError(ValueError):
    """A latency table is unreadable or malformed; the message names the file and the field."""


class LatencyTableMismatch(LatencyTableError):
    """A latency table was measured on another device, model shape or software version."""


def stage_kinds_for(pp: int) -> list[str]:
    """Stage kind of every stage: the first carries the embedding, the last the LM head + loss."""
    if pp == 1:
        return ["only"]
    return ["first"] + ["middle"] * (pp - 2) + ["last"]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    if table["format_version"] != FORMAT_VERSION:
        err("format_version", f"{table['format_version']!r}: expected {FORMAT_VERSION}")
    if table["source"] not in ("profiled", "analytic"):
        err("source", f"{table['source']!r}: expected 'profiled' or 'analytic'")
    if not isinstance(table["device"], str) or not table["device"]:
        err("device", f"{table['device']!r}: expected a non-empty string")
    sw = table["software"]
    if not isinstance(sw, dict) or "torch" not in sw or "megatron_core" not in sw:
        err("software", f"{sw!r}: expected an object with 'torch' and 'megatron_core'")
    if not isinstance(table["model"], dict):
        err("model", "expected an object describing the model shape")
    att = table["attention"]
    for k in ("block_size", "sink_blocks", "local_blocks"):
        if not isinstance(att, dict) or k not in att:
            err(f"attention.{k}", "missing")
        if not isinstance(att[k], int) or att[k] < (1 if k == "block_size" else 0):
            err(f"attention.{k}", f"{att[k]!r}: expected an integer >= "
                f"{1 if k == 'block_size' else 0}")
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
    feats = table["features"]
    if not isinstance(feats, list) or not feats or feats[0] != "const":
        err("features", f"{feats!r}: expected a list starting with 'const'")
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
        if m["kind"] not in kinds:
            err(f"{f}.kind", f"{m['kind']!r}: expected one of the pipeline's kinds {sorted(set(kinds))}")
        dl = m["doc_lengths"]
        if not isinstance(dl, list) or not dl or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in dl):
            err(f"{f}.doc_lengths", f"{str(dl)[:60]}: expected a non-empty list of positive integers")
        d = m["density"]
        if not _num(d) or not (0 < d <= 1):
            err(f"{f}.density", f"{d!r}: expected a number in (0, 1]")
        for k in ("fwd_s", "bwd_s"):
            v = m[k]
            if not _num(v) or not math.isfinite(v) or v < 0:
                err(f"{f}.{k}", f"{v!r}: expected a finite time in seconds >= 0")
    missing = sorted(set(kinds) - {m["kind"] for m in meas})
    if missing:
        err("measurements", f"no measurement for stage kind(s) {missing}")
    coef = table.get("coefficients")
    if coef is not None:
        if not isinstance(coef, dict):
            err("coefficients", "expected an object {kind: {fwd: [...], bwd: [...]}}")
        for kind in set(kinds):
            for part in ("fwd", "bwd"):
                c = coef.get(kind, {}).get(part) if isinstance(coef.get(kind), dict) else None
                if not isinstance(c, list) or len(c) != len(feats) or not all(
                        _num(x) and math.isfinite(x) for x in c):
                    err(f"coefficients.{kind}.{part}",
                        f"{c!r}: expected {len(feats)} finite numbers (one per feature)")
    p2p = table.get("p2p_s", 0.0)
    if not _num(p2p) or not math.isfinite(p2p) or p2p < 0:
        err("p2p_s", f"{p2p!r}: expected a finite time in seconds >= 0")
    return table


def read_table(path: str) -> dict:
    """Read and validate a JSON table; every failure is a ``LatencyTableError`` naming ``path``."""
    if not os.path.exists(path):
        raise LatencyTableError(f"latency table {path}: file not found")
    try:
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh, parse_constant=lambda c: float(c))
    except json.JSONDecodeError as e:
        raise LatencyTableError(f"latency table {path}: not valid JSON (truncated or malformed) "
                                f"at line {e.lineno} column {e.colno}: {e.msg}") from e
    except (OSError, UnicodeDecodeError) as e:
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
    timings), model (dict), attention (dict), pipeline (dict); absent keys are not checked."""
    diffs = []
    if "device" in expect and expect["device"] != table["device"]:
        diffs.append(f"device: table {table['device']!r}, this run {expect['device']!r}")
    for k in ("torch", "megatron_core", "sparsebalance_megatron"):
        if k == "sparsebalance_megatron" and k not in table["software"]:
            continue   # hand-written / analytic tables do not say which plugin measured them
        if k in expect and _strip_local(expect[k]) != _strip_local(table["software"].get(k)):
            diffs.append(f"{k} version: table {table['software'].get(k)!r}, this run {expect[k]!r}")
    for section in ("model", "attention", "pipeline"):
        want = expect.get(section)
        if not want:
            continue
        have = table[section]
        for k, v in want.items():
            if k in have and have[k] != v:
                diffs.append(f"{section}.{k}: table {have[k]!r}, this run {v!r}")
            elif k not in have:
                diffs.append(f"{section}.{k}: missing in the table, this run {v!r}")
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
