"""The latency model's layouts: the model of a run whose pipeline layout (Megatron's uneven
splits, layout strings, the interleaved schedule's model chunks, a HybridModel's attention and
MLP layers) or context parallelism differs from the table's own (``model.LatencyModel``'s
mixin: its stage coefficients, from one measured layer).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np

from .context_parallel import ContextParallelCost
from .layout import LayoutError, PipelineLayout


class LayoutsMixin:
    """``layer_coefficients``, ``with_layout`` and ``with_context_parallel`` of
    ``LatencyModel`` (its ``coef``, ``_coef_full``, ``table_layout``, ``layout``,
    ``context_parallel`` and ``_stage_coef``)."""

    def layer_coefficients(self) -> dict:
        """{fwd, bwd: [len(MODEL_FEATURES)]} of ONE decoder layer: the measured middle stage over
        its layers. ``LayoutError`` when the table has no middle stage (a pp=1 table, or a pp=2 one
        profiled before the profiler measured a middle stage at pp = 2)."""
        if "middle" not in self.coef:
            raise LayoutError(
                f"latency table ({self.table.get('device')}, pp={self.table_layout.pp}, stage "
                f"kinds {sorted(self.coef)}) has no middle-stage measurement, so one layer's cost "
                f"is unknown and only its own layout {self.table_layout.describe()} can be "
                f"predicted: profile again with sparsebalance-profile "
                f"--pipeline-model-parallel-size 2 or more (it measures a middle stage)")
        n = self._kind_layers("middle")
        return {p: self._coef_full["middle"][p] / n for p in ("fwd", "bwd")}

    def _kind_layers(self, kind: str) -> int:
        lay = self.table_layout
        kinds = lay.kinds()
        return lay.layers[kinds.index(kind)] if kind in kinds else max(lay.layers)

    def with_layout(self, layout: PipelineLayout) -> "LatencyModel":
        """This model for a run with ``layout`` (per virtual stage); calibration is shared.

        ``LayoutError`` when the table cannot predict it (see ``layer_coefficients``)."""
        kinds = layout.kinds()
        missing = sorted(set(kinds) - set(self.coef))
        if missing:
            raise LayoutError(
                f"latency table (stage kinds {sorted(self.coef)}, pp={self.table_layout.pp}) "
                f"cannot predict the {'x'.join(str(v) for v in (layout.pp, layout.vp) if v > 1) or 1}"
                f"-stage layout {layout.describe()}: it lacks stage kind(s) {missing} (profile "
                f"with --pipeline-model-parallel-size >= 2 for a pipelined run)")
        # a HybridModel's stages hold attention and MLP layers, not GPT layers (hybrid.py)
        stage_coef = self._gpt_stage_coef(layout) if layout.pattern is None \
            else self._hybrid_stage_coef(layout)
        out = copy.copy(self)
        out.layout = layout
        cp = self.context_parallel
        out._stage_coef = stage_coef if cp is None else [
            cp.stage_coefficients(c, n, folded_tokens=self._folded_tokens())
            for c, n in zip(stage_coef, layout.layers)]
        return out

    def _gpt_stage_coef(self, layout: PipelineLayout) -> list:
        stage_coef = []
        per_layer = None
        for kind, n in zip(layout.kinds(), layout.layers):
            base = self._coef_full[kind]
            dn = n - self._kind_layers(kind)
            if dn == 0:
                stage_coef.append(base)
                continue
            if per_layer is None:
                per_layer = self.layer_coefficients()
            c = {p: base[p] + dn * per_layer[p] for p in ("fwd", "bwd")}
            for p in c:           # a stage with fewer layers cannot have negative work costs
                c[p][1:] = np.maximum(c[p][1:], 0.0)
            stage_coef.append(c)
        return stage_coef

    def _hybrid_stage_coef(self, layout: PipelineLayout) -> list:
        """Stage coefficients of a HybridModel layout (``hybrid.py``). A one-stage table has no
        middle stage: its layers' mean (embedding and LM head spread over them) stands for one
        layer there, as nothing else says what a layer costs."""
        from .hybrid import hybrid_stage_coefficients

        if "middle" not in self.coef and self.table_layout.num_stages == 1:
            only = self._coef_full[self.table_layout.kinds()[0]]
            per_layer = {p: only[p] / self.table_layout.num_layers for p in ("fwd", "bwd")}
        else:
            per_layer = self.layer_coefficients()
        return hybrid_stage_coefficients(self._coef_full,
                                         {k: self._kind_layers(k) for k in self.coef},
                                         per_layer, self.table["model"], layout)

    def _folded_tokens(self) -> Optional[int]:
        """The grid's one token total when the table was profiled at a single one (the profiler's
        grid since 2026-11-23): its ``tokens`` coefficient is then 0 and the token-proportional
        work sits in the intercept (``fit_nonneg``); None for a table with several totals."""
        totals = self.table.get("profile", {}).get("token_totals") or []
        return int(totals[0]) if len(totals) == 1 and totals[0] > 0 else None

    def with_context_parallel(self, size: int, *, tensor_model_parallel_size: int = 1,
                              a2a_bytes_per_s: Optional[float] = None,
                              collective_latency_s: Optional[float] = None) -> "LatencyModel":
        """This model for one rank of a CP group of ``size`` ranks (``--cp-comm-type a2a``,
        ``context_parallel.py``), on this model's layout; calibration is shared. The table stays
        a CP=1 one. The interconnect defaults to the table's device profile (an analytic table),
        else ``DeviceProfile``'s assumed NVLink figures. ``size=1`` is this model unchanged."""
        from .analytic import DeviceProfile

        tp = tensor_model_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
            raise ValueError(f"tensor_model_parallel_size={tp!r}: expected an integer >= 1")
        m = self.table["model"]
        nh, ng = int(m["num_attention_heads"]), int(m.get("num_query_groups") or
                                                    m["num_attention_heads"])
        if nh % tp or ng % tp:
            raise ValueError(f"tensor_model_parallel_size={tp}: expected a divisor of the "
                             f"{nh} query heads and {ng} KV groups")
        prof = {**DeviceProfile().__dict__, **self.table.get("device_profile", {})}
        cp = ContextParallelCost(
            size, nh // tp, ng // tp, int(m.get("kv_channels") or
                                          int(m["hidden_size"]) // nh),
            prof["a2a_bytes_per_s"] if a2a_bytes_per_s is None else a2a_bytes_per_s,
            prof["collective_latency_s"] if collective_latency_s is None
            else collective_latency_s)
        base = copy.copy(self)
        base.context_parallel = None if cp.size == 1 else cp
        return base.with_layout(self.layout)

