"""Dense attention with SAB packing in Megatron's pretrain() on CPU: measured step times against
Megatron's sequential fill and token-balanced packing, paired step by step over several seeds.

Runs the README's job (``examples/run_cpu_demo.sh``: the tiny GPT, ``torchrun``, PP=2 x DP=2,
gloo, one thread per process) with dense attention and no sparse call, once per (seed, packing):

- ``sequential``: ``--sb-packing sequential`` (Megatron's fill of the plugin's data path);
- ``token_balanced``: ``--sb-packing token_balanced`` (balance token counts);
- ``sab``: ``--sb-batching`` alone, as shipped: SAB packs by the dense kernel's predicted time and
  stands down to sequential packing in a step where it is predicted no faster
  (``--sb-stand-down``, default).

Every run of a seed trains on the same documents in the same steps (the plugin's sampler cuts the
global batches before any packing; ``--sb-seed`` and ``--seed`` are the seed), so step k of one
packing is paired with step k of another: the paired ratio sequential / sab of one step is the
speedup of that step. The first ``UNTIMED_STEPS`` steps are not timed. The runs of a seed go in a
rotated order (seed i starts with packing i mod 3), so a load that drifts during the study does
not always favour the same packing.

The data: the built-in corpus with the byte tokenizer (``--sb-tokenizer byte``), so the tiny
model's LM head costs about what a large model's does beside its layers (the Qwen BPE's
vocabulary over hidden 128 makes the head most of the step, and attention, what SAB balances,
would hardly show), cut into sections by default (``--doc-unit``): 71% of its tokens are in
documents of 4,096 bytes or more, among many short ones. Whole files (``--doc-unit file``, 98% of
the tokens in documents of 4,096 bytes or more) are cut by a 4,096-position micro-batch into
full-length pieces of equal attention work, so there is nothing to balance: SAB's own prediction
stands it down in most steps there.

CPU attention costs are not GPU costs: the figure shows the mechanism works end to end in
Megatron's loop (the plugin's packing, its stand-down, its timers), not what a GPU would gain.
The four processes need four free cores: on fewer they time-share, a step's wall time follows the
total work (the same for every packing of the same documents) rather than the slowest rank, and
the balance SAB buys hardly shows; the study says so when the machine has fewer cores
(``cores`` in the JSON), and a loaded machine's figures are noise.

    .venv/bin/python scripts/bench.py dense_sab_run --json docs/results/dense_sab_run_cpu.json
"""

from __future__ import annotations

import os
import statistics
import tempfile

from ._demo import UNTIMED_STEPS, add_steps_arg, check_steps, run_demo
from .common import parser, write_result

PROCESSES = 4          # the README job: PP=2 x DP=2
PACKINGS = {"sequential": ["--sb-packing", "sequential"],
            "token_balanced": ["--sb-packing", "token_balanced"],
            "sab": ["--sb-batching"]}


def run(packing: str, seed: int, args, out: str) -> dict:
    """One pretrain() run; its per-step metrics reduced to what the table needs."""
    extra = ["--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
             "--sb-doc-unit", args.doc_unit, "--sb-tokenizer", "byte", "--eval-iters", "0",
             "--seed", str(seed), "--sb-seed", str(seed)]
    rows, times, _ = run_demo(extra, out, f"{packing} seed {seed}", args.steps,
                              SB_FLAGS=" ".join(PACKINGS[packing]))
    return {"packing": packing, "seed": seed, "step_times_s": times,
            "step_time_s_median": statistics.median(times),
            "tokens": [r["tokens"] for r in rows[UNTIMED_STEPS:]],
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
    """Per seed and over every paired step: the median ratios of sequential and token-balanced
    step times to SAB's, and each seed's sign (SAB faster in that seed's median or not)."""
    out, all_seq, all_tb = {"seeds": {}}, [], []
    for seed, runs in per_seed.items():
        seq, tb = paired(runs, "sequential", "sab"), paired(runs, "token_balanced", "sab")
        all_seq += seq
        all_tb += tb
        med = statistics.median(seq)
        out["seeds"][seed] = {
            "sequential_over_sab_paired": seq, "token_balanced_over_sab_paired": tb,
            "sequential_over_sab_median": med,
            "token_balanced_over_sab_median": statistics.median(tb),
            "sab_faster_than_sequential": med > 1.0,
            "steps_sab_faster": sum(x > 1.0 for x in seq), "steps": len(seq),
            "sab_stood_down_steps": runs["sab"]["sab_stood_down_steps"]}
    out["sequential_over_sab_median"] = statistics.median(all_seq)
    out["token_balanced_over_sab_median"] = statistics.median(all_tb)
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
    add_steps_arg(ap, 8)
    args = ap.parse_args(argv)
    check_steps(ap, args.steps)
    if args.global_batch_size < 4 or args.global_batch_size % 2:
        ap.error(f"--global-batch-size {args.global_batch_size}: expected an even number >= 4 "
                 f"(2 DP ranks, at least 2 micro-batches each for PP=2)")
    cores = os.cpu_count() or 1
    if cores < PROCESSES:
        print(f"warning: {cores} CPU cores for {PROCESSES} training processes: the ranks "
              f"time-share the cores, so the balance between them hardly changes a step's wall "
              f"time; run on >= {PROCESSES} free cores for a figure of SAB's balance")
    names = list(PACKINGS)
    per_seed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            order = names[i % len(names):] + names[:i % len(names)]
            per_seed[seed] = {p: run(p, seed, args, os.path.join(tmp, f"{p}_{seed}"))
                              for p in order}
    s = summarize(per_seed)
    print(f"dense attention, PP=2 x DP=2 (gloo, 1 thread/process), seq {args.seq_length}, "
          f"global batch {args.global_batch_size}, {args.doc_unit}s, byte tokenizer, {args.steps} "
          f"steps ({UNTIMED_STEPS} untimed); CPU attention costs are not GPU costs")
    print("| seed | sequential s | token-balanced s | SAB s | seq / SAB (paired median) | "
          "token-bal. / SAB | steps SAB faster | SAB stood down | sign |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for seed, r in s["seeds"].items():
        runs = per_seed[seed]
        print(f"| {seed} | {runs['sequential']['step_time_s_median']:.2f} | "
              f"{runs['token_balanced']['step_time_s_median']:.2f} | "
              f"{runs['sab']['step_time_s_median']:.2f} | "
              f"{r['sequential_over_sab_median']:.3f} | "
              f"{r['token_balanced_over_sab_median']:.3f} | {r['steps_sab_faster']}/{r['steps']} "
              f"| {r['sab_stood_down_steps']}/{r['steps']} | {s['seed_signs'][seed]} |")
    print(f"paired median over every step: sequential / SAB {s['sequential_over_sab_median']:.3f}"
          f", token-balanced / SAB {s['token_balanced_over_sab_median']:.3f}; seed signs "
          f"{' '.join(f'{k}:{v}' for k, v in s['seed_signs'].items())}")
    write_result(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                             "cores": cores, "processes": PROCESSES,
                             "runs": {str(k): v for k, v in per_seed.items()},
                             "summary": {**s, "seeds": {str(k): v for k, v in s["seeds"].items()},
                                         "seed_signs": {str(k): v for k, v in
                                                        s["seed_signs"].items()}}})
    return 0
