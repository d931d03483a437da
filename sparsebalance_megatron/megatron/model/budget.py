"""The typed slots through which a step's budget reaches the sparse attention.

Two objects, no process-wide globals:

- ``SparsePackedSeqParams``: megatron-core's ``PackedSeqParams`` plus the identity of the packed
  micro-batch (step, index within this DP rank's step, document ids). It travels with the inputs,
  so a forward re-run by activation recomputation during a later backward reads its own budget.
  ``sb_microbatch=None`` marks a micro-batch outside any plan (evaluation): static density.
- ``BudgetContext``: owned by the runtime (``callback.SparseBalanceCallback``) and handed to every
  ``SparseCoreAttention`` through ``ModuleSpec.params``. It holds the current step's
  ``BudgetPlan`` for this rank's (dp rank, pipeline stage), answers ``density(psp, layer)``, holds
  the routing threshold (documents shorter than ``dense_below_tokens`` run dense: the latency
  table's crossover, known once the runtime has loaded the table), and collects what attention
  reports back (the densities it served, per-document kept density and recall).
  Deep copies return the same object: Megatron may copy layer specs, the context must stay shared.

Part of the megatron adapter layer; no torch.distributed here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ...config import BACKENDS
from ...plan import BudgetPlan
from .backend_fallback import BackendFallback


@dataclass
class SparsePackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` of one packed micro-batch, with its place in the step's plan."""

    sb_step: Optional[int] = None
    """Training iteration (0-based, Megatron's ``args.curr_iteration``) the micro-batch belongs to."""
    sb_microbatch: Optional[int] = None
    """Index of the micro-batch within this DP rank's step; None outside a plan (evaluation)."""
    sb_doc_ids: tuple = field(default_factory=tuple)
    """Document ids of the micro-batch's sequences, in ``cu_seqlens`` order (padding has none)."""
    sb_cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-micro-batch scratch shared by every layer (and by a recomputed forward): what depends
    only on the micro-batch's documents, e.g. the block layout, is computed once and kept here."""
    sb_cp_size: int = 1
    """Context-parallel ranks the micro-batch's tokens are split over (Megatron's per-document
    zigzag order); the ``cu_seqlens*`` fields describe the whole micro-batch, as in Megatron."""
    sb_cu_seqlens_host: Optional[tuple] = None
    """``cu_seqlens_q`` as the data path built it on the host (None: unknown, read back once per
    micro-batch from the device tensor): the sparse attention's setup then waits for nothing."""
    sb_cu_seqlens_padded_host: Optional[tuple] = None
    """``cu_seqlens_q_padded`` on the host, likewise (None with no padded boundaries)."""

    def local_cu_seqlens(self) -> torch.Tensor:
        """Sequence boundaries of this rank's tokens ``[n_seq + 1]``: a sequence's two CP chunks
        lie next to each other, ``1 / sb_cp_size`` of its padded length."""
        cu = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None \
            else self.cu_seqlens_q
        return cu // self.sb_cp_size if self.sb_cp_size > 1 else cu


class BudgetError(RuntimeError):
    """A micro-batch asked for a budget the installed plan does not have."""


