"""Analytic latency table of a GPU from FLOP counts, for the scale study (docs/DESIGN.md
section 7).

No GPU is needed: the time of every matmul is its FLOP count divided by a throughput, the
attention kernels' are their measured H100 costs (dense cuDNN; the sparse call, below) scaled
to the model; memory-bound parts (loss over the vocabulary, elementwise ops) are bytes
divided by HBM bandwidth. The result is an ordinary table (``"source": "analytic"``) with the
same fields as a profiled one, so the same loader and ``LatencyModel`` read it.

Published figures behind ``DeviceProfile.h100_sxm`` (approximate, stated in the table's notes):
- NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 tensor-core peak, 3.35 TB/s HBM3.
- Large BF16 GEMMs reach about 60-70% of peak in practice (600-700 TFLOP/s); this model's GEMMs
  are narrow (hidden 896), so 550 TFLOP/s is assumed.
- Dense attention (routed short documents, and every document of a dense run): MEASURED, cuDNN's
  fwd+bwd on an H100 (docs/results/attention_gpu_h100_run2.json: one causal document, bf16, 8
  query / 2 KV heads, head dim 128, ``dense_cudnn_ms`` 1.2104 ms at 8K and 14.3121 ms at 32K).
  A fixed cost plus a cost per causal 128 x 128 tile fits both lengths: 0.3261 ms per call and
  0.42516 us per tile (about 552 TFLOP/s with the backward at 2.5x the forward FLOPs). The tile
  cost is scaled to the model by FLOPs (query heads x head dim over 8 x 128, block area over
  128^2) and split 1 : 2.5 between forward and backward; the call cost 1 : 2 (launches).
- The sparse call (block-sparse attention: selection, kernel, padding, launches): priced by a
  ``sparse_call.SparseCallPrice``, the one owner of that price, for the kernel
  ``--sb-attention-backend auto`` runs (``sparse_call.auto_price``): by default flex MEASURED on
  an H100 (docs/results/attention_gpu_h100_run2.json: 2.50 ms per call + 0.119 us per token of
  the micro-batch + 0.476 us per kept 128 x 128 tile at 8 q heads x hn 128, fwd+bwd, the
  selection included), scaled to the model (``SparseCallPrice.layer_terms``) and charged once per
  layer to a unit that has a document on the sparse path (``features.CALL_FEATURES``). Another
  price (``sparse_price=``: a device kernel table's fit, or the ``triton`` ESTIMATE from
  ``attention/work_model.py``) replaces it; the table records which (``sparse_call``), and a
  device latency table replaces all of it (``--table``).
- Block scoring, where a price does not include it (an estimate): a skinny batched GEMM at
  150 TFLOP/s, assumed. ``attn_fwd_flops`` / ``attn_bwd_flops`` (350 / 250 TFLOP/s, within the
  published FlashAttention-2/3 and FlexAttention ranges) price only ``flop_price``, an idealised
  FLOP-priced kernel for tests and what-ifs.
The other figures are assumptions from published numbers, not measurements: the output says so.

Routing (``routing_density``): the table's ``dense_crossover_tokens`` is derived from its own cost
terms, per layer, forward + backward, one document alone (the profiler measured so until
2026-11-26; it now times packed micro-batches of equal documents, ``megatron/launch/
crossover.py``, which shares the per-call costs: this derivation is not yet changed to match, so
the simulated studies' routing stays as they were computed): a
document of n blocks costs ``sparse_call + pair x kept(n, d0) + select x n^2`` sparse and
``dense_call + dense x n (n + 1) / 2`` dense, and ``crossover.crossover_tokens`` picks the
length from which sparse stays cheaper (above every length: all documents dense). Every table
carries ``dense_coefficients`` (with or without routing), so a dense run
(``LatencyModel.all_dense``) is priced by the dense kernel, never by the sparse one at density 1.
Context parallelism is not in the table (a table describes a CP=1 stage); ``LatencyModel.
with_context_parallel`` derives a CP rank's time from it, with the profile's all-to-all bandwidth
(the per-call costs do not divide there, flex's per-token part included: the sparse path is
charged its whole micro-batch's fixed cost at CP > 1, an overcharge).
Activation recomputation is modelled by its FLOPs (full: the layers' forward again in backward;
selective: the core attention's); tensor parallelism is not modelled (TP = 1 only), and the
transformer implementation is recorded, not modelled (the throughputs are fused-kernel ones).

Pure Python + numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .crossover import crossover_entries, crossover_lengths, crossover_tokens
from .features import FEATURES, UnitFeatures
from .shape import ModelShape
from .sparse_call import HBM_BYTES_PER_S, SparseCallPrice, auto_price
from .table import EXECUTION, FORMAT, FORMAT_VERSION, stage_kinds_for
from .work import attention_work


@dataclass
class DeviceProfile:
    """Throughputs of one GPU, in FLOP/s and bytes/s."""

    name: str = "NVIDIA H100 SXM (analytic)"
    matmul_flops: float = 550e12
    attn_fwd_flops: float = 350e12
    attn_bwd_flops: float = 250e12
    attn_bwd_flop_ratio: float = 2.5
    select_flops: float = 150e12
    # measured on an H100 (module docstring; docs/results/attention_gpu_h100_run2.json), fwd+bwd
    dense_tile_s: float = 0.42516e-6    # cuDNN, per causal 128 x 128 tile at the reference heads
    dense_call_s: float = 0.3261e-3     # cuDNN, per call
    dense_reference_heads_dim: int = 8 * 128   # query heads x head dim of that measurement
    hbm_bytes_per_s: float = HBM_BYTES_PER_S
    launch_s_per_layer: float = 30e-6   # kernel launches and small ops, forward; backward 2x
    p2p_bytes_per_s: float = 300e9      # NVLink activation transfer between stages
    # Context parallelism (latency/context_parallel.py), assumed: NCCL all-to-all inside one
    # NVLink 4 node (450 GB/s per direction peak) taken at 200 GB/s effective per rank, and
    # 20 us per collective (launch + synchronisation).
    a2a_bytes_per_s: float = 200e9
    collective_latency_s: float = 20e-6
    sources: str = field(default=(
        "NVIDIA H100 SXM datasheet (989 TFLOP/s dense BF16, 3.35 TB/s HBM3); FlashAttention-2/3 "
        "(Dao 2023; Shah et al. 2024: FA2 ~350, FA3 up to ~740 TFLOP/s fwd on H100); PyTorch "
        "FlexAttention blog (2024: ~90% of FA2 fwd, ~85% bwd). Throughputs are assumptions "
        "within these published ranges, not measurements; except the dense kernel (cuDNN), "
        "measured on an H100 (docs/results/attention_gpu_h100_run2.json). The sparse call is "
        "priced by its own record (sparse_call)."))

    @classmethod
    def h100_sxm(cls) -> "DeviceProfile":
        return cls()


def layer_coefficients(shape: ModelShape, dev: DeviceProfile, block_size: int,
                       price: SparseCallPrice | None = None) -> dict:
    """Seconds per feature of ONE transformer layer: {fwd, bwd: [const, tokens, pair, select]};
    the sparse kernel's pair (and selection) cost from ``price`` (default ``auto_price()``)."""
    price = price or auto_price()
    h, hd = shape.hidden_size, shape.head_dim
    nq, ng = shape.num_attention_heads, shape.num_query_groups
    qkv = 2 * h * (nq + 2 * ng) * hd            # FLOPs per token
    proj = 2 * nq * hd * h
    mlp = 2 * h * shape.ffn_hidden_size * (3 if shape.swiglu else 2)
    gemm_fwd_s = (qkv + proj + mlp) / dev.matmul_flops
    # elementwise traffic per token (norms, RoPE, residuals, activation), bf16 bytes, assumed
    elem_fwd_s = 2 * (12 * h + 4 * shape.ffn_hidden_size) / dev.hbm_bytes_per_s
    terms = price.layer_terms(nq, hd, block_size, shape.seq_length)
    # a measured call includes the selection; an estimate prices it by FLOPs
    select_flops = 0.0 if price.selection_in_call else 2 * block_size * hd * nq
    fwd = [dev.launch_s_per_layer, gemm_fwd_s + elem_fwd_s, terms["fwd"]["pair"],
           select_flops / dev.select_flops]
    bwd = [2 * dev.launch_s_per_layer, 2 * gemm_fwd_s + 2 * elem_fwd_s, terms["bwd"]["pair"],
           0.0]  # no grad via scores
    # per sequence: not modelled from FLOPs (a launch-bound cost; profile a device to see it)
    return {"fwd": fwd + [0.0], "bwd": bwd + [0.0]}


