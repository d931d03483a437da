"""A llama GGUF's weights packed here, dequantized elsewhere with torch alone.

``pack_gguf`` (needs the ``gguf`` package) copies each tensor's stored bytes, quantized blocks as
they are, into ``weights.bin`` (every tensor at a 64-byte aligned offset) and describes them in
``weights.json``: ``{"format": 1, "architecture": HFArchitecture.to_dict(), "source": {"file",
"sha256"}, "tensors": [{"name" (Hugging Face Llama name), "type", "shape" (torch order), "offset",
"nbytes"}]}``. ``load_packed`` reads the pair on a machine without ``gguf`` or ``transformers``:
float32 tensors keyed by Hugging Face names, q/k rows back in Hugging Face's RoPE layout (llama.cpp
permutes them), ready for ``hf_convert.convert_hf_state_dict``. ``read_architecture``: the
architecture alone, from the same parse (a GGUF is parsed once a process: its metadata, the
tokenizer's vocabulary included, takes seconds).

Stored types: Q8_0 (blocks of 32: fp16 d, 32 int8 q; w = d*q), Q4_1 (blocks of 32: fp16 d,
fp16 m, 16 bytes, element j the low nibble of byte j and element j+16 its high nibble;
w = d*q + m), F32, F16. May import torch and ``hf_convert``, and (lazily, in ``pack_gguf`` and
``read_architecture`` only) ``gguf``; never megatron or transformers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
from typing import Optional

import torch

from .hf_convert import HFArchitecture, require_package

FORMAT = 1
JSON_FILE, BIN_FILE = "weights.json", "weights.bin"
ALIGN = 64
# type -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_1": (32, 20), "F32": (1, 4), "F16": (1, 2)}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> tuple[Optional[int], str]:
    """llama.cpp tensor name -> ``(block index or None, Hugging Face Llama name)``."""
    if gguf_name in _GLOBAL:
        return None, _GLOBAL[gguf_name]
    m = _BLK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {gguf_name!r}: expected token_embd/output_norm/output or "
                         f"blk.N.{{{','.join(_BLOCK)}}}.weight (a plain llama model)")
    i = int(m.group(1))
    return i, f"model.layers.{i}.{_BLOCK[m.group(2)]}.weight"


def expected_nbytes(name: str, kind: str, shape) -> int:
    """Bytes a tensor of ``kind`` and torch-order ``shape`` occupies; unknown types raise."""
    if kind not in BLOCKS:
        raise ValueError(f"tensor {name!r} has type {kind!r}: expected one of {sorted(BLOCKS)}")
    per_block, block_bytes = BLOCKS[kind]
    if not shape or shape[-1] % per_block:
        raise ValueError(f"tensor {name!r}: shape {list(shape)} of type {kind}: expected a "
                         f"last dimension divisible by {per_block}")
    return math.prod(shape) // per_block * block_bytes


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _meta(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"GGUF metadata lacks {key!r}: expected a llama model's metadata")
    return field.contents()


def _architecture(reader, block_count_kept: int, vocab: int, tied: bool) -> HFArchitecture:
    heads = int(_meta(reader, "llama.attention.head_count"))
    hidden = int(_meta(reader, "llama.embedding_length"))
    if hidden % heads:
        raise ValueError(f"llama.embedding_length={hidden}: expected a multiple of "
                         f"llama.attention.head_count={heads}")
    key_len = reader.get_field("llama.attention.key_length")
    if key_len is not None and int(key_len.contents()) != hidden // heads:
        raise ValueError(f"llama.attention.key_length={key_len.contents()}: expected "
                         f"embedding_length // head_count = {hidden // heads}")
    scaling = reader.get_field("llama.rope.scaling.type")
    if scaling is not None and scaling.contents() not in ("none", ""):
        raise ValueError(f"llama.rope.scaling.type={scaling.contents()!r}: only plain RoPE "
                         f"('none') is supported")
    kv = reader.get_field("llama.attention.head_count_kv")
    return HFArchitecture(
        model_type="llama", num_layers=block_count_kept, hidden_size=hidden,
        ffn_hidden_size=int(_meta(reader, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_query_groups=int(kv.contents()) if kv is not None else heads,
        kv_channels=hidden // heads, vocab_size=vocab,
        rotary_base=float(_meta(reader, "llama.rope.freq_base")),
        layernorm_epsilon=float(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings=tied, add_qkv_bias=False,
        max_position_embeddings=int(_meta(reader, "llama.context_length")))


@functools.lru_cache(maxsize=2)
def _open(gguf_path: str):
    """The GGUF's reader (its tensors memory-mapped), once a process; a llama, little-endian."""
    require_package("gguf", "gguf")
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch_field = reader.get_field("general.architecture")
    arch_name = arch_field.contents() if arch_field is not None else None
    if arch_name != "llama":
        raise ValueError(f"{gguf_path!r}: general.architecture={arch_name!r}, expected 'llama'")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{gguf_path!r}: a big-endian GGUF, expected little-endian")
    if "token_embd.weight" not in {t.name for t in reader.tensors}:
        raise ValueError(f"{gguf_path!r} has no token_embd.weight: expected a llama model")
    return reader


def _kept(reader, gguf_path: str, num_layers) -> int:
    blocks = int(_meta(reader, "llama.block_count"))
    keep = blocks if num_layers is None else num_layers
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= blocks:
        raise ValueError(f"num_layers={num_layers!r}: expected an int in 1..{blocks} "
                         f"(llama.block_count of {os.path.basename(gguf_path)})")
    return keep


