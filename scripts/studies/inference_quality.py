"""Pretrained-model inference quality (issue 73): SmolLM2-135M in Megatron scored on RULER-style
samples under DST's planned densities against uniform density at the same kept density, with a
positive control, a margin fixed by a pilot before the main run, and a verdict that can fail.

What runs (every choice is a flag; the defaults are the committed study's):

- **Samples**: ``--tasks`` (needle_single, needle_multikey alternating: a 7-digit answer) of
  ``--lengths`` 2048-4096 tokens (uniform), the needle at a depth uniform in [0.1, 0.9], seeds
  ``--seed-base`` + i (the pilot's from 100000: no main-run sample is a pilot's).
- **Packed and planned as the runtime would**: consecutive samples fill ``--dp`` x
  ``--microbatches`` micro-batches of ``--seq-length`` tokens (Megatron's fill rule); each such
  step goes through the runtime's own ``step.drafting.Drafter.draft`` (SAB's packing and the
  sequential baseline's, raced under do-no-harm, DST on the committed one) with
  ``--sparse-balance``'s defaults at d0 (``--sb-dense-below-tokens 0``: no document is routed
  to dense attention), a fresh sensitivity tracker (no training loss seen yet) and the analytic
  H100 latency table of this model on ``--pp`` stages (modelled timings). A sample's density in
  decoder layer l is its micro-batch's density in l's stage. Each sample is then scored alone:
  the plugin's attention selects per document, so a document scores as it does packed.
- **Arms** (``ARMS``), per sample, with densities set per layer through the attention's own
  budget: ``uniform`` d0; ``dst`` (DST's densities); ``matched`` (uniform at the density whose
  kept density over the study's documents equals DST's, chosen from the plans before any
  forward); ``shuffled`` (DST's per-document densities permuted across documents: does DST's
  assignment matter, beyond its distribution); ``control`` (uniform ``--control-factor`` x d0,
  the positive control: a known small harm the study must detect); ``dense`` (density 1).
- **Scores** (one teacher-forced forward per arm; the LM head on the answer's positions and on
  every ``--loss-stride``-th position only): ``answer_nll`` (mean over the answer's tokens),
  ``exact`` (greedy exact match), ``token_accuracy``, ``loss`` (the document's next-token loss on
  the strided positions: held-out loss, unbiased at 1/stride of the head's cost), and the kept
  density the kernel reported, layer-mean.
- **Verdict** (``eval.verdict``, paired one-sided t over samples): dst - matched on answer NLL
  and on loss within the margin, the control (control - uniform) detected, kept densities
  matched within ``--match-tolerance``. ``--pilot`` fixes the margin (``--margin-fraction`` of
  the control's mean harm per metric) and the n the power calculation asks for, and writes them
  in its JSON; the main run reads them (``--margin-from``) before its first forward.
- One thread (``--threads``): on this 2-core machine two threads ran a 3K forward 4x slower
  under other jobs' load.

    .venv/bin/python scripts/bench.py inference_quality --pilot --samples 30 \
        --json docs/results/inference_quality_pilot.json
    .venv/bin/python scripts/bench.py inference_quality --samples N \
        --margin-from docs/results/inference_quality_pilot.json \
        --json docs/results/inference_quality_cpu.json
    .venv/bin/python scripts/bench.py inference_quality --quick --json /tmp/iq.json   # smoke
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time

import numpy as np

from .common import parser, write_result

ARMS = ("uniform", "dst", "matched", "shuffled", "control", "dense")
PAIRS = (("dst", "matched"), ("dst", "uniform"), ("shuffled", "dst"), ("matched", "uniform"),
         ("control", "uniform"), ("uniform", "dense"))
METRICS = ("answer_nll", "loss")                   # the verdict's (lower is better)
SCORES = METRICS + ("exact", "token_accuracy", "kept")
PILOT_SEED_BASE = 100_000


def parse_args(argv=None):
    ap = parser(__doc__, "inference_quality")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--pilot", action="store_true",
                    help="fix the margin and the n for the main run (seeds from 100000)")
    ap.add_argument("--margin-from", default=None, metavar="PILOT.json",
                    help="the pilot's JSON: its margin and settings (the main run)")
    ap.add_argument("--margin-fraction", type=float, default=0.5,
                    help="the pilot's margin: this share of the control's mean harm")
    ap.add_argument("--tasks", nargs="+", default=["needle_single", "needle_multikey"])
    ap.add_argument("--lengths", type=int, nargs=2, default=[2048, 4096], metavar=("LO", "HI"))
    ap.add_argument("--seed-base", type=int, default=None)
    ap.add_argument("--density", type=float, default=0.5, help="d0")
    ap.add_argument("--control-factor", type=float, default=0.9)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--pp", type=int, default=3)
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--match-tolerance", type=float, default=0.005)
    ap.add_argument("--loss-stride", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="a cut of the model (--quick: 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    ap.add_argument("--gpu-form-from", default=None, metavar="PILOT.json",
                    help="only the GPU form's power calculation from a pilot's JSON (no forward)")
    g = ap.add_argument_group("the GPU form (_inference_bundle)")
    g.add_argument("--prepare", default=None, metavar="DIR",
                   help="here: write the device's bundle (samples, plans, packed weights)")
    g.add_argument("--bundle", default=None, metavar="DIR", help="there: score this bundle")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--budget-s", type=float, default=None,
                   help="no sample starts after this many seconds (the JSON says how many ran)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 layers, 256-512 tokens, 4 samples, block 16, DP 2 x 2 x PP 2 of "
                         "1K (what the test runs; its numbers mean nothing)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.lengths, args.samples = 2, [256, 512], 4
        args.dp, args.microbatches, args.pp, args.seq_length = 2, 2, 2, 1024
        args.loss_stride, args.pilot, args.block_size = 4, args.margin_from is None, 16
    if args.seed_base is None:
        args.seed_base = PILOT_SEED_BASE if args.pilot else 0
    if args.gpu_form_from or args.bundle:
        return args
    if args.prepare and args.pilot:
        ap.error("--prepare: the GPU form reads a pilot's margin (--margin-from), it is none")
    if args.pilot == (args.margin_from is not None) and not args.prepare:
        ap.error("give --pilot (fix the margin) or --margin-from PILOT.json (the main run)")
    if not 0 < args.control_factor < 1 or not 0 < args.density <= 1:
        ap.error(f"--control-factor {args.control_factor} and --density {args.density}: "
                 f"expected in (0, 1)")
    if args.samples < 2 or not 0 < args.lengths[0] <= args.lengths[1]:
        ap.error("--samples >= 2 and --lengths LO <= HI expected")
    return args


# ---- samples and plans ---------------------------------------------------------------------------

def make_samples(args, encode) -> list:
    from sparsebalance_megatron.eval import make_sample

    rng = random.Random(args.seed_base)
    return [make_sample(args.tasks[i % len(args.tasks)], rng.randint(*args.lengths),
                        round(rng.uniform(0.1, 0.9), 3), args.seed_base + i, encode)
            for i in range(args.samples)]


def sb_config(args):
    from sparsebalance_megatron.config import SparseBalanceConfig

    return SparseBalanceConfig(sparse_balance=True, density=args.density,
                               block_size=args.block_size, dense_below_tokens="0",
                               raise_headroom="0")


def latency_model(args, arch, seq_length=None, pp=None):
    """The analytic H100 table of this model (micro-batches of ``--seq-length``, ``--pp``
    stages, or the given ones)."""
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.latency.shape import ModelShape

    shape = ModelShape(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                       ffn_hidden_size=arch.ffn_hidden_size,
                       num_attention_heads=arch.num_attention_heads,
                       num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                       vocab_size=arch.vocab_size, seq_length=seq_length or args.seq_length)
    return LatencyModel.analytic(shape, pp=pp or args.pp, block_size=args.block_size)


def plan(args, arch, lengths: list) -> dict:
    """Per sample, its micro-batch's density per stage as the runtime's draft commits it, and
    per step what DST did; samples fill the steps in order (a last partial step is planned with
    the micro-batches it fills)."""
    from sparsebalance_megatron.batching.sensitivity import SensitivityTracker
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    sb, lm = sb_config(args), latency_model(args, arch)
    lm = lm.with_routing(sb.routing_threshold(lm.dense_below_tokens))
    bins, cur = [], []                 # Megatron's fill rule: a new bin when the next one does not fit
    for i, n in enumerate(lengths):
        if cur and sum(lengths[j] for j in cur) + n > args.seq_length:
            bins.append(cur)
            cur = []
        cur.append(i)
    bins.append(cur)
    per_step = args.dp * args.microbatches
    stages = np.full((len(lengths), args.pp), np.nan)
    unit, steps = [None] * len(lengths), []
    for k in range(0, len(bins), per_step):
        ids = sum(bins[k:k + per_step], [])
        m = min(args.microbatches, -(-len(bins[k:k + per_step]) // args.dp))
        drafter = Drafter(sb, lm, SensitivityTracker(signal=sb.sensitivity_signal), dp=args.dp,
                          capacity=args.seq_length, attention_layers=lm.layout.layers)
        draft = drafter.draft(len(steps), 0, [(i, 0, lengths[i]) for i in ids], m,
                              with_dst=True)
        dens, report = draft.payload
        index = (report.get("stand_down") or {}).get("packing_index", 0)
        batch = draft.packing(index)[0]
        for r, rank in enumerate(batch.micro_batches):
            for mb, segs in enumerate(rank):
                for sid, _, _ in segs:
                    stages[sid] = dens[r][mb]
                    unit[sid] = [len(steps), r, mb]
        steps.append({"samples": len(ids), "micro_batches": m, "packing": batch.method,
                      "units_cut": report["units_cut"], "units_raised": report["units_raised"],
                      "predicted_step_vs_static": report["step_time_planned_s"]
                      / report["step_time_static_s"]})
    if np.isnan(stages).any():
        raise RuntimeError("a sample was left out of every micro-batch of its step's plan")
    return {"stage_densities": stages, "unit": unit, "steps": steps,
            "stage_layers": list(lm.layout.layers)}


def layer_stage(stage_layers) -> list:
    return [s for s, n in enumerate(stage_layers) for _ in range(n)]


def kept_share(tokens: int, d: float, args) -> float:
    """The share of one document's causal block pairs the selection keeps at density d (the
    forced sink and diagonal blocks included): the latency model's count."""
    from sparsebalance_megatron.latency.work import attention_work

    return attention_work([tokens], d, args.block_size) / attention_work([tokens], 1.0,
                                                                         args.block_size)


