"""The record every rank reports at a step's end, as one fixed-size float64 vector: what
``step/exchange.py`` gathers once per (DP rank, pipeline stage) cell, in place of a pickled dict
per rank.

One layout (``RecordShape``) at three levels:

- a rank encodes what it measured (``RankReport`` -> ``encode_rank``; one stage block);
- the tensor- and context-parallel ranks of a cell combine theirs (``combine_cell``: the slowest
  time, summed losses and counts, the first budget violation), as ``measured_busy`` took the
  slowest of the ranks that wait for each other in their collectives;
- the cells of a pipeline join into one line (``join_pipeline``: a block per stage, the document
  sums added), which decodes into its DP rank's ``StepSummary`` (``decode_step``); over the DP
  group travel its sums and maxima (``StepExchange.gather``), every line only for --sb-metrics-file.

The layout is sized from the step's shape, known on every rank before the step ends: the timed
intervals of a pipeline rank (micro-batches x model chunks), whether per-interval times travel
(only ``--sb-metrics-file`` writes them), and the document slots (the most documents of any DP
rank; only with a sensitivity signal, whose per-document sums reach the trackers every rank packs
with). Integers travel as the bits of int64 words in the same vector. A record that does not fit
its layout is refused with a ValueError naming the size.

Layout, in float64 words: a header ``[MAGIC, dp, stages, timed, units, docs]``; per stage a block
of ``BLOCK_FIELDS`` words and ``units`` x (fwd s, bwd s, micro-batch, virtual stage); then
``docs`` x (sum, count) of the sensitivity signal.

Pure numpy: no torch, no torch.distributed, no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from .checks import Violation

MAGIC = 0x5342_5245_4301        # "SBREC" v1: a vector that is not a step record is refused
MAX_BYTES = 64 << 20            # a control record this large is a wrong shape, not a step
HEADER = ("magic", "dp", "stages", "timed", "units", "docs")
# One stage's block: integers (int64 bits) first, then floats.
INT_FIELDS = ("pp", "fingerprint", "fingerprints_differ", "ranks", "violations", "bad_kind",
              "bad_stage", "bad_microbatch", "planner_events", "backend")
FLOAT_FIELDS = ("busy_s", "step_s", "loss_sum", "loss_tokens", "bad_value", "bad_want")
BLOCK_FIELDS = len(INT_FIELDS) + len(FLOAT_FIELDS)
UNIT_WORDS = 4                  # fwd s, bwd s (float); micro-batch, virtual stage (int)
DOC_WORDS = 2                   # sum, count (float)
BAD_KINDS = {"request": 1, "kept": 2}
MAX_EXAMPLES = 5                # violations a summary describes (the error names five)
_I = {k: i for i, k in enumerate(INT_FIELDS)}
_F = {k: len(INT_FIELDS) + i for i, k in enumerate(FLOAT_FIELDS)}


def _count(name: str, v, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"record shape: {name}={v!r}: expected an integer >= {low}")
    return int(v)


@dataclass(frozen=True)
class RecordShape:
    """The size of a step's record: ``stages`` blocks (1: a rank or cell; pp: a pipeline's line),
    ``timed`` intervals a pipeline rank times (micro-batches x model chunks), ``units`` of them
    travelling one by one (``timed`` or 0), ``docs`` document slots (0: no sensitivity signal)."""

    stages: int
    timed: int
    units: int = 0
    docs: int = 0

    def __post_init__(self):
        _count("stages", self.stages, 1)
        _count("timed", self.timed, 1)
        _count("units", self.units)
        _count("docs", self.docs)
        if self.units not in (0, self.timed):
            raise ValueError(f"record shape: units={self.units}: expected 0 or timed="
                             f"{self.timed} (per-interval times travel whole or not at all)")
        if self.nbytes > MAX_BYTES:
            raise ValueError(f"record shape {self}: {self.nbytes} bytes, over the "
                             f"{MAX_BYTES >> 20} MiB a step's control record may take")

    @property
    def block(self) -> int:
        return BLOCK_FIELDS + UNIT_WORDS * self.units

    @property
    def words(self) -> int:
        return len(HEADER) + self.stages * self.block + DOC_WORDS * self.docs

    @property
    def nbytes(self) -> int:
        return 8 * self.words

    def with_stages(self, stages: int) -> "RecordShape":
        return RecordShape(stages, self.timed, self.units, self.docs)


@dataclass
class RankReport:
    """What one rank measured in a step (``SparseBalanceCallback.end_step``)."""

    dp: int                              # its DP rank
    pp: int                              # its pipeline rank
    fingerprint: int                     # the step's packing (``checks.fingerprint``)
    fwd_s: Sequence[float] = ()          # every timed forward interval, in order
    bwd_s: Sequence[float] = ()          # every timed backward interval, in order
    units: Sequence[tuple] = ()          # (micro-batch, virtual stage) of each forward interval
    step_s: Optional[float] = None       # seconds since the schedule began
    loss: tuple = (0.0, 0.0)             # (loss sum, tokens) of its micro-batches
    violations: Sequence[Violation] = ()  # ``checks.budget_violations``
    doc_values: Mapping[int, tuple] = field(default_factory=dict)  # {doc: (sum, count)}
    planner_events: int = 0              # its planner process's deaths and stalls since the last
    backend: int = 0                     # 1 + its attention kernel's place in the fallback CHAIN


@dataclass
class StepSummary:
    """What a rank knows after a step's gather (busy seconds and documents: its DP rank's)."""

    busy_s: Optional[np.ndarray] = None  # [k, pp] fwd+bwd s, slowest TP/CP rank, NaN untimed
    step_s: Optional[float] = None       # the slowest rank's time since its schedule began
    loss: tuple = (0.0, 0.0)             # (loss sum, tokens) over every rank
    doc_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] sorted
    doc_sums: np.ndarray = field(default_factory=lambda: np.zeros((0, DOC_WORDS)))  # [n, 2]
    #                                    (sum, count) of the sensitivity signal per document
    fingerprints_agree: bool = True      # every rank of a DP rank packed its micro-batches alike
    violations: int = 0                  # (micro-batch, stage) units that ignored the plan
    examples: list = field(default_factory=list)   # the first MAX_EXAMPLES, described
    unit_times: dict = field(default_factory=dict)  # {(dp, pp): (units, fwd_s, bwd_s)}
    comm_s: float = 0.0                  # this rank's seconds in the gather's collectives
    bytes_received: int = 0              # what the gather brought this rank
    planner_events: int = 0              # every rank's planner deaths and stalls since the last
    backend: int = 0                     # the furthest attention fallback of any rank (0: none)


def doc_slots(batch) -> list:
    """[dp] sorted document ids of each DP rank's micro-batches (``batch``: a ``BatchPlan``, or
    its [dp][m] lists of segments): the slots its record's per-document sums fill (a document
    split over DP ranks has a slot on each)."""
    if hasattr(batch, "segment_array"):           # the plan's arrays
        ids, offsets = batch.segment_array()[:, 0], batch.unit_csr()[0]
        ends = offsets[::max(batch.num_microbatches, 1)][1:] if batch.dp else offsets[:0]
    else:
        ids = np.asarray([s[0] for rank in batch for mb in rank for s in mb], dtype=np.int64)
        ends = np.cumsum([sum(map(len, rank)) for rank in batch], dtype=np.int64)
    rank = np.repeat(np.arange(len(ends), dtype=np.int64), np.diff(np.r_[0, ends]))
    order = np.lexsort((ids, rank))                     # by rank, then id
    ids, rank = ids[order], rank[order]
    keep = np.ones(ids.size, dtype=bool)
    keep[1:] = (ids[1:] != ids[:-1]) | (rank[1:] != rank[:-1])
    return np.split(ids[keep], np.searchsorted(rank[keep], np.arange(1, len(ends))))


def step_record_shape(batch, vp: int, *, signal: bool, per_interval: bool) -> tuple:
    """(the step's ``RecordShape``, every DP rank's document slots): known to every rank before
    the step ends, from its packed ``batch`` and ``vp`` model chunks. Per-interval times travel
    only where ``per_interval`` (``--sb-metrics-file`` writes them); document sums only with a
    sensitivity ``signal``."""
    timed = batch.num_microbatches * vp
    slots = doc_slots(batch) if signal else []
    shape = RecordShape(1, timed, timed if per_interval else 0,
                        max((len(x) for x in slots), default=0))
    return shape, slots


def _views(buf: np.ndarray, shape: RecordShape):
    """(int header, float blocks [stages, block], int blocks, docs [docs, 2]) of ``buf``."""
    h, b = len(HEADER), shape.stages * shape.block
    ints = buf.view(np.int64)
    return (ints[:h], buf[h:h + b].reshape(shape.stages, shape.block),
            ints[h:h + b].reshape(shape.stages, shape.block),
            buf[h + b:].reshape(shape.docs, DOC_WORDS))


def check_record(buf: np.ndarray, shape: RecordShape, what: str = "record") -> None:
    """ValueError unless ``buf`` is a float64 vector of ``shape``'s size and header."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float64 or buf.ndim != 1:
        raise ValueError(f"{what}: expected a float64 vector, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} "
                         f"{getattr(buf, 'shape', '')}")
    if buf.size != shape.words:
        raise ValueError(f"{what}: {buf.size} words ({8 * buf.size} bytes), expected "
                         f"{shape.words} for {shape}")
    head = buf[:len(HEADER)].view(np.int64)
    want = (MAGIC, head[1], shape.stages, shape.timed, shape.units, shape.docs)
    if tuple(int(x) for x in head) != tuple(int(x) for x in want):
        got = dict(zip(HEADER, (int(x) for x in head)))
        raise ValueError(f"{what}: header {got} does not match {shape} (ranks disagree on the "
                         f"step's shape, or this is not a step record)")


