"""Dense attention with SAB packing in Megatron's pretrain() on CPU: measured step times against
Megatron's sequential fill and token-balanced packing, paired step by step over several seeds
(the README's job; BENCHMARKS.md, "Against dense attention")."""

from __future__ import annotations

import os
import statistics
import tempfile

from .common import UNTIMED_STEPS, add_steps_arg, check_steps, parser, run_demo, write_result

DP = 2                 # the README job: PP=2 x DP=2 (``--pp 1``: DP=2 alone)
PACKINGS = {"sequential": ["--sb-packing", "sequential"],
            "sequential_var": ["--sb-packing", "sequential", "--sb-microbatch-multiple", "128"],
            "token_balanced": ["--sb-packing", "token_balanced"],
            "sab": ["--sb-batching"],
            "sab_fixed": ["--sb-batching", "--sb-microbatch-multiple", "0"]}
# (a, b) step-time ratios the summary pairs, step by step: > 1 where b is faster
RATIOS = (("sequential", "sab"), ("sequential_var", "sab"), ("token_balanced", "sab"),
          ("sequential", "sab_fixed"))


def run(packing: str, seed: int, args, out: str) -> dict:
    """One pretrain() run; its per-step metrics reduced to what the table needs."""
    extra = ["--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
             "--sb-doc-unit", args.doc_unit, "--sb-tokenizer", "byte", "--eval-iters", "0",
             "--seed", str(seed), "--sb-seed", str(seed)]
    rows, times, _ = run_demo(extra, out, f"{packing} seed {seed}", args.steps,
                              SB_FLAGS=" ".join(PACKINGS[packing]), NPROC=DP * args.pp,
                              PP=args.pp)
    return {"packing": packing, "seed": seed, "step_times_s": times,
            "step_time_s_median": statistics.median(times),
            "tokens": [r["tokens"] for r in rows[UNTIMED_STEPS:]],
            "positions": [r.get("positions") for r in rows[UNTIMED_STEPS:]],
            "measured_imbalance": [r.get("measured_imbalance") for r in rows[UNTIMED_STEPS:]],
            "packed_as": [r.get("packing") for r in rows[UNTIMED_STEPS:]],
            "sab_stood_down_steps": sum(int(r.get("sab_stood_down", 0))
                                        for r in rows[UNTIMED_STEPS:]),
            "last_loss": rows[-1]["loss"]}


def paired(runs: dict, a: str, b: str) -> list:
    """Per timed step: a's step time / b's (> 1: b faster), same documents."""
    ta, tb = runs[a]["step_times_s"], runs[b]["step_times_s"]
    if [len(ta), runs[a]["tokens"]] != [len(tb), runs[b]["tokens"]]:
        raise SystemExit(f"runs {a} and {b} did not train on the same steps' tokens "
                         f"({runs[a]['tokens']} vs {runs[b]['tokens']}): cannot pair them")
    return [x / y for x, y in zip(ta, tb)]


