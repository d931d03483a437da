"""LatencyModel: forward/backward seconds of one micro-batch on one pipeline stage.

Form, per stage kind (first / middle / last, or "only" without PP), fitted separately for the
forward and the backward pass::

    t = c0 + c1 * tokens + c2 * attention_work(density) + c3 * selection_work + c4 * sequences

A stage of another layer count than the table's (Megatron's uneven splits, layout strings and
the interleaved schedule's model chunks: ``layout.PipelineLayout``) is its kind's coefficients
plus (its layers - the table's layers of that kind) x one layer's, where one layer is the
measured middle stage divided by its layers: exact for the table's own layout, and the embedding
and LM head + loss stay on the first and last (virtual) stage. ``with_layout`` gives the model of
a run's layout; ``num_stages`` is then the number of virtual stages.

(features in ``features.py``; attention work counts exactly the kept block pairs). Because the
density enters only through attention work, DST re-times a unit at another density with
``UnitTerms.time_s(d) = fixed_s + attn_s_per_pair * work(d)``: no documents are re-walked.
Online calibration multiplies a rank's predictions by an EMA of measured / predicted, each
ratio clipped to ``[1 / CALIBRATION_CLIP, CALIBRATION_CLIP]`` times the current factor so that
one outlier timing cannot throw a rank's factor off; unusable samples keep the factor.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .context_parallel import ContextParallelCost
from .features import FEATURES, UnitFeatures, features_of
from .layout import LayoutError, PipelineLayout
from .table import (LatencyTableError, check_coefficients, check_compatible, measured_kinds,
                    read_table, table_layout, validate_table, write_table)


def _fit_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error (rows scaled by 1/y), dropping features whose coefficient
    comes out negative (a cost cannot shrink with more work); the intercept may stay negative
    only if nothing else fits.

    A feature that does not vary over the grid cannot be told apart from the intercept: it gets
    0 and its cost stays in the intercept. A profiled grid has one token count (that of training's
    micro-batches, ``megatron/profile.default_mixes``), so ``tokens`` is such a feature there, and
    so is ``selection_work`` when every document fills whole blocks."""
    w = 1.0 / np.maximum(y, 1e-12)
    active = list(range(x.shape[1]))
    # features constant on this grid (zero, or one value for every micro-batch): unidentifiable
    active = [j for j in active if j == 0 or np.ptp(x[:, j]) > 0]
    while True:
        a = x[:, active] * w[:, None]
        c, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        neg = [j for j, v in zip(active, c) if v < 0 and j != 0]
        if not neg:
            break
        worst = min(neg, key=lambda j: c[active.index(j)])
        active.remove(worst)
    out = np.zeros(x.shape[1])
    out[active] = c
    return out


ERROR_HISTORY = 4096
"""Calibration errors (one per rank and step) kept for ``recent_error``."""
CALIBRATION_CLIP = 4.0
"""One calibration update moves a rank's factor toward measured / predicted clipped to
``[old / CALIBRATION_CLIP, old * CALIBRATION_CLIP]``: a single outlier (a 1e9 s glitch, a
paused process, a timer that read 0) moves the factor by at most ``1 + w * (CLIP - 1)`` (x1.9, or
/1.9, at the default EMA weight w = 0.3) instead of to the outlier, while a lasting slowdown is
still followed: at w = 0.3 the factor reaches 90% of a 10x slowdown in 8 steps (7 unclipped), of
a 100x one in 11 (7 unclipped)."""