def encode_rank(report: RankReport, shape: RecordShape, slots: np.ndarray) -> np.ndarray:
    """``report`` as a record of ``shape`` (one stage); ``slots``: the sorted document ids of
    the rank's DP rank (``doc_slots``), where its per-document sums go."""
    if shape.stages != 1:
        raise ValueError(f"a rank's record has one stage block, the shape says {shape.stages}")
    buf = np.zeros(shape.words)
    head, fb, ib, docs = _views(buf, shape)
    head[:] = (MAGIC, _count("dp", report.dp), 1, shape.timed, shape.units, shape.docs)
    f, i = fb[0], ib[0]
    i[_I["pp"]], i[_I["fingerprint"]], i[_I["ranks"]] = _count("pp", report.pp), \
        int(report.fingerprint), 1
    bad = list(report.violations)
    i[_I["violations"]] = len(bad)
    i[_I["planner_events"]] = _count("planner_events", report.planner_events)
    i[_I["backend"]] = _count("backend", report.backend)
    f[_F["bad_value"]] = f[_F["bad_want"]] = np.nan
    if bad:
        v = bad[0]
        i[_I["bad_kind"]], i[_I["bad_stage"]], i[_I["bad_microbatch"]] = \
            BAD_KINDS[v.kind], v.stage, v.microbatch
        f[_F["bad_value"]], f[_F["bad_want"]] = v.value, v.want
    fwd, bwd = np.asarray(report.fwd_s, np.float64), np.asarray(report.bwd_s, np.float64)
    timed = fwd.size == bwd.size == shape.timed    # a rank without every interval: untimed
    f[_F["busy_s"]] = fwd.sum() + bwd.sum() if timed else np.nan
    f[_F["step_s"]] = np.nan if report.step_s is None else float(report.step_s)
    f[_F["loss_sum"]], f[_F["loss_tokens"]] = (float(x) for x in report.loss)
    if shape.units:
        u = fb[0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS)
        ui = ib[0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS)
        units = list(report.units) or [(j, report.pp) for j in range(shape.timed)]
        if timed and len(units) == shape.timed:
            u[:, 0], u[:, 1] = fwd, bwd
            ui[:, 2:] = np.asarray(units, dtype=np.int64).reshape(-1, 2)
        else:
            u[:, :2], ui[:, 2:] = np.nan, -1
    if report.doc_values:
        _put_docs(docs, report.doc_values, np.asarray(slots, dtype=np.int64), report.dp, shape)
    return buf


