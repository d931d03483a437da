"""The verdict of a quality study that can fail (issue 73): non-inferiority of an arm against its
reference at matched kept density, judged with a positive control and a margin fixed in advance.

Inputs are paired differences, one per replicate: per seed of a training study, per sample of an
inference study, always ``arm - reference`` of a loss (answer NLL, held-out loss: higher is
worse). The control's differences are ``control - reference`` (0.9 x d0 against d0: a known small
harm). Outcomes (``verdict``):

- ``not matched``: the arm's kept density differs from its reference's by more than the
  tolerance in some replicate; no verdict on quality is stated.
- ``uninformative``: the study cannot say: the positive control was not detected (its one-sided
  95% lower bound is not above 0), the arm and reference are identical in every replicate (the
  arm made no move: nothing was tested), fewer than 2 replicates, or the interval straddles the
  margin (upper bound >= margin, lower bound <= margin).
- ``non-inferior``: the control detected and the one-sided 95% upper bound of the mean
  difference below the margin.
- ``inferior``: the control detected and the one-sided 95% lower bound above the margin (worse
  than the margin, at 95%).

Statistics: the paired Student t bound, ``mean +- t(1 - alpha, n - 1) x sd / sqrt(n)``, on the
replicates' differences (pairing removes what the arms share: a seed's or a sample's own
difficulty). Student's t and not the normal, because the training studies have 10 seeds: the
normal bound would be too narrow there (z 1.645 against t 1.833 at 9 degrees of freedom); at
the inference study's hundreds of samples the two agree to 1%. The t test needs the mean
difference to be about normal: over seeds, a mean of many documents' losses is; over samples
the per-sample differences are skewed (a sample that loses its needle moves by nats), and the
central limit theorem carries the mean at n >= 50, which the power calculation asks anyway.
Requiring non-inferiority on two metrics (answer NLL and held-out loss) is an intersection-union
test: each at alpha, no multiplicity correction needed.

Power (``power_report``): the smallest effect detectable at 80% power in a one-sided test at
alpha from the observed SD and n, ``(t(1 - alpha) + t(power)) x sd / sqrt(n)`` (the shifted
central-t approximation to the noncentral t); the n that detects a given effect; the power to
detect the control's observed harm; the n for which an arm truly equal to its reference is found
non-inferior with 80% power (margin / sd).

Pure Python (math, statistics); must not import torch, numpy or megatron.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Optional, Sequence, Union

ALPHA = 0.05
POWER = 0.8
VERDICTS = ("non-inferior", "inferior", "uninformative", "not matched")
Number = Union[int, float]


# ---- Student's t, exact (no scipy in the venv) --------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
          + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df}: expected > 0")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``, to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p}: expected a probability in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def z_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)


# ---- bounds and power ----------------------------------------------------------------------------

def paired_bound(diffs: Sequence[Number], alpha: float = ALPHA) -> dict:
    """Mean, SD, n, standard error and one-sided (1 - alpha) lower and upper bounds (paired t,
    n - 1 degrees of freedom) of the differences; bounds None with fewer than 2."""
    xs = [float(x) for x in diffs]
    if not xs or any(math.isnan(x) or math.isinf(x) for x in xs):
        raise ValueError(f"differences {xs[:8]}...: expected at least one finite number")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return {"mean": mean, "n": n, "sd": None, "se": None, "lower": None, "upper": None,
                "t": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    se = sd / math.sqrt(n)
    t = t_quantile(1.0 - alpha, n - 1)
    return {"mean": mean, "n": n, "sd": sd, "se": se, "t": t,
            "lower": mean - t * se, "upper": mean + t * se}


def detectable_effect(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a one-sided paired t test at ``alpha`` detects with
    ``power`` from ``n`` replicates of SD ``sd``."""
    if n < 2:
        return math.inf
    df = n - 1
    return (t_quantile(1.0 - alpha, df) + t_quantile(power, df)) * sd / math.sqrt(n)


