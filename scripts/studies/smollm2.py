"""SmolLM2-135M in Megatron with the plugin's sparse attention, scored one sample at a time: the
model every quality study of a pretrained model uses (``load``, ``score``: one teacher-forced
forward at one density per layer, ``samples``: RULER-style tasks and text windows by kind).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

KINDS = ("needle_single", "needle_multikey", "needle_multiquery", "text_code", "text_prose")


def arch(layers=None):
    """SmolLM2-135M's architecture from its GGUF (no weights read); ``layers``: its cut to the
    first N layers (the smoke tests')."""
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert

    return gguf_weights.read_architecture(hf_convert.smollm2_gguf_path(), layers)


def load(density: float, block_size: int, layers=None, threads: int = 1):
    """(model with the plugin's sparse attention, its budget, tokenizer, architecture)."""
    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert

    activate_cpu_shims()
    init_single_process()
    torch.set_num_threads(threads)
    gguf = hf_convert.smollm2_gguf_path()
    _, tok = hf_convert.load_hf_gguf(gguf, with_model=False)
    with tempfile.TemporaryDirectory(prefix="smollm2_weights_") as tmp:
        gguf_weights.pack_gguf(gguf, tmp, layers)
        hf_sd, a = gguf_weights.load_packed(tmp)
    sb = SparseBalanceConfig(sparse_attention=True, density=density, block_size=block_size,
                             dense_below_tokens="0", attention_backend="torch")
    model = hf_convert.build_gpt_model(a, "sparse", sb)
    hf_convert.load_converted_weights(model, hf_convert.convert_hf_state_dict(hf_sd, a))
    model.eval().requires_grad_(False)
    return model, model.decoder.layers[0].self_attention.core_attention.budget, tok, a


def tokenizer():
    """SmolLM2's tokenizer (from its GGUF, no weights read)."""
    from sparsebalance_megatron.megatron.model import hf_convert

    return hf_convert.load_hf_gguf(hf_convert.smollm2_gguf_path(), with_model=False)[1]


def encoder(tok):
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


def make(kind: str, length: int, depth: float, seed: int, encode):
    """One sample of ``kind`` (``KINDS``)."""
    from sparsebalance_megatron.eval import make_sample, make_text_window

    if kind.startswith("text_"):
        return make_text_window(kind[len("text_"):], length, seed, encode)
    return make_sample(kind, length, depth, seed, encode)


def samples(kinds, n: int, lengths, seed_base: int, encode) -> list:
    """``n`` samples, kinds in turn, lengths uniform in ``lengths``, needles at depths uniform
    in [0.1, 0.9], seeds ``seed_base`` + i."""
    rng = random.Random(seed_base)
    return [make(kinds[i % len(kinds)], rng.randint(*lengths), round(rng.uniform(0.1, 0.9), 3),
                 seed_base + i, encode) for i in range(n)]


def key(sample) -> str:
    """A sample's identity in a measurement cache."""
    return f"{sample.task}:{sample.length}:{sample.depth}:{sample.seed}"


def tokens(sample) -> int:
    """The positions a forward of the sample predicts (prompt + answer, less one)."""
    return len(sample.input_ids) + len(sample.answer_ids) - 1


def score(model, budget, sample, layer_dens, stride: int) -> dict:
    """One teacher-forced forward of prompt + answer with ``layer_dens`` (one density a decoder
    layer): ``loss`` the mean next-token loss of every ``stride``-th position of the whole
    sequence; with an answer, ``answer_nll`` (mean over its scored tokens), ``exact`` (every
    scored token's argmax right) and ``token_accuracy``; ``kept`` the layer-mean kept density
    the kernel reported."""
    import torch

    dev = next(model.parameters()).device
    full = sample.input_ids + sample.answer_ids
    ids = full[:-1]
    n_prompt = len(sample.input_ids)
    mask = sample.scored()
    answer = [n_prompt - 1 + j for j, m in enumerate(mask) if m]     # predicting answer tokens
    strided = list(range(0, len(ids), stride))
    pos = sorted(set(strided) | set(answer))
    at = torch.tensor(pos, device=dev)
    where = {p: i for i, p in enumerate(pos)}

    def keep(_module, _inp, out):                   # the LM head on these positions only
        h = out[0] if isinstance(out, tuple) else out                  # [s, b, h]
        return (h[at],) + tuple(out[1:]) if isinstance(out, tuple) else h[at]

    budget.set_layer_densities({j + 1: float(d) for j, d in enumerate(layer_dens)})
    budget.pop_stats()
    handle = model.decoder.register_forward_hook(keep)
    try:
        with torch.enable_grad():                  # the kernel reports its kept densities
            logits = model(torch.tensor([ids], device=dev),
                           torch.arange(len(ids), device=dev)[None],
                           attention_mask=None)[0].float()              # [len(pos), V]
    finally:
        handle.remove()
    kept: dict = {}
    for _, _, layer, k, _ in budget.pop_stats():
        kept.setdefault(layer, []).extend(k)
    target = torch.tensor(full, device=dev)[at + 1]
    nll = -torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
    out = {"loss": float(nll[[where[p] for p in strided]].mean()),
           "kept": float(np.mean([np.mean(v) for v in kept.values()]))}
    if answer:
        rows = [where[p] for p in answer]
        right = (logits[rows].argmax(-1) == target[rows]).tolist()
        out.update(answer_nll=float(nll[rows].mean()), exact=float(all(right)),
                   token_accuracy=sum(right) / len(right))
    return out


def layer_densities(group_densities, n_layers: int) -> list:
    """One density a decoder layer from one a depth group (groups of equal depth, in order)."""
    g = len(group_densities)
    return [float(group_densities[min(j * g // n_layers, g - 1)]) for j in range(n_layers)]


def regroup(stage_densities, groups: int) -> tuple:
    """A vector of one density per stage of an even split, as one per each of ``groups`` equal
    depth groups (``groups`` a multiple of the stages: a study's arms share one form, so the
    same per-layer densities are one forward)."""
    v = [float(x) for x in stage_densities]
    if groups % len(v):
        raise ValueError(f"{len(v)} stages do not split into {groups} equal groups")
    return tuple(round(v[g * len(v) // groups], 6) for g in range(groups))


def latency_model(a, seq_length: int, pp: int, block_size: int):
    """The analytic H100 table of architecture ``a`` (micro-batches of ``seq_length`` tokens on
    ``pp`` stages): the timings the studies plan with."""
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.latency.shape import ModelShape

    shape = ModelShape(num_layers=a.num_layers, hidden_size=a.hidden_size,
                       ffn_hidden_size=a.ffn_hidden_size,
                       num_attention_heads=a.num_attention_heads,
                       num_query_groups=a.num_query_groups, kv_channels=a.kv_channels,
                       vocab_size=a.vocab_size, seq_length=seq_length)
    return LatencyModel.analytic(shape, pp=pp, block_size=block_size)


def equal_time_density(lm, batch, units, dp: int, target_s: float, d0: float) -> tuple:
    """(the densest uniform density whose predicted step on ``batch``'s micro-batches is no
    slower than ``target_s``, that step's seconds): on a grid of 1/256, the step linear
    between its points (the predicted step is non-decreasing in a uniform density)."""
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.policy.stand_down import plan_step_time_s

    grid = np.unique(np.append(np.arange(16, 257) / 256.0, d0))
    costs = UnitCosts.from_latency(lm, units, dp, batch.num_microbatches, grid,
                                   kept_units=batch.unit_csr())
    t = np.array([plan_step_time_s(costs, np.full(costs.shape, d), lm.p2p_s) for d in grid])
    ok = np.flatnonzero(t <= target_s * (1 + 1e-12))
    if not ok.size:
        return float(grid[0]), float(t[0])
    i = int(ok.max())
    if i + 1 < grid.size and t[i + 1] > t[i]:      # within the step to the next point
        f = (target_s - t[i]) / (t[i + 1] - t[i])
        return float(grid[i] + f * (grid[i + 1] - grid[i])), float(target_s)
    return float(grid[i]), float(t[i])


def runtime_plans(sb, a, lengths: list, *, dp: int, microbatches: int, pp: int,
                  seq_length: int) -> dict:
    """The runtime's own plans of documents of ``lengths`` tokens (each with its EOD), in
    order: ``sequential_bins`` of ``seq_length``, ``dp`` x ``microbatches`` a step, each step
    through the runtime's ``Drafter`` with ``sb`` on ``a``'s analytic table at ``pp`` stages.
    Per document its micro-batch's density per stage (``stage_densities`` [n, pp]) and its
    unit; per step what DST did."""
    from sparsebalance_megatron.batching.sensitivity import SensitivityTracker
    from sparsebalance_megatron.data.packing import sequential_bins
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    lm = latency_model(a, seq_length, pp, sb.block_size)
    lm = lm.with_routing(sb.routing_threshold(lm.dense_below_tokens))
    bins = sequential_bins(lengths, seq_length)
    per_step = dp * microbatches
    stages = np.full((len(lengths), pp), np.nan)
    unit, steps = [None] * len(lengths), []
    for k in range(0, len(bins), per_step):
        ids = sum(bins[k:k + per_step], [])
        m = min(microbatches, -(-len(bins[k:k + per_step]) // dp))
        drafter = Drafter(sb, lm, SensitivityTracker(signal=sb.sensitivity_signal), dp=dp,
                          capacity=seq_length, attention_layers=lm.layout.layers)
        draft = drafter.draft(len(steps), 0, [(i, 0, lengths[i]) for i in ids], m,
                              with_dst=True)
        dens, report = draft.payload
        index = (report.get("stand_down") or {}).get("packing_index", 0)
        batch, units = draft.packing(index)
        eq, eq_s = equal_time_density(lm, batch, units, dp, report["step_time_planned_s"],
                                      sb.density)
        for r, rank in enumerate(batch.micro_batches):
            for mb, segs in enumerate(rank):
                for sid, _, _ in segs:
                    stages[sid] = dens[r][mb]
                    unit[sid] = [len(steps), r, mb]
        steps.append({"samples": len(ids), "micro_batches": m, "packing": batch.method,
                      "units_cut": report["units_cut"], "units_raised": report["units_raised"],
                      "adopted": report.get("adopted", ""),
                      "predicted_loss_change": report.get("quality_cost"),
                      "predicted_loss_sd": report.get("quality_sd"),
                      "step_time_planned_s": report["step_time_planned_s"],
                      "step_time_static_s": report["step_time_static_s"],
                      "predicted_step_vs_static": report["step_time_planned_s"]
                      / report["step_time_static_s"],
                      "equal_time_density": eq,
                      "equal_time_vs_static": eq_s / report["step_time_static_s"]})
    if np.isnan(stages).any():
        raise RuntimeError("a document was left out of every micro-batch of its step's plan")
    return {"stage_densities": stages, "unit": unit, "steps": steps,
            "stage_layers": list(lm.layout.layers), "latency": lm}


def shard(text: str) -> tuple:
    """``--shard K/N`` as (K, N), refused unless 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"{text}: expected K/N with 0 <= K < N") from None
    return k, n


def add_measure_args(ap, study: str, threads: int, quick_layers: int) -> None:
    """The options ``measure`` reads (and the samples' ``--lengths``), one body for the studies
    that score SmolLM2's forwards."""
    ap.add_argument("--lengths", type=int, nargs=2, default=[2048, 4096], metavar=("LO", "HI"))
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--loss-stride", type=int, default=4)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--layers", type=int, default=None,
                    help=f"a cut of the model (--quick: {quick_layers})")
    ap.add_argument("--cache", default=None, metavar="PATH.jsonl",
                    help=f"the forwards' cache (default runs/{study}/<run>.jsonl)")
    ap.add_argument("--shard", type=shard, default=(0, 1), metavar="K/N",
                    help="make every N-th forward from the K-th only (processes sharing the "
                         "cache; what reads the forwards waits for a run without --shard)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="N processes: shard 0/N here, N-1 children of this command the "
                         "others (--shard k/N, the same cache), then every forward read as "
                         "without --shard; torch threads each: --threads, at most cores / N")
    ap.set_defaults(study=study)


def parse(ap, argv=None):
    """``ap``'s arguments, ``--jobs`` checked before any work and its threads split: each process
    ``--threads`` but at most its share of the cores, so N processes do not oversubscribe them
    (one sample a forward: a second thread gains a process little, N processes gain N-fold)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: expected a count of processes >= 1")
    if args.jobs > 1 and args.shard != (0, 1):
        ap.error(f"--jobs {args.jobs} with --shard {args.shard[0]}/{args.shard[1]}: expected "
                 f"one of them (--jobs starts the shards itself)")
    if args.jobs > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        args.threads = max(1, min(args.threads, (cores or 1) // args.jobs))
    args.argv = argv
    return args


# ---- forwards, cached ---------------------------------------------------------------------------

class Cache:
    """Forwards by (sample key, vector), appended as JSON lines as they are made; several
    processes (``--shard``) may share one, each reading what the others appended."""

    def __init__(self, path: str):
        self.path, self.rows, self.offset = path, {}, 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.refresh()

    def refresh(self) -> None:
        """Read the lines appended since the last read (whole lines only)."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                if line.strip():
                    r = json.loads(line)
                    self.rows[(r["sample"], tuple(r["vector"]))] = r

    def get(self, sample_key: str, vector) -> dict | None:
        key = (sample_key, tuple(round(float(x), 6) for x in vector))
        if key not in self.rows:
            self.refresh()
        return self.rows.get(key)

    def put(self, row: dict) -> None:
        row["vector"] = [round(float(x), 6) for x in row["vector"]]
        self.rows[(row["sample"], tuple(row["vector"]))] = row
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def start_shards(args, caches: list) -> list:
    """``--jobs N``: the children making shards 1/N .. N-1/N, each this run's own command
    (``scripts/bench.py`` with the same arguments, environment and directory) with ``--shard``
    and the threads ``parse`` chose."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")
    n = args.jobs
    print(f"--jobs {n}: shard 0/{n} here, {', '.join(f'{k}/{n}' for k in range(1, n))} in "
          f"children, {args.threads} torch thread(s) each, cache "
          f"{', '.join(c.path for c in caches)}", flush=True)
    return [(k, subprocess.Popen([sys.executable, bench, args.study, *args.argv, "--jobs", "1",
                                  "--shard", f"{k}/{n}", "--threads", str(args.threads)]))
            for k in range(1, n)]


def wait_shards(children: list, n: int) -> None:
    """Wait for every child; any that failed named with its exit code, and the run stopped (the
    cache keeps every forward made: the same command resumes)."""
    failed = [f"shard {k}/{n} exited with code {rc}" for k, rc in
              [(k, p.wait()) for k, p in children] if rc]
    if failed:
        raise SystemExit("; ".join(failed) + " (the cache keeps what was made: run the same "
                         "command again to resume)")


def measure(args, *tasks: tuple) -> list:
    """Every (sample index, group vector) of each task's ``jobs`` scored, a task being ``(jobs,
    samples, cache)`` (from the cache where it is there): one list of rows a task, in its jobs'
    order; with ``--shard K/N`` only every N-th job of each task from the K-th (the others' rows
    where the caches have them); with ``--jobs N`` shard 0/N here beside the children's (the same
    command: they make their shards of every task), then every row as without it. The model is
    loaded once, and only if a forward is missing."""
    if args.jobs > 1:
        children = start_shards(args, [cache for _, _, cache in tasks])
        try:
            measure_shard(args, tasks, (0, args.jobs))
        except BaseException:
            for _, p in children:
                p.terminate()
                p.wait()
            raise
        wait_shards(children, args.jobs)
    return measure_shard(args, tasks, args.shard)


def measure_shard(args, tasks: tuple, shard_of: tuple) -> list:
    """``measure``'s rows of shard ``shard_of`` (K, N): the jobs the caches lack made only for
    every N-th job of a task from the K-th."""
    model = None
    k, n_shards = shard_of
    out, t0, made = [], time.perf_counter(), 0
    for jobs, samples, cache in tasks:
        rows = []
        for n, (i, vec) in enumerate(jobs):
            s = samples[i]
            row = cache.get(key(s), vec)
            if row is None and n % n_shards != k:
                continue
            if row is None:
                if model is None:
                    model, budget, _, a = load(args.density, args.block_size, args.layers,
                                               args.threads)
                    t0 = time.perf_counter()
                t1 = time.perf_counter()
                res = score(model, budget, s, layer_densities(vec, a.num_layers),
                            args.loss_stride)
                row = {"sample": key(s), "vector": list(vec), "kind": s.task,
                       "length": s.length, "tokens": tokens(s), **res,
                       "seconds": round(time.perf_counter() - t1, 2)}
                cache.put(row)
                made += 1
                if made % 10 == 0 or n + 1 == len(jobs):
                    rate = (time.perf_counter() - t0) / made
                    print(f"[{n + 1}/{len(jobs)}] {made} forwards, {rate:.1f} s each, "
                          f"~{rate * (len(jobs) - n - 1) / 60:.0f} min left", flush=True)
            rows.append(row)
        out.append(rows)
    return out