def _put_docs(docs: np.ndarray, values: Mapping, slots: np.ndarray, dp: int,
              shape: RecordShape) -> None:
    if slots.size > shape.docs:
        raise ValueError(f"DP rank {dp} has {slots.size} documents, the record {shape.docs} "
                         f"slots")
    ids = np.fromiter(values, dtype=np.int64, count=len(values))
    at = np.searchsorted(slots, ids)
    ok = (at < slots.size) & (slots[np.minimum(at, max(slots.size - 1, 0))] == ids) \
        if slots.size else np.zeros(ids.size, bool)
    if not ok.all():
        raise ValueError(f"document {int(ids[~ok][0])} is not one of DP rank {dp}'s "
                         f"{slots.size} documents of the step: no slot for its sums")
    docs[at] = np.asarray([tuple(values[d]) for d in ids.tolist()], dtype=np.float64)


def combine_cell(records: np.ndarray, shape: RecordShape) -> np.ndarray:
    """The record of one (DP rank, stage) cell from its TP/CP ranks' ``records`` [n, words] (group
    rank order): the slowest busy, step and interval times, losses and document sums added,
    violations counted (the first kept), the packings compared."""
    records = np.asarray(records)
    for k, r in enumerate(records):
        check_record(r, shape, f"record of rank {k} of the cell")
    if shape.stages != 1:
        raise ValueError(f"a cell's record has one stage block, the shape says {shape.stages}")
    out = records[0].copy()
    views = [_views(r, shape) for r in records]
    _, fo, io, do = _views(out, shape)
    ints = np.stack([v[2][0, :BLOCK_FIELDS] for v in views])
    flts = np.stack([v[1][0, :BLOCK_FIELDS] for v in views])
    if len({int(h[1]) for h, *_ in views}) != 1 or len(set(ints[:, _I["pp"]].tolist())) != 1:
        raise ValueError("a cell's records come from different (DP rank, stage) places")
    io[0, _I["fingerprints_differ"]] = int(ints[:, _I["fingerprints_differ"]].any()
                                           or len(set(ints[:, _I["fingerprint"]].tolist())) > 1)
    io[0, _I["ranks"]] = ints[:, _I["ranks"]].sum()
    io[0, _I["violations"]] = ints[:, _I["violations"]].sum()
    io[0, _I["planner_events"]] = ints[:, _I["planner_events"]].sum()
    io[0, _I["backend"]] = ints[:, _I["backend"]].max()
    first = np.flatnonzero(ints[:, _I["bad_kind"]])
    if first.size:
        k = first[0]
        for name in ("bad_kind", "bad_stage", "bad_microbatch"):
            io[0, _I[name]] = ints[k, _I[name]]
        for name in ("bad_value", "bad_want"):
            fo[0, _F[name]] = flts[k, _F[name]]
    for name in ("busy_s", "step_s"):
        fo[0, _F[name]] = np.fmax.reduce(flts[:, _F[name]])
    for name in ("loss_sum", "loss_tokens"):
        fo[0, _F[name]] = _ordered_sum(flts[:, _F[name]])
    if shape.units:
        u = np.stack([v[1][0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS) for v in views])
        ui = np.stack([v[2][0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS) for v in views])
        cell = fo[0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS)
        cell[:, :2] = np.fmax.reduce(u[:, :, :2], axis=0)
        timed = np.flatnonzero(ui[:, 0, 2] >= 0)
        io[0, BLOCK_FIELDS:].reshape(shape.units, UNIT_WORDS)[:, 2:] = \
            ui[timed[0], :, 2:] if timed.size else -1
    if shape.docs:
        do[:] = _ordered_sum(np.stack([v[3] for v in views]))
    return out


