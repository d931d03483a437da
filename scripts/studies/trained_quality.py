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

    .venv/bin/python scripts/bench.py trained_quality --json docs/results/trained_quality_cpu.json
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

from .common import parser, torchrun, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = {"dense": [],
        "static": ["--sb-sparse-attention"],
        "sparse_balance": ["--sparse-balance"],
        "dst_density": ["--sparse-balance", "--sb-dst-objective", "density"]}
PAIRS = (("sparse_balance", "static"), ("dst_density", "static"),
         ("sparse_balance", "dst_density"), ("static", "dense"), ("sparse_balance", "dense"))
# the pass key: one symbol of each alphabet (control bytes the corpus never holds; one alphabet of
# 16: chance 1/16), after the needle's marker at its depth and the query's at the document's end
ALPHABETS = ("".join(map(chr, range(0x10, 0x20))),)
NEEDLE, QUERY = "\x01", "\x02"
KEY_LEN = len(ALPHABETS)
# two-sided 95% t quantiles by degrees of freedom (no scipy in the venv)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


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


def document_densities(rows: list, block_size: int, d0: float) -> dict:
    """Planned and kept density of the documents alone, from the recorded plans: the metrics'
    ``mean_density`` and ``kept_density`` weigh the padding pieces that fill each micro-batch
    (256-token pseudo-documents, whose blocks no loss reads) like documents, and how much
    padding a step has depends on the packing, so static (sequential) and SAB differ in it.
    Per step, weighted by causal block pairs as the metrics are: ``planned``, ``kept`` (the
    selection's rule, ``latency/work.py``) and ``kept_d0`` (what the same documents keep at
    d0); per DST move, whether it kept any other block of a document than d0 does."""
    import numpy as np

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.features import UnitFeatures

    sb = SparseBalanceConfig()
    per = {"planned": [], "kept": [], "kept_d0": []}
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
    return {**{f"doc_{key}_density": sum(v) / len(v) for key, v in per.items()},
            "dst_moves": moves}


def replanned(run_dir: str, table: str, args, objective: str) -> dict:
    """``train_summary`` of a DST run's recorded steps re-planned by the planner as it is now:
    each step's committed packing, unit sensitivities and raise headroom, the study's latency
    table, timings modelled (no calibration), DST's plan of that packing (the stand-down's
    choices are not re-made: a step where DST stood down keeps its static plan).
    ``plans_as_recorded`` of ``dst_plans``: the steps DST planned whose plan is the run's (the
    sensitivities are recorded to 6 decimals: a near tie may order units otherwise)."""
    import numpy as np

    from sparsebalance_megatron.batching.replay import RecordedPlans
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.model import LatencyModel
    from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst import plan_dst_from_config

    rows, path = read_metrics(run_dir), os.path.join(run_dir, "metrics.jsonl")
    steps = RecordedPlans.read(path).steps
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, dst_objective=objective,
                             dense_below_tokens="0")                 # as the runs (train_cmd)
    lm = LatencyModel.load(table, force=True)
    lm = lm.with_routing(sb.routing_threshold(lm.dense_below_tokens))
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    out, same, gain = [], 0, []
    for r in rows:
        if r.get("dst_stood_down"):
            out.append(r)
            continue
        batch = steps[r["step"]]["batch"]
        costs = UnitCosts.from_latency(lm, batch.flat_lengths(with_padding=True), batch.dp,
                                       batch.num_microbatches, grid, calibrated=False,
                                       kept_units=batch.unit_csr())        # as choice.choose
        sens = r.get("unit_sensitivity")
        p = plan_dst_from_config(sb, costs, None if sens is None else np.asarray(sens),
                                 lm.p2p_s, raise_headroom=r.get("raise_headroom") or 0.0,
                                 stage_layers=r["layers_per_stage"])
        same += bool(np.array_equal(p.densities, np.asarray(r["densities"])))
        gain.append(p.report.step_time_planned_s / p.report.step_time_static_s)
        out.append(dict(r, densities=p.densities.tolist(), units_cut=p.report.units_cut,
                        units_raised=p.report.units_raised))
    # the metrics' figures with padding are the recorded plans': not these
    return {**train_summary(out, args.block_size, args.density), "plans_as_recorded": same,
            "dst_plans": len(gain), "predicted_step_vs_static": sum(gain) / max(len(gain), 1),
            "mean_kept_density": None,
            "mean_planned_density": None}


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
    return {"steps": len(rows), "final_train_loss": sum(tail) / len(tail),
            "train_losses": losses,
            "mean_kept_density": mean("kept_density") or 1.0,
            "mean_planned_density": mean("mean_density") or 1.0,
            "dst_steps_cut": sum(c > 0 for c in cut), "dst_steps_raised": sum(r > 0 for r in raised),
            "dst_units_cut": sum(cut), "dst_units_raised": sum(raised),
            "dst_stood_down": sum(int(r.get("dst_stood_down") or 0) for r in rows),
            "sab_stood_down": sum(int(r.get("sab_stood_down") or 0) for r in rows),
            "tokens": [r["tokens"] for r in rows], **document_densities(rows, block_size, d0)}


