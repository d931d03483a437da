"""The end-to-end call's full-depth Qwen2.5-0.5B (24 layers) before a device runs it: memory and
seconds per step, per run and per call, from the committed run-5 figures of the 8-layer model
(``docs/results/gpu_check_h200_run5_e2e.json``) and the memory model (``latency.memory``). Pure
Python (the train step imports ``memory_plan``)."""

from __future__ import annotations

import json
import os

from .common import ROOT, parser, write_result

RUN5 = os.path.join(ROOT, "docs", "results", "gpu_check_h200_run5_e2e.json")
RUN5_LAYERS = 8
LAYERS = 24
TRAIN_STEPS = 10
MICROBATCHES = 2
FIT_SHARE = 0.9
ATTENTION_FWD_SHARE = 0.26      # cuDNN's forward of its fwd+bwd at 14 / 2 x 64, 32K (run 5)
RECOMPUTE_FLAGS = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1"]
SEQUENCES = {"long_docs": 32768, "long_docs_64k": 65536, "long_docs_128k": 131072}
DEVICE_GIB = {"H200": 139.0, "H100": 78.0}      # what the machines report (about)


def _shape(seq: int, layers: int = LAYERS, recompute: bool = False):
    from sparsebalance_megatron.latency.shape import ModelShape
    return ModelShape(num_layers=layers, seq_length=seq,
                      recompute_granularity="full" if recompute else "none")


def peak_gib(seq: int, layers: int = LAYERS, recompute: bool = False) -> float:
    """Estimated peak GiB of one GPU training the model at ``seq`` tokens per micro-batch."""
    from sparsebalance_megatron.latency.layout import PipelineLayout
    from sparsebalance_megatron.latency.memory import MemoryModel
    model = MemoryModel(_shape(seq, layers, recompute), logit_bytes=6.0)
    return model.peak_gib(PipelineLayout.even(layers, 1), seq, MICROBATCHES)


def memory_plan(seq: int, device_gib: float, layers: int = LAYERS) -> dict:
    """{"flags": recomputation flags or [], "peak_gib": estimate, "fits": bool, "why": words}
    for a data set of ``seq``-token micro-batches on a device of ``device_gib``."""
    room = FIT_SHARE * device_gib
    plain, full = peak_gib(seq, layers), peak_gib(seq, layers, recompute=True)
    if plain <= room:
        return {"flags": [], "peak_gib": plain, "fits": True,
                "why": f"{plain:.0f} GiB of {device_gib:.0f} without recomputation"}
    if full <= room:
        return {"flags": list(RECOMPUTE_FLAGS), "peak_gib": full, "fits": True,
                "why": f"{full:.0f} GiB of {device_gib:.0f} with full recomputation "
                       f"({plain:.0f} without)"}
    return {"flags": [], "peak_gib": full, "fits": False,
            "why": f"{full:.0f} GiB with full recomputation: over {FIT_SHARE:.0%} of "
                   f"{device_gib:.0f} GiB"}


