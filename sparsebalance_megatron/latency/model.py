"""LatencyModel: forward/backward seconds of one micro-batch on one pipeline stage.

Form, per stage kind (first / middle / last, or "only" without PP), fitted separately for the
forward and the backward pass::

    t = c0 + c1 * tokens + c2 * attention_work(density) + c3 * selection_work + c4 * sequences
        + c5 * dense_work + c6 * sparse_calls + c7 * dense_calls

``dense_work`` (the causal block pairs of documents routed to the dense kernel, ``features.py``)
does not depend on the density, so it joins the fixed part of a unit's time: a unit of short
documents alone takes the same time at every density. Its coefficient is the table's
``dense_coefficients`` (fitted when the grid has routed documents), else the sparse kernel's
per-pair cost (``crossover.dense_coefficient``). The routing threshold is the table's crossover;
``with_routing`` gives the model of a run that routes at another (``--sb-dense-below-tokens``);
``all_dense`` that of a run with dense attention (every document through the dense kernel).
``sparse_calls`` / ``dense_calls`` (1 when the unit makes that kernel's call) carry each call's
fixed cost: the table's ``call_coefficients`` (fitted where the grid tells them from ``const``,
i.e. where some units make a call that others do not), else 0 (``const`` holds them).

A profiled table that carries a measured sparse call price (``price_fit.attach_price``) is
fitted *priced*: its sparse calls cost the stage's layers x the price's terms (the fixed cost
per call on ``sparse_calls``, the tiles on ``attention_work``, the selection inside the call);
only the rest is fitted to what the measurements leave. The price, timed per call over many
repeats, carries the density's effect, which a few noisy micro-batches cannot pin down.

A stage of another layer count than the table's (Megatron's uneven splits, layout strings and
the interleaved schedule's model chunks: ``layout.PipelineLayout``) is its kind's coefficients
plus (its layers - the table's layers of that kind) x one layer's, where one layer is the
measured middle stage divided by its layers: exact for the table's own layout, and the embedding
and LM head + loss stay on the first and last (virtual) stage. ``with_layout`` gives the model of
a run's layout; ``num_stages`` is then the number of virtual stages.

(features in ``features.py``; attention work counts exactly the kept block pairs). Because the
density enters only through attention work, DST re-times a unit at another density with
``UnitTerms.time_s(d) = fixed_s + attn_s_per_pair * work(d)``: no documents are re-walked.
Online calibration (``calibration.py``) multiplies a rank's predictions by an EMA of measured /
predicted, each ratio clipped to ``[1 / CALIBRATION_CLIP, CALIBRATION_CLIP]`` times the current
factor so that one outlier timing cannot throw a rank's factor off; unusable samples keep it.

Pure numpy; must not import torch or megatron.

The layouts and context parallelism are ``model_layouts.LayoutsMixin``'s.
"""

from __future__ import annotations

import copy
import json
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

ALL_DENSE_TOKENS = 1 << 40
"""A routing threshold above every document: all of them through the dense kernel."""

# CALIBRATION_CLIP lived here before calibration.py: callers still import it from this module
from .calibration import CALIBRATION_CLIP, Calibration  # noqa: F401
from .crossover import call_coefficient, dense_coefficient, table_crossover
from .features import CALL_FEATURES, FEATURES, MODEL_FEATURES, UnitFeatures, features_of
from .fit import fit_nonneg
from .model_layouts import LayoutsMixin
from .table import (FORMAT_VERSION, LatencyTableError, check_coefficients, check_compatible,
                    measured_kinds, read_table, table_layout, validate_table, write_table)


