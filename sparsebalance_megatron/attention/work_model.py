"""Work model of the block-sparse FlashAttention kernels: GEMMs, FLOPs and dQ traffic per tile.

A *kept tile* is one (query block, key block) pair the kernel computes for one query head:
``B x B`` scores over head dim ``hn``. Every GEMM on it is ``B x B x hn`` (``2 B^2 hn`` FLOPs):

==========  =====  ==============================================================
pass        GEMMs  what
==========  =====  ==============================================================
forward     2      S = Q K^T, O += P V
backward    5      S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K
==========  =====  ==============================================================

The backward is one pass (``sparse_triton_kernels.dkv_kernel``): dQ is accumulated inside the
dK/dV loop. A separate dQ pass (the design before it, and flex's) recomputes S and dP: 7 GEMMs,
9 per tile fwd+bwd instead of 7, 29% more tensor-core work for the same tiles.

Why dQ goes out by float32 atomic adds and not through a reduction buffer (``dq_traffic``):
a key-block program produces a partial dQ ``[rows, hn]`` for every query block of its list.
Atomics add it into one float32 ``[T, np, hn]`` accumulator in L2: ``4 B hn`` bytes of
reduce traffic per kept tile against ``5 * 2 B^2 hn`` FLOPs, i.e. ``2.5 B`` FLOP per byte (320
at block 128: above an H100's ~300 FLOP/byte of bf16 tensor core to HBM, and the adds are to L2),
and no extra memory. A reduction buffer keeps every partial (``4 B hn`` bytes per kept tile,
written and read back by a second kernel): at 32K tokens, block 128, 8 query heads, hn 128 and
density 0.5 that is ~8.6 GB per layer call, more than the whole attention's inputs, and twice
the traffic. FA2 makes the same choice (FA3 the same adds through TMA).

At head dim 128 the backward's key tile is 64 (``triton_launch.default_config``: 64 query rows
x 128 keys spills, 32 rows put the dQ GEMM on mma.sync), so a 128 block is two programs and
the dQ adds and Q/dO reads of a tile double (``dq_traffic(..., key_tile)``). The alternative
that also runs every GEMM on wgmma is FlashAttention-2's split (a dK/dV kernel and a dQ kernel;
``backward_designs``): per kept tile at block and head dim 128, the one pass with 64-key tiles
is 5 GEMMs (21.0 MFLOP) against 256 KB of Q/dO reads and dQ adds (80 FLOP/byte, the adds to
L2); the split is 7 GEMMs (29.4 MFLOP, +40%) against 128 KB and no atomics (224 FLOP/byte).
The one pass is the default: the targets are priced on tensor-core work (fwd+bwd at density
0.25 is 0.25 x 7/7 of dense's GEMM work with it and 0.25 x 9/7 with the split, so reaching
0.35x of a dense kernel's time needs 71% of that kernel's FLOP rate with the one pass and 92%
with the split, diagonal and selection aside), it needs no second kernel, and the traffic it
adds is L2-resident (a query block's Q/dO rows are read by the two programs of a key block);
the device decides whether the adds bind. It has not ruled for the one pass: the fastest
backward it measured keeps the whole 128-key block with 32 rows (dQ on mma.sync) and runs at
about half the forward's FLOP rate (backward 4.5-4.7x the forward's time for 2.5x its GEMMs,
H200 and H100, 2026-11-26), and flex's split backward beat it at 8/2/128. So the split is built
too (``dq_block_m`` of a launch config: ``dkv_kernel`` with ``ONE_PASS=False``, ``dq_kernel``),
where dK/dV of the whole key block without dQ fit 64 rows at head dim 128 with every GEMM on
wgmma, and the autotune times both.

``sparse_triton_kernels.GEMMS_PER_TILE`` declares the kernels' counts; a unit test counts the
``tl.dot`` calls in their list loops and checks them against ``GEMMS_PER_TILE`` here.
Pure python; must not import torch, triton or megatron.
"""

from __future__ import annotations

from typing import Dict, Optional

GEMMS_PER_TILE: Dict[str, int] = {"fwd": 2, "bwd": 5}
"""GEMMs per kept tile of the kernels as built: forward 2, one-pass backward 5."""

GEMMS_PER_TILE_SEPARATE_DQ: Dict[str, int] = {"fwd": 2, "bwd": 7}
"""The same with a separate dQ pass that recomputes S and dP (the former design): 7."""


