"""Continued-training quality on CPU (issue 73): a dense-trained base continued under static
sparsity, --sparse-balance, SAB alone, static at DST's kept density (the matched control) and
static at 0.9 x d0 (the positive control), seeds of the continued phase paired, and a verdict
fixed in advance (``eval.verdict``). The task, arms and verdicts: QUALITY.md.

Each checkpoint is scored on the held-out documents one document at a time; ``--eval-jobs N``
splits them into N contiguous shares scored at once (the parent and N - 1 spawned processes, one
torch thread each), the rows gathered in document order, so the scores are those of one process.
On this 2-core machine ``--eval-jobs 2`` halves the evaluation (QUALITY.md)."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
import sys
import time

from . import common
from .common import add_pilot_args, check_pilot, parser, torchrun, write_result
from .continued_verdicts import DST_ARMS, print_summary, read_margin, reading_key, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ)
ARMS = {"static": ["--sb-sparse-attention"], "sparse_balance": ["--sparse-balance"],
        "sab": ["--sb-sparse-attention", "--sb-batching"],
        "matched": ["--sb-sparse-attention"], "control": ["--sb-sparse-attention"],
        "refresh": ["--sparse-balance"]}   # + its interval and micro-batches (arm_flags)
MARKERS = ("\x01", "\x03", "\x04")
# one alphabet of 8 control bytes per needle (none occurs in the corpus): the key of needle j
# is the one byte of alphabet j in the document, a content lookup one attention layer can make
# (three keys from one alphabet need an induction circuit, which the base did not learn)
ALPHABETS = ("".join(map(chr, range(0x10, 0x18))), "".join(map(chr, range(0x18, 0x20))),
             "\x05\x06\x07\x08\x0b\x0c\x0e\x0f")
QUERY = "\x02"


# ---- data, runs and a run's record

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
    if args.pipeline > 1:                       # the first, middle and last stages' kinds
        cmd += ["--pipeline-model-parallel-size", str(args.pipeline)]
    run(cmd, os.path.join(out, "latency.log"))
    return path


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


def data_parallel(args) -> int:
    """The continued runs' DP size: two ranks without a pipeline, else one rank per stage."""
    return 2 if args.pipeline == 1 else 1