def nonattention_scale(layers: int = LAYERS, base_layers: int = RUN5_LAYERS) -> float:
    """The non-attention step's growth from ``base_layers`` to ``layers``: the GEMM FLOPs per
    token of the layers (QKV, projection, gated MLP) and of the LM head (once)."""
    s = _shape(32768)
    h, f, v = s.hidden_size, s.ffn_hidden_size, s.vocab_size
    layer = 2 * h * (s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim \
        + 2 * s.num_attention_heads * s.head_dim * h + 2 * h * f * 3
    head = 2 * h * v
    return (head + layers * layer) / (head + base_layers * layer)


def run5_parts(path: str = RUN5) -> dict:
    """Per data set of run 5: the 8-layer step's mean non-attention and attention seconds
    (varlen, cuDNN) over dense + SAB's steady steps, each run's mean steady step, kept density
    and fixed seconds (its seconds less ten steps)."""
    train = json.load(open(path))["steps"]["train"]
    tiles = train["dense_tile_us"]
    out = {}
    for data, seq in SEQUENCES.items():
        runs = {k.split("/")[1]: r for k, r in train["runs"].items()
                if k.split("/")[0] == data and r.get("step_s")}
        base = runs.get("dense_sab")
        if not base:
            continue
        t = tiles[str(min(int(n) for n in tiles if int(n) >= seq))] \
            if any(int(n) >= seq for n in tiles) else tiles[max(tiles, key=int)]
        steps = sorted(base["step_s"], key=int)
        work = [RUN5_LAYERS * base["step_dense_work"][k] for k in steps]
        attn = sum(w * t["varlen"] for w in work) / len(steps) / 1e6
        step = sum(base["step_s"][k] for k in steps) / len(steps)
        out[data] = {"step_s": step, "attention_varlen_s": attn,
                     "attention_cudnn_s": sum(w * t["cudnn"] for w in work) / len(steps) / 1e6,
                     "nonattention_s": step - attn, "runs": {
                         v: {"step_s": sum(r["step_s"].values()) / len(r["step_s"]),
                             "fixed_s": r["seconds"] - TRAIN_STEPS * sum(
                                 r["step_s"].values()) / len(r["step_s"]),
                             "density": r.get("mean_density")} for v, r in runs.items()}}
    return out


def estimate(device_gib: float = DEVICE_GIB["H200"], layers: int = LAYERS,
             path: str = RUN5) -> dict:
    """Per data set: the memory plan, and per run the estimated step and run seconds at
    ``layers``; the 128K data set from the 64K one's figures (its tiles and steps doubled and
    quadrupled as tokens and causal tiles grow)."""
    parts = run5_parts(path)
    if "long_docs_64k" in parts:      # 128K: twice the tokens, four times the causal tiles
        p = parts["long_docs_64k"]
        parts["long_docs_128k"] = dict(
            nonattention_s=2 * p["nonattention_s"], attention_varlen_s=4 * p[
                "attention_varlen_s"], attention_cudnn_s=4 * p["attention_cudnn_s"],
            runs={v: dict(r, step_s=2 * p["nonattention_s"] + 4 * (r["step_s"] - p[
                "nonattention_s"])) for v, r in p["runs"].items()})
    k, scale = layers / RUN5_LAYERS, nonattention_scale(layers)
    out = {}
    for data, p in parts.items():
        mem = memory_plan(SEQUENCES[data], device_gib, layers)
        rc = bool(mem["flags"])
        layer_share = 1 - 1 / scale          # of the scaled non-attention time: the layers'
        nonattn = p["nonattention_s"] * scale * (1 + layer_share / 3 if rc else 1)
        runs = {}
        for v, r in p["runs"].items():
            attn = (p["attention_cudnn_s"] if v == "dense_sab_sdpa" else
                    r["step_s"] - p["nonattention_s"]) * k
            step = nonattn + attn * (1 + ATTENTION_FWD_SHARE if rc else 1)
            runs[v] = {"step_s": step, "run_s": r["fixed_s"] + TRAIN_STEPS * step}
        cudnn = nonattn + p["attention_cudnn_s"] * k * (1 + ATTENTION_FWD_SHARE if rc else 1)
        out[data] = {"memory": mem, "nonattention_s": nonattn, "cudnn_priced_step_s": cudnn,
                     "tokens_per_step": MICROBATCHES * SEQUENCES[data], "runs": runs}
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "full_depth")
    p.add_argument("--device-gib", type=float, default=DEVICE_GIB["H200"])
    p.add_argument("--layers", type=int, default=LAYERS)
    args = p.parse_args(argv)
    got = estimate(args.device_gib, args.layers)
    print(f"full-depth estimate: {args.layers} layers on {args.device_gib:.0f} GiB "
          f"(non-attention x {nonattention_scale(args.layers):.2f}, attention x "
          f"{args.layers / RUN5_LAYERS:g} of run 5's {RUN5_LAYERS} layers)")
    for data, e in got.items():
        print(f"{data}: {e['memory']['why']}; cuDNN-priced dense step "
              f"{e['cudnn_priced_step_s']:.2f} s"
              + ("" if e["memory"]["fits"] else " (not run)"))
        for v, r in e["runs"].items():
            print(f"  {v:16s} step {r['step_s']:.2f} s, run {r['run_s']:.0f} s")
    write_result(args.json, {"layers": args.layers, "device_gib": args.device_gib,
                             "source": os.path.relpath(RUN5, ROOT), "estimate": got})
    return 0