def _priced_terms(table: dict):
    """``f(kind, pass) -> {MODEL_FEATURES column: seconds per unit}`` of the sparse call's
    measured price a profiled table carries (``price_fit.attach_price``), for a stage of
    that kind's layers at the table's model and micro-batch; None without one."""
    rec = table.get("sparse_call")
    if table.get("source") != "profiled" or not rec or not rec.get("measured"):
        return None
    from .price import SparseCallPrice
    price = SparseCallPrice.from_dict(rec)
    m, lay = table["model"], table_layout(table)
    heads = int(m["num_attention_heads"])
    head_dim = int(m.get("kv_channels") or int(m["hidden_size"]) // heads)
    terms = price.layer_terms(heads, head_dim, int(table["attention"]["block_size"]),
                              int(m["seq_length"]))
    kinds = lay.kinds()
    cols = [MODEL_FEATURES.index(n) for n in ("attention_work", "selection_work",
                                              "sparse_calls")]

    def known(kind: str, part: str) -> dict:
        n = lay.layers[kinds.index(kind)] if kind in kinds else max(lay.layers)
        return dict(zip(cols, (n * terms[part]["pair"], 0.0, n * terms[part]["call"])))
    return known


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


class LatencyModel(LayoutsMixin, Calibration):
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
        # one vector per (kind, pass) in the order of MODEL_FEATURES (the table's features,
        # then dense_work and the calls); ``coef`` is its view on the table's features
        self._coef_full = {
            k: {p: np.asarray(list(v[p]) + [dense_coefficient(table, coefficients, k, p)]
                              + [call_coefficient(table, k, p, n) for n in CALL_FEATURES],
                              dtype=np.float64) for p in ("fwd", "bwd")}
            for k, v in coefficients.items()}
        self.coef = {k: {p: v[p][:len(FEATURES)] for p in v} for k, v in self._coef_full.items()}
        self.dense_below_tokens = table_crossover(table)
        self.table_layout = table_layout(table)
        self.layout = self.table_layout
        self._stage_coef = [self._coef_full[k] for k in self.layout.kinds()]
        self.context_parallel = None      # a ContextParallelCost (with_context_parallel)
        self.init_calibration(calibration_ema)

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def fit(cls, table: dict, *, calibration_ema: float = 0.3, where: str = "<table>"
            ) -> "LatencyModel":
        """Least squares per stage kind on the table's measurements (ignores stored
        coefficients); priced where the table carries a measured price (module docstring)."""
        validate_table(table, where)
        att = table["attention"]
        coef, dense, calls = {}, {}, {}
        nf, nd = len(FEATURES), len(FEATURES) + 1
        priced = _priced_terms(table)
        for kind in measured_kinds(table):
            rows = [m for m in table["measurements"] if m["kind"] == kind]
            feats = UnitFeatures.build([m["doc_lengths"] for m in rows], att["block_size"],
                                       att["sink_blocks"], att["local_blocks"],
                                       att.get("work", "kept"),
                                       int(att.get("query_chunk_blocks", 16)),
                                       table_crossover(table))
            x = feats.matrix(np.asarray([m["density"] for m in rows]), MODEL_FEATURES)
            y = {p: np.asarray([m[p + "_s"] for m in rows]) for p in ("fwd", "bwd")}
            if priced is None:
                fitted = {p: fit_nonneg(x, y[p]) for p in y}
            else:
                known = {p: priced(kind, p) for p in y}       # {column: seconds per unit}
                rest = x.copy()
                rest[:, list(known["fwd"])] = 0.0             # not fitted: unidentifiable
                fitted = {p: fit_nonneg(rest, y[p] - x[:, list(known[p])] @ np.array(
                    list(known[p].values())), scale=y[p]) for p in y}
                for p in y:
                    fitted[p][list(known[p])] = list(known[p].values())
            coef[kind] = {p: c[:nf].tolist() for p, c in fitted.items()}
            # the dense kernel's own coefficient, where the grid has routed documents that price
            # it (else the sparse kernel's per-pair cost stands in: crossover.dense_coefficient)
            if all(c[nf] > 0 for c in fitted.values()):
                dense[kind] = {p: float(c[nf]) for p, c in fitted.items()}
            # per-call costs where the grid tells them from const (else 0: const holds them);
            # a format 1 table (no execution section) cannot hold them, and has no routing
            if any(c[nd:].any() for c in fitted.values()) and table["format_version"] >= 2:
                calls[kind] = {p: dict(zip(CALL_FEATURES, map(float, c[nd:])))
                               for p, c in fitted.items()}
        table = dict(table)
        table["coefficients"] = coef
        table.pop("dense_coefficients", None)
        table.pop("call_coefficients", None)
        if dense:
            table["dense_coefficients"] = dense
        if calls:
            table["call_coefficients"] = calls
            table["format_version"] = FORMAT_VERSION
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
        write_table(self._table_with_coefficients(), path)

    def to_json(self) -> str:
        return json.dumps(self._table_with_coefficients())

    def _table_with_coefficients(self) -> dict:
        table = copy.deepcopy(self.table)
        n = len(FEATURES)
        table["coefficients"] = {k: {p: v[p].tolist() for p in v}
                                 for k, v in self.coef.items()}
        if "dense_coefficients" in table:       # fitted; a fallback is not written
            table["dense_coefficients"] = {k: {p: float(v[p][n]) for p in v}
                                           for k, v in self._coef_full.items()}
        if "call_coefficients" in table:
            table["call_coefficients"] = {
                k: {p: dict(zip(CALL_FEATURES, map(float, v[p][n + 1:]))) for p in v}
                for k, v in self._coef_full.items()}
        return table

    def with_routing(self, dense_below_tokens: int) -> "LatencyModel":
        """This model for a run whose documents shorter than ``dense_below_tokens`` run dense
        (0: none); calibration is shared. The table's own threshold is its crossover."""
        n = dense_below_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"dense_below_tokens={n!r}: expected an integer >= 0")
        out = copy.copy(self)
        out.dense_below_tokens = int(n)
        return out

    def all_dense(self) -> "LatencyModel":
        """This model for a run with dense attention: every document through the dense kernel
        (its ``dense_coefficients`` and dense call cost; no sparse call, no selection)."""
        return self.with_routing(ALL_DENSE_TOKENS)

    def without_call_costs(self) -> "LatencyModel":
        """This model with the per-call costs at 0: what a document adds to a micro-batch that
        makes the kernels' calls anyway (SAB's per-document cost, ``batching.packing``), so that
        a call's fixed cost is not charged once per document."""
        n = len(FEATURES) + 1
        out = copy.copy(self)
        out._coef_full = {k: {p: np.r_[v[p][:n], np.zeros(len(v[p]) - n)] for p in v}
                          for k, v in self._coef_full.items()}
        out._stage_coef = [{p: np.r_[c[p][:n], np.zeros(len(c[p]) - n)] for p in c}
                           for c in self._stage_coef]
        return out

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
                           self.work_mode, self.query_chunk_blocks, self.dense_below_tokens)

    def unit_terms(self, mb_doc_lengths, stage: int, rank: Optional[int] = None) -> UnitTerms:
        """Closed-form per-unit time at any density on ``stage`` (calibrated for ``rank``)."""
        f = self.unit_features(mb_doc_lengths)
        self.kind_of(stage)
        c = self._stage_coef[stage]
        corr = self.correction(rank) if rank is not None else 1.0
        # the stages of one kind share their coefficients: their terms of the same features are
        # the same arrays, computed once per features object (a step's tables ask every stage).
        # The memo holds the arrays and only a weak reference to the terms, which refer to the
        # features: a strong one would make a cycle that only the garbage collector frees
        memo = f.__dict__.setdefault("_terms_memo", {})
        key = (c["fwd"].tobytes(), c["bwd"].tobytes(), float(corr))
        hit = memo.get(key)
        if hit is not None:
            terms = hit[0]()
            if terms is None:                  # the last one was freed: the same arrays again
                terms = UnitTerms(f, *hit[1:])
                memo[key] = (weakref.ref(terms),) + hit[1:]
            return terms
        x = f.__dict__.get("_x_stack")
        if x is None:
            x = f.__dict__["_x_stack"] = np.stack(
                [np.ones(f.num_units), f.tokens, f.selection_work, f.sequences], axis=1)  # [n, 4]
        # dense work and the calls are density-independent: fixed time (+ 0.0 exactly without
        # routing and without call costs)
        sc, dc = f.sparse_calls, f.dense_calls
        fixed = {p: np.maximum(x @ c[p][[0, 1, 3, 4]] + c[p][5] * f.dense_work + c[p][6] * sc
                               + c[p][7] * dc, 0.0) * corr
                 for p in ("fwd", "bwd")}
        parts = (fixed["fwd"], fixed["bwd"], float(c["fwd"][2]) * corr, float(c["bwd"][2]) * corr)
        terms = UnitTerms(f, *parts)
        memo[key] = (weakref.ref(terms),) + parts
        return terms

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
