"""Is the sensitivity signal SAB and DST use related to what sparsification costs a sample?
(SmolLM2-135M on the built-in corpus: Spearman of each cheap signal with the measured loss
change; docs/benchmarks/dst-accuracy.md.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from . import smollm2
from .common import parser, spearman, write_result


def window_loss(model, budget, ids, dens: list) -> float:
    """Mean next-token loss (nats) over every position of the window ``ids`` with ``dens`` (one
    density a decoder layer): ``smollm2.score`` of the window as a sample without an answer."""
    window = SimpleNamespace(input_ids=list(ids), answer_ids=[], scored=lambda: [])
    return smollm2.score(model, budget, window, dens, stride=1)["loss"]


def main(argv=None) -> int:
    ap = parser(__doc__, "sensitivity_signal")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.min_tokens, args.max_tokens, args.d0, args.low = 512, 2048, 0.5, 0.25   # the settings
    from sparsebalance_megatron.batching.sensitivity import prior_sensitivity
    from sparsebalance_megatron.data.sources import read_text, shakespeare_files, stdlib_files

    t0 = time.perf_counter()
    model, budget, tok, a = smollm2.load(args.d0, args.block_size,
                                         threads=torch.get_num_threads())
    n_layers = a.num_layers
    rng = np.random.default_rng(args.seed)
    files = stdlib_files()
    plays = shakespeare_files()
    picks = [files[i] for i in rng.choice(len(files), args.samples, replace=False)]
    picks[::3] = [plays[i] for i in rng.choice(len(plays), len(picks[::3]), replace=False)]
    rows = []
    for name, path in picks:
        ids = tok(read_text(path), add_special_tokens=False)["input_ids"]
        want = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        n = min(len(ids), want + 1)
        if n < args.min_tokens // 2:
            continue
        ids = ids[:n]
        losses = {d: window_loss(model, budget, ids, [d] * n_layers)
                  for d in (1.0, args.d0, args.low)}
        # the estimator's kept mass at d0 (window_loss consumed its own statistics)
        budget.set_layer_densities({j: args.d0 for j in range(1, n_layers + 1)})
        budget.pop_stats()
        x = torch.tensor([ids[:-1]])
        with torch.enable_grad():
            model(x, torch.arange(x.shape[1]).unsqueeze(0), attention_mask=None)
        rec = [r for _, _, _, _, rr in budget.pop_stats() for r in rr]
        recall = float(np.mean(rec))
        rows.append({"doc": name, "tokens": n - 1, "loss_dense": losses[1.0],
                     "loss_d0": losses[args.d0], "loss_low": losses[args.low],
                     "sensitivity": losses[args.low] - losses[1.0],
                     "recall": 1.0 - recall,
                     "length_prior": float(prior_sensitivity([n - 1])[0]),
                     "loss_d0_minus_dense": losses[args.d0] - losses[1.0]})
        r = rows[-1]
        print(f"{name[:40]:<40} {n - 1:>5} tok: sens {r['sensitivity']:+.4f} "
              f"(1 - recall {r['recall']:.4f}) ({time.perf_counter() - t0:.0f} s)", flush=True)
    y = np.asarray([r["sensitivity"] for r in rows])
    out = {}
    for sig in ("recall", "length_prior", "loss_d0_minus_dense"):
        x = np.asarray([r[sig] for r in rows])
        boots = []
        for _ in range(2000):
            i = rng.integers(0, len(rows), len(rows))
            if np.ptp(x[i]) > 0 and np.ptp(y[i]) > 0:
                boots.append(spearman(x[i], y[i]))
        out[sig] = {"spearman": spearman(x, y),
                    "interval_90": [float(np.quantile(boots, 0.05)),
                                    float(np.quantile(boots, 0.95))]}
        print(f"{sig:<22} Spearman {out[sig]['spearman']:+.3f} "
              f"(90% bootstrap {out[sig]['interval_90'][0]:+.2f} .. "
              f"{out[sig]['interval_90'][1]:+.2f}), n={len(rows)}")
    if args.json:
        write_result(args.json, {"settings": vars(args), "correlations": out, "samples": rows})
    return 0