@dataclass
class UnitTerms:
    """Closed-form time of n units on one stage: ``t(d) = fixed_s + attn_s_per_pair * work(d)``."""

    features: UnitFeatures
    fwd_fixed_s: np.ndarray       # [n]
    bwd_fixed_s: np.ndarray       # [n]
    fwd_attn_s_per_pair: float    # seconds per kept block pair (already calibrated)
    bwd_attn_s_per_pair: float

    @property
    def fixed_s(self) -> np.ndarray:
        return self.fwd_fixed_s + self.bwd_fixed_s

    @property
    def attn_s_per_pair(self) -> float:
        return self.fwd_attn_s_per_pair + self.bwd_attn_s_per_pair

    def fwd_bwd_s(self, densities) -> tuple[np.ndarray, np.ndarray]:
        w = self.features.attention_work(densities)
        return (self.fwd_fixed_s + self.fwd_attn_s_per_pair * w,
                self.bwd_fixed_s + self.bwd_attn_s_per_pair * w)

    def time_s(self, densities) -> np.ndarray:
        """[n] fwd+bwd seconds of every unit at its density (scalar or [n]); exact."""
        return self.fixed_s + self.attn_s_per_pair * self.features.attention_work(densities)

    def time_grid_s(self, density_grid) -> np.ndarray:
        """[n, g] fwd+bwd seconds of every unit at every density of the grid."""
        return self.fixed_s[:, None] + self.attn_s_per_pair * self.features.work_grid(density_grid)