def train_cmd(args, arm: str, seed: int, data: str, table: str, run_dir: str, *,
              arm_flags=(), density=None, extra=(), valid=None) -> list:
    """The torchrun command of one run of ``args``' model; ``arm_flags``, ``density`` (default
    d0) and ``extra`` flags; ``arm`` "dense" runs without the sparse flags (the base). ``valid``:
    a valid set of its own (the refresh's held-out batch), the training batches unchanged."""
    source = ["--data-path", data, "--split", "100,0,0"] if valid is None else \
        ["--train-data-path", data, "--valid-data-path", valid]
    flags = [*model_flags(args), "--micro-batch-size", "1",
             "--global-batch-size", args.global_batch_size, "--lr", args.lr,
             "--min-lr", args.lr / 10, "--lr-decay-style", "cosine",
             "--lr-warmup-iters", max(1, args.steps // 10), "--clip-grad", "1.0",
             "--weight-decay", "0.01", "--init-method-std", args.init_std,
             "--train-iters", args.steps,
             "--log-interval", max(1, args.steps // 10), "--eval-iters", "0", *source,
             "--seed", seed, "--sb-seed", seed, "--sb-tokenizer", "byte",
             "--save", os.path.join(run_dir, "ckpt"), "--save-interval", args.steps,
             "--ckpt-format", "torch_dist",
             "--sb-metrics-file", os.path.join(run_dir, "metrics.jsonl"),
             *arm_flags, *extra]
    if arm != "dense":
        flags += ["--sb-density", args.density if density is None else density,
                  "--sb-block-size", args.block_size,
                  "--sb-attention-backend", "torch", "--sb-dense-below-tokens", "0",
                  "--sb-timing-source", "model", "--sb-latency-table", table,
                  "--sb-latency-table-force"]
    if args.pipeline > 1:                       # one DP rank, each stage its own process
        flags += ["--pipeline-model-parallel-size", args.pipeline]
    return [*torchrun(data_parallel(args) * args.pipeline),
            "examples/pretrain_gpt_sparsebalance.py", *map(str, flags)]


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


def read_metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def train_summary(rows: list, block_size: int = 32, d0: float = 0.25) -> dict:
    """What the table needs of a run's per-step metrics."""
    def mean(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None
    cut = [r.get("units_cut") or 0 for r in rows]
    raised = [r.get("units_raised") or 0 for r in rows]
    losses = [r["loss"] for r in rows]
    tail = losses[-max(1, len(losses) // 10):]
    ratio = [r["predicted_dst_s"] / r["predicted_static_s"] for r in rows
             if r.get("predicted_dst_s") and r.get("predicted_static_s")]
    refreshed = [r for r in rows if "quality_refresh_s" in r]
    return {"steps": len(rows), "final_train_loss": sum(tail) / len(tail),
            "mean_kept_density": mean("kept_density") or 1.0,
            "mean_planned_density": mean("mean_density") or 1.0,
            "dst_steps_cut": sum(c > 0 for c in cut), "dst_steps_raised": sum(r > 0 for r in raised),
            "dst_units_cut": sum(cut), "dst_units_raised": sum(raised),
            "dst_stood_down": sum(int(r.get("dst_stood_down") or 0) for r in rows),
            "sab_stood_down": sum(int(r.get("sab_stood_down") or 0) for r in rows),
            # DST's predicted step over the static plan's, the mean over the steps it planned
            "predicted_step_vs_static": sum(ratio) / len(ratio) if ratio else None,
            **({} if not refreshed else {          # --sb-quality-refresh-interval's refreshes
                "quality_refreshes": [r["step"] for r in refreshed],
                "quality_refresh_s": sum(r["quality_refresh_s"] for r in refreshed),
                "quality_scales": [r.get("quality_scales") for r in refreshed]}),
            **document_densities(rows, block_size, d0)}


def document_densities(rows: list, block_size: int, d0: float) -> dict:
    """Planned and kept density of the documents alone, from the recorded plans (the metrics'
    densities weigh the padding pieces like documents, and padding depends on the packing): per
    step, weighted by causal block pairs, ``planned``, ``kept`` and ``kept_d0``; per DST move,
    whether it kept any other block of a document than d0 does."""
    import numpy as np

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.features import UnitFeatures

    sb = SparseBalanceConfig()
    per = {"planned": [], "kept": [], "kept_d0": []}
    stages = []                                                          # per step, per stage
    moves = {"raised": 0, "raised_keeping_no_block": 0, "cut": 0, "cut_keeping_no_block": 0}
    for r in rows:
        if r.get("densities") is None or r.get("plan") is None:
            return {}
        d = np.asarray(r["densities"], dtype=np.float64)                 # [dp, m, stages]
        layers = np.asarray(r.get("attention_layers_per_stage") or [1] * d.shape[2], float)
        lens = [np.diff(np.asarray(mb, dtype=np.int64).reshape(-1, 3)[:, 1:], axis=1)[:, 0]
                for rank in r["plan"]["micro_batches"] for mb in rank]
        f = UnitFeatures.build(lens, block_size, sb.sink_blocks, sb.local_blocks)
        w, k0 = f.attention_work(1.0), f.attention_work(d0)              # [dp * m]
        num = {"planned": 0.0, "kept": 0.0, "kept_d0": 0.0}
        for s in range(d.shape[2]):
            ds = d[:, :, s].reshape(-1)
            k = f.attention_work(ds)
            num["planned"] += layers[s] * float((ds * w).sum())
            num["kept"] += layers[s] * float(k.sum())
            num["kept_d0"] += layers[s] * float(k0.sum())
            for name, moved in (("raised", ds > d0 + 1e-12), ("cut", ds < d0 - 1e-12)):
                moves[name] += int(moved.sum())
                moves[f"{name}_keeping_no_block"] += int((moved & (k == k0)).sum())
        den = float(layers.sum() * w.sum())
        for key in per:
            per[key].append(num[key] / den)
        stages.append([float((d[:, :, s].reshape(-1) * w).sum() / w.sum())
                       for s in range(d.shape[2])])
    return {**{f"doc_{key}_density": sum(v) / len(v) for key, v in per.items()},
            "doc_planned_per_stage": np.mean(stages, axis=0).tolist(), "dst_moves": moves}


def checkpoint_arch(args, ckpt: str):
    """The architecture the training flags built, its vocabulary read from the checkpoint."""
    from megatron.core import dist_checkpointing

    from sparsebalance_megatron.megatron.model import hf_convert

    meta = dist_checkpointing.load_tensors_metadata(hf_convert.checkpoint_subdir(ckpt))
    vocab = meta["embedding.word_embeddings.weight"].global_shape[0]
    return hf_convert.HFArchitecture(
        model_type="llama", num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=3 * args.hidden_size, num_attention_heads=args.heads,
        num_query_groups=args.heads // 2, kv_channels=args.hidden_size // args.heads,
        vocab_size=vocab, rotary_base=10000.0, layernorm_epsilon=1e-5, tie_embeddings=False,
        add_qkv_bias=False, max_position_embeddings=args.seq_length)


def load_model(args, ckpt: str, sb):
    from sparsebalance_megatron.megatron.model import hf_convert

    model, _ = hf_convert.load_checkpoint(ckpt, "sparse", sb, expected=checkpoint_arch(args, ckpt))
    return model.requires_grad_(False)


def score_docs(model, budget, docs: list) -> list:
    """Per document (``ids`` and its ``answer_positions``), run alone: the summed next-token
    loss and its token count, the answer's mean NLL, ``exact`` (every answer token the argmax)
    and the share that is, and the kept density the sparse attention reported (grad mode on:
    the budget then records what it kept)."""
    import torch
    import torch.nn.functional as F

    dev = next(model.parameters()).device
    rows = []
    budget.pop_stats()
    for doc in docs:
        ids = torch.tensor([doc["ids"]], device=dev)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        with torch.enable_grad():
            logits = model(ids, pos, attention_mask=None)[0].float()     # [s, V]
        stats = budget.pop_stats()
        at = torch.tensor(doc["answer_positions"], device=dev)
        right = (logits[at - 1].argmax(-1) == ids[0, at]).tolist()
        rows.append({"nll": float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")),
                     "tokens": ids.shape[1] - 1, "exact": float(all(right)),
                     "answer_nll": float(F.cross_entropy(logits[at - 1], ids[0, at])),
                     "token_accuracy": sum(right) / len(right),
                     "kept": sum(st[3][0] for st in stats) / max(1, len(stats))})
    return rows


def make_document(rng: random.Random, text: str, length: int, needles: int) -> dict:
    """``text`` cut so that the document is ``length`` characters: ``needles`` needles (marker,
    key, newline) at random line starts, then the query marker and each marker with its key."""
    keys = [rng.choice(ALPHABETS[j]) for j in range(needles)]
    query = "\n" + QUERY + "".join(m + k for m, k in zip(MARKERS, keys))
    hay = list(text[:max(0, length - len(query) - 3 * needles)])
    starts = [i + 1 for i, c in enumerate(hay) if c == "\n"] or [0]
    at = sorted(rng.sample(starts, needles) if len(starts) >= needles else
                [rng.randint(0, len(hay)) for _ in range(needles)])   # a short document
    for j in reversed(range(needles)):        # back to front: earlier positions stay valid
        hay[at[j]:at[j]] = list(MARKERS[j] + keys[j] + "\n")
    doc = "".join(hay) + query
    ans = [len(doc) - 2 * needles + 2 * j + 1 for j in range(needles)]
    assert all(doc[p] == k for p, k in zip(ans, keys))
    return {"text": doc, "answer_positions": ans, "depth": at[0] / max(1, len(hay))}


def build_data(args, out: str) -> tuple:
    """``out/base.jsonl`` (the base's documents, from ``--base-min-doc``: short ones teach the
    lookup at short range first), ``out/train.jsonl`` (the continued phase's, from
    ``--min-doc``), the held-out documents (sections split: none shared) and ``out/valid.jsonl``
    (the refresh arm's held-out batch: held-out sections, drawn after the held-out documents,
    which it leaves as they were; the training runs never read it)."""
    rng = random.Random(args.data_seed)
    secs = corpus_sections(args.min_doc)
    rng.shuffle(secs)
    held_secs, train_secs = secs[:len(secs) // 5], secs[len(secs) // 5:]
    hi = math.log(args.seq_length - 1)

    def docs(pool, n, shortest=args.min_doc):
        lo = math.log(shortest)
        for _ in range(n):
            length = int(math.exp(rng.uniform(lo, hi)))
            text = next(t for t in (rng.choice(pool) for _ in range(1000)) if len(t) >= length)
            yield make_document(rng, text, length, args.needles)
    paths = [os.path.join(out, name) for name in ("base.jsonl", "train.jsonl")]
    for path, shortest in zip(paths, (args.base_min_doc, args.min_doc)):
        with open(path, "w") as f:
            for d in docs(train_secs, args.train_docs, shortest):
                f.write(json.dumps({"text": d["text"]}) + "\n")
    held = list(docs(held_secs, args.heldout))
    paths.append(os.path.join(out, "valid.jsonl"))
    with open(paths[-1], "w") as f:
        f.writelines(json.dumps({"text": d["text"]}) + "\n" for d in docs(held_secs, 64))
    return paths, held


def arm_flags(args, arm: str) -> list:
    return ARMS[arm] + ([] if arm != "refresh" else [
        "--sb-quality-refresh-interval", str(args.refresh_interval),
        "--sb-quality-refresh-microbatches", str(args.refresh_microbatches)])


def run_once(args, out: str, name: str, cmd: list, walls: dict) -> str:
    """Train ``name`` unless its checkpoint is in ``out``; its run directory."""
    import shutil

    run_dir = os.path.join(out, name)
    if os.path.exists(os.path.join(run_dir, "ckpt", "latest_checkpointed_iteration.txt")):
        print(f"kept {name}: its checkpoint is in {run_dir}", flush=True)
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    walls[name] = round(run(cmd(run_dir), os.path.join(run_dir, "train.log")), 1)
    print(f"trained {name} in {walls[name]} s", flush=True)
    return run_dir


def matched_density(static_rows: list, target: float, args) -> float:
    """The uniform density whose kept density on the static runs' documents (their recorded
    plans read at that uniform density) is ``target``."""
    return common.matched_uniform(lambda d: sum(
        document_densities(r, args.block_size, d)["doc_kept_d0_density"]
        for r in static_rows) / len(static_rows), target, lo=0.05, steps=30)


def trained_profile(summary: dict, args) -> list:
    """One density per decoder layer: the documents' planned density of its stage, the mean
    over the run's steps (what DST trained each layer at)."""
    per_stage = summary["doc_planned_per_stage"]
    return [round(per_stage[j * len(per_stage) // args.num_layers], 4)
            for j in range(args.num_layers)]


def equal_work(profile: list, lengths: list, args) -> list:
    """``profile`` scaled by the one factor that makes its kept attention work on documents of
    ``lengths`` (summed over layers) that of uniform d0: the trained shape at d0's cost."""
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.work import attention_work, scaled_to_work

    sb = SparseBalanceConfig()

    def work(d: float) -> float:
        return attention_work(lengths, min(1.0, d), args.block_size, sb.sink_blocks,
                              sb.local_blocks)
    return scaled_to_work(profile, work, args.density)


def evaluate(args, ckpt: str, docs: list, readings, pool=None) -> dict:
    """Per reading (``reading_key``), the per-document scores and their means (``score_docs``).
    Scores are kept beside the checkpoint (``eval.json``, for these documents), so a rerun in
    the same ``--out`` scores only readings it has not scored. ``pool`` (``eval_pool``) scores
    all but the first share of the documents in its processes."""
    import hashlib

    path = os.path.join(os.path.dirname(ckpt), "eval.json")
    digest = hashlib.sha256(json.dumps([[d["ids"], d["answer_positions"]] for d in docs])
                            .encode()).hexdigest()[:16]
    saved = {}
    if os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        saved = got["scores"] if got.get("documents") == digest else {}
    out = {reading_key(r): saved[reading_key(r)] for r in readings if reading_key(r) in saved}
    todo = [r for r in readings if reading_key(r) not in out]
    for reading, rows in zip(todo, scored(args, ckpt, docs, todo, pool)):
        out[reading_key(reading)] = {
            "heldout_loss": sum(r["nll"] for r in rows) / sum(r["tokens"] for r in rows),
            **{k: sum(r[k] for r in rows) / len(rows)
               for k in ("answer_nll", "exact", "token_accuracy", "kept")},
            "per_sample_answer_nll": [round(r["answer_nll"], 4) for r in rows]}
        with open(path, "w") as f:
            json.dump({"documents": digest, "scores": {**saved, **out}}, f)
    return out


def score_readings(args, ckpt: str, docs: list, readings):
    """Per reading in turn, ``score_docs``' rows of ``docs`` on the checkpoint ``ckpt`` (loaded
    once, before the first)."""
    from sparsebalance_megatron.config import SparseBalanceConfig

    if not readings:
        return
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, attention_backend="torch",
                             dense_below_tokens="0")
    model = load_model(args, ckpt, sb)
    budget = model.decoder.layers[0].self_attention.core_attention.budget
    for reading in readings:
        uniform = isinstance(reading, (int, float))
        sb.density = budget.default_density = reading if uniform else args.density
        budget.set_layer_densities(None if uniform else dict(enumerate(reading, start=1)))
        yield score_docs(model, budget, docs)


def scored(args, ckpt: str, docs: list, readings: list, pool=None):
    """``score_readings`` of every document, in document order: here alone (no ``pool``), or
    the first of ``--eval-jobs`` contiguous shares here while ``pool`` scores the others."""
    if pool is None:
        yield from score_readings(args, ckpt, docs, readings)
        return
    cuts = share_bounds([len(d["ids"]) for d in docs], args.eval_jobs)
    pending = [pool.submit(score_share, args, ckpt, docs[a:b], readings)
               for a, b in zip(cuts[1:-1], cuts[2:])]
    parts = [score_share(args, ckpt, docs[:cuts[1]], readings)] + [p.result() for p in pending]
    for j in range(len(readings)):
        yield [row for part in parts for row in part[j]]


def score_share(args, ckpt: str, docs: list, readings: list) -> list:
    """``score_readings`` at once: one share's task, in the parent or a pool's process."""
    return list(score_readings(args, ckpt, docs, readings))


def share_bounds(lengths: list, n: int) -> list:
    """``n`` + 1 cut points splitting documents of ``lengths`` into ``n`` contiguous shares of
    about equal tokens (the first share from ``0``, the last to ``len(lengths)``)."""
    import bisect
    import itertools

    cum = list(itertools.accumulate(lengths))
    total = cum[-1] if cum else 0
    return [0, *(bisect.bisect_left(cum, total * k / n) + 1 if total else 0
                 for k in range(1, n)), len(lengths)]


def eval_pool(args):
    """``--eval-jobs`` N > 1: N - 1 spawned processes (each its own one-process group and one
    torch thread, as the parent's evaluation) for ``evaluate``'s other shares; else no pool.
    Spawned, not forked: the parent's process group does not survive a fork."""
    import contextlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if args.eval_jobs == 1:
        return contextlib.nullcontext()
    return ProcessPoolExecutor(args.eval_jobs - 1, multiprocessing.get_context("spawn"),
                               initializer=init_eval_process)


def init_eval_process() -> None:
    """An evaluating process's state: one torch thread (the study's evaluation always ran at
    one; N processes share the cores) and a one-process group for ``load_model``'s read."""
    import torch

    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    torch.set_num_threads(1)
    init_single_process()


def parse_args(argv=None):
    ap = parser(__doc__, "continued_quality")
    ap.add_argument("--out", required=True, help="runs, data and checkpoints (kept: a run "
                    "whose checkpoint is there is not trained again)")
    add_pilot_args(ap)
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="continued-phase seeds (main: 1-10; pilot: 101-103)")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None)
    ap.add_argument("--base-steps", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=150, help="continued-phase steps")
    ap.add_argument("--density", type=float, default=0.5, help="d0")
    ap.add_argument("--control-factor", type=float, default=0.9)
    ap.add_argument("--refresh-interval", type=int, default=None, metavar="N",
                    help="the refresh arm's --sb-quality-refresh-interval (default: --steps / "
                         "6, five refreshes)")
    ap.add_argument("--refresh-microbatches", type=int, default=None, metavar="R",
                    help="the refresh arm's --sb-quality-refresh-microbatches: held-out "
                         "micro-batches per DP rank each refresh measures (default: the global "
                         "batch's per DP rank, one global batch, as Megatron's evaluation reads "
                         "one iteration; 8 at global batch 8 and DP 1)")
    ap.add_argument("--needles", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--pipeline", type=int, default=1,
                    help="pipeline stages (1: two DP ranks; N > 1: N stages of one DP rank, "
                         "DST moving density between stages as well as micro-batches)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-doc", type=int, default=512)
    ap.add_argument("--base-min-doc", type=int, default=17,
                    help="the base's shortest document (17: three needles and their query "
                         "alone, the shortest teach the lookup first)")
    ap.add_argument("--table", choices=("analytic", "profile"), default="profile")
    ap.add_argument("--eval-jobs", type=int, default=1, metavar="N",
                    help="processes scoring each checkpoint's held-out documents, each a "
                         "contiguous share (the scores are those of one process)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 256 tokens, block 8, 3 base and 2 continued steps, 1 "
                         "seed, 8 held-out documents (what the test runs)")
    args = ap.parse_args(argv)
    # settings no documented run changed (a pilot's margin holds for them: SAME)
    args.continue_lr, args.init_std, args.train_docs, args.heldout = 1e-3, 0.08, 30000, 1000
    args.data_seed, args.match_tolerance = 0, 0.01
    if args.quick:
        args.seq_length, args.min_doc, args.block_size, args.train_docs = 256, 128, 8, 200
        args.base_min_doc = 32
        args.base_steps, args.steps, args.heldout, args.table = 3, 2, 8, "analytic"
        args.seeds = args.seeds or [1]
        args.pilot = args.margin_from is None
    check_pilot(ap, args)
    if args.eval_jobs < 1:
        ap.error(f"--eval-jobs {args.eval_jobs}: expected a count of processes >= 1")
    if args.pipeline < 1 or args.num_layers % args.pipeline:
        ap.error(f"--pipeline {args.pipeline}: expected a positive divisor of --num-layers "
                 f"{args.num_layers} (each stage the same number of layers)")
    if min(args.base_min_doc, args.min_doc) < 5 * args.needles + 2:
        ap.error(f"--base-min-doc / --min-doc: {args.needles} needles and their query take "
                 f"{5 * args.needles + 2} bytes: expected at least that")
    args.seeds = args.seeds or ([101, 102, 103] if args.pilot else list(range(1, 11)))
    args.arms = args.arms or (["static", "control"] if args.pilot else list(ARMS))
    if args.refresh_interval is None:
        args.refresh_interval = max(1, args.steps // 6)
    if "refresh" in args.arms and not 1 <= args.refresh_interval < args.steps:
        ap.error(f"--refresh-interval {args.refresh_interval}: expected 1 <= N < --steps "
                 f"{args.steps} (a refresh at the last step or later plans nothing)")
    if args.refresh_microbatches is None:         # micro-batch 1: one per sample
        args.refresh_microbatches = max(1, args.global_batch_size // data_parallel(args))
    if args.refresh_microbatches < 1:
        ap.error(f"--refresh-microbatches {args.refresh_microbatches}: expected a count of "
                 f"micro-batches >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    fixed = read_margin(args) if args.margin_from else {}
    os.makedirs(args.out, exist_ok=True)
    (base_data, data, valid), held = build_data(args, args.out)
    docs = [{"ids": list(d["text"].encode("ascii")), "answer_positions": d["answer_positions"]}
            for d in held]
    table = latency_table(args, args.out)
    walls = {}
    base_args = copy.copy(args)
    base_args.steps = args.base_steps
    base = run_once(args, args.out, "base", lambda d: train_cmd(
        base_args, "dense", 1000, base_data, None, d), walls)
    cont = copy.copy(args)
    cont.lr = args.continue_lr
    load = ["--load", os.path.join(base, "ckpt"), "--finetune", "--no-load-optim",
            "--no-load-rng"]
    d_train = {"static": args.density, "sab": args.density, "sparse_balance": args.density,
               "refresh": args.density, "control": args.control_factor * args.density}
    train, dirs, d_eval = {}, {}, dict(d_train)

    def train_arm(arm: str, name: str) -> None:
        for s in args.seeds:
            dirs[(arm, s)] = run_once(args, args.out, f"{name}_s{s}", lambda r, s=s: train_cmd(
                cont, arm, s, data, table, r, arm_flags=arm_flags(args, arm),
                density=d_train[arm], extra=load, valid=valid if arm == "refresh" else None),
                walls)
            train[(arm, s)] = read_metrics(dirs[(arm, s)])
    for arm in [a for a in ARMS if a in args.arms and a != "matched"]:
        # the refresh arm named by its held-out micro-batches: a run of another count is not kept
        train_arm(arm, arm if arm != "refresh" else f"refresh{args.refresh_microbatches}mb")
    if "sparse_balance" in args.arms and "matched" in args.arms:
        target = sum(train_summary(train[("sparse_balance", s)], args.block_size,
                                      args.density)["doc_kept_density"]
                     for s in args.seeds) / len(args.seeds)
        d_m = matched_density([train[("static", s)] for s in args.seeds], target, args)
        d_eval.update(matched=d_m, sparse_balance=d_m)
        d_train["matched"] = d_m
        train_arm("matched", f"matched{d_m:.4f}")   # named by density: other seeds, another
    init_eval_process()
    t_eval = time.perf_counter()
    with eval_pool(args) as pool:
        runs = {"base": {"eval": evaluate(args, os.path.join(base, "ckpt"), docs,
                                          [1.0, args.density], pool)}}
        lengths = [len(d["ids"]) for d in docs]
        summaries = {key: train_summary(rows, args.block_size, d_train[key[0]])
                     for key, rows in train.items()}
        profiles = {}              # per DST run its trained profile, raw and at d0's work
        for (arm, s), summary in summaries.items():
            if arm in DST_ARMS and summary.get("doc_planned_per_stage"):
                raw = trained_profile(summary, args)
                profiles[(arm, s)] = {"trained_profile": raw,
                                      "equal_work_profile": equal_work(raw, lengths, args)}
        for (arm, s), summary in summaries.items():
            run = runs.setdefault(arm, {})[str(s)] = {"train": summary,
                                                      "eval_density": d_eval[arm]}
            readings, dst = [d_eval[arm], 1.0], profiles.get(("sparse_balance", s))
            if (arm, s) in profiles:
                run.update(profiles[(arm, s)])
                readings += [args.density, *profiles[(arm, s)].values()]
            elif arm == "static" and dst:         # the same seed's profile, static network
                run["equal_work_profile"] = dst["equal_work_profile"]
                readings.append(run["equal_work_profile"])
            run["eval"] = evaluate(args, os.path.join(dirs[(arm, s)], "ckpt"), docs,
                                   list({reading_key(r): r for r in readings}.values()), pool)
            print(f"evaluated {arm} seed {s}: " + ", ".join(
                f"d {d}: answer NLL {e['answer_nll']:.4f} token acc {e['token_accuracy']:.3f} "
                f"loss {e['heldout_loss']:.4f}" for d, e in runs[arm][str(s)]["eval"].items()),
                flush=True)
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json"}, **fixed,
           "arms": {a: {"flags": arm_flags(args, a), "eval_density": d_eval.get(a)} for a in runs
                    if a != "base"},
           "chance": {"token_accuracy": 1 / len(ALPHABETS[0]),
                      "exact": len(ALPHABETS[0]) ** -args.needles},
           "runs": runs, "train_wall_s": walls,
           "eval_wall_s": round(time.perf_counter() - t_eval, 1)}   # scoring, pool start included
    doc.update(summarize(doc, args))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.json, doc)
    print_summary(doc)
    return 0
