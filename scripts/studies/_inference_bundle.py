"""``inference_quality``'s GPU form (issue 73 item 5): a bundle made here, scored on the device.

- ``--prepare DIR`` (here; needs transformers and gguf): the samples tokenized with SmolLM2's
  tokenizer, planned as the CPU study plans them (the runtime's draft on the analytic H100
  table), every arm's per-layer densities and the scoring order fixed before any forward, the
  margin read from the CPU pilot (``--margin-from``; its setting may differ only in the lengths
  and micro-batch size: the JSON says so), and SmolLM2's tensors as the GGUF stores them
  (``gguf_weights.pack_gguf``; the device dequantizes them with torch alone). Writes
  ``DIR/bundle.json``, ``DIR/ids.npz`` and ``DIR/weights/``.
- ``--bundle DIR`` (there; torch, megatron-core and this package): the model built from the
  packed tensors on ``--device`` (cuda: bf16 and the triton backend), the samples scored under
  the six arms in the bundle's order until ``--budget-s``, the JSON written after every
  sample with the CPU study's summary and verdicts (``inference_quality.score_all``).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np

BUNDLE = "bundle.json"
# settings a bundle may change against its CPU pilot: the GPU form's longer samples
ACROSS = ("lengths", "seq_length")


def prepare(args) -> int:
    from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert
    from sparsebalance_megatron.megatron.model.hf_convert import HFArchitecture

    from . import _inference_report as rep
    from . import inference_quality as iq

    out = args.prepare
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: --prepare {out!r}: expected a new or empty directory")
    fixed = rep.read_margin(args, ignore=ACROSS) if args.margin_from else {}
    gguf = hf_convert.smollm2_gguf_path()
    packed = gguf_weights.pack_gguf(gguf, os.path.join(out, "weights"), args.layers)
    arch = HFArchitecture.from_dict(packed["architecture"])
    _, tok = hf_convert.load_hf_gguf(gguf, with_model=False)
    samples = iq.make_samples(args, lambda s: tok(s, add_special_tokens=False)["input_ids"])
    tokens = [len(s.input_ids) + len(s.answer_ids) - 1 for s in samples]
    planned = iq.plan(args, arch, [t + 1 for t in tokens])
    dens = iq.arm_densities(args, planned, tokens, arch.num_layers)
    order = iq.balanced_order(tokens, dens["layers"]["dst"], dens["layers"]["matched"], args)
    cat = lambda key: np.concatenate([np.asarray(getattr(s, key), np.int32)  # noqa: E731
                                      for s in samples])
    np.savez_compressed(os.path.join(out, "ids.npz"), input_ids=cat("input_ids"),
                        answer_ids=cat("answer_ids"),
                        input_len=[len(s.input_ids) for s in samples],
                        answer_len=[len(s.answer_ids) for s in samples])
    made = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "prepare")},
            "fixed": fixed, "across_pilot": list(ACROSS) if fixed else [],
            "samples": [{"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed}
                        for s in samples],
            "tokens": tokens, "order": order,
            "planned": dict(planned, stage_densities=planned["stage_densities"].tolist()),
            "dens": dens}
    with open(os.path.join(out, BUNDLE), "w") as f:
        json.dump(made, f)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
    print(f"bundle {out}: {len(samples)} samples ({sum(tokens)} tokens), {len(planned['steps'])} "
          f"steps planned, matched density {dens['matched_density']:.4f}, "
          f"{size / 2 ** 20:.1f} MiB", flush=True)
    return 0


def read(bundle: str) -> tuple:
    """(the bundle's record, its samples with their token ids)."""
    with open(os.path.join(bundle, BUNDLE)) as f:
        made = json.load(f)
    z = np.load(os.path.join(bundle, "ids.npz"))
    cut = lambda key: np.split(z[key], np.cumsum(z[key.replace("ids", "len")])[:-1])  # noqa
    samples = [SimpleNamespace(**meta, input_ids=i.tolist(), answer_ids=a.tolist())
               for meta, i, a in zip(made["samples"], cut("input_ids"), cut("answer_ids"))]
    return made, samples


def load_model(args, bundle: str):
    """SmolLM2 (or the bundle's cut of it) with the plugin's sparse attention on
    ``args.device``, from the packed tensors; (model, budget, arch)."""
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
    """Score a bundle (there): the CPU study's loop on the bundle's plans and order."""
    from . import inference_quality as iq

    t0 = time.perf_counter()
    made, samples = read(args.bundle)
    for k, v in made["config"].items():          # the bundle's setting decides these
        if k not in ("device", "budget_s", "bundle", "threads", "margin_from"):
            setattr(args, k, v)
    model, budget, arch = load_model(args, args.bundle)
    planned = dict(made["planned"], stage_densities=np.asarray(
        made["planned"]["stage_densities"]))
    doc = iq.study_doc(args, made["fixed"], planned, made["dens"])
    doc["bundle"] = {"path": args.bundle, "across_pilot": made["across_pilot"],
                     "device": args.device}
    if args.device == "cuda":
        import torch
        doc["device_name"] = torch.cuda.get_device_name()
    print(f"bundle read and model on {args.device} in {time.perf_counter() - t0:.0f} s: "
          f"{len(samples)} samples", flush=True)
    iq.score_all(args, model, budget, arch, samples, made["tokens"], planned, made["dens"],
                 made["order"], doc, t0)
    return 0