def n_needed(sd: float, effect: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """The fewest replicates whose one-sided paired t test at ``alpha`` detects a true mean
    difference ``effect`` with ``power`` (``detectable_effect`` <= effect)."""
    if effect <= 0:
        raise ValueError(f"effect={effect}: expected > 0")
    if sd <= 0:
        return 2
    n = max(2, math.ceil(((z_quantile(1 - alpha) + z_quantile(power)) * sd / effect) ** 2))
    while detectable_effect(sd, n, alpha, power) > effect:
        n += 1
    return n


def power_at(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """The power of the one-sided paired t test at ``alpha`` to detect a true mean difference
    ``effect`` (shifted central t)."""
    if n < 2 or sd <= 0:
        return float(effect > 0)
    df = n - 1
    return 1.0 - t_cdf(t_quantile(1.0 - alpha, df) - effect * math.sqrt(n) / sd, df)


def power_report(comparison: dict, control: dict, margin: float, alpha: float = ALPHA,
                 power: float = POWER) -> dict:
    """What the study could detect: from the comparison's SD and n, the smallest effect at
    ``power`` and the n an equal arm needs to be found non-inferior within ``margin``; from the
    control's, its observed harm's power and the n that detects it."""
    out = {"alpha": alpha, "power": power, "margin": margin}
    sd, n = comparison.get("sd"), comparison["n"]
    if sd is not None:
        out["detectable_effect"] = detectable_effect(sd, n, alpha, power)
        out["n_for_margin"] = n_needed(sd, margin, alpha, power) if margin > 0 else None
        out["power_for_margin"] = power_at(margin, sd, n, alpha)
    csd, cn, harm = control.get("sd"), control["n"], control["mean"]
    if csd is not None:
        out["control_detectable_effect"] = detectable_effect(csd, cn, alpha, power)
        out["control_power"] = power_at(harm, csd, cn, alpha) if harm > 0 else 0.0
        out["n_for_control"] = n_needed(csd, harm, alpha, power) if harm > 0 else None
    return out


def margin_from_pilot(control_diffs: Sequence[Number], fraction: float = 0.5) -> float:
    """The margin a pilot fixes: ``fraction`` of the control's mean harm (must be > 0)."""
    harm = paired_bound(control_diffs)["mean"]
    if harm <= 0:
        raise ValueError(f"the pilot's control harm is {harm:+.4g}: a control that does no harm "
                         f"fixes no margin (make the control stronger or the pilot larger)")
    return fraction * harm


# ---- the verdict ---------------------------------------------------------------------------------

def _as_list(x) -> list:
    return [float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)]


def density_match(kept: Union[Number, Sequence[Number]],
                  kept_reference: Union[Number, Sequence[Number]], tolerance: float,
                  at_most: bool = False) -> dict:
    """Whether the arm's kept densities are within ``tolerance`` of the reference's in every
    replicate (scalars: one comparison; lists: paired); ``at_most``: only a gap above the
    reference counts (e.g. a predicted step no slower than the reference's)."""
    a, b = _as_list(kept), _as_list(kept_reference)
    if len(a) != len(b):
        raise ValueError(f"kept densities: {len(a)} values against {len(b)} of the reference")
    gaps = [x - y for x, y in zip(a, b)]
    return {"kept": sum(a) / len(a), "kept_reference": sum(b) / len(b), "gaps": gaps,
            "tolerance": tolerance, "at_most": at_most,
            "matched": all((g if at_most else abs(g)) <= tolerance for g in gaps)}


def verdict(diffs: Sequence[Number], control_diffs: Sequence[Number], margin: float, *,
            kept, kept_reference, tolerance: float, alpha: float = ALPHA,
            power: float = POWER, matched_on: str = "kept density",
            at_most: bool = False) -> dict:
    """The verdict (module docstring) of ``diffs`` (arm - reference) within ``margin``, with the
    positive control's ``control_diffs`` (control - its reference) and the arms' kept densities
    (``kept``, ``kept_reference``: per replicate or overall) matched within ``tolerance``; or
    another quantity the arms are matched on (``matched_on``: e.g. their predicted step
    time), given the same way; ``at_most``: the arm may fall below its reference by any
    amount (``density_match``)."""
    if not margin > 0:
        raise ValueError(f"margin={margin}: expected > 0, fixed before the run")
    cmp, ctl = paired_bound(diffs, alpha), paired_bound(control_diffs, alpha)
    match = density_match(kept, kept_reference, tolerance, at_most)
    detected = ctl["lower"] is not None and ctl["lower"] > 0
    out = {"margin": margin, "alpha": alpha,
           "method": "paired Student t, one-sided, n - 1 degrees of freedom",
           "comparison": cmp, "control": dict(ctl, detected=detected), "density": match,
           "matched_on": matched_on,
           "worse_than_reference": cmp["lower"] is not None and cmp["lower"] > 0,
           "power": power_report(cmp, ctl, margin, alpha, power)}

    def say(v: str, reason: str) -> dict:
        return dict(out, verdict=v, reason=reason)
    if not match["matched"]:
        worst = max(match["gaps"], key=abs)
        return say("not matched", f"the arms' {matched_on} differs by {worst:+.4f}, beyond "
                                  f"the tolerance {tolerance:g}: no verdict on quality")
    if cmp["lower"] is None:
        return say("uninformative", f"{cmp['n']} replicate(s): no spread, no bound")
    if all(float(x) == 0.0 for x in diffs):
        return say("uninformative", "the arm equals its reference in every replicate: it made "
                                    "no move, so nothing was tested")
    if not detected:
        return say("uninformative", f"the positive control was not detected: its lower bound "
                                    f"{ctl['lower']:+.4g} is not above 0 (power "
                                    f"{out['power'].get('control_power', 0):.2f})")
    if cmp["upper"] < margin:
        return say("non-inferior", f"upper bound {cmp['upper']:+.4g} < margin {margin:.4g}")
    if cmp["lower"] > margin:
        return say("inferior", f"lower bound {cmp['lower']:+.4g} > margin {margin:.4g}")
    return say("uninformative", f"the interval [{cmp['lower']:+.4g}, {cmp['upper']:+.4g}] "
                                f"straddles the margin {margin:.4g}: more replicates needed "
                                f"(about {out['power'].get('n_for_margin')} for an equal arm)")


def superiority(diffs: Sequence[Number], control_diffs: Sequence[Number],
                alpha: float = ALPHA) -> dict:
    """A superiority reading of ``diffs`` (arm - reference, a loss): ``better`` where the
    one-sided (1 - alpha) upper bound is below 0, ``worse`` where the lower bound is above 0,
    ``no difference shown`` between; ``uninformative`` with fewer than 2 replicates or where
    the positive control (``control_diffs``) is not detected."""
    b, ctl = paired_bound(diffs, alpha), paired_bound(control_diffs, alpha)
    if b["upper"] is None:
        v = "uninformative"
    elif ctl["lower"] is None or not ctl["lower"] > 0:
        v = "uninformative (control not detected)"
    else:
        v = "better" if b["upper"] < 0 else "worse" if b["lower"] > 0 else "no difference shown"
    return dict(b, verdict=v)


def one_line(v: dict) -> str:
    """The verdict in one line: the difference's mean and upper bound, the margin, the control."""
    c, k = v["comparison"], v["control"]
    bound = "" if c["upper"] is None else f" (95% upper {c['upper']:+.4f})"
    ctl = "" if k["lower"] is None else f"; control {k['mean']:+.4f} (lower {k['lower']:+.4f}, " \
                                        f"{'detected' if k['detected'] else 'not detected'})"
    return f"{v['verdict']}: {c['mean']:+.4f}{bound} against margin {v['margin']:.4f}{ctl}, " \
           f"n={c['n']}"