# ---- evaluation ----------------------------------------------------------------------------------

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
    """Per document (``ids``, the answer's ``answer_at`` and ``answer_len``, or its
    ``answer_positions`` where the answer is not one run of tokens), run alone on the model's
    device: the summed next-token loss and its token count, the answer tokens' mean NLL
    (``answer_nll``), whether every answer token is the teacher-forced argmax (``exact``: what
    greedy decoding emits) and the share that is, and the kept density the sparse attention
    reported (grad mode on, though no weight needs grad: the budget then records what it
    kept). The GPU form and ``continued_quality`` score with it too."""
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
        at = doc.get("answer_positions") or range(doc["answer_at"],
                                                  doc["answer_at"] + doc["answer_len"])
        at = torch.tensor(list(at), device=dev)
        right = (logits[at - 1].argmax(-1) == ids[0, at]).tolist()
        rows.append({"nll": float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")),
                     "tokens": ids.shape[1] - 1, "exact": float(all(right)),
                     "answer_nll": float(F.cross_entropy(logits[at - 1], ids[0, at])),
                     "token_accuracy": sum(right) / len(right),
                     "kept": sum(st[3][0] for st in stats) / max(1, len(stats))})
    return rows


def score_densities(model, budget, sb, docs: list, densities, depths, group=None) -> dict:
    """Per density (the budget's and ``sb``'s default, set in turn): held-out LM loss, answer
    accuracy (exact and per token) overall and by ``depths`` (each doc's ``depth``), and kept
    density; ``group``: a key of the docs whose values get their own accuracy
    (``accuracy_by_<group>``). The GPU form scores with it too."""
    out = {}
    for d in densities:
        sb.density = budget.default_density = d
        rows = score_docs(model, budget, docs)
        by_depth = {}
        for depth in depths:
            rs = [r for r, doc in zip(rows, docs) if doc["depth"] == depth]
            by_depth[f"{depth:g}"] = {"accuracy": sum(r["exact"] for r in rs) / len(rs),
                                      "token_accuracy": sum(r["token_accuracy"] for r in rs)
                                      / len(rs), "n": len(rs)}
        out[f"{d:g}"] = {"heldout_loss": sum(r["nll"] for r in rows)
                         / sum(r["tokens"] for r in rows),
                         "accuracy": sum(r["exact"] for r in rows) / len(rows),
                         "token_accuracy": sum(r["token_accuracy"] for r in rows) / len(rows),
                         "accuracy_by_depth": by_depth,
                         "eval_kept_density": sum(r["kept"] for r in rows) / len(rows)}
        if group is not None:
            rs = {}
            for r, doc in zip(rows, docs):
                rs.setdefault(doc[group], []).append(r["exact"])
            out[f"{d:g}"][f"accuracy_by_{group}"] = {g: sum(x) / len(x) for g, x in rs.items()}
    return out


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


# ---- summary -------------------------------------------------------------------------------------

def metrics_of(run: dict) -> dict:
    """The flat metrics a pair compares: the primary evaluation's and the training's."""
    p = run["eval"][run["primary"]]
    out = {"heldout_loss": p["heldout_loss"], "accuracy": p["accuracy"],
           "token_accuracy": p["token_accuracy"],
           "doc_kept_density": kept_of(run["train"])}
    out.update({f"accuracy@depth{k}": v["accuracy"] for k, v in p["accuracy_by_depth"].items()})
    return out


def kept_of(train: dict) -> float:
    """A run's kept density of its documents (padding left out: ``document_densities``); 1
    for a dense run."""
    return train.get("doc_kept_density", 1.0)


