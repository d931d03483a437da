"""The plugin's console line: one ``[sparsebalance]`` line per ``--log-interval`` from the last
rank, its figures averaged over the interval like Megatron's (README, "Read it as")."""

from __future__ import annotations

import numpy as np

PREFIX = "sparsebalance/"


def console_line(iteration: int, rec: dict, rep) -> str:
    """The line of ``iteration`` from ``rep`` (the ``StepReporter``: its interval's scalars,
    stages, flags and stand-down counts) and the step's record ``rec``."""
    def mean(name):
        v = rep.interval.get(PREFIX + name)
        return float(np.mean(v)) if v else None

    parts = [f"[sparsebalance] iteration {iteration:>6d}/{rep.args.train_iters}"]
    if mean("step_time/measured_s") is not None:
        parts.append(f"fwd-bwd {mean('step_time/measured_s'):.3f} s")
    if mean("density/mean") is not None:
        stages = [mean(f"density/stage{s}") for s in range(rep.stages)]
        kept = mean("density/kept")
        parts.append(f"density {mean('density/mean'):.3f}"
                     + (f" kept {kept:.3f}" if kept is not None else "")
                     + (f" (stages {'/'.join(f'{x:.2f}' for x in stages)})"
                        if rep.stages > 1 else ""))
    if mean("step_time/predicted_s") is not None:
        pred, static = mean("step_time/predicted_s"), mean("step_time/static_s")
        parts.append(f"pred {pred:.3f} s (static {static:.3f} s, "
                     f"{100.0 * (1.0 - pred / static):+.2f}%)" if static else
                     f"pred {pred:.3f} s")
        if mean("quality/predicted_loss_change") is not None:
            sd = mean("quality/predicted_loss_sd")
            parts.append(f"dL {mean('quality/predicted_loss_change'):+.4f}"
                         + (f"±{sd:.4f}" if sd else ""))
        parts.append(f"imb {mean('imbalance/predicted_before'):.2f}->"
                     f"{mean('imbalance/predicted_after'):.2f}")
        cut = sum(rep.interval.get(PREFIX + "units/cut", []))
        raised = sum(rep.interval.get(PREFIX + "units/raised", []))
        no_cuts = rep.interval.get(PREFIX + "dst/no_cuts", [])
        parts.append(f"cut {int(cut)} raised {int(raised)}"
                     + (f" (no cuts kept {int(sum(no_cuts))}/{len(no_cuts)})"
                        if sum(no_cuts) else ""))
        h = mean("raise_headroom")
        if not cut and not raised:          # why nothing moved
            parts.append(f"nothing moved: no cut the {rep.sb.tolerance:g} band and the "
                         f"floors allow" + (f", raises held {100 * h:.0f}% under the "
                                            f"bottleneck (the latency model's error, "
                                            f"--sb-raise-headroom)" if h else ""))
    if mean("latency_model/error") is not None:
        parts.append(f"lat err {100 * mean('latency_model/error'):.1f}%")
    if rec.get("split_docs"):
        parts.append(f"split docs {rec['split_docs']}")
    if rep.stood.describe():                    # cumulative over the run
        parts.append(rep.stood.describe())
    own, wait = mean("overhead/own_s"), mean("overhead/wait_s")
    parts.append(f"overhead {mean('overhead_s') or 0.0:.3f} s"
                 + (f" (own {own:.3f} s, waiting {wait:.3f} s)" if own is not None else ""))
    return " | ".join(parts)
