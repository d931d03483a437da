"""Trained quality on CPU (issue 62): dense, static sparse at d0, --sparse-balance and DST with
the density objective, each trained from scratch in Megatron's pretrain() on the same data in the
same order with the same seeds, then evaluated on held-out documents: LM loss and a long-range
retrieval task's accuracy by depth, with paired differences over seeds.

What runs (every choice is a flag; the defaults are what the committed result used):

- **Model**: a 2-layer GPT from scratch (hidden 64, 4 query heads in 2 GQA groups, head dim 16,
  SwiGLU 192, RMSNorm, RoPE, untied head, ``--init-method-std 0.08``), bytes as tokens
  (``--sb-tokenizer byte``), 512-token micro-batches, 700 steps of 8 micro-batches (about 4K
  tokens a step), lr 3e-3 cosine to 3e-4. Why so small: 12 runs (4 arms x 3 seeds) must train in
  under an hour on 2 shared cores, about 0.27 s a step here; two layers are enough to learn the
  retrieval. With Megatron's default init (0.02) the dense model was still at chance (0.055,
  chance 1/16) after 700 steps; at 0.08 it retrieved 0.995 of the held-out keys (dense eval).
- **Task** (``make_document``): every training and held-out document is a section of the
  built-in corpus (CPython stdlib top-level definitions, Shakespeare scenes; any byte that is not
  printable ASCII, tab or newline replaced by '?', so one character is one token), cut to a
  length drawn log-uniformly from ``[--min-doc, --seq-length - 1]`` = [16, 511] tokens (varied
  lengths: what the DP imbalance comes from; the short ones also teach the lookup at short range
  first), with a needle, the marker byte 0x01 and a pass key (one of 16 control bytes 0x10-0x1f,
  none of which occurs in the corpus), inserted on its own line at a random depth, and at the
  very end the query marker 0x02 followed by the key. The model learns it as language modelling
  (the key is in the loss like any token; nothing else marks the task): a content lookup from
  the document's end back to the needle, which sparse attention must select to answer. Chance is
  1/16. (A pass key of 5 digits after a ``#KEY:`` marker, which needs an induction circuit, was
  not learned by this model in 800 steps, even dense.) Held-out documents come from sections no
  training document uses, with the needle at the fixed depths ``--depths`` (0 = the document's
  start, 1 = just before the query), 40 per depth, lengths drawn log-uniformly from
  [``--heldout-min-doc``, 511] = [256, 511] tokens (8 to 16 blocks of 32), where sparse attention
  has blocks to drop.
- **Arms** (``ARMS``): ``dense`` (the plugin's data path, Megatron's dense attention, sequential
  packing); ``static`` (``--sb-sparse-attention`` at d0, sequential packing); ``sparse_balance``
  (``--sparse-balance``: SAB + DST with its default quality objective); ``dst_density``
  (``--sparse-balance --sb-dst-objective density``: the same SAB + DST, only the objective
  differs). Every sparse arm: block ``--block-size``, the torch blockwise kernel (CPU), no routing
  of short documents to dense attention (``--sb-dense-below-tokens 0``, so a document's density is
  the plan's whatever its length, in training and in the evaluation alike).
- **Same data, order and seeds**: one data file for every run; seed s sets ``--seed`` (weights)
  and ``--sb-seed`` (the sampler: every arm's step k trains on the same documents; packing into
  micro-batches differs where SAB packs).
- **Parallelism**: DP 2 (torchrun, 2 processes, gloo, one thread each), PP 1, global batch
  ``--global-batch-size`` micro-batches of ``--seq-length`` tokens (4 per rank by default).
- **Timings are modelled**: on 2 shared CPU cores a measured micro-batch time is noise, so DST
  and SAB plan with ``--sb-timing-source model`` (the latency model's own prediction calibrates
  it, so the plans are a function of the data and the table alone). The table is profiled once
  per study on this CPU (``sparsebalance-profile --quick``, one thread; its coefficients are in
  the JSON) and given to every sparse arm, so all arms and seeds plan with the same one; on the
  CPU attention is a large share of a micro-batch, so DST has imbalance to cut and bubbles to
  raise (an analytic H100 table of this tiny model, ``--table analytic``, sees the step as
  launch-bound: DST then only raised, never cut, in a 40-step try; ``--quick`` uses it).
- **Evaluation**: each run saves its checkpoint at its end (``--save``, torch_dist); the study
  loads it on CPU into a megatron-core GPTModel with the plugin's sparse attention
  (``hf_convert.load_checkpoint``, every weight checked loaded) and runs every held-out document
  alone at density 1 (dense) and at d0 (the sparse arms' static density; DST's plans vary around
  it): held-out LM loss (mean per token over the whole document) and the key's greedy
  retrieval (the argmax after the query marker is the key, teacher-forced), by depth. The arm's own density is d0 for
  the sparse arms and 1 for dense (``primary`` in the JSON); the other is reported beside it.
- **Densities reported**: per run, the mean over steps of the layer-weighted kept density of the
  plan's documents (``doc_kept_density``: kept key blocks over causal key blocks by the
  selection's rule, forced sink and diagonal blocks included), of their planned density
  (``doc_planned_density``) and of what they keep at d0 (``doc_kept_d0_density``), from the
  recorded plans with the padding pieces left out (the metrics' ``kept_density`` and
  ``mean_density``, kept beside them, count padding like documents, and the packings differ in
  it); how often DST cut or raised (steps with any unit cut / raised, units in all, and units
  whose move kept no other block of a document: ``dst_moves``). Arms count as matched when
  their documents' kept density is within ``--match-tolerance`` of static's
  (``density_match``). ``--densities-only`` prints these of the runs already in ``--out``;
  with ``--replan`` also those of the DST runs' recorded steps planned again by the planner as
  it is now (``replanned``).
- **Paired differences** (``PAIRS``): per seed, arm a minus arm b of every metric; over seeds the
  mean and a 95% t interval (seeds are the replicates; with 2 seeds it is wide, with 1 absent).

    .venv/bin/python scripts/bench.py trained_quality --json /tmp/tq_cpu.json   # the results of
        # record: docs/history/results/trained_quality_cpu*.json at a6ec5bf
    .venv/bin/python scripts/bench.py trained_quality --quick --json /tmp/tq.json   # a smoke run
    .venv/bin/python scripts/bench.py trained_quality --out runs/trained_quality --densities-only \
        --replan
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from ._tq_eval import checkpoint_arch, load_model, score_densities, score_docs  # noqa: F401
from ._tq_runs import document_densities, read_metrics, replanned, train_summary  # noqa: F401
from ._tq_summary import (PAIRS, density_match, density_rows, interval, kept_of,  # noqa: F401
                          metrics_of, paired, print_densities, print_table)
from .common import parser, torchrun, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = {"dense": [],
        "static": ["--sb-sparse-attention"],
        "sparse_balance": ["--sparse-balance"],
        "dst_density": ["--sparse-balance", "--sb-dst-objective", "density"]}
# the pass key: one symbol of each alphabet (control bytes the corpus never holds; one alphabet of
# 16: chance 1/16), after the needle's marker at its depth and the query's at the document's end
ALPHABETS = ("".join(map(chr, range(0x10, 0x20))),)
NEEDLE, QUERY = "\x01", "\x02"
KEY_LEN = len(ALPHABETS)


# ---- data ----------------------------------------------------------------------------------------

def corpus_sections(min_chars: int) -> list:
    """The built-in corpus's sections (stdlib definitions, play scenes): printable ASCII, tabs and
    newlines only (anything else becomes '?'), so the pass key's control bytes occur nowhere else
    and one character is one byte token."""
    from sparsebalance_megatron.data import sources

    files, missing = sources.list_source_files(("stdlib", "shakespeare"),
                                               sources.default_cache_dir())
    if missing:
        raise SystemExit(f"error: built-in corpus incomplete: {'; '.join(missing)} "
                         f"(python -m sparsebalance_megatron.data fetch)")
    out = []
    for name, path in files:
        for text in sources.split_sections(name, sources.read_text(path)):
            text = "".join(c if 32 <= ord(c) < 127 or c in "\n\t" else "?" for c in text)
            if len(text) >= min_chars:
                out.append(text)
    return out


def make_document(rng: random.Random, text: str, length: int, depth: float) -> dict:
    """``text`` cut so that haystack + needle + query + answer is ``length`` characters, the
    needle at ``depth`` of the haystack (moved to the nearest line start within 32 characters).
    The pass key is one symbol of each of ``ALPHABETS`` (control bytes the corpus never holds)."""
    key = "".join(rng.choice(a) for a in ALPHABETS)
    needle, query = f"{NEEDLE}{key}\n", "\n" + QUERY
    n_hay = length - len(needle) - len(query) - len(key)
    hay = text[:n_hay]
    at = int(round(depth * len(hay)))
    lines = [i + 1 for i in range(max(0, at - 32), min(len(hay), at + 32)) if hay[i] == "\n"]
    if lines:
        at = min(lines, key=lambda i: abs(i - at))
    doc = hay[:at] + needle + hay[at:] + query + key
    return {"text": doc, "needle_at": at, "depth": at / max(1, len(hay)),
            "answer_at": len(doc) - len(key), "answer": key}


def build_data(args, out: str) -> tuple:
    """``out/train.jsonl`` (documents for pretrain()) and ``out/heldout.json`` (documents with
    their needle and answer positions); sections split so held-out text is never trained on."""
    train_path, held_path = os.path.join(out, "train.jsonl"), os.path.join(out, "heldout.json")
    rng = random.Random(args.data_seed)
    secs = corpus_sections(args.min_doc)
    rng.shuffle(secs)
    n_held = max(len(args.depths) * args.heldout_per_depth, len(secs) // 10)
    held_secs, train_secs = secs[:n_held], secs[n_held:]
    lo, hi = math.log(args.min_doc), math.log(args.seq_length - 1)
    with open(train_path, "w") as f:
        for i in range(args.train_docs):
            length = int(math.exp(rng.uniform(lo, hi)))
            text = next(t for t in (rng.choice(train_secs) for _ in range(1000))
                        if len(t) >= length)
            f.write(json.dumps({"text": make_document(rng, text, length, rng.random())["text"]})
                    + "\n")
    held, lo = [], math.log(args.heldout_min_doc)
    long_secs = [t for t in held_secs if len(t) >= args.heldout_min_doc]
    for depth in args.depths:
        for _ in range(args.heldout_per_depth):
            length = int(math.exp(rng.uniform(lo, hi)))
            text = next(t for t in (rng.choice(long_secs) for _ in range(1000))
                        if len(t) >= length)
            held.append({**make_document(rng, text, length, depth), "target_depth": depth})
    with open(held_path, "w") as f:
        json.dump(held, f)
    return train_path, held


def latency_table(args, out: str) -> str:
    """One table for every sparse run: analytic (default) or profiled on this CPU; an ``--out``
    that already holds one keeps it, as it keeps its finished runs (re-running some arms then
    plans them from the table the others were planned with)."""
    path = os.path.join(out, "latency.json")
    if os.path.exists(path):
        print(f"latency table: {path} (kept from an earlier run in this --out)", flush=True)
        return path
    cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--out", path,
           "--no-progress", *model_flags(args, profile=True),
           "--sb-block-size", str(args.block_size), "--sb-density", str(args.density)]
    cmd += ["--analytic"] if args.table == "analytic" else ["--quick", "--threads", "1"]
    run(cmd, os.path.join(out, "latency.log"))
    return path


def table_coefficients(path) -> dict | None:
    """The table's fitted coefficients (what the modelled timings were), for the record."""
    if path is None:
        return None
    with open(path) as f:
        t = json.load(f)
    return {k: t[k] for k in ("device", "coefficients", "call_coefficients") if k in t}


