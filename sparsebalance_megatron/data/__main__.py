"""Build (or open) a corpus and print its statistics: ``python -m sparsebalance_megatron.data``.

Run it once before ``torchrun`` to build the cache outside the training processes; the numbers
(documents, tokens, length percentiles) are the ones the README quotes. Writes JSON with --json.
Must not depend on torch, torch.distributed or megatron (except for an indexed --data-path).
"""

from __future__ import annotations

import argparse
import json
import time

from .corpus import DEFAULT_SOURCES, load_corpus
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
    p.add_argument("--json", default=None, help="write the statistics here")
    args = p.parse_args(argv)

    rows = []
    for tok in args.tokenizer:
        t0 = time.perf_counter()
        c = load_corpus(args.data_path, tokenizer=tok, cache_dir=args.cache_dir,
                        compact_vocab=args.compact_vocab, sources=args.sources,
                        min_doc_tokens=args.min_doc_tokens)
        rows.append({**c.stats(), "tokenizer": tok, "compact_vocab": args.compact_vocab,
                     "load_s": round(time.perf_counter() - t0, 2), "notes": c.notes})
    cols = ["name", "n_docs", "total_tokens", "p50", "p90", "p99", "max", "vocab_size", "load_s"]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
        for note in r["notes"]:
            print(f"  note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