class BudgetContext:
    """This rank's view of the step plan, and the sink of attention statistics."""

    def __init__(self, default_density: float, dense_below_tokens: int = 0):
        if not 0.0 < float(default_density) <= 1.0:
            raise ValueError(f"default_density={default_density!r}: expected a number in (0, 1]")
        self.default_density = float(default_density)
        self.dense_below_tokens = 0
        self.set_routing(dense_below_tokens)
        self.attention_backend: Optional[str] = None   # the latency table's pick for 'auto'
        self.fallback = BackendFallback()              # a failing GPU kernel's successor
        self.plan: Optional[BudgetPlan] = None
        self.dp_rank, self.stage = 0, 0
        self.layer_stages: Optional[tuple] = None
        self.layer_densities: Optional[dict] = None   # static per-layer densities (evaluation)
        self._served: dict[int, float] = {}
        self._stats: list = []
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self  # a runtime handle, not configuration: shared by every layer

    @classmethod
    def for_config(cls, sb) -> "BudgetContext":
        """The context of a ``SparseBalanceConfig`` before any latency table is known: its
        density, and its routing threshold if it names one (the table's comes later)."""
        return cls(sb.density, sb.routing_threshold(None))

    def set_routing(self, dense_below_tokens: int) -> None:
        """Documents shorter than ``dense_below_tokens`` tokens run dense (0: none)."""
        n = dense_below_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"dense_below_tokens={n!r}: expected an integer >= 0")
        self.dense_below_tokens = n

    def set_backend(self, backend: Optional[str]) -> None:
        """The kernel ``--sb-attention-backend auto`` runs: the fastest one measured on this
        device when its latency table was profiled (None: ``resolve_backend``'s default)."""
        if backend is not None and (backend not in BACKENDS or backend == "auto"):
            raise ValueError(f"attention backend {backend!r}: expected one of "
                             f"{', '.join(b for b in BACKENDS if b != 'auto')} or None")
        self.attention_backend = backend

    def set_plan(self, plan: Optional[BudgetPlan], *, dp_rank: int, stage: int = 0,
                 layer_stages: Optional[Sequence[int]] = None) -> None:
        """Install the coming step's plan for this rank's (dp rank, pipeline stage).

        ``layer_stages``: the plan's stage of every decoder layer (entry ``n - 1`` for Megatron's
        1-based global layer number ``n``), for a rank that holds several model chunks (the
        interleaved schedule: each chunk is its own virtual stage of the plan); None: every
        layer of this rank is ``stage``.
        """
        self.plan, self.dp_rank, self.stage = plan, int(dp_rank), int(stage)
        self.layer_stages = None if layer_stages is None else tuple(int(s) for s in layer_stages)

    def set_layer_densities(self, densities: Optional[dict]) -> None:
        """Static density per decoder layer ({1-based global layer number: density}), served
        when no step plan applies (evaluating a per-layer allocation on a model outside
        training); layers not named, and None, get ``default_density``."""
        if densities is not None:
            for n, d in densities.items():
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise BudgetError(f"layer number {n!r}: expected an integer >= 1")
                if not 0.0 < float(d) <= 1.0:
                    raise BudgetError(f"density {d!r} of layer {n}: expected a number in (0, 1]")
            densities = {int(n): float(d) for n, d in densities.items()}
        self.layer_densities = densities

    def stage_of(self, layer_number: Optional[int]) -> int:
        """The plan's stage of the decoder layer ``layer_number`` (1-based, global)."""
        if self.layer_stages is None or layer_number is None:
            return self.stage
        if not 1 <= layer_number <= len(self.layer_stages):
            raise BudgetError(f"layer number {layer_number}: the pipeline layout has "
                              f"{len(self.layer_stages)} decoder layers (expected 1.."
                              f"{len(self.layer_stages)})")
        return self.layer_stages[layer_number - 1]

    def density(self, psp: Optional[PackedSeqParams], layer_number: Optional[int] = None
                ) -> float:
        """Density for the micro-batch of ``psp`` in decoder layer ``layer_number``: the plan's
        unit, else the static default."""
        mb = getattr(psp, "sb_microbatch", None)
        if self.plan is None or mb is None:
            if self.layer_densities is not None and layer_number is not None:
                return self.layer_densities.get(layer_number, self.default_density)
            return self.default_density
        step = getattr(psp, "sb_step", None)
        if step is not None and step != self.plan.step:
            raise BudgetError(f"micro-batch {mb} of step {step} ran under the plan of step "
                              f"{self.plan.step}: the data iterator and the plan are out of step")
        stage = self.stage_of(layer_number)
        d = self.plan.density(self.dp_rank, mb, stage)
        self._served[(mb, stage)] = d
        return d

    def record(self, layer_number: int, psp, density_kept: torch.Tensor,
               recall: torch.Tensor) -> None:
        """Per-document kept density and estimated recall of one layer's forward ([n_seq] each).

        Kept as detached tensors; ``pop_stats`` moves them to the host once per step, so the
        per-layer path does not synchronise with the device.
        """
        mb = getattr(psp, "sb_microbatch", None)
        docs = tuple(getattr(psp, "sb_doc_ids", ()) or ())
        with self._lock:
            self._stats.append((mb, docs, layer_number, density_kept.detach(), recall.detach()))

    def pop_served(self) -> dict:
        """{(micro-batch, stage): density} handed to attention since the last call."""
        out, self._served = self._served, {}
        return out

    def pop_stats(self) -> list:
        """[(micro-batch, doc_ids, layer, kept [n_seq] list, recall [n_seq] list)] since the last
        call, in recording order."""
        with self._lock:
            stats, self._stats = self._stats, []
        return [(mb, docs, layer, kept.float().cpu().tolist(), rec.float().cpu().tolist())
                for mb, docs, layer, kept, rec in stats]