def _ordered_sum(x: np.ndarray) -> np.ndarray:
    """The sum over axis 0 added in order, one rank after another: every rank that adds the same
    gathered records gets the same bits (no pairwise reordering)."""
    acc = np.array(x[0], dtype=np.float64, copy=True)
    for row in x[1:]:
        acc = acc + row
    return acc


def join_pipeline(cells: np.ndarray, shape: RecordShape) -> np.ndarray:
    """One DP rank's line from its pipeline's cell records ``cells`` [pp, words] (pipeline rank
    order): a block per stage, the document sums added."""
    cells = np.asarray(cells)
    for s, c in enumerate(cells):
        check_record(c, shape, f"record of pipeline stage {s}")
        if int(c.view(np.int64)[len(HEADER) + _I["pp"]]) != s:
            raise ValueError(f"record {s} of the pipeline group comes from another stage")
    line_shape = shape.with_stages(len(cells))
    out = np.zeros(line_shape.words)
    head, fb, _, docs = _views(out, line_shape)
    head[:] = cells[0].view(np.int64)[:len(HEADER)]
    head[2] = len(cells)
    fb[:] = np.stack([_views(c, shape)[1][0] for c in cells])
    if shape.docs:
        docs[:] = _ordered_sum(np.stack([_views(c, shape)[3] for c in cells]))
    return out


def split_docs(line: np.ndarray, shape: RecordShape, slots) -> tuple:
    """(``line`` without its document sums, its header saying none; the sorted document ids and
    [n, 2] sums of its DP rank's document ``slots``)."""
    check_record(line, shape, "line")
    cut = len(line) - DOC_WORDS * shape.docs
    bare = line[:cut].copy()
    bare.view(np.int64)[5] = 0
    return (bare,) + _doc_sums(line[cut:].reshape(1, shape.docs, DOC_WORDS), [slots])