class LatencyModel:
    """Fitted per-stage-kind linear model over the work features, with per-rank calibration."""

    def __init__(self, table: dict, coefficients: dict, *, calibration_ema: float = 0.3,
                 where: str = "<table>"):
        self.table = table
        att = table["attention"]
        self.block_size = int(att["block_size"])
        self.sink_blocks = int(att["sink_blocks"])
        self.local_blocks = int(att["local_blocks"])
        self.work_mode = att.get("work", "kept")
        self.query_chunk_blocks = int(att.get("query_chunk_blocks", 16))
        self.features = list(table["features"])
        if self.features != list(FEATURES):
            raise LatencyTableError(f"latency table {where}: field 'features': "
                                    f"{self.features!r}: expected {list(FEATURES)} (a table from "
                                    "another version of this plugin: profile the device again "
                                    "with python -m sparsebalance_megatron.megatron.profile_cli)")
        check_coefficients(table, coefficients, where)
        self.coef = {k: {p: np.asarray(v[p], dtype=np.float64) for p in ("fwd", "bwd")}
                     for k, v in coefficients.items()}
        self.table_layout = table_layout(table)
        self.layout = self.table_layout
        self._stage_coef = [self.coef[k] for k in self.layout.kinds()]
        self.context_parallel: Optional[ContextParallelCost] = None
        if not (0.0 < calibration_ema <= 1.0):
            raise ValueError(f"calibration_ema={calibration_ema!r}: expected a value in (0, 1]")
        self.calibration_ema = float(calibration_ema)
        self._correction: dict[int, float] = {}
        self._errors: deque = deque(maxlen=ERROR_HISTORY)
        self._warned_bad_measurement = False
        self._warned_clipped = False

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def fit(cls, table: dict, *, calibration_ema: float = 0.3, where: str = "<table>"
            ) -> "LatencyModel":
        """Least squares per stage kind on the table's measurements (ignores stored coefficients)."""
        validate_table(table, where)
        att = table["attention"]
        coef = {}
        for kind in measured_kinds(table):
            rows = [m for m in table["measurements"] if m["kind"] == kind]
            feats = UnitFeatures.build([m["doc_lengths"] for m in rows], att["block_size"],
                                       att["sink_blocks"], att["local_blocks"],
                                       att.get("work", "kept"),
                                       int(att.get("query_chunk_blocks", 16)))
            x = feats.matrix(np.asarray([m["density"] for m in rows]))
            coef[kind] = {p: _fit_nonneg(x, np.asarray([m[p + "_s"] for m in rows])).tolist()
                          for p in ("fwd", "bwd")}
        table = dict(table)
        table["coefficients"] = coef
        return cls(table, coef, calibration_ema=calibration_ema, where=where)

    @classmethod
    def from_table(cls, table: dict, *, calibration_ema: float = 0.3, where: str = "<table>"
                   ) -> "LatencyModel":
        """Use the table's stored coefficients, or fit them when it has none."""
        validate_table(table, where)
        if table.get("coefficients") is None:
            return cls.fit(table, calibration_ema=calibration_ema, where=where)
        return cls(table, table["coefficients"], calibration_ema=calibration_ema, where=where)

    @classmethod
    def load(cls, path: str, *, expect: Optional[dict] = None, force: bool = False,
             calibration_ema: float = 0.3) -> "LatencyModel":
        """Read a JSON table; refuse one from another device/model/execution/software unless
        ``force``; warn when no coefficient depends on the density (DST would have no effect)."""
        table = read_table(path)
        check_compatible(table, expect, path, force)
        model = cls.from_table(table, calibration_ema=calibration_ema, where=path)
        attn = FEATURES.index("attention_work")
        if not any(c[p][attn] > 0 for c in model.coef.values() for p in c):
            warnings.warn(f"latency table {path}: the attention_work coefficient is 0 for every "
                          f"stage and pass: the density changes no prediction, so DST cannot "
                          f"trade density for time (profile with more repeats, a larger grid "
                          f"or on a quieter machine)", stacklevel=2)
        return model

    @classmethod
    def analytic(cls, shape=None, device=None, *, calibration_ema: float = 0.3,
                 context_parallel: int = 1, **kw) -> "LatencyModel":
        """FLOP-based model of a GPU (``analytic.py``); see ``analytic_table`` for the knobs;
        ``context_parallel``: the model of one rank of a CP group that size (with the device's
        all-to-all bandwidth)."""
        from .analytic import analytic_table
        model = cls.from_table(analytic_table(shape, device, **kw),
                               calibration_ema=calibration_ema, where="<analytic>")
        return model if context_parallel == 1 else model.with_context_parallel(context_parallel)

    def save(self, path: str) -> None:
        """Write the table with the current coefficients as JSON (never pickle)."""
        table = copy.deepcopy(self.table)
        table["coefficients"] = {k: {p: v[p].tolist() for p in v} for k, v in self.coef.items()}
        write_table(table, path)

    def to_json(self) -> str:
        table = copy.deepcopy(self.table)
        table["coefficients"] = {k: {p: v[p].tolist() for p in v} for k, v in self.coef.items()}
        return json.dumps(table)

    # --- layouts ---------------------------------------------------------------------------
    def layer_coefficients(self) -> dict:
        """{fwd, bwd: [n_features]} of ONE decoder layer: the measured middle stage over its
        layers. ``LayoutError`` when the table has no middle stage (a pp=1 table, or a pp=2 one
        profiled before the profiler measured a middle stage at pp = 2)."""
        if "middle" not in self.coef:
            raise LayoutError(
                f"latency table ({self.table.get('device')}, pp={self.table_layout.pp}, stage "
                f"kinds {sorted(self.coef)}) has no middle-stage measurement, so one layer's cost "
                f"is unknown and only its own layout {self.table_layout.describe()} can be "
                f"predicted: profile again with sparsebalance-profile "
                f"--pipeline-model-parallel-size 2 or more (it measures a middle stage)")
        n = self._kind_layers("middle")
        return {p: self.coef["middle"][p] / n for p in ("fwd", "bwd")}

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
            base = self.coef[kind]
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
            only = self.coef[self.table_layout.kinds()[0]]
            per_layer = {p: only[p] / self.table_layout.num_layers for p in ("fwd", "bwd")}
        else:
            per_layer = self.layer_coefficients()
        return hybrid_stage_coefficients(self.coef, {k: self._kind_layers(k) for k in self.coef},
                                         per_layer, self.table["model"], layout)

    def _folded_tokens(self) -> Optional[int]:
        """The grid's one token total when the table was profiled at a single one (the profiler's
        grid since 2026-11-23): its ``tokens`` coefficient is then 0 and the token-proportional
        work sits in the intercept (``_fit_nonneg``); None for a table with several totals."""
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

    # --- prediction -----------------------------------------------------------------------
    @property
    def pp(self) -> int:
        """Pipeline ranks of the layout."""
        return self.layout.pp

    @property
    def num_stages(self) -> int:
        """Virtual stages of the layout (pp x vp); the stage axis of every prediction."""
        return self.layout.num_stages

    @property
    def stage_kinds(self) -> list:
        return self.layout.kinds()

    @property
    def cp(self) -> int:
        """Context-parallel ranks the predictions are for (1 without CP)."""
        return self.context_parallel.size if self.context_parallel is not None else 1

    @property
    def p2p_s(self) -> float:
        """Stage-to-stage activation transfer of one micro-batch (a CP rank sends its share)."""
        return float(self.table.get("p2p_s", 0.0)) / self.cp

    def kind_of(self, stage: int) -> str:
        n = self.num_stages
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) \
                or not (0 <= stage < n):
            raise ValueError(f"stage={stage!r}: expected an integer in [0, {n}) "
                             f"(the layout {self.layout.describe()} has {n} stage(s))")
        return self.stage_kinds[stage]

    def unit_features(self, mb_doc_lengths) -> UnitFeatures:
        """Density-independent features of many units; pass the result back to avoid rebuilding."""
        return features_of(mb_doc_lengths, self.block_size, self.sink_blocks, self.local_blocks,
                           self.work_mode, self.query_chunk_blocks)

    def unit_terms(self, mb_doc_lengths, stage: int, rank: Optional[int] = None) -> UnitTerms:
        """Closed-form per-unit time at any density on ``stage`` (calibrated for ``rank``)."""
        f = self.unit_features(mb_doc_lengths)
        self.kind_of(stage)
        c = self._stage_coef[stage]
        corr = self.correction(rank) if rank is not None else 1.0
        x = np.stack([np.ones(f.num_units), f.tokens, f.selection_work, f.sequences],
                     axis=1)                                                   # [n, 4]
        fixed = {p: np.maximum(x @ c[p][[0, 1, 3, 4]], 0.0) * corr for p in ("fwd", "bwd")}
        return UnitTerms(f, fixed["fwd"], fixed["bwd"], float(c["fwd"][2]) * corr,
                         float(c["bwd"][2]) * corr)

    def predict_many_fwd_bwd(self, mb_doc_lengths, densities, stage: int,
                             rank: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        return self.unit_terms(mb_doc_lengths, stage, rank).fwd_bwd_s(densities)

    def predict_many(self, mb_doc_lengths, densities, stage: int,
                     rank: Optional[int] = None) -> np.ndarray:
        """[n] fwd+bwd seconds; units as a list of length arrays, a CSR (offsets, lengths)
        tuple or a ``UnitFeatures``; densities scalar or [n]."""
        return self.unit_terms(mb_doc_lengths, stage, rank).time_s(densities)

    def busy_s(self, mb_doc_lengths, densities) -> np.ndarray:
        """[dp, pipeline ranks] uncorrected fwd+bwd seconds of one step: units as in
        ``predict_many`` (dp * m of them, rank-major), densities [dp, m, stages] (the layout's
        virtual stages); each pipeline rank's model chunks summed."""
        f = self.unit_features(mb_doc_lengths)
        d = np.asarray(densities, dtype=np.float64)
        if d.ndim != 3 or d.shape[0] * d.shape[1] != f.num_units or d.shape[2] != self.num_stages:
            raise ValueError(f"densities shape {d.shape}: expected [dp, m, {self.num_stages}] "
                             f"with dp x m = {f.num_units} units")
        out = np.zeros((d.shape[0], self.layout.pp))
        for v in range(self.num_stages):
            t = self.unit_terms(f, v).time_s(d[:, :, v].reshape(-1))
            out[:, self.layout.rank_of(v)] += t.reshape(d.shape[:2]).sum(axis=1)
        return out

    def predict_fwd_bwd(self, doc_lengths, density: float, stage: int,
                        rank: Optional[int] = None) -> tuple[float, float]:
        f, b = self.predict_many_fwd_bwd([doc_lengths], np.asarray([density]), stage, rank)
        return float(f[0]), float(b[0])

    def predict(self, doc_lengths, density: float, stage: int,
                rank: Optional[int] = None) -> float:
        """Seconds, forward + backward, of one micro-batch on one stage."""
        f, b = self.predict_fwd_bwd(doc_lengths, density, stage, rank)
        return f + b

    # --- online calibration ---------------------------------------------------------------
    def correction(self, rank: Optional[int]) -> float:
        return self._correction.get(int(rank), 1.0) if rank is not None else 1.0

    def calibrate(self, rank: int, predicted_s, measured_s) -> None:
        """EMA update of ``rank``'s factor toward measured / predicted (sums over the arrays),
        the ratio clipped to ``[1 / CALIBRATION_CLIP, CALIBRATION_CLIP]`` x the current factor.

        ``predicted_s`` must be the *uncorrected* prediction. A NaN, inf, negative, zero, missing
        or non-numeric sample (any element of it) keeps the previous factor and warns once; a
        clipped outlier warns once.
        """
        try:
            p = np.asarray(predicted_s if predicted_s is not None else np.nan, dtype=np.float64)
            m = np.asarray(measured_s if measured_s is not None else np.nan, dtype=np.float64)
        except (TypeError, ValueError):
            p = m = np.asarray(np.nan)
        ps, ms = float(p.sum()) if p.size else math.nan, float(m.sum()) if m.size else math.nan
        ok = (p.shape == m.shape and np.all(np.isfinite(p)) and np.all(np.isfinite(m))
              and np.all(m >= 0) and ps > 0 and ms > 0)
        if not ok:
            if not self._warned_bad_measurement:
                warnings.warn(f"latency calibration of rank {rank}: unusable measurement "
                              f"(predicted={ps!r}, measured={ms!r}); keeping the previous "
                              f"correction {self.correction(rank):.3f}", stacklevel=2)
                self._warned_bad_measurement = True
            return
        w = self.calibration_ema
        old = self.correction(rank)
        ratio = ms / ps
        clipped = min(max(ratio, old / CALIBRATION_CLIP), old * CALIBRATION_CLIP)
        if clipped != ratio and not self._warned_clipped:
            warnings.warn(f"latency calibration of rank {rank}: measured / predicted = "
                          f"{ratio:.3g} ({ms:.3g} s / {ps:.3g} s) is more than "
                          f"{CALIBRATION_CLIP:g}x off the current correction {old:.3g}; this update uses {clipped:.3g} "
                          f"(an outlier moves the factor by a bounded step)", stacklevel=2)
            self._warned_clipped = True
        self._errors.append(abs(old * ps - ms) / ms)
        self._correction[int(rank)] = (1.0 - w) * old + w * clipped

    def recent_error(self, last: int = 16) -> Optional[float]:
        """Median relative error |corrected prediction - measured| / measured over the ``last``
        calibrations (each taken before its own update: the error a plan made with the model
        would have had; one per rank and step); None before any."""
        if not self._errors:
            return None
        return float(np.median(list(self._errors)[-max(int(last), 1):]))

    def corrections(self) -> dict[int, float]:
        return dict(self._correction)

    def calibration_state(self) -> dict:
        """What online calibration learned: per-rank factors and the recent errors."""
        return {"corrections": {str(r): f for r, f in self._correction.items()},
                "errors": [float(e) for e in self._errors]}

    def load_calibration_state(self, state: dict) -> None:
        """Restore ``calibration_state()`` (a resumed run continues where the saved one stood)."""
        self._correction.clear()
        self.load_corrections(state.get("corrections", {}))
        errors = [float(e) for e in state.get("errors", [])]
        if not all(math.isfinite(e) and e >= 0 for e in errors):
            raise ValueError("calibration errors must be finite numbers >= 0")
        self._errors.clear()
        self._errors.extend(errors)

    def load_corrections(self, corrections: dict) -> None:
        """Restore per-rank factors saved with ``corrections()`` (a resumed run)."""
        for rank, factor in corrections.items():
            f = float(factor)
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"correction of rank {rank}: {factor!r}: expected a number > 0")
            self._correction[int(rank)] = f
