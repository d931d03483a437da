"""``inference_quality``'s GPU form: a bundle made here, scored on the device (no tokenizer, no
GGUF reader and no network there).

- ``--prepare DIR`` (here): the study's samples tokenized, its layouts' plans and every arm's
  vectors fixed (``inference_quality.arms``), the margins read from the CPU pilot
  (``--margin-from``; the GPU form may lengthen the samples, ``--lengths`` and
  ``--seq-length``, and the JSON says so), and SmolLM2's tensors as the GGUF stores them
  (``gguf_weights.pack_gguf``). Writes ``DIR/bundle.json``, ``DIR/ids.npz`` and
  ``DIR/weights/``.
- ``--bundle DIR`` (there): the model built from the packed tensors on ``--device`` (cuda:
  bf16 and the triton backend), the bundle's forwards scored in order until ``--budget-s``,
  then the CPU study's summary and verdicts (``inference_quality.summarize``) on the samples
  whose every arm was scored.

    .venv/bin/python scripts/bench.py inference_quality_gpu --prepare .sb-inference/bundle \\
        --margin-from docs/results/inference_quality_pilot.json --samples 300 \\
        --lengths 15360 16000 --seq-length 16384
    python scripts/bench.py inference_quality_gpu --bundle DIR --device cuda --budget-s 400 \\
        --json $OUT/inference/inference_quality_gpu.json                      # there
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np

from . import inference_quality as iq
from . import smollm2
from .common import write_result

BUNDLE = "bundle.json"
ACROSS = ("lengths", "seq_length")     # what the GPU form may change against its CPU pilot


def parse_args(argv=None):
    import argparse
    import sys

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--prepare", default=None, metavar="DIR")
    own.add_argument("--bundle", default=None, metavar="DIR")
    own.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    own.add_argument("--budget-s", type=float, default=None,
                     help="no forward starts after this many seconds")
    mine, rest = own.parse_known_args(argv if argv is not None else sys.argv[1:])
    if (mine.prepare is None) == (mine.bundle is None):
        own.error("give --prepare DIR (here) or --bundle DIR (on the device)")
    args = iq.parse_args((["--pilot"] if mine.bundle else []) + rest)   # (the bundle's own)
    for k, v in vars(mine).items():
        setattr(args, k, v)
    return args


def prepare(args) -> int:
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert
    from sparsebalance_megatron.megatron.model.hf_convert import HFArchitecture

    out = args.prepare
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: --prepare {out!r}: expected a new or empty directory")
    saved = {k: getattr(args, k) for k in ACROSS}
    pilot = json.load(open(args.margin_from))["config"] if args.margin_from else {}
    for k in ACROSS:                   # the margin holds for the pilot's setting but these
        if k in pilot:
            setattr(args, k, pilot[k])
    fixed = iq.read_margin(args) if args.margin_from else {}
    for k, v in saved.items():
        setattr(args, k, v)
    if fixed:
        fixed["margin_source"]["changed_since_pilot"] = {
            k: [pilot.get(k), getattr(args, k)] for k in ACROSS if pilot.get(k) != getattr(args, k)}
    packed = gguf_weights.pack_gguf(hf_convert.smollm2_gguf_path(), os.path.join(out, "weights"),
                                    args.layers)
    arch = HFArchitecture.from_dict(packed["architecture"])
    samples = iq.make_samples(args, smollm2.encoder(smollm2.tokenizer()))
    tokens = [smollm2.tokens(s) for s in samples]
    planned = iq.arms(args, arch, tokens)
    cat = lambda key: np.concatenate([np.asarray(getattr(s, key), np.int32)  # noqa: E731
                                      for s in samples])
    np.savez_compressed(os.path.join(out, "ids.npz"), input_ids=cat("input_ids"),
                        answer_ids=cat("answer_ids"),
                        input_len=[len(s.input_ids) for s in samples],
                        answer_len=[len(s.answer_ids) for s in samples])
    made = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "prepare")},
            "fixed": fixed, "tokens": tokens,
            "samples": [{"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed,
                         "answer_mask": s.scored()} for s in samples],
            "vectors": {k: [list(v) for v in vs] for k, vs in planned["vectors"].items()},
            "layouts": planned["layouts"], "kept_planned": planned["kept_planned"]}
    with open(os.path.join(out, BUNDLE), "w") as f:
        json.dump(made, f)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
    print(f"bundle {out}: {len(samples)} samples ({sum(tokens)} tokens), "
          f"{size / 2 ** 20:.1f} MiB", flush=True)
    return 0


def read(bundle: str) -> tuple:
    """(the bundle's record, its samples with their token ids)."""
    with open(os.path.join(bundle, BUNDLE)) as f:
        made = json.load(f)
    z = np.load(os.path.join(bundle, "ids.npz"))
    cut = lambda key: np.split(z[key], np.cumsum(z[key.replace("ids", "len")])[:-1])  # noqa
    samples = []
    for meta, i, a in zip(made["samples"], cut("input_ids"), cut("answer_ids")):
        mask = meta.pop("answer_mask")
        samples.append(SimpleNamespace(**meta, input_ids=i.tolist(), answer_ids=a.tolist(),
                                       scored=lambda m=mask: list(m)))
    return made, samples


def load_model(args, bundle: str):
    """SmolLM2 (or the bundle's cut of it) with the plugin's sparse attention on
    ``args.device``, from the packed tensors: (model, budget, arch)."""
    import torch

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert

    cuda = args.device == "cuda"
    activate_cpu_shims()                                     # a no-op where CUDA is
    init_single_process()
    torch.set_num_threads(args.threads)
    hf_sd, arch = gguf_weights.load_packed(os.path.join(bundle, "weights"))
    sb = SparseBalanceConfig(sparse_attention=True, density=args.density,
                             block_size=args.block_size, dense_below_tokens="0",
                             attention_backend="triton" if cuda else "torch")
    model = hf_convert.build_gpt_model(arch, "sparse", sb)
    hf_convert.load_converted_weights(model, hf_convert.convert_hf_state_dict(hf_sd, arch))
    del hf_sd
    model = model.to(args.device, torch.bfloat16 if cuda else torch.float32)
    model.eval().requires_grad_(False)
    return model, model.decoder.layers[0].self_attention.core_attention.budget, arch


def run(args) -> int:
    """Score a bundle (there): its forwards in order until ``--budget-s``, then the summary."""
    t0 = time.perf_counter()
    made, samples = read(args.bundle)
    for k, v in made["config"].items():          # the bundle's setting decides these
        if k not in ("device", "budget_s", "bundle", "threads", "json"):
            setattr(args, k, v)
    model, budget, arch = load_model(args, args.bundle)
    vectors = {k: [tuple(v) for v in vs] for k, vs in made["vectors"].items()}
    names = list(vectors)
    scored = []
    for i, s in enumerate(samples):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            break
        got = {}
        for n in names:
            v = vectors[n][i]
            if v not in got:
                got[v] = smollm2.score(model, budget, s,
                                       smollm2.layer_densities(v, arch.num_layers),
                                       args.loss_stride)
        scored.append({"index": i, "task": s.task, "length": s.length, "seed": s.seed,
                       "tokens": made["tokens"][i],
                       "arms": {n: {k: got[vectors[n][i]].get(k) for k in iq.SCORES}
                                for n in names}})
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json"}, **made["fixed"],
           "layouts": made["layouts"], "kept_density_planned": made["kept_planned"],
           "samples": scored, "bundle": {"path": args.bundle, "device": args.device},
           "complete": len(scored) == len(samples)}
    if args.device == "cuda":
        import torch
        doc["device_name"] = torch.cuda.get_device_name()
    doc["summary"] = iq.summarize(doc, args, made["fixed"].get("margin") or {})
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.json, doc)
    print(f"{len(scored)} of {len(samples)} samples scored on {args.device} in "
          f"{doc['wall_s']:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return prepare(args) if args.prepare else run(args)
