"""The DST plan rank 0 broadcasts each step, as one fixed-size float64 vector (``step/exchange.py``
sends it down the process groups in place of a pickled object).

A plan is ``(densities [dp][m][stages], report)`` as ``step/choice.py``'s ``choose`` returns it:
the report is ``DSTReport``'s fields, ``raise_headroom``, ``unit_sensitivity`` [dp][m] (or None),
``predicted_busy_s`` [dp][pipeline ranks] (the planner's uncorrected prediction of the committed
plan, which every rank calibrates against, or None) and the do-no-harm record ``stand_down``. Its
layout (``PlanShape``) is sized from what every rank knows before the broadcast: DP ranks,
micro-batches (each candidate packing's: Megatron's dp_balanced makes its own count, so the
densities' room is the largest and the committed packing's ``packing_index`` says how much of it
is filled), stages, pipeline ranks, how many packings were candidates, whether a sensitivity
tracker runs. ``DSTReport``'s fields are read from the dataclass
(an ``int``, ``float`` or ``tuple`` of per-stage floats each), so a field added there travels
without a change here; a report entry with no slot, or a value that does not fit its slot, is
refused with a ValueError naming it. Decoding gives back the same keys with Python ``int``,
``float``, ``bool`` and ``list`` values.

Layout: a header ``[MAGIC, dp, m, stages, options, sensitivity]``, the densities, then each report
entry in a fixed order: an int in one word, an optional float in two (present, value), an
optional list in a length word (-1: None) and its capacity.

Pure numpy: no torch, no torch.distributed, no megatron.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...policy.dst_band import DSTReport

MAGIC = 0x5342_504C_4E02        # "SBPLN" v2 (v1 had no predicted_busy_s)
MAX_BYTES = 64 << 20
HEADER = 6
STAND_DOWN = ("dst_stood_down", "sab_stood_down", "packing_index", "predicted_step_s",
              "predicted_static_s", "predicted_dst_s")
EXTRAS = ("raise_headroom", "unit_sensitivity", "predicted_busy_s", "stand_down")


def _report_fields() -> list:
    """(name, kind) of every ``DSTReport`` field: 'int', 'float' or 'stages' (a tuple of per-stage
    floats); a field of another type has no slot (TypeError when a plan is encoded)."""
    kinds = {"int": "int", "float": "float", "tuple": "stages"}
    out = []
    for f in dataclasses.fields(DSTReport):
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if t not in kinds:
            raise TypeError(f"DSTReport.{f.name} has type {t}: the plan record has slots for "
                            f"int, float and tuple (per-stage floats) fields only")
        out.append((f.name, kinds[t]))
    return out


@dataclass(frozen=True)
class PlanShape:
    """The size of a step's plan: ``dp`` x ``microbatches`` x ``stages`` densities, ``options``
    candidate packings (1, or 2 with the do-no-harm baseline), ``sensitivity``: whether the report
    carries a [dp, m] unit sensitivity (a tracker runs), ``ranks``: the pipeline ranks of the
    report's [dp, ranks] predicted busy seconds (0: the record has no room for them),
    ``option_microbatches``: each candidate's micro-batches per DP rank where they differ
    (the first is ``microbatches``; empty: every candidate has ``microbatches``)."""

    dp: int
    microbatches: int
    stages: int
    options: int = 1
    sensitivity: bool = False
    ranks: int = 0
    option_microbatches: tuple = ()

    def __post_init__(self):
        for name in ("dp", "microbatches", "stages", "options"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"plan shape: {name}={v!r}: expected an integer >= 1")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, (int, np.integer)) \
                or self.ranks < 0:
            raise ValueError(f"plan shape: ranks={self.ranks!r}: expected an integer >= 0")
        if not isinstance(self.sensitivity, (bool, np.bool_)):
            raise ValueError(f"plan shape: sensitivity={self.sensitivity!r}: expected a bool")
        m = self.option_microbatches
        if m and (len(m) != self.options or m[0] != self.microbatches or any(
                isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                for v in m)):
            raise ValueError(f"plan shape: option_microbatches={m!r}: expected {self.options} "
                             f"integers >= 1, the first microbatches={self.microbatches}")
        if self.nbytes > MAX_BYTES:
            raise ValueError(f"plan shape {self}: {self.nbytes} bytes, over the "
                             f"{MAX_BYTES >> 20} MiB a step's plan may take")

    @property
    def room(self) -> int:
        """Micro-batches per DP rank the record has room for: the most of any candidate."""
        return max(self.option_microbatches or (self.microbatches,))

    def microbatches_of(self, index: int) -> int:
        """Micro-batches per DP rank of candidate packing ``index``."""
        if not 0 <= index < self.options:
            raise ValueError(f"plan record packing_index {index}: the plan has {self.options} "
                             f"candidate packing(s)")
        return (self.option_microbatches or (self.microbatches,) * self.options)[index]

    @property
    def units(self) -> int:
        return self.dp * self.room * self.stages

    @property
    def words(self) -> int:
        sizes = {"int": 1, "float": 2, "stages": 1 + self.stages}
        report = sum(sizes[k] for _, k in _report_fields())
        extras = 2 + 1 + self.dp * self.room              # raise_headroom, unit_sensitivity
        extras += 1 + self.dp * self.ranks                 # predicted_busy_s
        stand = 1 + 1 + 1 + 1 + (1 + self.options) + 2 + 2   # present, flags, index, times
        return HEADER + self.units + report + extras + stand

    @property
    def nbytes(self) -> int:
        return 8 * self.words


class _Writer:
    def __init__(self, words: int):
        self.f = np.zeros(words)
        self.i = self.f.view(np.int64)
        self.k = 0

    def int(self, v) -> None:
        self.i[self.k] = v
        self.k += 1

    def flag(self, v: Optional[bool]) -> None:
        self.int(-1 if v is None else int(bool(v)))

    def float(self, v, name: str) -> None:
        if v is not None and not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"plan report {name}={v!r}: expected a number or None")
        self.int(v is not None)
        self.f[self.k] = np.nan if v is None else float(v)
        self.k += 1

    def floats(self, v, cap: int, name: str) -> None:
        if v is None:
            self.int(-1)
        else:
            x = np.asarray(v, dtype=np.float64).reshape(-1)
            if x.size > cap:
                raise ValueError(f"plan report {name}: {x.size} values, the record has {cap}")
            self.int(x.size)
            self.f[self.k:self.k + x.size] = x
        self.k += cap


class _Reader:
    def __init__(self, buf: np.ndarray):
        self.f, self.i, self.k = buf, buf.view(np.int64), 0

    def int(self) -> int:
        self.k += 1
        return int(self.i[self.k - 1])

    def flag(self) -> Optional[bool]:
        v = self.int()
        return None if v < 0 else bool(v)

    def float(self) -> Optional[float]:
        present = self.int()
        self.k += 1
        return float(self.f[self.k - 1]) if present else None

    def floats(self, cap: int) -> Optional[list]:
        n = self.int()
        out = None if n < 0 else self.f[self.k:self.k + n].tolist()
        self.k += cap
        return out


def _int(v, name: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"plan report {name}={v!r}: expected an integer")
    return int(v)


def encode_plan(densities, report: dict, shape: PlanShape) -> np.ndarray:
    """``(densities, report)`` of ``choose`` as a plan record of ``shape``."""
    d = np.asarray(densities, dtype=np.float64)
    stand = report.get("stand_down") or {}
    m = shape.microbatches_of(_int(stand.get("packing_index", 0), "packing_index"))
    if d.shape != (shape.dp, m, shape.stages):
        raise ValueError(f"plan densities of shape {d.shape}: expected (dp, m, stages) = "
                         f"{(shape.dp, m, shape.stages)}")
    fields = _report_fields()
    extra = set(report) - {n for n, _ in fields} - set(EXTRAS)
    if extra:
        raise ValueError(f"plan report entry {sorted(extra)[0]!r} has no slot in the plan "
                         f"record (expected DSTReport's fields and {', '.join(EXTRAS)})")
    w = _Writer(shape.words)
    for v in (MAGIC, shape.dp, shape.microbatches, shape.stages, shape.options,
              int(shape.sensitivity)):
        w.int(v)
    area = np.zeros((shape.dp, shape.room, shape.stages))
    area[:, :m] = d
    w.f[w.k:w.k + area.size] = area.reshape(-1)
    w.k += area.size
    for name, kind in fields:
        if name not in report:
            raise ValueError(f"plan report has no {name!r} (a DSTReport field)")
        v = report[name]
        if kind == "int":
            w.int(_int(v, name))
        elif kind == "float":
            w.float(v, name)
        else:
            w.floats(v, shape.stages, name)
    w.float(report.get("raise_headroom"), "raise_headroom")
    sens = report.get("unit_sensitivity")
    if sens is not None and np.shape(sens) != (shape.dp, m):
        raise ValueError(f"plan report unit_sensitivity of shape {np.shape(sens)}: expected "
                         f"(dp, m) = {(shape.dp, m)}")
    if sens is not None and not shape.sensitivity:
        raise ValueError("plan report carries a unit_sensitivity, the plan shape none")
    w.floats(sens, shape.dp * shape.room, "unit_sensitivity")
    busy = report.get("predicted_busy_s")
    if busy is not None and np.shape(busy) != (shape.dp, shape.ranks):
        raise ValueError(f"plan report predicted_busy_s of shape {np.shape(busy)}: expected "
                         f"(dp, pipeline ranks) = {(shape.dp, shape.ranks)}")
    w.floats(busy, shape.dp * shape.ranks, "predicted_busy_s")
    if set(stand) - set(STAND_DOWN) or (stand and set(stand) != set(STAND_DOWN)):
        raise ValueError(f"plan report stand_down keys {sorted(stand)}: expected "
                         f"{list(STAND_DOWN)}")
    w.int(int(bool(stand)))
    w.flag(stand.get("dst_stood_down"))
    w.flag(stand.get("sab_stood_down"))
    w.int(_int(stand.get("packing_index", 0), "packing_index"))
    w.floats(stand.get("predicted_step_s", []), shape.options, "stand_down.predicted_step_s")
    w.float(stand.get("predicted_static_s"), "stand_down.predicted_static_s")
    w.float(stand.get("predicted_dst_s"), "stand_down.predicted_dst_s")
    if w.k != shape.words:
        raise AssertionError(f"plan record layout: wrote {w.k} of {shape.words} words")
    return w.f


def decode_plan(buf: np.ndarray, shape: PlanShape) -> tuple:
    """``(densities [dp, m, stages] float64, report dict)`` of a plan record of ``shape``."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float64 or buf.shape != (shape.words,):
        raise ValueError(f"plan record: {getattr(buf, 'dtype', type(buf).__name__)} "
                         f"{getattr(buf, 'shape', '')}, expected float64 ({shape.words},) for "
                         f"{shape}")
    r = _Reader(buf)
    head = tuple(r.int() for _ in range(HEADER))
    want = (MAGIC, shape.dp, shape.microbatches, shape.stages, shape.options,
            int(shape.sensitivity))
    if head != want:
        raise ValueError(f"plan record header {head} does not match {shape}")
    area = buf[r.k:r.k + shape.units].reshape(shape.dp, shape.room, shape.stages)
    r.k += shape.units
    report: dict = {}
    for name, kind in _report_fields():
        report[name] = r.int() if kind == "int" else r.float() if kind == "float" \
            else (lambda v: None if v is None else tuple(v))(r.floats(shape.stages))
    report["raise_headroom"] = r.float()
    report["unit_sensitivity"] = r.floats(shape.dp * shape.room)   # shaped below
    busy = r.floats(shape.dp * shape.ranks)
    report["predicted_busy_s"] = None if busy is None else \
        np.asarray(busy).reshape(shape.dp, shape.ranks).tolist()
    has_stand = r.int()
    stand = {"dst_stood_down": r.flag(), "sab_stood_down": r.flag(),
             "packing_index": r.int(), "predicted_step_s": r.floats(shape.options),
             "predicted_static_s": r.float(), "predicted_dst_s": r.float()}
    report["stand_down"] = stand if has_stand else None
    m = shape.microbatches_of(stand["packing_index"])      # the committed packing's count
    sens = report["unit_sensitivity"]
    report["unit_sensitivity"] = None if sens is None else \
        np.asarray(sens).reshape(shape.dp, m).tolist()
    return area[:, :m].copy(), report
