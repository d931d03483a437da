"""Both entry points' model flow on megatron-core 0.19.2, CPU: the sparse attention is built where
the plan budgets it, runs forward and backward on packed documents, and a model whose budgeted
layers run Megatron's own attention is refused after it is built ("no silent dense").

One process per model kind (gloo, world size 1), as the entries run it: Megatron's parse and
validation -> ``gpt_config_from_args`` / ``hybrid_config_from_args`` -> ``hooks.install`` ->
Megatron's builder -> the post-wrap hooks (``hooks._on_model_built``: the check). Then a spec set
after install (Megatron's ``DotProductAttention`` in the core-attention slot, as a ``--spec`` or a
custom builder would) is built and must be refused with one line naming the layer.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.integration

_FLOW = r"""
import sys
import torch
from sparsebalance_megatron.megatron.launch import compat
from sparsebalance_megatron.megatron import hooks
compat.activate_cpu_shims()
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.training.arguments import parse_args, validate_args
from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args
from megatron.training.global_vars import set_global_variables
from megatron.training.models.base import compose_hooks

kind = sys.argv[1]
sys.argv = [f"pretrain_{kind}.py", *sys.argv[2:]]
args = parse_args(extra_args_provider=hooks.extra_args_provider(None))
validate_args(args, {})
set_global_variables(args, build_tokenizer=False)
args.padded_vocab_size = 512
model_cfg = (hybrid_config_from_args if kind == "hybrid" else gpt_config_from_args)(args)
hooks.install(args, model_cfg)
torch.distributed.init_process_group("gloo", world_size=1, rank=0)
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)

def build():
    model = model_cfg.get_builder_cls()(model_cfg).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
    return compose_hooks(model_cfg.post_wrap_hooks)([model])[0]   # the check runs here

model = build()
for i, layer in enumerate(model.decoder.layers):
    core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
    print("LAYER", i, type(layer).__name__, type(core).__name__ if core is not None else "-")
if kind == "hybrid":
    print("FINAL_NORM", type(model.decoder.final_norm).__name__)

def packed(lengths, tokens):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return model(tokens, pos, None, labels=tokens, packed_seq_params=psp)   # [1, T] losses

torch.manual_seed(0)
tokens = torch.randint(0, 500, (1, 256))
losses = packed([96, 160], tokens)
losses.float().mean().backward()
qkv = model.decoder.layers[0].self_attention.linear_qkv.weight.grad
print("LOSS", float(losses.mean()), "GRAD", float(qkv.abs().sum()))
with torch.no_grad():   # documents do not see each other: the second alone gives its losses
    alone = packed([160], tokens[:, 96:])
print("DOC_DIFF", float((losses[:, 96:] - alone).abs().max()))

# a spec set after install: Megatron's own core attention in the budgeted layers
from megatron.core.transformer.dot_product_attention import DotProductAttention
if kind == "hybrid":
    from sparsebalance_megatron.megatron.model.spec import swap_hybrid_core_attention
    model_cfg.hybrid_stack_spec = swap_hybrid_core_attention(model_cfg.hybrid_stack_spec,
                                                             DotProductAttention)
else:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    model_cfg.transformer_layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
try:
    build()
except SystemExit as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
print("NOT REFUSED", flush=True)
"""

COMMON = [
    "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--lr", "1e-3", "--train-iters", "1", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--vocab-size", "512", "--tokenizer-type", "NullTokenizer",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--sb-sparse-attention", "--sb-block-size", "32", "--sb-density", "0.5",
]


def _run_flow(kind: str, argv: list, tmp_path) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    return run_python(["-c", _FLOW, kind, *argv], cwd=tmp_path, env=env, timeout=300)


@pytest.mark.parametrize("kind, argv, layers", [
    ("hybrid", ["--hybrid-layer-pattern", "*-*-"],
     [("TransformerLayer", "SparseCoreAttention"), ("MLPLayer", "-"),
      ("TransformerLayer", "SparseCoreAttention"), ("MLPLayer", "-")]),
    ("gpt", ["--num-layers", "2"],
     [("TransformerLayer", "SparseCoreAttention")] * 2),
], ids=["hybrid-*-*-", "gpt"])
def test_entry_flow_builds_sparse_attention_and_refuses_a_dense_one(tmp_path, kind, argv, layers):
    proc = _run_flow(kind, [*COMMON, *argv], tmp_path)
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]
    got = [tuple(ln.split()[2:4]) for ln in out.splitlines() if ln.startswith("LAYER ")]
    assert got == layers, got
    if kind == "hybrid":   # the plugin's local stack: a plain norm, not transformer-engine's
        assert "FINAL_NORM RMSNorm" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("LOSS "))
    loss, grad = float(line.split()[1]), float(line.split()[3])
    assert 0 < loss < 20 and grad > 0, line
    doc_diff = float(next(ln for ln in out.splitlines() if ln.startswith("DOC_DIFF")).split()[1])
    assert doc_diff < 1e-4, doc_diff
    refused = next(ln for ln in out.splitlines() if ln.startswith("REFUSED "))
    want = ("HybridModel attention layer ('*') 1 (model chunk 0, decoder.layers.0)"
            if kind == "hybrid" else "GPT decoder layer 1 (model chunk 0, decoder.layers.0)")
    assert "error: cannot launch: " + want in refused, refused
    assert "DotProductAttention, not SparseCoreAttention" in refused