def _check(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return value


def tile_flops(block_size: int, head_dim: int, gemms: int) -> int:
    """FLOPs of ``gemms`` ``B x B x hn`` GEMMs (one kept tile, one query head)."""
    _check("block_size", block_size)
    _check("head_dim", head_dim)
    return gemms * 2 * block_size * block_size * head_dim


def attention_flops(kept_tiles: int, q_heads: int, block_size: int, head_dim: int,
                    one_pass_backward: bool = True) -> Dict[str, int]:
    """Forward, backward and total FLOPs of ``kept_tiles`` (query block, key block) pairs per
    query head (the kernel's work at one call): ``{"fwd", "bwd", "total"}``."""
    _check("kept_tiles", kept_tiles, 0)
    _check("q_heads", q_heads)
    g = GEMMS_PER_TILE if one_pass_backward else GEMMS_PER_TILE_SEPARATE_DQ
    fwd = kept_tiles * q_heads * tile_flops(block_size, head_dim, g["fwd"])
    bwd = kept_tiles * q_heads * tile_flops(block_size, head_dim, g["bwd"])
    return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def dq_traffic(kept_tiles: int, q_heads: int, block_size: int, head_dim: int,
               key_tile: Optional[int] = None) -> Dict[str, float]:
    """The two ways of reducing dQ in a one-pass backward, in bytes: ``atomic`` (float32 adds
    into one accumulator; no extra memory), ``buffer_memory`` / ``buffer_traffic`` (every
    partial kept, written and read back), and ``flop_per_atomic_byte`` (backward FLOPs per
    byte of atomic traffic: ``2.5 * key_tile``). ``key_tile`` (the dK/dV program's keys,
    ``LaunchConfig.bwd_block_n``; default the whole block): each of the ``block / key_tile``
    programs of a key block adds its own partial dQ of the whole query block."""
    key_tile = block_size if key_tile is None else _check("key_tile", key_tile)
    if block_size % key_tile:
        raise ValueError(f"key_tile={key_tile}: expected a divisor of the block {block_size}")
    part = 4 * block_size * head_dim * (block_size // key_tile)   # partial dQs of one tile
    n = kept_tiles * q_heads
    bwd = tile_flops(block_size, head_dim, GEMMS_PER_TILE["bwd"])
    return {"atomic": float(n * part), "buffer_memory": float(n * part),
            "buffer_traffic": float(2 * n * part), "flop_per_atomic_byte": bwd / part}


def backward_designs(block_size: int, head_dim: int, key_tile: Optional[int] = None,
                     elem_bytes: int = 2) -> Dict[str, Dict[str, float]]:
    """What one kept tile (one query head) costs in each backward design that runs every GEMM
    on wgmma at head dim 128 (``compile_gate``), per kept tile: ``gemms``, ``flops``,
    ``load_bytes`` (the query side Q/dO and, for the dQ kernel, K/V, at ``elem_bytes``;
    K/V of the key tile a dK/dV program holds are loaded once per column and not counted),
    ``atomic_bytes`` (float32 dQ adds), ``flop_per_byte``:

    - ``one_pass``: ``dkv_kernel`` with ``key_tile`` keys per program (64 of a 128 block: two
      programs per key block, so Q/dO are read twice and dQ added twice per tile); 5 GEMMs.
    - ``split``: FlashAttention-2's two kernels, dK/dV over the whole key block (4 GEMMs: S, dP,
      dV, dK; Q/dO read once) and dQ per query block (3 GEMMs: S, dP, dQ; K/V read, dQ stored
      once, no atomics); 7 GEMMs.
    """
    b, hn = _check("block_size", block_size), _check("head_dim", head_dim)
    key_tile = b if key_tile is None else key_tile
    subs = b // key_tile
    rows = b * hn * elem_bytes                              # one [B, hn] tile of Q, dO, K or V
    one = dict(gemms=5, flops=tile_flops(b, hn, 5), load_bytes=2 * rows * subs,
               atomic_bytes=dq_traffic(1, 1, b, hn, key_tile)["atomic"])
    split = dict(gemms=7, flops=tile_flops(b, hn, 7), load_bytes=4 * rows, atomic_bytes=0.0)
    for d in (one, split):
        d["flop_per_byte"] = d["flops"] / (d["load_bytes"] + d["atomic_bytes"])
    return {"one_pass": one, "split": split}


def causal_kept_tiles(doc_blocks: int, density: float) -> int:
    """Kept tiles per head of one document of ``doc_blocks`` blocks at ``density`` (every query
    block keeps ``max(1, ceil(density * available))``; forced blocks ignored): a quick count
    for the docstring's figures and the autotune's TFLOP/s, not the selection's exact one."""
    import math
    _check("doc_blocks", doc_blocks)
    return sum(max(1, math.ceil((density - 1e-6) * (i + 1))) for i in range(doc_blocks))


__all__ = ["GEMMS_PER_TILE", "GEMMS_PER_TILE_SEPARATE_DQ", "attention_flops", "backward_designs",
           "causal_kept_tiles", "dq_traffic", "tile_flops"]