def density_rows(runs: dict, seeds: list) -> list:
    """Per arm, means over seeds of the documents' planned, kept and d0-kept densities, and the
    DST moves summed over seeds, with how many kept no other block of a document."""
    out = []
    for arm, per in runs.items():
        tr = [per[str(s)]["train"] for s in seeds]
        if "doc_kept_density" not in tr[0]:
            continue
        row = {"arm": arm, **{k: None if tr[0][k] is None else sum(t[k] for t in tr) / len(tr)
                              for k in ("doc_planned_density", "doc_kept_density",
                                        "doc_kept_d0_density", "mean_planned_density",
                                        "mean_kept_density")}}
        row.update({k: sum(t["dst_moves"][k] for t in tr) for k in tr[0]["dst_moves"]})
        row.update({k: sum(t[k] for t in tr) / len(tr) for k in (
            "plans_as_recorded", "dst_plans", "predicted_step_vs_static") if k in tr[0]})
        out.append(row)
    return out


def print_densities(rows: list) -> None:
    print("\n| arm | planned | kept | kept at d0 | kept - at d0 | with padding: planned / kept "
          "| raised (kept no block) | cut (kept no block) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        padded = "-" if r["mean_kept_density"] is None else \
            f"{r['mean_planned_density']:.4f} / {r['mean_kept_density']:.4f}"
        print(f"| {r['arm']} | {r['doc_planned_density']:.4f} | {r['doc_kept_density']:.4f} | "
              f"{r['doc_kept_d0_density']:.4f} | "
              f"{r['doc_kept_density'] - r['doc_kept_d0_density']:+.4f} | "
              f"{padded} | "
              f"{r['raised']} ({r['raised_keeping_no_block']}) | "
              f"{r['cut']} ({r['cut_keeping_no_block']}) |")
    for r in rows:
        if "plans_as_recorded" in r:
            print(f"{r['arm']}: predicted step / static {r['predicted_step_vs_static']:.4f}, "
                  f"plans as recorded {r['plans_as_recorded']:.0f} of {r['dst_plans']:.0f} "
                  f"a seed")


def interval(xs: list) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return {"mean": mean, "n": n, "ci95": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = T975.get(n - 1) or T975[max(k for k in T975 if k <= n - 1)]
    half = t * sd / math.sqrt(n)
    return {"mean": mean, "n": n, "sd": sd, "ci95": [mean - half, mean + half]}


def paired(runs: dict, seeds: list) -> dict:
    out = {}
    for a, b in PAIRS:
        if a not in runs or b not in runs:
            continue
        per = {}
        for s in seeds:
            ma, mb = metrics_of(runs[a][s]), metrics_of(runs[b][s])
            for k in ma:
                per.setdefault(k, []).append(ma[k] - mb[k])
        out[f"{a}-{b}"] = {k: {**interval(v), "per_seed": v} for k, v in per.items()}
    return out


def density_match(runs: dict, seeds: list, tol: float) -> dict:
    if "static" not in runs:
        return {}
    ref = {s: kept_of(runs["static"][s]["train"]) for s in seeds}
    out = {}
    for arm in runs:
        if arm in ("static", "dense"):
            continue
        gaps = [kept_of(runs[arm][s]["train"]) - ref[s] for s in seeds]
        out[arm] = {"kept_minus_static": gaps, "matched": all(abs(g) <= tol for g in gaps)}
    return out


def print_table(doc: dict) -> None:
    runs, seeds = doc["runs"], doc["config"]["seeds"]
    depths = [f"{d:g}" for d in doc["config"]["depths"]]
    print("\n| arm | eval density | held-out loss | accuracy | "
          + " | ".join(f"acc @{d}" for d in depths)
          + " | train kept density (documents) | DST steps cut / raised |")
    print("|---|---:|---:|---:|" + "---:|" * len(depths) + "---:|---:|")
    for arm, per in runs.items():
        ms = [metrics_of(per[str(s)]) for s in seeds]
        tr = [per[str(s)]["train"] for s in seeds]

        def m(k):
            return sum(x[k] for x in ms) / len(ms)
        print(f"| {arm} | {per[str(seeds[0])]['primary']} | {m('heldout_loss'):.4f} | "
              f"{m('accuracy'):.3f} | " + " | ".join(f"{m('accuracy@depth' + d):.2f}"
                                                     for d in depths)
              + f" | {sum(kept_of(t) for t in tr) / len(tr):.3f} | "
              f"{sum(t['dst_steps_cut'] for t in tr)} / {sum(t['dst_steps_raised'] for t in tr)}"
              f" |")
    print(f"(means over seeds {seeds}; DST steps summed over seeds)\n")
    for pair, ms in doc["paired"].items():
        print(f"{pair}: " + ", ".join(
            f"{k} {v['mean']:+.4f}" + (f" [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"
                                       if v["ci95"] else "")
            for k, v in ms.items() if k in ("heldout_loss", "accuracy", "doc_kept_density")))
    print_densities(doc.get("densities") or [])


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