def study_kept(tokens: list, layer_dens: list, args) -> float:
    """Kept density over the study's documents: per document the layer-mean kept share,
    weighted by its causal block pairs (a long document counts as its attention work does)."""
    from sparsebalance_megatron.latency.work import attention_work

    w = [attention_work([t], 1.0, args.block_size) for t in tokens]
    k = [np.mean([kept_share(t, d, args) for d in ld]) for t, ld in zip(tokens, layer_dens)]
    return float(np.dot(w, k) / np.sum(w))


def balanced_order(tokens: list, dst: list, matched: list, args) -> list:
    """The order the samples are scored in: each next one the sample that brings the scored
    ones' kept density under DST closest to theirs under the matched arm (weighted as
    ``study_kept``), so that a run cut short is still about matched. From the plans alone."""
    from sparsebalance_megatron.latency.work import attention_work

    gap = [attention_work([t], 1.0, args.block_size) * (
        np.mean([kept_share(t, d, args) for d in a]) - np.mean([kept_share(t, d, args)
                                                                for d in b]))
        for t, a, b in zip(tokens, dst, matched)]
    left, order, run = set(range(len(tokens))), [], 0.0
    while left:
        i = min(left, key=lambda j: (abs(run + gap[j]), j))
        order.append(i)
        left.remove(i)
        run += gap[i]
    return order