def ideal_price() -> SparseCallPrice:
    """The analytic table's sparse call before issue 40: FLOP-priced tiles at the published
    throughputs and flex's cost outside its kernel (0.637 ms per call), an ideal kernel. For tests
    whose subject is not the price (an attention-bound model), never a default."""
    return flop_price(DeviceProfile(), call_s=0.637e-3)


def flop_price(dev: DeviceProfile, call_s: float = 0.0) -> SparseCallPrice:
    """An idealised sparse kernel priced by FLOPs at ``dev``'s attention throughputs (the
    analytic table's sparse kernel before issue 40) and ``call_s`` per call: for tests that
    need an attention-bound model and for what-ifs, never a default."""
    pair_flops = 4 * 128 * 128 * 128 * 8          # QK^T and PV of one 128 x 128 tile, 8 x 128
    fwd = pair_flops / dev.attn_fwd_flops
    bwd = dev.attn_bwd_flop_ratio * pair_flops / dev.attn_bwd_flops
    return SparseCallPrice(backend="ideal", measured=False, call_s=call_s, call_s_per_token=0.0,
                           tile_s=fwd + bwd, selection_in_call=False,
                           tile_bwd_share=bwd / (fwd + bwd),
                           source=f"FLOP-priced at {dev.attn_fwd_flops / 1e12:.0f} / "
                                  f"{dev.attn_bwd_flops / 1e12:.0f} TFLOP/s (an ideal kernel)")


