"""GGUF -> packed weights -> torch-only dequantization (``model/gguf_weights.py``), on SmolLM2-135M.

References: ``gguf.quants.dequantize`` for every stored type, transformers' GGUF loader (a 2-layer
cut of SmolLM2, so its weights map stays cheap) for names, shapes, the q/k row order and the
architecture, and its logits for the megatron model built from the packed weights. The GGUF is
parsed once per module: ``gguf.GGUFReader`` of that path returns the parsed reader (read-only),
to ``pack_gguf`` and to transformers alike.
"""

import json
import os
import shutil
import types

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sparsebalance_megatron.megatron.model import gguf_weights, hf_convert  # noqa: E402
from sparsebalance_megatron.megatron.model.gguf_weights import (  # noqa: E402
          dequantize, load_packed, pack_gguf, read_architecture)

try:
    GGUF_PATH = hf_convert.smollm2_gguf_path()
except hf_convert.MissingPackageError as e:
    pytest.skip(f"SmolLM2 GGUF absent: {e}", allow_module_level=True)

LAYERS = 2


@pytest.fixture(scope="module", autouse=True)
def reader():
    parsed = gguf.GGUFReader(GGUF_PATH)
    real = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader",
                   lambda path, *a, **k: parsed if os.path.samefile(path, GGUF_PATH)
                   else real(path, *a, **k))
        yield parsed


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("packed"))
    return out, pack_gguf(GGUF_PATH, out, num_layers=LAYERS)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF load (what ``hf_convert.load_hf_gguf`` does), first 2 layers."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()
    d, name = os.path.split(GGUF_PATH)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                num_hidden_layers=LAYERS).eval()


def copy_of(packed, tmp_path):
    shutil.copytree(packed[0], tmp_path / "p")
    return tmp_path / "p"


def test_dequantize_matches_gguf(reader):
    """Each stored type on real tensors (F16 on fp16 values: the file has none) equals gguf's."""
    picks = {"token_embd.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight",
             "blk.29.ffn_gate.weight", "blk.0.attn_norm.weight", "output_norm.weight"}
    seen = set()
    for t in reader.tensors:
        if t.name not in picks:
            continue
        raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8))
        got = dequantize(raw, t.tensor_type.name, [int(s) for s in reversed(t.shape.tolist())])
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        assert got.dtype == torch.float32 and torch.equal(got, ref.reshape(got.shape)), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q4_1", "F32"}
    f16 = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).half()
    ref = gguf.quants.dequantize(f16.numpy(), gguf.GGMLQuantizationType.F16)
    got = dequantize(f16.reshape(-1).view(torch.uint8), "F16", [4, 64])
    assert torch.equal(got, torch.from_numpy(np.asarray(ref, dtype=np.float32)))


def test_packed_equals_transformers(packed, hf_model):
    directory, record = packed
    sd, arch = load_packed(directory)
    assert record["architecture"] == arch.to_dict()
    assert arch == hf_convert.arch_from_hf_config(hf_model.config)   # 2 layers on both sides
    assert read_architecture(GGUF_PATH, LAYERS) == arch                # without packing
    assert read_architecture(GGUF_PATH).num_layers == 30
    assert record["source"]["file"] == os.path.basename(GGUF_PATH)
    assert all(e["offset"] % 64 == 0 for e in record["tensors"])
    ref = hf_model.state_dict()
    assert sorted(sd) == sorted(ref)
    for name, w in ref.items():
        assert sd[name].dtype == torch.float32 and sd[name].shape == w.shape, name
        assert torch.equal(sd[name], w), name
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]      # tied, as transformers


def test_tokenizer_is_the_one_auto_tokenizer_builds():
    """``load_hf_gguf``'s tokenizer, built without ``AutoTokenizer``'s config parse, is the one
    ``AutoTokenizer`` builds (the config here comes from the module's parsed reader)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    d, name = os.path.split(GGUF_PATH)
    ref = AutoTokenizer.from_pretrained(d, gguf_file=name)
    got = hf_convert.load_hf_gguf(GGUF_PATH, with_model=False)[1]
    assert type(got) is type(ref)
    assert got.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert got.init_kwargs == ref.init_kwargs and len(got) == len(ref)
    assert got.special_tokens_map == ref.special_tokens_map
    text = "def f(x):\n    return x + 1  # é 日本 <|im_start|> The passkey is 71432."
    for special in (False, True):
        assert got(text, add_special_tokens=special)["input_ids"] \
            == ref(text, add_special_tokens=special)["input_ids"]


@pytest.mark.usefixtures("megatron_single_process")    # tests/conftest.py
def test_megatron_from_packed_matches_transformers(packed, hf_model):
    sd, arch = load_packed(packed[0])
    model = hf_convert.build_gpt_model(arch)
    hf_convert.load_converted_weights(model, hf_convert.convert_hf_state_dict(sd, arch))
    model.eval()
    ids = torch.randint(0, arch.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids, torch.arange(48).unsqueeze(0), attention_mask=None)
        ref = hf_model(ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_pack_and_load_errors(packed, tmp_path, reader, monkeypatch):
    for bad in (0, 31, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"num_layers={bad!r}: expected an int in 1\.\.30"):
            pack_gguf(GGUF_PATH, str(tmp_path / "x"), num_layers=bad)
    other = types.SimpleNamespace(get_field=lambda key: types.SimpleNamespace(
        contents=lambda: "qwen2") if key == "general.architecture" else None)
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: other)
    gguf_weights._open.cache_clear()            # the file is parsed once a process
    with pytest.raises(ValueError, match="general.architecture='qwen2', expected 'llama'"):
        pack_gguf(GGUF_PATH, str(tmp_path / "x"))

    d = copy_of(packed, tmp_path)
    record = json.loads((d / "weights.json").read_text())
    record["tensors"][1]["type"] = "Q4_K"
    (d / "weights.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.input_layernorm.weight' has "
                                         r"type 'Q4_K': expected one of"):
        load_packed(str(d))
    record["format"] = 2
    (d / "weights.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="format=2, expected 1"):
        load_packed(str(d))

    d = tmp_path / "t"
    shutil.copytree(packed[0], d)
    size = os.path.getsize(d / "weights.bin")
    os.truncate(d / "weights.bin", size - 1)
    with pytest.raises(ValueError, match=rf"weights.bin': {size - 1} bytes, expected {size} bytes"):
        load_packed(str(d))
    os.remove(d / "weights.bin")
    with pytest.raises(ValueError, match=rf"weights.bin': missing, expected {size} bytes"):
        load_packed(str(d))
    with pytest.raises(ValueError, match="expected a packed-weights record"):
        load_packed(str(tmp_path / "nowhere"))