def arm_densities(args, planned: dict, tokens: list, n_layers: int) -> dict:
    """{arm: per sample, its per-layer densities}, the matched density and the kept densities
    the plans predict (before any forward)."""
    st = layer_stage(planned["stage_layers"])
    dst = [[float(row[st[j]]) for j in range(n_layers)] for row in planned["stage_densities"]]
    perm = np.random.RandomState(args.seed).permutation(len(dst))
    uni = lambda d: [[d] * n_layers for _ in tokens]            # noqa: E731
    target = study_kept(tokens, dst, args)
    lo, hi = args.density * 0.25, 1.0           # the smallest uniform density keeping >= DST's
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if study_kept(tokens, uni(mid), args) < target else (lo, mid)
    matched = min((lo, hi), key=lambda d: abs(study_kept(tokens, uni(d), args) - target))
    out = {"uniform": uni(args.density), "dst": dst, "matched": uni(matched),
           "shuffled": [dst[p] for p in perm], "control": uni(args.control_factor * args.density),
           "dense": uni(1.0)}
    return {"layers": out, "matched_density": matched, "perm": perm.tolist(),
            "kept_planned": {a: study_kept(tokens, v, args) for a, v in out.items()},
            "planned": {a: float(np.mean(v)) for a, v in out.items()}}


