#!/usr/bin/env python
"""Draw a pipeline timeline (Gantt chart per DP rank and stage) of a simulated step.

    python scripts/plot_timeline.py --example straggler --out docs/timeline_example.png
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

FWD_COLOR, BWD_COLOR, IDLE_COLOR = "#4C78A8", "#F58518", "#D9D9D9"


def plot_timeline(start_s: np.ndarray, end_s: np.ndarray, path: str, *, title: str = "",
                  highlight=(), time_unit: str = "ms") -> None:
    """start_s, end_s: [dp, m, pp, 2]; highlight: (dp, m) micro-batches to outline in red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3}[time_unit]
    dp, m, pp, _ = start_s.shape
    step = float(end_s.max()) * scale
    fig, ax = plt.subplots(figsize=(13, 0.55 * dp * pp + 1.8))
    yticks, ylabels = [], []
    for r in range(dp):
        rank_end = float(end_s[r].max()) * scale
        for s in range(pp):
            y = (dp - 1 - r) * (pp + 1) + (pp - 1 - s)
            yticks.append(y)
            ylabels.append(f"rank {r} / stage {s}")
            ax.broken_barh([(0, step)], (y - 0.4, 0.8), facecolors=IDLE_COLOR, hatch="///",
                           edgecolor="white", linewidth=0)
            for i in range(m):
                for k, color in ((0, FWD_COLOR), (1, BWD_COLOR)):
                    a, b = start_s[r, i, s, k] * scale, end_s[r, i, s, k] * scale
                    hot = (r, i) in highlight
                    ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), facecolors=color,
                                   edgecolor="red" if hot else "black",
                                   linewidth=1.6 if hot else 0.4)
                    if b - a > step / 60:
                        ax.text((a + b) / 2, y, str(i), ha="center", va="center", fontsize=7,
                                color="white")
        ytop = (dp - 1 - r) * (pp + 1) + pp - 0.5
        ax.plot([rank_end, rank_end], [ytop - pp, ytop], color="black", linestyle="--",
                linewidth=1)
        ax.text(rank_end, ytop + 0.05, f" rank {r}: {rank_end:.0f} {time_unit}", fontsize=8,
                va="bottom")
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlim(0, step * 1.08)
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(facecolor=FWD_COLOR, label="forward"),
                       Patch(facecolor=BWD_COLOR, label="backward"),
                       Patch(facecolor=IDLE_COLOR, hatch="///", label="idle (bubble / wait)"),
                       Patch(facecolor="white", edgecolor="red", label="long-document micro-batch")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def straggler_example(density: float = 0.5, m: int = 8, seed: int = 0):
    """2 DP ranks x PP=4 on the analytic Qwen2.5-0.5B H100 model, 32K-token micro-batches of
    real-length documents; micro-batch 3 of rank 0 is one 32K-token document."""
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.sim import simulate_1f1b

    model = LatencyModel.analytic(pp=4)
    t = model.table["model"]["seq_length"]
    rng = np.random.default_rng(seed)
    try:
        from sparsebalance_megatron.data import load_corpus
        lengths = np.asarray(load_corpus(tokenizer="qwen", compact_vocab=True).lengths)
        lengths = lengths[lengths < t // 4]
    except Exception:  # no corpus cache: a heavy-tailed stand-in
        lengths = np.clip(rng.lognormal(7.5, 1.2, 5000).astype(int), 16, t // 4)
    units = []
    for _ in range(2 * m):
        mix, room = [], t
        while room > 0:
            x = int(min(rng.choice(lengths), room))
            mix.append(x)
            room -= x
        units.append(mix)
    units[3] = [t]                    # rank 0, micro-batch 3: the long document
    per_stage = [model.predict_many_fwd_bwd(units, density, s) for s in range(4)]
    f, b = (np.stack([p[k].reshape(2, m) for p in per_stage], axis=-1) for k in (0, 1))
    return simulate_1f1b(f, b, model.p2p_s, record=True), model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--example", choices=("straggler",), required=True)
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--density", type=float, default=0.5)
    args = p.parse_args(argv)
    sim, _ = straggler_example(args.density)
    title = (f"Simulated 1F1B step, 2 DP ranks x PP=4, Qwen2.5-0.5B shape, 32K tokens per "
             f"micro-batch, density {args.density} (ANALYTIC H100 latency table)\n"
             f"rank 0 micro-batch 3 is one 32K-token document: step {1e3 * sim.step_time_s:.0f}"
             f" ms, imbalance {sim.imbalance:.2f}, bubble fraction {sim.bubble_fraction:.2f}")
    start, end = sim.start_s, sim.end_s
    plot_timeline(start, end, args.out, title=title, highlight=((0, 3),))
    print(f"wrote {args.out}: step {1e3 * float(end.max()):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
