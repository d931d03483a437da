"""The checks and sums of a step's end, over what every rank reports (``SparseBalanceCallback``).

Each rank sends one record per step (``end_step``: its dp and pp rank, micro-batch timings, the
densities its attention served and the smallest share it kept, the batch fingerprint, losses); every
rank gathers all of them and runs the same pure functions here: the packing was the same everywhere
(``fingerprint``), the attention used the broadcast plan (``check_budgets``), the measured busy time
per (dp, pp) place (``measured_busy``), and the per-document sums the sensitivity tracker reads.
Plain Python and numpy: no torch.distributed, no megatron.
"""

from __future__ import annotations

import numpy as np

from ...batching.plan import BatchPlan
from ...plan import BudgetPlan


def check_assignment(segments, batch: BatchPlan, capacity: int) -> None:
    """The packer used every segment of the step exactly once and respected the capacity."""
    used = sorted(batch.segments())
    if used != sorted(tuple(s) for s in segments):
        raise RuntimeError("packer dropped or duplicated segments of the global batch")
    for r, rank in enumerate(batch.micro_batches):
        for j, mb in enumerate(rank):
            n = sum(e - s for _, s, e in mb)
            if n > capacity:
                raise RuntimeError(f"packer put {n} tokens in micro-batch ({r}, {j}), "
                                   f"capacity {capacity}")


def fingerprint(batch: BatchPlan) -> int:
    return hash(tuple(tuple(tuple(mb) for mb in rank) for rank in batch.micro_batches))


def unit_order(fwd_order: list, layout, pp_rank: int) -> list:
    """The plan unit (micro-batch, virtual stage) of each of a pipeline rank's forward timer
    intervals, in order. Backward intervals follow the same micro-batches with the model chunks
    reversed (Megatron's interleaved schedule runs chunk ``vp - 1 - c`` where the forward ran
    ``c``; with one chunk both orders are the forward's)."""
    return [(mb, layout.stage_of(pp_rank, chunk)) for mb, chunk in fwd_order]


def measured_busy(gathered, dp: int, pp: int, m: int) -> np.ndarray:
    """[dp, pp] measured fwd+bwd seconds of every rank's ``m`` timed forwards and backwards
    (micro-batches x model chunks; NaN: missing); the slowest of the TP and CP ranks that share
    a (dp, pp) place (they wait for each other in their collectives)."""
    measured = np.full((dp, pp), np.nan)
    for g in gathered:
        if len(g["fwd_s"]) == m and len(g["bwd_s"]) == m:
            t = float(np.sum(g["fwd_s"]) + np.sum(g["bwd_s"]))
            prev = measured[g["dp"], g["pp"]]
            measured[g["dp"], g["pp"]] = t if not np.isfinite(prev) else max(prev, t)
    return measured


USED_TOLERANCE = 1e-3   # kept blocks are counted in whole blocks; a float rounding slack


def check_budgets(plan: BudgetPlan, gathered, *, check_used: bool = True) -> None:
    """Every rank (all TP ranks of a micro-batch included) asked for exactly the plan's density,
    and its attention kept at least that share of every sequence's causal blocks (density
    selection keeps ceil(density x available) of them: fewer means the plan was ignored)."""
    bad = []
    for g in gathered:
        for (mb, stage), d in (g["served"] or {}).items():
            want = plan.density(g["dp"], mb, stage)
            if d != want:
                bad.append(f"(dp {g['dp']}, stage {stage}, micro-batch {mb}): {d} != {want}")
        for (mb, stage), kept in (g.get("used") or {}).items() if check_used else ():
            want = plan.density(g["dp"], mb, stage)
            if kept < want - USED_TOLERANCE:
                bad.append(f"(dp {g['dp']}, stage {stage}, micro-batch {mb}): kept {kept:.4f} "
                           f"of the blocks, plan {want}")
    if bad:
        raise RuntimeError("attention budgets differ from the broadcast plan: " + "; ".join(bad[:5]))


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


def doc_recalls(stats: list) -> dict:
    """{doc_id: [recall per layer]} from the attention statistics of this rank's step."""
    out: dict[int, list] = {}
    for _, doc_ids, _, _, recall in stats:
        for doc_id, r in zip(doc_ids, recall):  # the trailing padding sequences have no doc id
            if np.isfinite(r):
                out.setdefault(int(doc_id), []).append(float(r))
    return out