# ---- the model and its scores --------------------------------------------------------------------

def load(args):
    """(SmolLM2 with the plugin's sparse attention, its budget, tokenizer, architecture), from
    the GGUF's tensors as stored (``gguf_weights``; ``--layers``: the first N layers)."""
    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert

    activate_cpu_shims()
    init_single_process()
    torch.set_num_threads(args.threads)
    gguf = hf_convert.smollm2_gguf_path()
    _, tok = hf_convert.load_hf_gguf(gguf, with_model=False)
    with tempfile.TemporaryDirectory(prefix="iq_weights_") as tmp:
        gguf_weights.pack_gguf(gguf, tmp, args.layers)
        hf_sd, arch = gguf_weights.load_packed(tmp)
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, dense_below_tokens="0",
                             attention_backend="torch")          # sink and local as planned
    model = hf_convert.build_gpt_model(arch, "sparse", sb)
    hf_convert.load_converted_weights(model, hf_convert.convert_hf_state_dict(hf_sd, arch))
    model.eval().requires_grad_(False)
    return model, model.decoder.layers[0].self_attention.core_attention.budget, tok, arch


def score(model, budget, sample, layer_dens: list, stride: int) -> dict:
    """One teacher-forced forward of prompt + answer with ``layer_dens`` (one density a decoder
    layer): the answer's mean NLL, exact match and token accuracy, the loss of every
    ``stride``-th position's next token (prompt and answer), and the layer-mean kept density the
    kernel reported."""
    import torch

    dev = next(model.parameters()).device
    full = sample.input_ids + sample.answer_ids
    ids, n = full[:-1], len(sample.answer_ids)
    pos = list(range(0, len(ids) - n, stride)) + list(range(len(ids) - n, len(ids)))
    at = torch.tensor(pos, device=dev)

    def keep(_module, _inp, out):                   # the LM head on these positions only
        h = out[0] if isinstance(out, tuple) else out                  # [s, b, h]
        return (h[at],) + tuple(out[1:]) if isinstance(out, tuple) else h[at]

    budget.set_layer_densities({j + 1: d for j, d in enumerate(layer_dens)})
    budget.pop_stats()
    handle = model.decoder.register_forward_hook(keep)
    try:
        with torch.enable_grad():                  # the kernel reports its kept densities
            logits = model(torch.tensor([ids], device=dev),
                           torch.arange(len(ids), device=dev)[None],
                           attention_mask=None)[0].float()              # [len(pos), V]
    finally:
        handle.remove()
    kept = {}
    for _, _, layer, k, _ in budget.pop_stats():
        kept.setdefault(layer, []).extend(k)
    target = torch.tensor(full, device=dev)[at + 1]
    nll = -torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
    right = (logits[-n:].argmax(-1) == torch.tensor(sample.answer_ids, device=dev)).tolist()
    return {"answer_nll": float(nll[-n:].mean()), "exact": float(all(right)),
            "token_accuracy": sum(right) / n, "loss": float(nll.mean()),
            "kept": float(np.mean([np.mean(v) for v in kept.values()]))}


def smollm2_arch():
    """SmolLM2-135M's architecture from its GGUF's config (no weights read)."""
    from transformers import AutoConfig

    from sparsebalance_megatron.megatron.model import hf_convert

    d, name = os.path.split(hf_convert.smollm2_gguf_path())
    return hf_convert.arch_from_hf_config(AutoConfig.from_pretrained(d, gguf_file=name))


def gpu_form_only(args, rep) -> int:
    """The GPU form's size from a pilot's SDs, in the pilot's setting."""
    with open(args.gpu_form_from) as f:
        pilot = json.load(f)
    for k, v in pilot["config"].items():
        if k in ("density", "control_factor", "block_size"):
            setattr(args, k, v)
    size = rep.gpu_form_size(pilot["summary"], args, smollm2_arch())
    write_result(args.json, {"pilot": args.gpu_form_from, "pilot_n": pilot["summary"]["n"],
                             "gpu_form": size})
    for length, row in size["lengths"].items():
        print(f"{length} tokens: {row['samples']} samples in one {size['call_s']:.0f} s call "
              f"({row['sample_s']:.2f} s a sample, every arm); at 80% power they detect "
              + ", ".join(f"{k} {row[k + '_detectable']:.4f}" for k in METRICS
                          if k + "_detectable" in row))
    return 0