def summarize(per_seed: dict) -> dict:
    """Per seed and over every paired step: the median ratio of each ``RATIOS`` pair whose runs
    are there (``<a>_over_<b>_paired`` / ``_median``), and each seed's sign (SAB faster than
    sequential in that seed's median, or not; SAB at fixed length where SAB did not run)."""
    out, pooled = {"seeds": {}}, {}
    for seed, runs in per_seed.items():
        r = {}
        for a, b in RATIOS:
            if a in runs and b in runs:
                ratios = paired(runs, a, b)
                pooled.setdefault(f"{a}_over_{b}", []).extend(ratios)
                r[f"{a}_over_{b}_paired"] = ratios
                r[f"{a}_over_{b}_median"] = statistics.median(ratios)
        seq = r.get("sequential_over_sab_paired", r.get("sequential_over_sab_fixed_paired", []))
        r.update(sab_faster_than_sequential=bool(seq) and statistics.median(seq) > 1.0,
                 steps_sab_faster=sum(x > 1.0 for x in seq), steps=len(seq),
                 sab_stood_down_steps=runs.get("sab", {}).get("sab_stood_down_steps"))
        out["seeds"][seed] = r
    for key, ratios in pooled.items():
        out[f"{key}_median"] = statistics.median(ratios)
    out["seed_signs"] = {s: ("+" if r["sab_faster_than_sequential"] else "-")
                         for s, r in out["seeds"].items()}
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, "dense_sab_run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="one run of every packing per seed (--seed and --sb-seed)")
    ap.add_argument("--seq-length", type=int, default=4096, help="tokens per micro-batch")
    ap.add_argument("--doc-unit", choices=("section", "file"), default="section",
                    help="the built-in corpus's documents: sections (default) or whole files")
    ap.add_argument("--global-batch-size", type=int, default=8,
                    help="micro-batches per step over the 2 DP ranks (8: 4 per rank)")
    ap.add_argument("--pp", type=int, choices=(1, 2), default=2,
                    help="pipeline stages: 2 (the README job, PP=2 x DP=2, 4 processes) or 1 "
                         "(DP=2, 2 processes: what a 2-core machine can time without sharing)")
    add_steps_arg(ap, 8)
    args = ap.parse_args(argv)
    check_steps(ap, args.steps)
    if args.global_batch_size < 4 or args.global_batch_size % 2:
        ap.error(f"--global-batch-size {args.global_batch_size}: expected an even number >= 4 "
                 f"(2 DP ranks, at least 2 micro-batches each)")
    cores, processes = os.cpu_count() or 1, DP * args.pp
    if cores < processes:
        print(f"warning: {cores} CPU cores for {processes} training processes: the ranks "
              f"time-share the cores, so the balance between them hardly changes a step's wall "
              f"time; run on >= {processes} free cores for a figure of SAB's balance")
    names = list(PACKINGS)
    per_seed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            order = names[i % len(names):] + names[:i % len(names)]
            per_seed[seed] = {p: run(p, seed, args, os.path.join(tmp, f"{p}_{seed}"))
                              for p in order}
    s = summarize(per_seed)
    pairs = [f"{a}_over_{b}" for a, b in RATIOS if a in names and b in names]
    print(f"dense attention, PP={args.pp} x DP={DP} (gloo, 1 thread/process), seq "
          f"{args.seq_length}, global batch {args.global_batch_size}, {args.doc_unit}s, byte "
          f"tokenizer, {args.steps} steps ({UNTIMED_STEPS} untimed); CPU attention costs are not "
          f"GPU costs. Step seconds (median of the timed steps), then paired medians")
    print("| seed | " + " | ".join(f"{p} s" for p in names) + " | "
          + " | ".join(k.replace("_over_", " / ") for k in pairs)
          + " | steps SAB faster than sequential | SAB stood down | sign |")
    print("|---|" + "---:|" * (len(names) + len(pairs) + 2) + "---|")
    for seed, r in s["seeds"].items():
        runs = per_seed[seed]
        print(f"| {seed} | " + " | ".join(f"{runs[p]['step_time_s_median']:.2f}" for p in names)
              + " | " + " | ".join(f"{r[k + '_median']:.3f}" for k in pairs)
              + f" | {r['steps_sab_faster']}/{r['steps']} | {r['sab_stood_down_steps']}/"
              f"{r['steps']} | {s['seed_signs'][seed]} |")
    print("paired medians over every step: " + ", ".join(
        f"{k.replace('_over_', ' / ')} {s[k + '_median']:.3f}" for k in pairs)
          + "; seed signs (SAB vs sequential) "
          + " ".join(f"{k}:{v}" for k, v in s["seed_signs"].items()))
    write_result(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                             "cores": cores, "processes": processes,
                             "runs": {str(k): v for k, v in per_seed.items()},
                             "summary": {**s, "seeds": {str(k): v for k, v in s["seeds"].items()},
                                         "seed_signs": {str(k): v for k, v in
                                                        s["seed_signs"].items()}}})
    return 0