BWD_CALL_SHARE = 2 / 3
"""Share of a per-call cost (fwd+bwd) in the backward: about twice the forward's launches."""


def dense_layer_coefficients(shape: ModelShape, dev: DeviceProfile, block_size: int) -> dict:
    """Seconds per causal block pair of a dense document, ONE layer: {fwd, bwd}: the measured
    cuDNN tile cost scaled by FLOPs to this model's heads x head dim and block area."""
    scale = (shape.num_attention_heads * shape.head_dim / dev.dense_reference_heads_dim
             * (block_size / 128) ** 2)
    pair_s = dev.dense_tile_s * scale
    bwd = dev.attn_bwd_flop_ratio / (1 + dev.attn_bwd_flop_ratio)
    return {"fwd": (1 - bwd) * pair_s, "bwd": bwd * pair_s}


def call_layer_coefficients(dev: DeviceProfile, shape: ModelShape | None = None,
                            block_size: int = 64, price: SparseCallPrice | None = None) -> dict:
    """Seconds per call of each kernel, ONE layer: {fwd, bwd: {sparse_calls, dense_calls}}; the
    sparse call's from ``price`` (default ``auto_price()``) at ``shape``'s heads and micro-batch."""
    shape, price = shape or ModelShape(), price or auto_price()
    sparse = price.layer_terms(shape.num_attention_heads, shape.head_dim, block_size,
                               shape.seq_length)
    return {p: {"sparse_calls": sparse[p]["call"], "dense_calls": share * dev.dense_call_s}
            for p, share in (("fwd", 1 - BWD_CALL_SHARE), ("bwd", BWD_CALL_SHARE))}


