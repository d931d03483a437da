"""The quality model DST plans by: a sample's held-out loss change against the density of each
depth group of the model's layers and the sample's length, measured on a real model and fitted
convex (``scripts/bench.py plan_quality``; the fit, offline, is ``eval.quality_fit``).

The model (docs/DESIGN.md section 7). A document of ``n`` tokens whose layers in depth group g
run at density d_g loses, per token, against dense attention

    E(n, d) = rho(n) S(d) + gamma rho(n)^2 S(d)^2,    S(d) = sum_g c_g(d_g),
    rho(n) = (clip(n, *length_range) / length_ref) ** length_exponent,

where each c_g is convex and non-increasing in density (piecewise linear through its knots,
linear below the first, flat above the last): loss is convex in a group's density, so
concentrated cuts cost more than the same kept blocks spread, and a long document's blocks are
many and each worth less (``length_exponent`` < 0 where the measurement says so; outside the
lengths measured, ``length_range``, a document counts as the nearest measured length); ``gamma``
is the groups' interaction (cuts in two groups cost more, or less, than the sum). A plan's
change against uniform d0 is ``E(n, d) - E(n, d0)`` summed over its documents' tokens and divided
by the step's tokens (token-weighted, as a training loss weighs them). Its uncertainty is the
spread of the same change under the fit's bootstrap replicates (``bootstrap``).

Groups are depth ranges as fractions of the model ([0, 1/3), ...), so a model measured on one
network maps onto another's pipeline (virtual) stages by the share of each group's layers a stage
holds (``stage_weights``; on the stages: ``stages``).

The file (JSON, ``version`` 2) holds the fields ``QualityCost.as_dict`` writes; ``from_dict``
checks them: the groups tile the depth [0, 1], and every curve (the fit's and each bootstrap
replicate's) is convex and non-increasing over increasing knots in (0, 1].

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

KIND = "sparsebalance-quality-cost"
VERSION = 2


class QualityCostError(ValueError):
    """A quality-cost file or measurement is malformed."""


def curve(knots: np.ndarray, cost: np.ndarray, density) -> np.ndarray:
    """A group's cost at ``density``: linear between knots, the first segment's slope below
    them, flat above."""
    d = np.asarray(density, dtype=np.float64)
    out = np.interp(d, knots, cost)
    if knots.size >= 2:
        slope = (cost[1] - cost[0]) / (knots[1] - knots[0])
        out = np.where(d < knots[0], cost[0] + slope * (d - knots[0]), out)
    return out


@dataclass(frozen=True)
class GroupCost:
    depth: tuple                # (lo, hi) fraction of the model's depth
    layers: tuple               # (first, last) 1-based layers of the measured model
    knots: np.ndarray
    cost_at_knots: np.ndarray   # convex, non-increasing loss increase (nats per token, rho = 1)


@dataclass(frozen=True)
class Replicate:
    """One bootstrap replicate of the fit: its exponent, interaction and curves (on the
    groups' knots)."""
    length_exponent: float
    interaction: float
    cost: tuple                 # [G] arrays


@dataclass(frozen=True, eq=False)      # hashed by identity (``StageQuality.from_cost``'s cache)
class QualityCost:
    model: str
    reference_density: float
    reference_loss: float
    windows: int                # samples measured
    window_tokens: int          # their mean tokens
    text: str
    groups: tuple
    length_ref: float = 0.0     # tokens (0: no length term)
    length_exponent: float = 0.0
    interaction: float = 0.0
    bootstrap: tuple = ()       # [B] Replicate
    length_range: tuple = (0.0, float("inf"))   # the lengths measured (rho is clipped to them)
    fit: dict = field(default_factory=dict, compare=False)

    def stage_weights(self, stage_layers: Sequence[float]) -> np.ndarray:
        """[stages, G]: the share of group g's depth that stage s holds (stages laid in order
        over the model's depth by their layer counts): a stage's cost at density d is
        ``sum_g w[s, g] c_g(d)``."""
        layers = np.asarray(stage_layers, dtype=np.float64)
        if layers.ndim != 1 or layers.size < 1 or np.any(layers < 0) or layers.sum() <= 0:
            raise QualityCostError(f"stage_layers={list(stage_layers)!r}: expected layer counts "
                                   f">= 0, at least one layer")
        edges = np.concatenate([[0.0], np.cumsum(layers)]) / layers.sum()
        lo, hi = (np.array([g.depth[i] for g in self.groups]) for i in (0, 1))
        over = np.clip(np.minimum(edges[1:, None], hi) - np.maximum(edges[:-1, None], lo),
                       0.0, None)
        return over / (hi - lo)

    def as_dict(self) -> dict:
        return {"kind": KIND, "version": VERSION, "model": self.model,
                "reference_density": self.reference_density,
                "reference_loss": self.reference_loss, "windows": self.windows,
                "window_tokens": self.window_tokens, "text": self.text,
                "length_ref": self.length_ref, "length_range": list(self.length_range),
                "length_exponent": self.length_exponent,
                "interaction": self.interaction,
                "groups": [{"depth": list(g.depth), "layers": list(g.layers),
                            "knots": g.knots.tolist(), "cost": g.cost_at_knots.tolist()}
                           for g in self.groups],
                "bootstrap": [{"length_exponent": r.length_exponent,
                               "interaction": r.interaction,
                               "cost": [c.tolist() for c in r.cost]} for r in self.bootstrap],
                "fit": self.fit}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict, where: str = "quality cost") -> "QualityCost":
        def bad(msg):
            return QualityCostError(f"{where}: {msg}")
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise bad(f"kind={d.get('kind') if isinstance(d, dict) else None!r}: expected {KIND!r}")
        version = d.get("version")
        if version != VERSION:
            raise bad(f"version={version!r}: expected {VERSION}")
        try:
            d_ref = float(d["reference_density"])
            groups = d["groups"]
            head = (str(d["model"]), float(d["reference_loss"]), int(d["windows"]),
                    int(d["window_tokens"]), str(d["text"]))
            extra = (float(d.get("length_ref", 0.0)), float(d.get("length_exponent", 0.0)),
                     float(d.get("interaction", 0.0)))
            span = tuple(float(x) for x in d.get("length_range", (0.0, float("inf"))))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"missing or malformed field: {e}") from None
        if not 0.0 < d_ref <= 1.0:
            raise bad(f"reference_density={d_ref!r}: expected a number in (0, 1]")
        if not all(math.isfinite(x) for x in extra) or extra[0] < 0:
            raise bad(f"length_ref, length_exponent, interaction = {extra}: expected finite "
                      f"numbers, length_ref >= 0")
        if not isinstance(groups, list) or not groups:
            raise bad("groups: expected a non-empty list")
        out, edge = [], 0.0
        for i, g in enumerate(groups):
            try:
                lo, hi = (float(x) for x in g["depth"])
                first, last = (int(x) for x in g["layers"])
                knots = np.asarray([float(x) for x in g["knots"]])
                cost = np.asarray([float(x) for x in g["cost"]])
            except (KeyError, TypeError, ValueError) as e:
                raise bad(f"group {i}: missing or malformed field: {e}") from None
            if abs(lo - edge) > 1e-9 or not lo < hi <= 1.0:
                raise bad(f"group {i}: depth [{lo}, {hi}]: expected to start at {edge:g} and "
                          f"end in ({lo}, 1]: the groups must tile the model's depth")
            _check_curve(knots, cost, lambda m, i=i: bad(f"group {i}: {m}"))
            out.append(GroupCost((lo, hi), (first, last), knots, cost))
            edge = hi
        if abs(edge - 1.0) > 1e-9:
            raise bad(f"groups end at depth {edge:g}: expected 1")
        reps = []
        for j, r in enumerate(d.get("bootstrap", [])):
            try:
                costs = tuple(np.asarray([float(x) for x in c]) for c in r["cost"])
                rep = Replicate(float(r["length_exponent"]), float(r["interaction"]), costs)
            except (KeyError, TypeError, ValueError) as e:
                raise bad(f"bootstrap {j}: missing or malformed field: {e}") from None
            if len(costs) != len(out):
                raise bad(f"bootstrap {j}: {len(costs)} curves, expected one per group "
                          f"({len(out)})")
            for g, c in zip(out, costs):
                _check_curve(g.knots, c, lambda m, j=j: bad(f"bootstrap {j}: {m}"))
            reps.append(rep)
        if len(span) != 2 or not 0 <= span[0] <= span[1]:
            raise bad(f"length_range={list(span)}: expected [shortest, longest] tokens")
        return cls(head[0], d_ref, head[1], head[2], head[3], head[4], tuple(out), *extra,
                   tuple(reps), length_range=span, fit=dict(d.get("fit", {})))

    @classmethod
    def load(cls, path: str) -> "QualityCost":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise QualityCostError(f"quality cost file {path!r} not found (make one with "
                                   f"python scripts/bench.py plan_quality --calibrate)") from None
        except json.JSONDecodeError as e:
            raise QualityCostError(f"{path}: not JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise QualityCostError(f"{path}: not UTF-8 text ({e.reason})") from None
        except IsADirectoryError:
            raise QualityCostError(f"{path}: is a directory (expected a quality cost JSON "
                                   f"file)") from None
        except OSError as e:
            raise QualityCostError(f"{path}: cannot be read ({e.strerror or e})") from None
        except RecursionError:
            raise QualityCostError(f"{path}: JSON nested too deeply") from None
        return cls.from_dict(d, where=path)


def _check_curve(knots: np.ndarray, cost: np.ndarray, bad) -> None:
    if knots.size < 1 or knots.size != cost.size:
        raise bad(f"knots ({knots.size}) and cost ({cost.size}) must have the same length >= 1")
    if np.any(~np.isfinite(knots)) or np.any(~np.isfinite(cost)) or np.any(np.diff(knots) <= 0) \
            or knots[0] <= 0 or knots[-1] > 1:
        raise bad(f"knots {knots.tolist()}: expected increasing densities in (0, 1], finite costs")
    if np.any(np.diff(cost) > 1e-12):
        raise bad(f"cost {cost.tolist()}: expected non-increasing in density")
    if knots.size >= 3 and np.any(np.diff(np.diff(cost) / np.diff(knots)) < -1e-9):
        raise bad(f"cost {cost.tolist()}: expected convex in density")


DEFAULT_QUALITY_COST = os.path.join(os.path.dirname(__file__), "quality_model_smollm2.json")


@functools.lru_cache(maxsize=8)
def load_quality_cost(path: Optional[str] = None) -> QualityCost:
    """``path``, or the shipped default: SmolLM2-135M measured on retrieval samples and natural
    text (``DEFAULT_QUALITY_COST``, made by ``scripts/bench.py plan_quality --calibrate``). Read
    once per path (DST asks every step)."""
    return QualityCost.load(path or DEFAULT_QUALITY_COST)
