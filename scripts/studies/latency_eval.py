"""Held-out accuracy of the latency model: fit on a table's grid, predict real micro-batches
(packed from the built-in corpus as training packs them, at densities off the grid)."""

from __future__ import annotations

import sys
import warnings

import numpy as np

from .common import parser, write_result

SEED = 7            # the held-out micro-batches' and their densities'


def heldout_mixes(seq_length: int, n: int, seed: int, doc_unit: str = "file") -> list[list[int]]:
    from sparsebalance_megatron.data import load_corpus, padding_lengths

    lengths = np.asarray(load_corpus(tokenizer="qwen", compact_vocab=True,
                                     doc_unit=doc_unit).lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(lengths.size)
    mixes, cur = [], []
    for i in order:
        rest = int(lengths[i])
        while rest > 0:
            take = min(rest, seq_length - sum(cur))
            cur.append(take)
            rest -= take
            full = sum(cur) == seq_length
            early = rng.random() < 0.3 and not full   # some end early: padding pieces
            if early:
                cur.extend(padding_lengths(seq_length - sum(cur)))
            if full or early:
                mixes.append(cur)
                cur = []
                if len(mixes) == n:
                    return mixes
            if early:
                break
    return mixes


def main(argv=None) -> int:
    p = parser(__doc__, "latency_eval", json_required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--n", type=int, default=12, help="held-out micro-batches per stage kind")
    p.add_argument("--doc-unit", choices=("file", "section"), default="file")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency import LatencyModel, read_table
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.megatron.launch.profile import (build_stage, device_name,
                                                                init_single_process, time_microbatch)
    warnings.filterwarnings("ignore", message=".*RNG state changed.*")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    table = read_table(args.table)
    model = LatencyModel.fit(table, where=args.table)        # fit on the grid only
    if device_name() != table["device"]:
        print(f"warning: table measured on {table['device']!r}, evaluating on {device_name()!r}",
              file=sys.stderr)
    mod, att, prof = table["model"], table["attention"], table.get("profile", {})
    fields = {**mod, **table.get("execution", {})}   # model shape and how the stage ran
    shape = ModelShape(**{k: fields[k] for k in ModelShape.__dataclass_fields__ if k in fields},
                       pp=table["pipeline"]["pp"])
    sb = SparseBalanceConfig(sparse_attention=True, block_size=att["block_size"],
                             sink_blocks=att["sink_blocks"], local_blocks=att["local_blocks"],
                             attention_backend=att.get("backend", "auto"),
                             estimator=att.get("estimator", "maxkey"), min_density=0.05,
                             query_chunk_blocks=att.get("query_chunk_blocks", 16))
    repeats, stat = int(prof.get("repeats", 3)), prof.get("statistic", "median")
    init_single_process(sb.seed)
    rng = np.random.default_rng(SEED)
    mixes = heldout_mixes(shape.seq_length, args.n, SEED, args.doc_unit)
    grid = sorted({m["density"] for m in table["measurements"]})
    rows = []
    kinds = table["pipeline"]["stage_kinds"]
    for kind in sorted(set(kinds)):
        stage = kinds.index(kind)
        torch.manual_seed(sb.seed)
        net, dev = build_stage(shape, sb, kind, table["pipeline"]["layers_per_stage"][stage])
        time_microbatch(net, dev, kind, shape, mixes[0], 1.0, 0, 1)   # warm-up
        dens = [float(rng.uniform(min(grid), 1.0)) for _ in mixes]   # off the grid
        samples = [[] for _ in mixes]
        # On CUDA a new shape compiles the flex kernel: one untimed run per sample, as the
        # profiler does, keeps the compile out of the held-out times.
        warmup = 1 if torch.cuda.is_available() else 0
        for _ in range(repeats):          # passes, like the profiler
            for j, mix in enumerate(tqdm(mixes, desc=kind)):
                samples[j].append(time_microbatch(net, dev, kind, shape, mix, dens[j], 1, warmup))
        statf = {"median": np.median, "min": np.min}[stat]
        for mix, d, smp in zip(mixes, dens, samples):
            arr = np.asarray(smp)
            f, b = float(statf(arr[:, 0])), float(statf(arr[:, 1]))
            pf, pb = model.predict_fwd_bwd(mix, d, stage)
            rows.append(dict(kind=kind, docs=len(mix), density=d, measured_s=f + b,
                             predicted_s=pf + pb, measured_fwd_s=f, predicted_fwd_s=pf,
                             doc_lengths=[int(x) for x in mix]))
        del net
    meas = np.array([r["measured_s"] for r in rows])
    pred = np.array([r["predicted_s"] for r in rows])
    err = np.abs(pred - meas) / meas
    print(f"{'kind':6s} {'docs':>4s} {'density':>7s} {'measured ms':>11s} {'predicted ms':>12s} "
          f"{'err':>6s}")
    for r, e in zip(rows, err):
        print(f"{r['kind']:6s} {r['docs']:4d} {r['density']:7.3f} {1e3 * r['measured_s']:11.1f} "
              f"{1e3 * r['predicted_s']:12.1f} {100 * e:5.1f}%")
    out = {"mape": float(err.mean()), "n": int(err.size), "device": device_name(),
           "max_error": float(err.max()), "table": args.table,
           "table_device": table["device"], "statistic": stat, "repeats": repeats,
           "rows": rows}
    print(f"held-out MAPE {100 * out['mape']:.1f}% over n={out['n']} micro-batches "
          f"(max {100 * out['max_error']:.1f}%) on {out['device']}")
    write_result(args.json, out)
    return 0