def derived_crossover(lay: dict, dense: dict, calls: dict, *, density: float, block_size: int,
                      sink_blocks: int, local_blocks: int, max_tokens: int,
                      sparse_kernel: str = "flex (analytic)") -> dict:
    """The ``dense_crossover`` record of one layer's cost terms (module docstring)."""
    lengths = crossover_lengths(block_size, max_tokens)
    sparse_s, dense_s = [], []
    for n_tok in lengths:
        nb = -(-n_tok // block_size)
        kept = attention_work([n_tok], density, block_size, sink_blocks, local_blocks)
        sparse_s.append(sum(calls[p]["sparse_calls"] + lay[p][2] * kept + lay[p][3] * nb * nb
                            for p in ("fwd", "bwd")))
        dense_s.append(sum(calls[p]["dense_calls"] + dense[p] * nb * (nb + 1) / 2
                           for p in ("fwd", "bwd")))
    return {"source": "analytic", "sparse_kernel": sparse_kernel,
            "dense_kernel": "cudnn (measured H100, scaled)", "block_size": block_size, "density": density,
            "lengths": lengths, "dense_s": dense_s, "sparse_s": sparse_s,
            "tokens": crossover_tokens(lengths, dense_s, sparse_s)}


def analytic_table(shape: ModelShape | None = None, device: DeviceProfile | None = None, *,
                   pp: int = 1, block_size: int = 64, sink_blocks: int = 1,
                   local_blocks: int = 0, densities=(0.125, 0.25, 0.5, 0.75, 1.0),
                   seed: int = 0, transformer_impl: str = "transformer_engine",
                   recompute_granularity: str = "none",
                   routing_density: float | None = None,
                   sparse_price: SparseCallPrice | None = None) -> dict:
    """A complete latency table (coefficients + a synthetic grid of 'measurements').
    ``routing_density``: the run's base density d0, to derive the dense crossover at (module
    docstring) and route the grid's short documents; None: no routing entry (no routing).
    ``sparse_price``: what prices the sparse call (default ``sparse_call.auto_price()``: the
    kernel ``auto`` runs, measured); recorded in the table as ``sparse_call``."""
    shape = shape or ModelShape()
    dev = device or DeviceProfile.h100_sxm()
    price = sparse_price or auto_price()
    if pp < 1 or shape.num_layers % pp:
        raise ValueError(f"pp={pp}: expected a divisor of num_layers={shape.num_layers}")
    for name, value in (("transformer_impl", transformer_impl),
                        ("recompute_granularity", recompute_granularity)):
        if value not in EXECUTION[name]:
            raise ValueError(f"{name}={value!r}: expected one of {EXECUTION[name]}")
    kinds = stage_kinds_for(pp)
    per_stage = shape.num_layers // pp
    lay = layer_coefficients(shape, dev, block_size, price)
    dense = dense_layer_coefficients(shape, dev, block_size)
    calls = call_layer_coefficients(dev, shape, block_size, price)
    # Recomputation runs (part of) the forward again inside the backward; the block selection
    # is cached per micro-batch, so it is not recomputed.
    if recompute_granularity == "full":
        lay["bwd"] = [b + f for b, f in zip(lay["bwd"][:3], lay["fwd"][:3])] + lay["bwd"][3:]
    if recompute_granularity != "none":           # selective: Megatron's default, core attention
        dense["bwd"] += dense["fwd"]
        calls["bwd"] = {k: v + calls["fwd"][k] for k, v in calls["bwd"].items()}
    if recompute_granularity == "selective":
        lay["bwd"][2] += lay["fwd"][2]
    routing = None if routing_density is None else derived_crossover(
        lay, dense, calls, density=float(routing_density), block_size=block_size,
        sink_blocks=sink_blocks, local_blocks=local_blocks, max_tokens=shape.seq_length,
        sparse_kernel=price.describe())
    crossover = routing["tokens"] if routing else 0
    h, v = shape.hidden_size, shape.vocab_size
    embed_tok_s = 2 * 2 * h / dev.hbm_bytes_per_s                  # gather + write, bf16
    head_tok_fwd_s = 2 * h * v / dev.matmul_flops + 4 * 2 * v / dev.hbm_bytes_per_s  # + loss
    # a middle stage is always given (measured, in a profiled table): it is one layer's cost x
    # per_stage, what ``LatencyModel.with_layout`` needs for uneven and interleaved layouts
    all_kinds = sorted(set(kinds) | ({"middle"} if pp >= 2 else set()))
    coef = {}
    for kind in all_kinds:
        c = {p: [per_stage * x for x in lay[p]] for p in ("fwd", "bwd")}
        if kind in ("first", "only"):
            c["fwd"][1] += embed_tok_s
            c["bwd"][1] += 2 * embed_tok_s
        if kind in ("last", "only"):
            c["fwd"][1] += head_tok_fwd_s
            c["bwd"][1] += 2 * head_tok_fwd_s
        coef[kind] = c
    # a grid over document mixes x densities, evaluated with the coefficients, so the table
    # has the same shape as a profiled one and fit() recovers the coefficients exactly
    rng = np.random.default_rng(seed)
    t = shape.seq_length
    mixes = [[t], [t // 2] * 2, [t // 8] * 8, [t // 64] * 64, [t // 2], [t // 4] * 3]
    for total in (t, t, t // 2, t // 4):   # unequal token totals keep const and tokens apart
        cuts = np.sort(rng.choice(np.arange(1, total), size=rng.integers(2, 12), replace=False))
        mixes.append(np.diff(np.concatenate([[0], cuts, [total]])).tolist())
    dense_coef = {kind: {p: per_stage * dense[p] for p in dense} for kind in all_kinds}
    call_coef = {kind: {p: {k: per_stage * v for k, v in calls[p].items()} for p in calls}
                 for kind in all_kinds}
    meas = []
    for kind in all_kinds:
        f = UnitFeatures.build(mixes, block_size, sink_blocks, local_blocks,
                               dense_below_tokens=crossover)
        for d in densities:
            x = f.matrix(float(d))
            for j, mix in enumerate(mixes):
                row = {"kind": kind, "doc_lengths": [int(a) for a in mix], "density": float(d)}
                for p in ("fwd", "bwd"):    # routed documents: the dense kernel's pairs
                    row[p + "_s"] = float(x[j] @ np.asarray(coef[kind][p])
                                          + f.dense_work[j] * dense_coef[kind][p]
                                          + f.sparse_calls[j] * call_coef[kind][p]["sparse_calls"]
                                          + f.dense_calls[j] * call_coef[kind][p]["dense_calls"])
                meas.append(row)
    act_bytes = 2 * t * h
    routed = {} if routing is None else crossover_entries(dict(
        routing, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, head_dim=shape.head_dim, dtype="bfloat16"))
    return {**routed, "dense_coefficients": dense_coef, "call_coefficients": call_coef,
        "format": FORMAT, "format_version": FORMAT_VERSION, "source": "analytic",
        "device": dev.name,
        "software": {"torch": "analytic", "megatron_core": "analytic"},
        "model": shape.as_table_model(),
        "execution": {"tensor_model_parallel_size": 1, "transformer_impl": transformer_impl,
                      "recompute_granularity": recompute_granularity},
        "attention": {"block_size": block_size, "sink_blocks": sink_blocks,
                      "local_blocks": local_blocks, "work": "kept"},  # FlexAttention on GPU
        "pipeline": {"pp": pp, "stage_kinds": kinds, "layers_per_stage": [per_stage] * pp},
        "features": list(FEATURES),
        "measurements": meas,
        "coefficients": coef,
        "p2p_s": act_bytes / dev.p2p_bytes_per_s,
        "device_profile": asdict(dev),
        "sparse_call": price.as_dict(),
        "notes": "ANALYTIC table: FLOPs / published H100 throughputs, not a measurement. "
                 + dev.sources + " Sparse call: " + price.describe(),
    }
