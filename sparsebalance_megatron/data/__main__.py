"""Build (or open) a corpus and print its statistics: ``python -m sparsebalance_megatron.data``.

Run it once before ``torchrun`` to build the cache outside the training processes; the numbers
(documents, tokens, length percentiles) are the ones the README quotes. Writes JSON with --json.
Must not depend on torch, torch.distributed or megatron (except for an indexed --data-path).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .corpus import DEFAULT_SOURCES, DOC_UNITS, load_corpus
from .packing import GlobalBatchSampler, sequential_pack
from .tokenizers import TOKENIZER_NAMES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", default=None,
                   help="a .jsonl file or a Megatron indexed prefix (default: built-in corpus)")
    p.add_argument("--tokenizer", nargs="+", default=["qwen"], choices=TOKENIZER_NAMES)
    p.add_argument("--compact-vocab", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES))
    p.add_argument("--min-doc-tokens", type=int, default=16)
    p.add_argument("--doc-unit", default="file", choices=DOC_UNITS)
    p.add_argument("--capacity", type=int, nargs="*", default=[],
                   help="also report Megatron-default (sequential) packing at these micro-batch "
                        "sizes in tokens: padding share and attention-cost spread")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write the statistics here")
    args = p.parse_args(argv)

    rows = []
    for tok in args.tokenizer:
        t0 = time.perf_counter()
        c = load_corpus(args.data_path, tokenizer=tok, cache_dir=args.cache_dir,
                        compact_vocab=args.compact_vocab, sources=args.sources,
                        min_doc_tokens=args.min_doc_tokens, doc_unit=args.doc_unit)
        rows.append({**c.stats(), "tokenizer": tok, "compact_vocab": args.compact_vocab,
                     "load_s": round(time.perf_counter() - t0, 2), "notes": c.notes,
                     "packing": [packing_stats(c.lengths, cap, args) for cap in args.capacity]})
    cols = ["name", "n_docs", "total_tokens", "p50", "p90", "p99", "max", "vocab_size", "load_s"]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
        for note in r["notes"]:
            print(f"  note: {note}")
        for q in r["packing"]:
            print(f"  sequential packing at {q['capacity']} tokens, dp={q['dp']} "
                  f"m={q['num_microbatches']}, {q['steps']} steps: padding "
                  f"{100 * q['padding_share']:.1f}%, docs/micro-batch {q['docs_per_microbatch']:.2f}, "
                  f"attention cost (sum of seq^2) max/mean over micro-batches of a step "
                  f"{q['attn_cost_max_over_mean']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def packing_stats(lengths, capacity: int, args) -> dict:
    """Padding share and per-step attention-cost imbalance of Megatron's default packing."""
    sampler = GlobalBatchSampler(lengths, capacity=capacity, dp=args.dp,
                                 num_microbatches=args.num_microbatches, seed=args.seed)
    padding, docs, ratios = [], [], []
    for _ in range(args.steps):
        packed = sequential_pack(sampler.next_global_batch(), capacity=capacity, dp=args.dp,
                                 num_microbatches=args.num_microbatches)
        mbs = [mb for rank in packed for mb in rank]
        real = np.array([sum(e - s for _, s, e in mb) for mb in mbs], dtype=np.float64)
        cost = np.array([sum((e - s) ** 2 for _, s, e in mb) for mb in mbs], dtype=np.float64)
        padding.append(1.0 - real.sum() / (capacity * len(mbs)))
        docs.append(np.mean([len(mb) for mb in mbs]))
        ratios.append(cost.max() / cost.mean())
    return {"capacity": capacity, "dp": args.dp, "num_microbatches": args.num_microbatches,
            "steps": args.steps, "padding_share": float(np.mean(padding)),
            "docs_per_microbatch": float(np.mean(docs)),
            "attn_cost_max_over_mean": float(np.mean(ratios))}


if __name__ == "__main__":
    raise SystemExit(main())
