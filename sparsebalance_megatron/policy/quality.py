"""Quality cost of attention sparsity per layer group: the LM-loss increase against density,
measured on a real model (``scripts/bench.py quality_cost``) and fitted convex.

docs/DESIGN.md section 7: loss was measured convex in per-layer density: cutting a few layers hard
costs more than the same mean density spread evenly. A planner that only keeps a mean density
cannot see that; this module gives it a cost to minimise.

The measurement: one group of consecutive layers (a depth range of the model) runs at density d
while every other layer stays at the reference density d_ref; the cost of (group, d) is the mean
over paired text windows of ``loss(group at d) - loss(all at d_ref)`` in nats per token. The fit
per group is the lower convex envelope of the measured points and (d_ref, 0), made non-increasing
(more density never costs quality; a measured rise above d_ref is noise), linear below the
lowest measured density and flat above the highest.

Groups are depth ranges as fractions of the model ([0, 0.25), ...), so a cost measured on one
model maps onto another model's pipeline stages by relative depth (``stage_costs``).

JSON (``version`` 1)::

    {"kind": "sparsebalance-quality-cost", "version": 1, "model": str,
     "reference_density": d_ref, "reference_loss": nats, "windows": W, "window_tokens": L,
     "text": str, "groups": [{"depth": [lo, hi], "layers": [first, last],
                              "densities": [...], "delta_loss": [...], "stderr": [...]}]}

Also here: ``StageQuality``, the cost mapped onto a pipeline layout, which DST's quality objective
evaluates (``--sb-dst-objective quality``).

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

KIND = "sparsebalance-quality-cost"
VERSION = 1


class QualityCostError(ValueError):
    """A quality-cost file or measurement is malformed."""


def convex_fit(densities: Sequence[float], delta: Sequence[float], d_ref: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """(knots, cost) of the non-increasing lower convex envelope of the points and (d_ref, 0)."""
    d = np.append(np.asarray(densities, dtype=np.float64), float(d_ref))
    c = np.append(np.asarray(delta, dtype=np.float64), 0.0)
    order = np.lexsort((c, d))
    d, c = d[order], c[order]
    keep = np.ones(d.size, dtype=bool)
    keep[1:] = d[1:] != d[:-1]                     # one point per density: the lowest cost
    d, c = d[keep], c[keep]
    hull: list[int] = []
    for i in range(d.size):                        # Andrew's monotone chain, lower hull
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            cross = (d[b] - d[a]) * (c[i] - c[a]) - (c[b] - c[a]) * (d[i] - d[a])
            if cross > 0:
                break
            hull.pop()
        hull.append(i)
    kd, kc = d[hull], c[hull]
    low = int(np.argmin(kc))                       # non-increasing: flat after the minimum
    return kd[:low + 1].copy(), kc[:low + 1].copy()


@dataclass(frozen=True)
class GroupCost:
    depth: tuple                # (lo, hi) fraction of the model's depth
    layers: tuple               # (first, last) 1-based layers of the measured model
    densities: tuple
    delta_loss: tuple
    stderr: tuple
    knots: np.ndarray
    cost_at_knots: np.ndarray

    def cost(self, density) -> np.ndarray:
        """Convex, non-increasing loss increase (nats/token) at density (scalar or array)."""
        d = np.asarray(density, dtype=np.float64)
        k, c = self.knots, self.cost_at_knots
        out = np.interp(d, k, c)
        if k.size >= 2:                            # below the data: the first segment's slope
            slope = (c[1] - c[0]) / (k[1] - k[0])
            out = np.where(d < k[0], c[0] + slope * (d - k[0]), out)
        return out


@dataclass(frozen=True)
class QualityCost:
    model: str
    reference_density: float
    reference_loss: float
    windows: int
    window_tokens: int
    text: str
    groups: tuple

    def group_at(self, depth: float) -> GroupCost:
        for g in self.groups:
            if g.depth[0] <= depth < g.depth[1] or (depth == 1.0 and g.depth[1] == 1.0):
                return g
        raise QualityCostError(f"depth {depth!r}: no group covers it")

    def stage_costs(self, stage_layers: Sequence[int]) -> list:
        """Per pipeline (virtual) stage of a model with ``stage_layers`` decoder layers each:
        the cost function of the group at the stage's middle depth, per layer of the measured
        group (a stage's cost is that times its share of the model's layers)."""
        layers = np.asarray(stage_layers, dtype=np.float64)
        if layers.ndim != 1 or layers.size < 1 or np.any(layers < 0) or layers.sum() <= 0:
            raise QualityCostError(f"stage_layers={list(stage_layers)!r}: expected layer counts "
                                   f">= 0, at least one layer")
        edges = np.concatenate([[0.0], np.cumsum(layers)]) / layers.sum()
        return [self.group_at(float((a + b) / 2)) for a, b in zip(edges[:-1], edges[1:])]

    def as_dict(self) -> dict:
        return {"kind": KIND, "version": VERSION, "model": self.model,
                "reference_density": self.reference_density,
                "reference_loss": self.reference_loss, "windows": self.windows,
                "window_tokens": self.window_tokens, "text": self.text,
                "groups": [{"depth": list(g.depth), "layers": list(g.layers),
                            "densities": list(g.densities), "delta_loss": list(g.delta_loss),
                            "stderr": list(g.stderr)} for g in self.groups]}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict, where: str = "quality cost") -> "QualityCost":
        def bad(msg):
            return QualityCostError(f"{where}: {msg}")
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise bad(f"kind={d.get('kind') if isinstance(d, dict) else None!r}: expected {KIND!r}")
        if d.get("version") != VERSION:
            raise bad(f"version={d.get('version')!r}: expected {VERSION}")
        try:
            d_ref = float(d["reference_density"])
            groups = d["groups"]
            head = (str(d["model"]), float(d["reference_loss"]), int(d["windows"]),
                    int(d["window_tokens"]), str(d["text"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"missing or malformed field: {e}") from None
        if not 0.0 < d_ref <= 1.0:
            raise bad(f"reference_density={d_ref!r}: expected a number in (0, 1]")
        if not isinstance(groups, list) or not groups:
            raise bad("groups: expected a non-empty list")
        out, edge = [], 0.0
        for i, g in enumerate(groups):
            try:
                lo, hi = (float(x) for x in g["depth"])
                first, last = (int(x) for x in g["layers"])
                dens = [float(x) for x in g["densities"]]
                delta = [float(x) for x in g["delta_loss"]]
                err = [float(x) for x in g["stderr"]]
            except (KeyError, TypeError, ValueError) as e:
                raise bad(f"group {i}: missing or malformed field: {e}") from None
            if abs(lo - edge) > 1e-9 or not lo < hi <= 1.0:
                raise bad(f"group {i}: depth [{lo}, {hi}]: expected to start at {edge:g} and "
                          f"end in ({lo}, 1]: the groups must tile the model's depth")
            if not (len(dens) == len(delta) == len(err) >= 1):
                raise bad(f"group {i}: densities ({len(dens)}), delta_loss ({len(delta)}) and "
                          f"stderr ({len(err)}) must have the same length >= 1")
            if any(not 0.0 < x <= 1.0 for x in dens):
                raise bad(f"group {i}: densities {dens}: expected numbers in (0, 1]")
            if any(not math.isfinite(x) for x in delta + err) or any(x < 0 for x in err):
                raise bad(f"group {i}: delta_loss and stderr must be finite (stderr >= 0)")
            knots, cost = convex_fit(dens, delta, d_ref)
            out.append(GroupCost((lo, hi), (first, last), tuple(dens), tuple(delta), tuple(err),
                                 knots, cost))
            edge = hi
        if abs(edge - 1.0) > 1e-9:
            raise bad(f"groups end at depth {edge:g}: expected 1")
        return cls(head[0], d_ref, head[1], head[2], head[3], head[4], tuple(out))

    @classmethod
    def load(cls, path: str) -> "QualityCost":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise QualityCostError(f"quality cost file {path!r} not found (make one with "
                                   f"python scripts/bench.py quality_cost)") from None
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


_FROM_COST: dict = {}      # StageQuality.from_cost's: (id(cost), layers, d0) -> (cost, quality)


@dataclass(frozen=True)
class StageQuality:
    """A quality cost mapped onto a pipeline's (virtual) stages: stage s's layers run at a
    unit's density, costing ``scale[s] x (Q_s(d) - Q_s(d0))`` nats per token of that micro-batch,
    where Q_s is the measured group at the stage's middle depth and ``scale[s]`` the stage's
    share of the model's depth over the group's (a group's cost spread over its layers)."""

    groups: tuple               # [nv] GroupCost
    scale: np.ndarray           # [nv]
    d0: float

    @classmethod
    def from_cost(cls, cost: "QualityCost", stage_layers: Sequence[int], d0: float
                  ) -> "StageQuality":
        """The stages' quality of ``cost``; the same object for the same cost object, layers
        and d0 (DST asks every step: its grid tables, ``_grid_table``, are then made once)."""
        key = (id(cost), tuple(float(x) for x in stage_layers), float(d0))
        hit = _FROM_COST.get(key)
        if hit is not None and hit[0] is cost:
            return hit[1]
        groups = cost.stage_costs(stage_layers)
        layers = np.asarray(stage_layers, dtype=np.float64)
        share = layers / layers.sum()
        width = np.asarray([g.depth[1] - g.depth[0] for g in groups])
        out = cls(tuple(groups), share / width, float(d0))
        if len(_FROM_COST) >= 16:
            _FROM_COST.clear()
        _FROM_COST[key] = (cost, out)          # the cost held: its id is not reused meanwhile
        return out

    def unit_costs(self, densities: np.ndarray) -> np.ndarray:
        """[dp, m, nv] predicted loss change of every unit against uniform d0."""
        d = np.asarray(densities, dtype=np.float64)
        if d.ndim != 3 or d.shape[2] != len(self.groups):
            raise QualityCostError(f"densities shape {d.shape}: expected [dp, m, "
                                   f"{len(self.groups)}] (one per stage)")
        out = np.empty_like(d)
        for s, (g, at_d0) in enumerate(zip(self.groups, self._at_d0)):
            out[..., s] = self.scale[s] * (g.cost(d[..., s]) - at_d0)
        return out

    @functools.cached_property
    def _at_d0(self) -> tuple:
        """Every stage's Q_s(d0), computed once (the planner asks for plan costs many times a
        step): the same values each ``g.cost(self.d0)`` call gives."""
        return tuple(g.cost(self.d0) for g in self.groups)

    def grid_table(self, grid: np.ndarray) -> np.ndarray:
        """[nv, g] ``unit_costs`` of a unit at every density of the grid, per stage."""
        g = np.asarray(grid, dtype=np.float64)
        return np.stack([self.scale[s] * (grp.cost(g) - grp.cost(self.d0))
                         for s, grp in enumerate(self.groups)])

    def marginal_gain(self, grid: np.ndarray) -> np.ndarray:
        """[nv, g] quality gained per unit of density by stepping up to each grid index from the
        one below (+inf at index 0), non-increasing along the grid (the cost is convex): what
        DST's quality water-filling weighs against attention seconds."""
        g = np.asarray(grid, dtype=np.float64)
        q = self._grid_table(g)
        out = np.full(q.shape, np.inf)
        out[:, 1:] = np.maximum((q[:, :-1] - q[:, 1:]) / np.diff(g), 0.0)
        return np.minimum.accumulate(out, axis=1)

    def plan_cost(self, densities: np.ndarray, grid: Optional[np.ndarray] = None) -> float:
        """Predicted loss change (nats per token) of a plan against uniform d0: every
        micro-batch's stages summed, micro-batches averaged (each holds the same tokens).
        ``grid`` (the plan's density grid, sorted): where every density is on it, each unit's
        cost is looked up in ``grid_table`` (computed once per grid) instead of interpolated:
        the same floats (the table's entries are ``unit_costs``' operations on the same
        values), for a fraction of the time DST's many checks of a step would take."""
        d = np.asarray(densities, dtype=np.float64)
        if grid is not None and d.ndim == 3 and d.shape[2] == len(self.groups):
            g = np.asarray(grid, dtype=np.float64)
            idx = np.minimum(np.searchsorted(g, d), g.size - 1)
            if np.array_equal(g.take(idx), d):
                flat = self._grid_table(g).reshape(-1)
                return float(flat.take(idx + np.arange(d.shape[2]) * g.size).sum(axis=2).mean())
        return float(self.unit_costs(d).sum(axis=2).mean())

    def plan_cost_at(self, idx: np.ndarray, grid: np.ndarray) -> float:
        """``plan_cost`` of the plan at grid indices ``idx`` [dp, m, nv] of ``grid`` (sorted,
        distinct): the floats ``plan_cost(grid[idx], grid)`` gives (its search finds ``idx``
        again), without the search. The planner's checks hold indices already."""
        g = np.asarray(grid, dtype=np.float64)
        flat = self._grid_table(g).reshape(-1)
        return float(flat.take(idx + np.arange(idx.shape[2]) * g.size).sum(axis=2).mean())

    def _grid_table(self, grid: np.ndarray) -> np.ndarray:
        key = grid.tobytes()
        cache = self.__dict__.setdefault("_tables", {})     # frozen: not a field
        got = cache.get(key)            # one read: a planner thread and a report may share it
        if got is None:
            got = self.grid_table(grid)
            cache.clear()                                   # one grid per planner config
            cache[key] = got
        return got


DEFAULT_QUALITY_COST = os.path.join(os.path.dirname(__file__), "quality_cost_smollm2.json")


@functools.lru_cache(maxsize=8)
def load_quality_cost(path: Optional[str] = None) -> QualityCost:
    """``path``, or the shipped default: SmolLM2-135M measured on real text
    (``DEFAULT_QUALITY_COST``, made by ``scripts/bench.py quality_cost``). Read once per path
    (DST asks every step)."""
    return QualityCost.load(path or DEFAULT_QUALITY_COST)