# ---- training ------------------------------------------------------------------------------------

def model_flags(args, profile: bool = False) -> list:
    shape = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size,
             "--ffn-hidden-size", 3 * args.hidden_size, "--num-attention-heads", args.heads,
             "--num-query-groups", args.heads // 2, "--seq-length", args.seq_length]
    if profile:
        return [str(x) for x in shape + ["--vocab-size", "512"]]
    return [str(x) for x in shape + [
        "--group-query-attention", "--max-position-embeddings", args.seq_length,
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0", "--hidden-dropout", "0"]]


def train_cmd(args, arm: str, seed: int, data: str, table: str, run_dir: str, *,
              arm_flags=None, density=None, extra=()) -> list:
    """The torchrun command of one run; ``arm_flags`` (default ``ARMS[arm]``), ``density``
    (default d0) and ``extra`` flags for ``continued_quality``'s arms."""
    flags = [*model_flags(args), "--micro-batch-size", "1",
             "--global-batch-size", args.global_batch_size, "--lr", args.lr,
             "--min-lr", args.lr / 10, "--lr-decay-style", "cosine",
             "--lr-warmup-iters", max(1, args.steps // 10), "--clip-grad", "1.0",
             "--weight-decay", "0.01", "--init-method-std", args.init_std,
             "--train-iters", args.steps,
             "--log-interval", max(1, args.steps // 10), "--eval-iters", "0", "--split", "100,0,0",
             "--seed", seed, "--sb-seed", seed, "--data-path", data, "--sb-tokenizer", "byte",
             "--save", os.path.join(run_dir, "ckpt"), "--save-interval", args.steps,
             "--ckpt-format", "torch_dist",
             "--sb-metrics-file", os.path.join(run_dir, "metrics.jsonl"),
             *(ARMS[arm] if arm_flags is None else arm_flags), *extra]
    if arm != "dense":
        flags += ["--sb-density", args.density if density is None else density,
                  "--sb-block-size", args.block_size,
                  "--sb-attention-backend", "torch", "--sb-dense-below-tokens", "0",
                  "--sb-timing-source", "model", "--sb-latency-table", table,
                  "--sb-latency-table-force"]
    return [*torchrun(2), "examples/pretrain_gpt_sparsebalance.py", *map(str, flags)]


def run(cmd: list, log_path: str) -> float:
    env = dict(ENV, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"error: {' '.join(cmd[:6])} ... failed ({proc.returncode}), "
                         f"log {log_path}:\n{tail}")
    return time.perf_counter() - t0


# ---- evaluation ----------------------------------------------------------------------------------

def evaluate(args, ckpt: str, held: list, densities) -> dict:
    """Held-out LM loss, answer accuracy by depth and kept density, per density."""
    from sparsebalance_megatron.config import SparseBalanceConfig

    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, attention_backend="torch",
                             dense_below_tokens="0")
    model = load_model(args, ckpt, sb)
    budget = model.decoder.layers[0].self_attention.core_attention.budget
    docs = [{"ids": list(d["text"].encode("ascii")), "answer_at": d["answer_at"],
             "answer_len": KEY_LEN, "depth": d["target_depth"]} for d in held]
    return score_densities(model, budget, sb, docs, densities, args.depths)


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = parser(__doc__, "trained_quality")
    ap.add_argument("--out", default=None, help="keep runs, data and checkpoints here "
                    "(default: a temporary directory, removed at the end); a run whose "
                    "checkpoint and metrics are there is not trained again")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=700, help="training steps per run")
    ap.add_argument("--density", type=float, default=0.25, help="d0")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4, help="query heads (KV groups: half)")
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--init-std", type=float, default=0.08,
                    help="--init-method-std (Megatron's 0.02 left attention near uniform and "
                         "the retrieval unlearned in 700 steps)")
    ap.add_argument("--train-docs", type=int, default=30000)
    ap.add_argument("--min-doc", type=int, default=16, help="shortest training document")
    ap.add_argument("--heldout-min-doc", type=int, default=256, help="shortest held-out one")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--heldout-per-depth", type=int, default=40)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--table", choices=("analytic", "profile"), default="profile",
                    help="the latency table DST and SAB plan with: profiled once on this CPU "
                         "(default) or analytic (H100 FLOPs; --quick); timings modelled either way")
    ap.add_argument("--match-tolerance", type=float, default=0.01,
                    help="|kept density - static's| that counts as matched")
    ap.add_argument("--densities-only", action="store_true",
                    help="only the documents' planned and kept densities and DST's moves of the "
                         "runs already in --out (their metrics files; nothing trained or "
                         "evaluated)")
    ap.add_argument("--replan", action="store_true",
                    help="with --densities-only: also re-plan the DST runs' recorded steps "
                         "with the planner as it is now (``replanned``)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 layers, 256 tokens, 3 steps, 1 seed, 2 documents per "
                         "depth (what the test runs; its numbers mean nothing)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.num_layers, args.hidden_size = [1], 3, 2, 64
        args.seq_length, args.train_docs, args.min_doc = 256, 200, 64
        args.heldout_min_doc, args.heldout_per_depth, args.block_size = 128, 2, 32
        args.depths, args.table = [0.2, 0.8], "analytic"
    if args.hidden_size % args.heads or args.heads % 2:
        ap.error("--heads must be even and divide --hidden-size")
    return args


ENV = dict(os.environ)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.densities_only:
        if args.out is None:
            raise SystemExit("error: --densities-only reads the runs in --out: give --out DIR")
        runs = {arm: {str(seed): {"train": train_summary(
            read_metrics(os.path.join(args.out, f"{arm}_s{seed}")), args.block_size,
            args.density)} for seed in args.seeds} for arm in args.arms}
        if args.replan:
            objective = {"sparse_balance": "quality", "dst_density": "density"}
            table = os.path.join(args.out, "latency.json")
            runs.update({f"{arm} re-planned": {str(seed): {"train": replanned(
                os.path.join(args.out, f"{arm}_s{seed}"), table, args, objective[arm])}
                for seed in args.seeds} for arm in args.arms if arm in objective})
        rows = density_rows(runs, args.seeds)
        write_result(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                                 "densities": rows})
        print_densities(rows)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="trained_quality_")
    os.makedirs(out, exist_ok=True)
    try:
        doc = study(args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_result(args.json, doc)
    print_table(doc)
    print(f"study wall time {doc['wall_s']} s")
    return 0


def study(args, out: str) -> dict:
    data, held = build_data(args, out)
    table = latency_table(args, out) if set(args.arms) - {"dense"} else None
    runs_wall = {}
    for arm in args.arms:               # every run first: the evaluation initialises a process
        for seed in args.seeds:         # group in this process, which torchrun must not inherit
            run_dir = os.path.join(out, f"{arm}_s{seed}")
            if not os.path.exists(os.path.join(run_dir, "ckpt",
                                               "latest_checkpointed_iteration.txt")):
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
                runs_wall[f"{arm}_s{seed}"] = round(run(
                    train_cmd(args, arm, seed, data, table, run_dir),
                    os.path.join(run_dir, "train.log")), 1)
                print(f"trained {arm} seed {seed} in {runs_wall[f'{arm}_s{seed}']} s", flush=True)
            else:
                print(f"kept {arm} seed {seed}: its checkpoint is in {run_dir}", flush=True)
    import torch

    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    torch.set_num_threads(1)
    init_single_process()
    runs, t_eval = {}, time.perf_counter()
    for arm in args.arms:
        runs[arm] = {}
        for seed in args.seeds:
            run_dir = os.path.join(out, f"{arm}_s{seed}")
            rows = read_metrics(run_dir)
            ev = evaluate(args, os.path.join(run_dir, "ckpt"), held, [1.0, args.density])
            runs[arm][seed] = {"train": train_summary(rows, args.block_size, args.density),
                               "eval": ev,
                               "primary": "1" if arm == "dense" else f"{args.density:g}"}
            print(f"evaluated {arm} seed {seed}: " + ", ".join(
                f"d {d}: loss {e['heldout_loss']:.4f} acc {e['accuracy']:.3f}"
                for d, e in ev.items()), flush=True)
    tokens = {arm: [runs[arm][s]["train"]["tokens"] for s in args.seeds] for arm in runs}
    same_data = all(t == next(iter(tokens.values())) for t in tokens.values())
    return {"config": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
            "arms": {a: ARMS[a] for a in args.arms},
            "timing_source": "model", "latency_table": args.table,
            "latency_table_coefficients": table_coefficients(table),
            "heldout": {"documents": len(held), "depths": args.depths,
                        "mean_length": sum(len(d["text"]) for d in held) / len(held)},
            "same_tokens_every_step": same_data,
            "runs": {a: {str(s): r for s, r in per.items()} for a, per in runs.items()},
            "paired": paired(runs, args.seeds),
            "densities": density_rows({a: {str(s): r for s, r in per.items()}
                                       for a, per in runs.items()}, args.seeds),
            "density_match": density_match(runs, args.seeds, args.match_tolerance),
            "train_wall_s": runs_wall, "eval_wall_s": round(time.perf_counter() - t_eval, 1)}