def study_doc(args, fixed: dict, planned: dict, dens: dict) -> dict:
    """The JSON's head: the setting, the margin, the arms and the plans (before any forward)."""
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, **fixed,
            "arms": {"uniform": args.density, "dst": "DST's plan (per stage)",
                     "matched": dens["matched_density"], "shuffled": "DST's, permuted",
                     "control": args.control_factor * args.density, "dense": 1.0},
            "stage_layers": planned["stage_layers"], "steps": planned["steps"],
            "planned_density": dens["planned"], "kept_density_planned": dens["kept_planned"],
            "matched_planned": abs(dens["kept_planned"]["dst"] - dens["kept_planned"]["matched"])
            <= args.match_tolerance, "samples": [], "complete": False}


def score_all(args, model, budget, arch, samples, tokens, planned, dens, order, doc, t0):
    """Each sample under every arm in ``order``, the JSON written after each (a run cut short
    keeps what it scored); no sample starts after ``--budget-s``."""
    from . import _inference_report as rep

    fixed_margin = doc.get("margin")
    t_scored = time.perf_counter()
    doc["scoring_order"] = order
    for n, i in enumerate(order):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            doc["stopped_by_budget_s"] = args.budget_s
            print(f"--budget-s {args.budget_s:g}: stopped after {n} samples", flush=True)
            break
        s = samples[i]
        t1 = time.perf_counter()
        res = {a: score(model, budget, s, dens["layers"][a][i], args.loss_stride) for a in ARMS}
        doc["samples"].append({
            "index": i, "task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed,
            "tokens": tokens[i], "unit": planned["unit"][i],
            "dst_stage_densities": list(map(float, planned["stage_densities"][i])),
            "shuffled_from": dens["perm"][i], "arms": res})
        print(f"[{n + 1}/{len(samples)}] {s.task} {s.length} depth {s.depth}: " + " ".join(
            f"{a} {r['answer_nll']:.3f}/{r['exact']:.0f}" for a, r in res.items())
              + f" ({time.perf_counter() - t1:.0f} s)", flush=True)
        doc["summary"] = rep.summarize(doc, args, fixed_margin)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.pilot and doc["summary"]:
            doc.update(rep.pilot_plan(doc["summary"], args, arch, (time.perf_counter() - t_scored)
                                      / (n + 1)))
        write_result(args.json, doc)
    doc["complete"] = len(doc["samples"]) == len(order)
    write_result(args.json, doc)
    for k, v in ((doc.get("summary") or {}).get("verdicts") or {}).items():
        from sparsebalance_megatron.eval.verdict import one_line
        print(f"{k}: {one_line(v)}")
    if args.pilot:
        print(f"margin {doc['margin']}, n needed {doc['n_needed']}, "
              f"{doc['seconds_per_sample']:.0f} s a sample")


def main(argv=None) -> int:
    from . import _inference_bundle as bundle
    from . import _inference_report as rep

    args = parse_args(argv)
    if args.gpu_form_from:
        return gpu_form_only(args, rep)
    if args.prepare:
        return bundle.prepare(args)
    if args.bundle:
        return bundle.run(args)
    t0 = time.perf_counter()
    fixed = rep.read_margin(args) if args.margin_from else {}     # before any forward
    model, budget, tok, arch = load(args)
    samples = make_samples(args, lambda s: tok(s, add_special_tokens=False)["input_ids"])
    tokens = [len(s.input_ids) + len(s.answer_ids) - 1 for s in samples]
    planned = plan(args, arch, [t + 1 for t in tokens])
    dens = arm_densities(args, planned, tokens, arch.num_layers)
    doc = study_doc(args, fixed, planned, dens)
    print(f"model and {len(samples)} samples ready in {time.perf_counter() - t0:.0f} s; "
          f"{len(planned['steps'])} steps planned: " + ", ".join(
              f"cut {s['units_cut']} raised {s['units_raised']}" for s in planned["steps"])
          + f"; matched density {dens['matched_density']:.4f}, kept planned " + ", ".join(
              f"{a} {v:.4f}" for a, v in dens["kept_planned"].items()), flush=True)
    order = balanced_order(tokens, dens["layers"]["dst"], dens["layers"]["matched"], args)
    score_all(args, model, budget, arch, samples, tokens, planned, dens, order, doc, t0)
    return 0
