"""The checks and sums of a step's end (``SparseBalanceCallback``).

Each rank checks its own part before the step's record goes out: the attention used the broadcast
plan (``budget_violations``: what it asked for and what it kept, per (micro-batch, stage)); the
record (``step/record.py``) carries the count and the first violation, and every rank raises alike
from the gathered summary. Also here: the packing's fingerprint every rank compares, the order of a
pipeline rank's timed units, the per-document sums the sensitivity tracker reads, and the line that
warns of a slower pipeline layout than another split.
Plain Python and numpy: no torch.distributed, no megatron.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import numpy as np

from ...batching.plan import BatchPlan
from ...plan import BudgetPlan


def check_assignment(segments, batch: BatchPlan, capacity: int, given=None) -> None:
    """The packer used every segment of the step exactly once and respected the capacity;
    ``given``: ``segment_counts(segments)`` where the caller has it (one per step, whatever
    the packings checked against it)."""
    want = segment_counts(segments) if given is None else given
    if not np.array_equal(_sorted_rows(batch.segment_array()), want):     # as multisets
        raise RuntimeError("packer dropped or duplicated segments of the global batch")
    check_capacity(batch, capacity)


def check_capacity(batch: BatchPlan, capacity: int, rank: int = 0) -> None:
    """No micro-batch of ``batch`` holds more than ``capacity`` tokens (``rank``: the DP rank
    of its first row, for the message)."""
    offsets, lengths = batch.unit_csr()
    ends = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=ends[1:])
    tokens = ends[offsets[1:]] - ends[offsets[:-1]]               # [dp * m], rank-major
    over = np.flatnonzero(tokens > capacity)
    if over.size:
        r, j = divmod(int(over[0]), batch.num_microbatches)
        raise RuntimeError(f"packer put {int(tokens[over[0]])} tokens in micro-batch "
                           f"({r + rank}, {j}), capacity {capacity}")


def segment_counts(segments) -> np.ndarray:
    """The step's segments as a multiset (``check_assignment``): their (sample id, start, end)
    rows sorted, [n, 3] int64."""
    arr = getattr(segments, "array", None)             # CheckedSegments: converted already
    if arr is None:
        rows = list(map(tuple, segments))
        try:
            arr = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1) if rows \
                else np.zeros((0, 3), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            arr = None
        if arr is None or arr.shape[1] != 3:
            raise ValueError(f"the step's segments {rows[:3]!r}...: expected (sample_id, "
                             f"start, end) triples of integers")
    return _sorted_rows(arr)


def _sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))] if a.shape[0] > 1 else a


def fingerprint(batch: BatchPlan) -> int:
    """The packing as one int64 every rank compares: a digest of its segments and micro-batch
    sizes in rank-major slot order (the same bytes in every process, wherever the plan was
    made or unpickled)."""
    offsets, _ = batch.unit_csr()
    h = hashlib.blake2b(np.asarray([batch.dp, batch.num_microbatches], np.int64).tobytes(), digest_size=8)
    h.update(np.ascontiguousarray(batch.segment_array(), dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def doc_lengths(batch, ids: np.ndarray) -> np.ndarray:
    """[n] the length of each of ``ids`` (documents of ``batch``, a ``BatchPlan``) as the
    tracker learns it: its last segment's in rank-major slot order (a split document's last
    piece)."""
    segs = batch.segment_array()
    uniq, first = np.unique(segs[::-1, 0], return_index=True)    # reversed: the last one
    last = segs.shape[0] - 1 - first
    ids = np.asarray(ids, dtype=np.int64)
    at = np.minimum(np.searchsorted(uniq, ids), max(uniq.size - 1, 0))
    if ids.size and (uniq.size == 0 or not np.array_equal(uniq[at], ids)):
        missing = ids[(uniq.size == 0) | (uniq[at] != ids)] if uniq.size else ids
        raise KeyError(f"documents {missing[:5].tolist()} are not in the step's packing")
    return (segs[last, 2] - segs[last, 1])[at]


def unit_order(fwd_order: list, layout, pp_rank: int) -> list:
    """The plan unit (micro-batch, virtual stage) of each of a pipeline rank's forward timer
    intervals, in order. Backward intervals follow the same micro-batches with the model chunks
    reversed (Megatron's interleaved schedule runs chunk ``vp - 1 - c`` where the forward ran
    ``c``; with one chunk both orders are the forward's)."""
    return [(mb, layout.stage_of(pp_rank, chunk)) for mb, chunk in fwd_order]


USED_TOLERANCE = 1e-3   # kept blocks are counted in whole blocks; a float rounding slack


class Violation(NamedTuple):
    """One (micro-batch, stage) whose attention did not follow the plan: it asked for another
    density (``kind`` 'request': ``value`` the density asked for) or kept fewer blocks than the
    plan's share ('kept': ``value`` the smallest kept share)."""

    kind: str
    stage: int
    microbatch: int
    value: float
    want: float

    def describe(self, dp: int) -> str:
        where = f"(dp {dp}, stage {self.stage}, micro-batch {self.microbatch})"
        if self.kind == "request":
            return f"{where}: {self.value} != {self.want}"
        return f"{where}: kept {self.value:.4f} of the blocks, plan {self.want}"


def budget_violations(plan: BudgetPlan, dp: int, served: dict, used: Optional[dict], *,
                      check_used: bool = True) -> list:
    """A rank's ``Violation``s, in (micro-batch, stage) order: every density its attention asked
    for (``served`` {(micro-batch, stage): density}) must be exactly the plan's, and every
    sequence kept at least that share of its causal blocks (``used``, ``min_kept``; density
    selection keeps ceil(density x available) of them: fewer means the plan was ignored)."""
    bad = []
    for (mb, stage), d in sorted((served or {}).items()):
        want = plan.density(dp, mb, stage)
        if d != want:
            bad.append(Violation("request", int(stage), int(mb), float(d), want))
    for (mb, stage), kept in sorted((used or {}).items()) if check_used else ():
        want = plan.density(dp, mb, stage)
        if kept < want - USED_TOLERANCE:
            bad.append(Violation("kept", int(stage), int(mb), float(kept), want))
    return bad


def budget_error(examples: list) -> RuntimeError:
    """The error every rank raises when some rank's attention ignored the plan."""
    return RuntimeError("attention budgets differ from the broadcast plan: "
                        + "; ".join(examples[:5]))


def check_budgets(plan: BudgetPlan, reports, *, check_used: bool = True) -> None:
    """``budget_violations`` of several ranks' reports ({'dp', 'served', 'used'} each) at once:
    a RuntimeError naming the first five (a test's view of what the gathered summary raises)."""
    bad = [v.describe(g["dp"]) for g in reports
           for v in budget_violations(plan, g["dp"], g["served"], g.get("used"),
                                      check_used=check_used)]
    if bad:
        raise budget_error(bad)


def min_kept(records: list, stage_of) -> dict:
    """{(micro-batch, stage): the smallest kept density of any of its sequences in any layer};
    ``stage_of(layer_number)`` is the plan stage of a layer."""
    out: dict = {}
    for mb, _, layer, kept, _ in records:
        if mb is not None and kept:
            key = (mb, stage_of(layer))
            out[key] = min(out.get(key, 1.0), min(kept))
    return out


def sum_by_doc(triples) -> dict:
    """{doc_id: [loss sum, tokens]} summed over (doc_id, loss sum, tokens) triples, in their
    order (a document split over micro-batches or ranks counts once, whole)."""
    out: dict[int, list] = {}
    for doc_id, s_, n in triples:
        acc = out.setdefault(int(doc_id), [0.0, 0.0])
        acc[0] += s_
        acc[1] += n
    return out


def recall_sums(stats: list) -> dict:
    """{doc_id: [sum of its recalls, how many]} over every layer and sequence of this rank's
    step's training forwards (the recall signal's mean is the ratio, after every rank's sums are
    added); evaluation forwards (no micro-batch of the step) are left out."""
    out: dict[int, list] = {}
    for mb, doc_ids, _, _, recall in stats:
        if mb is None:
            continue
        for doc_id, r in zip(doc_ids, recall):  # the trailing padding sequences have no doc id
            if np.isfinite(r):
                acc = out.setdefault(int(doc_id), [0.0, 0])
                acc[0] += float(r)
                acc[1] += 1
    return out


def layout_warning(latency, units, dp: int, num_microbatches: int, layout,
                   density: float) -> Optional[str]:
    """The line that warns when the run's pipeline ``layout`` is predicted well slower (static,
    at d0, this step's data) than another split Megatron's flags allow; None otherwise."""
    from ...experiments.layout_search import LAYOUT_GAP_WARN, layout_gap
    from ...latency.layout import LayoutError
    try:
        gap, best = layout_gap(latency, units, dp, num_microbatches, layout, density)
    except LayoutError:
        return None   # a table that knows only its own layout: nothing to compare
    if gap <= LAYOUT_GAP_WARN:
        return None
    return (f"warning: the pipeline layout {layout.describe()} is predicted {gap:.2f}x slower "
            f"(static, d0, this step's data) than {best.describe()} "
            f"({' '.join(best.megatron_flags())}); see sparsebalance-layout")

