"""The per-step budget plan and the context through which attention modules read it.

DST (``policy/``) produces a density for every (dp_rank, micro-batch, pp_stage) unit; every rank
holds the same ``BudgetPlan``. Before each micro-batch's forward, the training step calls
``set_current_microbatch`` and the attention modules read ``current_density()``. Attention
statistics (density kept, estimated mass recall per document) flow back through
``record_attention_stats`` so SAB can refine its sensitivity estimates.
Pure Python + numpy; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass
class BudgetPlan:
    """Densities for one step: ``densities[dp_rank, microbatch, stage]``, identical on all ranks."""

    step: int
    densities: np.ndarray  # [dp, m, pp] float64

    def __post_init__(self):
        d = np.asarray(self.densities, dtype=np.float64)
        if d.ndim != 3:
            raise ValueError(f"BudgetPlan.densities must be [dp, m, pp], got shape {d.shape}")
        if not np.all((d > 0) & (d <= 1)):
            raise ValueError(f"BudgetPlan densities must lie in (0, 1], got min={d.min()} max={d.max()}")
        self.densities = d

    @classmethod
    def static(cls, step: int, density: float, dp: int, microbatches: int, stages: int) -> "BudgetPlan":
        return cls(step, np.full((dp, microbatches, stages), float(density)))

    def density(self, dp_rank: int, microbatch: int, stage: int) -> float:
        return float(self.densities[dp_rank, microbatch, stage])


@dataclass
class _Context:
    plan: Optional[BudgetPlan] = None
    dp_rank: int = 0
    stage: int = 0
    microbatch: Optional[int] = None
    doc_ids: Optional[Sequence[int]] = None
    default_density: Optional[float] = None
    stats: list = field(default_factory=list)
    served: dict = field(default_factory=dict)  # microbatch -> density handed to attention


_ctx = _Context()
_lock = threading.Lock()


def set_step_plan(plan: Optional[BudgetPlan], dp_rank: int = 0, stage: int = 0) -> None:
    """Install the plan of the coming step for this rank's (dp_rank, stage)."""
    _ctx.plan, _ctx.dp_rank, _ctx.stage = plan, dp_rank, stage


def set_current_microbatch(index: Optional[int], doc_ids: Optional[Sequence[int]] = None) -> None:
    """Called before a micro-batch's forward: which micro-batch (and documents) attention sees."""
    _ctx.microbatch, _ctx.doc_ids = index, doc_ids


def current_plan() -> Optional[BudgetPlan]:
    return _ctx.plan


def current_density(default: float, microbatch: Optional[int] = None) -> float:
    """Density the attention must use now: the plan's unit, else ``default`` (static d0).

    ``microbatch`` overrides the context's current one: activation recomputation re-runs a
    micro-batch's forward during a later backward, so the module passes the index it was given
    with its inputs (``packed_seq_params.sb_microbatch``) rather than trusting the context.
    """
    mb = _ctx.microbatch if microbatch is None else microbatch
    if _ctx.plan is None or mb is None:
        return default
    d = _ctx.plan.density(_ctx.dp_rank, mb, _ctx.stage)
    _ctx.served[mb] = d
    return d


def pop_served_densities() -> dict:
    """{micro-batch: density} handed to attention since the last call (for consistency checks)."""
    out, _ctx.served = _ctx.served, {}
    return out


def record_attention_stats(layer_number: int, density_kept: Sequence[float],
                           recall: Sequence[float], microbatch: Optional[int] = None,
                           doc_ids: Optional[Sequence[int]] = None) -> None:
    """Attention reports per-document kept density and estimated mass recall (cu_seqlens order).

    ``microbatch``/``doc_ids`` override the context (see ``current_density``)."""
    mb = _ctx.microbatch if microbatch is None else microbatch
    ids = _ctx.doc_ids if doc_ids is None else doc_ids
    with _lock:
        _ctx.stats.append((mb, ids, layer_number,
                           list(map(float, density_kept)), list(map(float, recall))))


def pop_attention_stats() -> list:
    """Take the statistics recorded since the last call (one entry per layer forward)."""
    with _lock:
        out, _ctx.stats = _ctx.stats, []
    return out
