"""Do no harm on net in the simulated study (issue 44, ``NetGate``): whether a step plans at all,
net of the plugin's own cost (``plugin_cost``), beside the per-step rule of
``policy.stand_down``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..policy.stand_down import StepChoice


@dataclass
class NetGate:
    """The step plans unless the last planned step's net gain, its predicted gain over the baseline
    (``StepChoice.baseline_s`` minus the committed step) less its own cost, was below zero; then the
    step stands down without planning and runs as the static baseline (the baseline packing at d0:
    nothing to plan, gather or broadcast). A probe plans again after ``probe_every`` steps, and
    every probe that does not pay doubles the wait (up to ``max_probe_every``), so what probing
    costs a run where planning never pays shrinks towards nothing. A run whose plans pay their cost
    is never stood down: a healthy run is unaffected. The first step plans (nothing is known yet).
    With the quality objective (``quality``) a plan's predicted loss gain counts too, at the
    exchange rate its report says it was planned at (nats per token a 1% faster step is worth): a
    plan that only raises into bubbles pays in quality."""

    quality: bool = False
    probe_every: int = 8
    max_probe_every: int = 256
    net_gain_s: Optional[float] = None     # of the last planned step (None: none yet)
    skipped: int = 0                       # steps stood down since then
    stood_down: int = 0                    # steps stood down in all
    steps: int = 0
    wait: int = 0                          # steps to stand down before the next probe

    def __post_init__(self):
        for name in ("probe_every", "max_probe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an integer >= 1")
        self.wait = self.wait or self.probe_every

    def plans(self) -> bool:
        """Whether the next step plans (and pays for planning)."""
        return (self.net_gain_s is None or self.net_gain_s >= 0.0
                or self.skipped + 1 >= self.wait)

    def planned(self, choice: StepChoice, cost_s: float) -> float:
        """Record a planned step (its choice and its own cost, seconds); its net gain."""
        probe = self.net_gain_s is not None and self.net_gain_s < 0.0
        self.steps += 1
        self.skipped = 0
        self.net_gain_s = float(choice.baseline_s - choice.outcome.step_s - cost_s
                                + self.quality_worth_s(choice))
        if self.net_gain_s >= 0.0:
            self.wait = self.probe_every
        elif probe:                                   # a probe that did not pay: back off
            self.wait = min(2 * self.wait, self.max_probe_every)
        return self.net_gain_s

    def quality_worth_s(self, choice: StepChoice) -> float:
        """The committed plan's predicted loss gain in seconds of the baseline step, at the
        exchange rate (0 without one, or where the plan gains none)."""
        report = getattr(choice.outcome.plan, "report", None)
        gain = -float(getattr(report, "quality_cost", float("nan")))
        rate = float(getattr(report, "exchange_rate", float("nan")))
        if not self.quality or choice.dst_stood_down or not gain > 0 or not rate == rate:
            return 0.0
        if rate <= 0:
            return float("inf")
        return gain / (100.0 * rate) * float(choice.baseline_s)

    def skip(self) -> None:
        """Record a step that stood down without planning."""
        self.steps += 1
        self.skipped += 1
        self.stood_down += 1