def decode_step(lines: np.ndarray, shape: RecordShape, slots: Sequence,
                first: int = 0) -> StepSummary:
    """The ``StepSummary`` of DP ranks ``first``, ``first + 1``, ...'s lines ``lines`` [k, words]
    (DP rank order; ``shape`` with ``stages`` = pp) and each DP rank's document ``slots``."""
    lines = np.asarray(lines)
    if lines.dtype != np.float64 or lines.ndim != 2 or lines.shape[1] != shape.words:
        raise ValueError(f"lines of the data-parallel group: {lines.dtype} {lines.shape}, "
                         f"expected float64 [dp, {shape.words}] for {shape}")
    dp, pp, h, b = len(lines), shape.stages, len(HEADER), shape.stages * shape.block
    ints = lines.view(np.int64)
    head = ints[:, :h]
    want = np.array([MAGIC, 0, pp, shape.timed, shape.units, shape.docs])
    wrong = np.flatnonzero((head[:, [0, 2, 3, 4, 5]] != want[[0, 2, 3, 4, 5]]).any(axis=1)
                           | (head[:, 1] != first + np.arange(dp)))
    if wrong.size:
        r, got = int(wrong[0]), dict(zip(HEADER, head[int(wrong[0])].tolist()))
        raise ValueError(f"line {r} of the data-parallel group: header {got} does not match "
                         f"DP rank {first + r} of {shape} (ranks disagree on the step's shape?)")
    fb = lines[:, h:h + b].reshape(dp, pp, shape.block)
    ib = ints[:, h:h + b].reshape(dp, pp, shape.block)
    step_s = np.fmax.reduce(fb[:, :, _F["step_s"]].reshape(-1))
    loss = _ordered_sum(fb[:, :, [_F["loss_sum"], _F["loss_tokens"]]].reshape(-1, 2))
    # a DP rank's ranks packed alike (its cells and stages); DP ranks pack their own rows
    fp = ib[:, :, _I["fingerprint"]]
    agree = bool((fp == fp[:, :1]).all()) and not ib[:, :, _I["fingerprints_differ"]].any()
    bad_at = np.argwhere(ib[:, :, _I["bad_kind"]] != 0)[:MAX_EXAMPLES]
    examples = [_violation(ib[r, s], fb[r, s]).describe(first + int(r)) for r, s in bad_at]
    unit_times: dict = {}
    if shape.units:
        for r in range(dp):
            for s in range(pp):
                _unit_times(unit_times, (first + r, s), fb[r, s], ib[r, s], shape.units)
    ids, sums = _doc_sums(lines[:, h + b:].reshape(dp, shape.docs, DOC_WORDS), slots)
    return StepSummary(busy_s=fb[:, :, _F["busy_s"]].copy(),
                       step_s=None if np.isnan(step_s) else float(step_s),
                       loss=(float(loss[0]), float(loss[1])), doc_ids=ids, doc_sums=sums,
                       fingerprints_agree=bool(agree),
                       violations=int(ib[:, :, _I["violations"]].sum()), examples=examples,
                       unit_times=unit_times,
                       planner_events=int(ib[:, :, _I["planner_events"]].sum()),
                       backend=int(ib[:, :, _I["backend"]].max()))


def _doc_sums(docs: np.ndarray, slots: Sequence) -> tuple:
    """(sorted document ids, [n, 2] sums) of the documents with a count: every DP rank's slots
    added in DP rank order (a split document's parts added one after another)."""
    if not docs.shape[1]:
        return np.zeros(0, np.int64), np.zeros((0, DOC_WORDS))
    ids = np.concatenate([np.asarray(slots[r], np.int64) for r in range(len(docs))])
    vals = np.concatenate([docs[r, :len(slots[r])] for r in range(len(docs))])
    keep = vals[:, 1] != 0
    uniq, inv = np.unique(ids[keep], return_inverse=True)
    sums = np.stack([np.bincount(inv, weights=vals[keep, k], minlength=uniq.size)
                     for k in range(DOC_WORDS)], axis=1)
    return uniq, sums


def _violation(i: np.ndarray, f: np.ndarray) -> Violation:
    kind = {v: k for k, v in BAD_KINDS.items()}[int(i[_I["bad_kind"]])]
    return Violation(kind, int(i[_I["bad_stage"]]), int(i[_I["bad_microbatch"]]),
                     float(f[_F["bad_value"]]), float(f[_F["bad_want"]]))


def _unit_times(out: dict, key: tuple, f: np.ndarray, i: np.ndarray, units: int) -> None:
    u, ui = (x[BLOCK_FIELDS:].reshape(units, UNIT_WORDS) for x in (f, i))
    if (ui[:, 2] >= 0).all():
        out[key] = ([(int(a), int(b)) for a, b in ui[:, 2:].tolist()], u[:, 0].tolist(),
                    u[:, 1].tolist())
