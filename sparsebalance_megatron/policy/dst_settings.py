"""DST's settings as one frozen record (``DSTSettings``), made from a ``SparseBalanceConfig``
in one place (``DSTSettings.from_config``; ``dst_inputs``: with the quality objective's model
of the run's stages).

Every layer of the planner (the band search, one band pass, the critical-path descent) reads
the same bounds, band, floors and raise rule; one record passed down instead of a dozen loose
arguments keeps their signatures short and checks the values once, where the record is made.

Pure numpy; must not import torch, megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional

import numpy as np

from ..config import (ANCHORS, DEFAULT_RAISE_HEADROOM, MAX_RAISE_HEADROOM, RAISE_TARGETS,
                      ConfigError)
from .costs import check_density_bounds


def _number(v) -> bool:
    return isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) and v == v


@dataclass(frozen=True)
class DSTSettings:
    """What DST plans by: d0 and its bounds [d_min, d_max]; the band (``anchor``,
    ``tolerance``); the p2p latency between stages (seconds); the mean and per-stage density
    floors (fractions of d0); the raise headroom h and target (``raise_to``); whether the
    critical-path descent refines the band plan (``descent``); the quality objective's
    ``exchange_rate`` (nats per token that 1% of step time is worth: when a plan's cuts pay for
    themselves; None: the step's own uniform trade).
    A bad value raises where the record is made, naming it."""

    d0: float
    d_min: float
    d_max: float
    _: KW_ONLY
    anchor: str = "mean"
    tolerance: float = 0.1
    p2p_s: float = 0.0
    density_floor: float = 0.0
    stage_density_floor: float = 0.0
    raise_headroom: float = 0.0
    raise_to: str = "bottleneck"
    descent: bool = True
    exchange_rate: Optional[float] = None

    def __post_init__(self):
        for flag, v, choices in (("--sb-anchor", self.anchor, ANCHORS),
                                 ("--sb-raise-to", self.raise_to, RAISE_TARGETS)):
            if v not in choices:
                raise ConfigError(f"{flag}={v!r}: expected one of {', '.join(choices)}")
        check_density_bounds(self.d0, self.d_min, self.d_max)
        for flag, v, hi in (("--sb-tolerance", self.tolerance, 10),
                            ("--sb-raise-headroom", self.raise_headroom, MAX_RAISE_HEADROOM),
                            ("--sb-density-floor", self.density_floor, 1),
                            ("--sb-stage-density-floor", self.stage_density_floor, 1)):
            if not _number(v) or not 0.0 <= v <= hi:
                raise ConfigError(f"{flag}={v!r}: expected a number in [0, {hi}]")
        if not _number(self.p2p_s) or not 0.0 <= self.p2p_s < float("inf"):
            raise ValueError(f"p2p_s={self.p2p_s!r}: expected a time in seconds >= 0")
        x = self.exchange_rate
        if x is not None and (not _number(x) or not 0.0 <= x < float("inf")):
            raise ConfigError(f"--sb-exchange-rate={x!r}: expected 'auto' or a number of nats "
                              f"per token >= 0")

    @classmethod
    def from_config(cls, config, p2p_s: float = 0.0,
                    raise_headroom: Optional[float] = None) -> "DSTSettings":
        """The settings of a ``SparseBalanceConfig``; ``raise_headroom`` overrides the config's
        (the runtime passes the measured error when the config says 'auto'; 'auto' without one
        is ``DEFAULT_RAISE_HEADROOM``)."""
        if raise_headroom is None:
            raise_headroom = config.raise_headroom_value
        if raise_headroom is None:
            raise_headroom = DEFAULT_RAISE_HEADROOM
        return cls(config.density, config.min_density, config.max_density,
                   anchor=config.anchor, tolerance=config.tolerance, p2p_s=p2p_s,
                   density_floor=config.density_floor,
                   stage_density_floor=config.stage_density_floor,
                   raise_headroom=raise_headroom, raise_to=config.raise_to,
                   descent=config.dst_descent != "off",
                   exchange_rate=config.exchange_rate_value)


def dst_inputs(config, stages: int, p2p_s: float = 0.0, raise_headroom: Optional[float] = None,
               stage_layers=None, quality_scales: Optional[tuple] = None) -> tuple:
    """(``DSTSettings``, the quality objective's ``StageQuality`` or None) of a
    ``SparseBalanceConfig`` for costs of ``stages`` (virtual) stages (``raise_headroom``:
    ``DSTSettings.from_config``'s). With ``--sb-dst-objective quality`` (the default),
    ``stage_layers`` (the decoder layers of every (virtual) stage) maps the quality model onto
    the stages: without it a ``ValueError`` (no silent fall-back to the density objective);
    ``dst_objective="density"`` needs none. ``quality_scales``: the depth groups'
    scales of the run's last quality refresh (``quality.refresh``; None: the model as loaded)."""
    quality = None
    if config.dst_objective == "quality":
        from ..quality.refresh import scaled_quality_cost
        from ..quality.stages import StageQuality
        if stage_layers is None or len(stage_layers) != stages:
            raise ValueError(f"--sb-dst-objective quality (the default) needs the decoder "
                             f"layers of each of the {stages} stages, got "
                             f"{stage_layers!r}; pass stage_layers, or plan with "
                             f"--sb-dst-objective density, which needs none")
        cost = scaled_quality_cost(config.quality_cost,
                                   None if quality_scales is None else tuple(quality_scales))
        quality = StageQuality.from_cost(cost, stage_layers, config.density)
    return DSTSettings.from_config(config, p2p_s=p2p_s, raise_headroom=raise_headroom), quality
