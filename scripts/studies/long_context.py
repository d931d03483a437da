"""Long-context retrieval quality of a converted model under dense and block-sparse attention
(SmolLM2-135M in megatron-core: ``dense``, ``static`` at each density, ``mass`` threshold;
RULER-style tasks; the estimator's and the oracle's recall of the dense attention mass;
QUALITY.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import torch

from .common import parser, write_result

ALL_TASKS = ("needle_single", "needle_multikey", "needle_multivalue", "variable_tracking", "qa")


def parse_args(argv=None):
    ap = parser(__doc__, "long_context")
    ap.add_argument("--tasks", nargs="+", default=list(ALL_TASKS), choices=ALL_TASKS)
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    ap.add_argument("--samples", type=int, default=2, help="seeds per (task, length, depth)")
    ap.add_argument("--densities", nargs="+", type=float, default=[0.75, 0.5, 0.25, 0.125])
    ap.add_argument("--no-mass", action="store_true")
    ap.add_argument("--recall-samples", type=int, default=1,  # 0: no recall measurement
                    help="samples per (task, length) whose dense forward also measures recall")
    ap.add_argument("--quick", action="store_true",
                    help="2K tokens, needle_single + needle_multikey, depth 0.5, 2 seeds, "
                         "densities 0.5 and 0.25, mass mode")
    args = ap.parse_args(argv)
    # the settings every documented run used (recorded in the JSON's settings): SmolLM2's GGUF,
    # torch's threads as they are
    args.sink_blocks, args.local_blocks, args.estimator = 1, 0, "maxkey"
    args.mass_threshold, args.haystack = 0.9, "essays"
    args.gguf, args.min_density, args.max_density, args.block_size, args.seed = \
        None, 0.125, 1.0, 64, 0
    if args.quick:
        args.tasks, args.lengths, args.depths = ["needle_single", "needle_multikey"], [2048], [0.5]
        args.samples, args.densities, args.recall_samples = 2, [0.5, 0.25], 1
    return args


# ---- models --------------------------------------------------------------------------------------

def build_models(args, sb):
    """(dense local-spec model, sparse-spec model sharing the weights' values, arch, tokenizer)."""
    from sparsebalance_megatron.megatron.model import hf_convert

    hf, tok = hf_convert.load_hf_gguf(args.gguf)
    dense, arch = hf_convert.hf_to_megatron(hf)
    del hf
    name = os.path.basename(args.gguf or hf_convert.smollm2_gguf_path())
    sparse = hf_convert.build_gpt_model(arch, "sparse", sb)
    sparse.load_state_dict(dense.state_dict(), strict=False)
    for m in (dense, sparse):
        m.eval().requires_grad_(False)
    cores = [layer.self_attention.core_attention for layer in sparse.decoder.layers]
    if not all(c.sb_config is sb for c in cores):
        raise RuntimeError("sparse layers do not share the SparseBalanceConfig object")
    return dense, sparse, arch, tok, name


def only_last_positions(model, n_last: int):
    """Hook the decoder so the LM head runs on the last ``n_last`` positions only."""
    def hook(_module, _inp, out):
        h = out[0] if isinstance(out, tuple) else out             # [s, b, h]
        h = h[-n_last:]
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
    return model.decoder.register_forward_hook(hook)


def forward_argmax(model, ids: list, n_answer: int) -> list:
    """Greedy predictions for the ``n_answer`` positions that predict the answer tokens."""
    x = torch.tensor([ids])                                        # [1, s]
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    handle = only_last_positions(model, n_answer)
    try:
        # grad mode on (no parameter needs grad, so no graph is built): the sparse core
        # attention then reports its kept density and estimated recall to its budget context.
        with torch.enable_grad():
            logits = model(x, pos, attention_mask=None)             # [1, n_answer, V]
    finally:
        handle.remove()
    return logits[0].argmax(dim=-1).tolist()


class RecallProbe:
    """Forward pre-hooks on the dense model's core attention: per-layer recall of selections."""

    def __init__(self, model, args, arch):
        from sparsebalance_megatron.eval.recall import layer_recalls
        self.rows, self.handles, self.args = [], [], args
        self.scale = 1.0 / arch.kv_channels ** 0.5

        def pre_hook(_module, inputs):
            q, k = inputs[0], inputs[1]                             # [s, 1, np, hn], [s, 1, ng, hn]
            self.rows.append(layer_recalls(
                q[:, 0], k[:, 0], args.densities, block_size=args.block_size,
                sink_blocks=args.sink_blocks, local_blocks=args.local_blocks,
                estimator=args.estimator,
                mass_threshold=None if args.no_mass else args.mass_threshold,
                min_density=args.min_density, max_density=args.max_density,
                softmax_scale=self.scale))
        for layer in model.decoder.layers:
            self.handles.append(layer.self_attention.core_attention.register_forward_pre_hook(
                pre_hook))

    def take(self) -> dict:
        """Mean over layers of each variant's recall figures; clears the buffer."""
        acc = defaultdict(lambda: defaultdict(float))
        for row in self.rows:
            for name, vals in row.items():
                for key, v in vals.items():
                    acc[name][key] += v / len(self.rows)
        self.rows = []
        return {k: dict(v) for k, v in acc.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


# ---- evaluation ----------------------------------------------------------------------------------

def variants(args):
    out = [("dense", 1.0)] + [("static", d) for d in args.densities]
    if not args.no_mass:
        out.append(("mass", None))
    return out


def evaluate(args, partial=None) -> dict:
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.eval import answer_token_accuracy, greedy_exact_match, make_suite

    sb = SparseBalanceConfig(
        sparse_attention=True, density=0.5, min_density=args.min_density,
        max_density=args.max_density, block_size=args.block_size, sink_blocks=args.sink_blocks,
        local_blocks=args.local_blocks, mass_threshold=args.mass_threshold,
        estimator=args.estimator, attention_backend="torch")
    t0 = time.perf_counter()
    dense, sparse, arch, tok, name = build_models(args, sb)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    print(f"model {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    suite = make_suite(args.tasks, args.lengths, args.depths, args.samples, encode,
                       seed=args.seed, haystack=args.haystack)
    probe_budget = defaultdict(int)
    samples, recalls = [], []
    budget = sparse.decoder.layers[0].self_attention.core_attention.budget  # shared by layers
    for n, s in enumerate(suite):
        ids = s.input_ids + s.answer_ids[:-1]
        key = (s.task, s.length)
        probe = None
        if probe_budget[key] < args.recall_samples:
            probe_budget[key] += 1
            probe = RecallProbe(dense, args, arch)
        t1 = time.perf_counter()
        for variant, density in variants(args):
            if variant == "dense":
                try:
                    pred = forward_argmax(dense, ids, len(s.answer_ids))
                finally:
                    if probe is not None:
                        probe.remove()
                if probe is not None:
                    recalls.append({"task": s.task, "length": s.length, **{
                        "by_variant": probe.take()}})
                kept = 1.0
            else:
                sb.selection_mode = "mass" if variant == "mass" else "density"
                sb.density = density if density is not None else args.max_density
                budget.default_density = sb.density       # no plan: the static density
                budget.pop_stats()
                pred = forward_argmax(sparse, ids, len(s.answer_ids))
                stats = budget.pop_stats()
                kept = sum(st[3][0] for st in stats) / max(1, len(stats))
            samples.append({
                "variant": variant, "density": density, "kept_density": kept, "task": s.task,
                "length": s.length, "depth": s.depth, "seed": s.seed,
                "accuracy": float(greedy_exact_match(pred, s.answer_ids)),
                "token_accuracy": answer_token_accuracy(pred, s.answer_ids)})
        print(f"[{n + 1}/{len(suite)}] {s.task} len={s.length} depth={s.depth} seed={s.seed}: "
              + " ".join(f"{r['variant']}{'' if r['density'] is None else '@%g' % r['density']}="
                         f"{r['accuracy']:.0f}/{r['token_accuracy']:.2f}"
                         for r in samples[-len(variants(args)):])
              + f" ({time.perf_counter() - t1:.1f} s)", flush=True)
        raw = {"model": name, "samples": samples, "recalls": recalls,
               "settings": {k: v for k, v in vars(args).items() if k != "json"}}
        if partial is not None:   # long runs: results so far survive an interruption
            partial(raw, n + 1, len(suite))
    return raw


def summarize(raw: dict) -> dict:
    """The issue's results schema: one row per (variant, density, task, length)."""
    from sparsebalance_megatron.eval import mean_by

    groups = defaultdict(list)
    for r in raw["samples"]:
        groups[(r["variant"], r["density"], r["task"], r["length"])].append(r)
    rec = defaultdict(list)
    for r in raw["recalls"]:
        for name, vals in r["by_variant"].items():
            rec[(name, r["task"], r["length"])].append(vals)
    results = []
    for (variant, density, task, length), rows in groups.items():
        rname = "mass" if variant == "mass" else f"static@{density:g}"
        rr = rec.get((rname, task, length), [])
        mean = lambda key: (sum(x[key] for x in rr) / len(rr)) if rr else None  # noqa: E731
        kept = sum(r["kept_density"] for r in rows) / len(rows)
        results.append({
            "variant": variant, "density": round(kept, 4) if variant == "mass" else density,
            "task": task, "length": length,
            "accuracy": sum(r["accuracy"] for r in rows) / len(rows),
            "token_accuracy": sum(r["token_accuracy"] for r in rows) / len(rows),
            "recall": 1.0 if variant == "dense" else mean("recall"),
            "oracle_recall": 1.0 if variant == "dense" else mean("oracle_recall"),
            "estimated_recall": None if variant == "dense" else mean("estimated_recall"),
            "samples": len(rows)})
    by_depth = [{"variant": k[0], "density": k[1], "task": k[2], "length": k[3], "depth": k[4],
                 "accuracy": v}
                for k, v in mean_by(raw["samples"], ("variant", "density", "task", "length",
                                                     "depth"), "accuracy").items()]
    return {"model": raw["model"], "results": results, "by_depth": by_depth,
            "settings": raw["settings"], "samples": raw["samples"]}


def markdown(out: dict) -> str:
    """Density x length tables (accuracy; recall vs oracle) for QUALITY.md: what a run prints."""
    rows = out["results"]
    lengths = sorted({r["length"] for r in rows})
    lines = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        keys = sorted({(r["variant"], r["density"] if r["variant"] != "mass" else None)
                       for r in sub}, key=lambda k: (k[0] != "dense", k[0] == "mass",
                                                     -(k[1] or 0)))
        lines += [f"\n{task}: greedy exact match (answer-token accuracy), n samples per cell\n",
                  "| variant | density | " + " | ".join(f"{n} tok" for n in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for variant, dens in keys:
            cells, shown = [], dens
            for n in lengths:
                hit = [r for r in sub if r["length"] == n and r["variant"] == variant and
                       (variant == "mass" or r["density"] == dens)]
                if not hit:
                    cells.append("-")
                    continue
                r = hit[0]
                shown = r["density"]
                kept = f", kept {r['density']:.2f}" if variant == "mass" else ""
                cells.append(f"{r['accuracy']:.2f} ({r['token_accuracy']:.2f}), "
                             f"n={r['samples']}{kept}")
            tau = out.get("settings", {}).get("mass_threshold")
            label = f"tau={tau}" if variant == "mass" else f"{shown:.3g}"
            lines.append(f"| {variant} | {label} | " + " | ".join(cells) + " |")
    rec = [r for r in rows if r["variant"] != "dense" and r["recall"] is not None]
    if rec:
        lines += ["\nmass recall of the selected blocks vs exact attention (dense forward's q/k, "
                  "mean over 30 layers and KV groups)\n",
                  "| task | length | variant | density | estimator recall | oracle recall | "
                  "ratio |", "|---|---|---|---|---|---|---|"]
        for r in sorted(rec, key=lambda r: (r["task"], r["length"], r["variant"],
                                            -r["density"])):
            lines.append(f"| {r['task']} | {r['length']} | {r['variant']} | {r['density']:.3g} | "
                         f"{r['recall']:.4f} | {r['oracle_recall']:.4f} | "
                         f"{r['recall'] / r['oracle_recall']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--markdown":
        with open(argv[1]) as f:           # re-render a results file: --markdown PATH
            print(markdown(json.load(f)))
        return 0
    args = parse_args(argv)
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    activate_cpu_shims()
    init_single_process()
    t0, c0 = time.perf_counter(), time.process_time()

    def partial(raw, done, total):
        if args.json:
            with open(args.json + ".partial", "w") as f:
                json.dump({**summarize(raw), "done": f"{done}/{total}"}, f, indent=1)

    out = summarize(evaluate(args, partial))
    # wall time on a shared machine says little: CPU time (all threads) is reported next to it
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["cpu_s"] = round(time.process_time() - c0, 1)
    print(markdown(out))
    print(f"\ntotal {out['wall_s']} s wall, {out['cpu_s']} s CPU ({torch.get_num_threads()} "
          f"threads)")
    if args.json:
        out = write_result(args.json, out)
        if os.path.exists(args.json + ".partial"):
            os.remove(args.json + ".partial")
    return 0