def read_architecture(gguf_path: str, num_layers: Optional[int] = None) -> HFArchitecture:
    """The architecture ``pack_gguf`` records, without packing (``num_layers``: its)."""
    reader = _open(os.path.abspath(gguf_path))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    tied = "output.weight" not in {t.name for t in reader.tensors}
    return _architecture(reader, _kept(reader, gguf_path, num_layers),
                         int(embed.shape.tolist()[-1]), tied)


def pack_gguf(gguf_path: str, out_dir: str, num_layers: Optional[int] = None) -> dict:
    """Write ``out_dir/weights.bin`` and ``weights.json`` from a llama GGUF; return the json dict.

    ``num_layers``: keep only the first N blocks (1..llama.block_count), a cut-down model.
    """
    reader = _open(os.path.abspath(gguf_path))
    keep = _kept(reader, gguf_path, num_layers)
    entries, chunks, offset = [], [], 0
    for t in reader.tensors:
        layer, name = hf_name(t.name)
        if layer is not None and layer >= keep:
            continue
        kind = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]
        nbytes = expected_nbytes(t.name, kind, shape)
        if nbytes != int(t.n_bytes):
            raise ValueError(f"GGUF tensor {t.name!r}: {t.n_bytes} bytes, expected {nbytes} for "
                             f"{kind} {shape}")
        offset = -(-offset // ALIGN) * ALIGN
        entries.append({"name": name, "type": kind, "shape": shape, "offset": offset,
                        "nbytes": nbytes})
        chunks.append((offset, reader.data[t.data_offset:t.data_offset + nbytes]))
        offset += nbytes
    arch = read_architecture(gguf_path, keep)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, BIN_FILE), "wb") as f:
        for off, data in chunks:
            f.write(b"\0" * (off - f.tell()))
            f.write(data.tobytes())
    record = {"format": FORMAT, "architecture": arch.to_dict(),
              "source": {"file": os.path.basename(gguf_path), "sha256": _file_sha256(gguf_path)},
              "tensors": entries}
    with open(os.path.join(out_dir, JSON_FILE), "w") as f:
        json.dump(record, f, indent=1)
    return record


def dequantize(raw: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """A tensor's stored bytes (1-D uint8, on any device) -> float32 of torch-order ``shape``."""
    per_block, block_bytes = BLOCKS[kind]

    def f16(cols):   # [n_blocks, 2] bytes -> [n_blocks, 1] float32
        return cols.contiguous().view(torch.float16).float()

    if kind == "F32":
        out = raw.view(torch.float32).clone()
    elif kind == "F16":
        out = raw.view(torch.float16).float()
    elif kind == "Q8_0":
        b = raw.view(-1, block_bytes)
        out = b[:, 2:].contiguous().view(torch.int8).float() * f16(b[:, :2])
    elif kind == "Q4_1":
        b = raw.view(-1, block_bytes)
        qs = b[:, 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
        out = f16(b[:, :2]) * q + f16(b[:, 2:4])
    else:
        raise ValueError(f"type {kind!r}: expected one of {sorted(BLOCKS)}")
    return out.reshape(shape)


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf``: ``w.reshape(n_head, 2,
    rows // n_head // 2, cols).swapaxes(1, 2)``), as transformers' GGUF loader does."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_record(directory: str) -> dict:
    path = os.path.join(directory, JSON_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r}: expected a packed-weights record written by pack_gguf "
                         f"({e})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path!r}: format={got!r}, expected {FORMAT}")
    return record


def load_packed(directory: str, device="cpu") -> tuple[dict, HFArchitecture]:
    """``(state dict, HFArchitecture)`` from a ``pack_gguf`` directory, dequantized on ``device``.

    The state dict has float32 tensors under Hugging Face Llama names, as a transformers
    ``LlamaForCausalLM.state_dict()`` does (a tied model's ``lm_head.weight`` is the embedding).
    """
    record = _read_record(directory)
    arch = HFArchitecture.from_dict(record["architecture"])
    bin_path = os.path.join(directory, BIN_FILE)
    size = os.path.getsize(bin_path) if os.path.exists(bin_path) else None
    end = 0
    for e in record["tensors"]:
        nbytes = expected_nbytes(e["name"], e["type"], e["shape"])
        if nbytes != e["nbytes"] or e["offset"] % ALIGN:
            raise ValueError(f"{bin_path!r}: tensor {e['name']!r} at offset {e['offset']} with "
                             f"{e['nbytes']} bytes, expected {nbytes} bytes at a multiple of "
                             f"{ALIGN}")
        end = max(end, e["offset"] + nbytes)
    if size != end:
        raise ValueError(f"{bin_path!r}: {'missing' if size is None else f'{size} bytes'}, "
                         f"expected {end} bytes (as {JSON_FILE} lists)")
    buf = bytearray(size)
    with open(bin_path, "rb") as f:
        f.readinto(buf)
    data = torch.frombuffer(buf, dtype=torch.uint8).to(device)

    heads = {"self_attn.q_proj.weight": arch.num_attention_heads,
             "self_attn.k_proj.weight": arch.num_query_groups}
    sd = {}
    for e in record["tensors"]:
        w = dequantize(data[e["offset"]:e["offset"] + e["nbytes"]], e["type"], e["shape"])
        n_head = heads.get(e["name"].split(".", 3)[-1]) if e["name"].startswith("model.layers.") \
            else None
        sd[e["name"]] = unpermute_rope_rows(w, n_head) if n_head else w
    if arch.tie_embeddings and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd, arch
