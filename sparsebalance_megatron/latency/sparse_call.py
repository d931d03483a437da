"""The sparse call's price: what one layer's block-sparse attention call costs on a GPU, fixed per
call and per kept tile, for the kernel ``--sb-attention-backend auto`` runs (issue 40).

How ``auto`` picks (``attention/api.py``): on a device whose latency profile timed the kernels,
the fastest measured (``megatron/launch/crossover.fastest_backend``: one document of the
micro-batch length at d0, fwd+bwd; recorded as the table's ``attention.backend``); with no
measurement, ``AUTO_UNMEASURED`` (flex). The simulator prices the sparse call the same way, in
this one place:

- a device latency table (``--table``) is priced by its own fitted coefficients, measured with
  the kernel it names (``table_sparse_kernel``);
- the analytic table takes a ``SparseCallPrice``: ``auto_price()`` is what ``auto`` runs on an
  H100 today, ``FLEX_H100`` (flex is the only kernel ever timed on one, and what ``auto`` runs
  unmeasured); ``auto_price(kernel_rows(path))`` prices every backend of a device kernel table
  (``scripts/bench_attention_gpu.py``) from its own rows and takes the fastest at the
  micro-batch length and d0, as ``fastest_backend`` would;
- ``triton_estimate()``: the plugin's own Triton kernel before any device measurement: an
  ESTIMATE (FLOPs and dQ bytes per tile from ``attention/work_model.py`` at flex's measured
  rate, plus its launches), said so wherever it prices a row.

A price, per layer and fwd+bwd, at its reference head shape (query heads x head dim, block)::

    call = call_s + call_s_per_token x T        (T: tokens of the micro-batch the call lays out)
    tile = tile_s                               (one kept query-block x key-block pair, all heads)

``T`` is the micro-batch length: flex pads every call to one compiled shape, the micro-batch's
(``attention/blocks.fixed_padded_blocks``; routing pads the long documents the same way), so its
density-independent kernel work (2.9-3.1 ms at 8K at every density, run2) is a fixed cost per
call that grows with the micro-batch, not with the kept tiles. ``layer_terms`` scales a price to
a model: tiles by FLOPs (query heads x head dim, block area), the per-token part by query heads
x head dim, the per-call constant not at all (launches). A measured call includes the block
selection (``selection_in_call``: the latency model's ``selection_work`` is then 0); an
estimate prices the selection by FLOPs instead. Split into passes like the dense kernel's
(``analytic``): tiles 1 : 2.5, calls 1 : 2.

Pure Python + numpy; must not import torch or megatron (``triton_estimate`` imports
``attention.work_model`` lazily: importing the attention package loads torch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from .work import attention_work

TILE_BWD_SHARE = 2.5 / 3.5
"""Backward share of a kept tile's fwd+bwd time (2 forward GEMMs, 5 backward)."""
CALL_BWD_SHARE = 2 / 3
"""Backward share of a call's fixed cost (about twice the forward's launches)."""
REFERENCE_SHAPE = "8/2/128"
"""The head shape every H100 kernel figure of the project was measured at (query / KV heads,
head dim), block 128."""
HBM_BYTES_PER_S = 3.35e12
"""H100 SXM HBM3 bandwidth (datasheet); ``analytic.DeviceProfile``'s default."""
SINK_BLOCKS = 1
"""The sink setting of the priced rows (the studies' and the runtime's default)."""
LENGTH_FREE_BACKENDS = ("fa4", "triton")
"""Sparse backends whose kernels take any micro-batch length without compiling again (fa4: no
length in FlashAttention-4's compile keys, 4.0.0b36; triton: the per-micro-batch sizes are not
specialised on, ``sparse_triton_kernels``), so 'auto' packs variable-length micro-batches for
them as for dense attention; in the order 'auto' prefers them before its start-up profile times
them (fa4 first: the H200's kernel table of 2026-11-26, one 32K document, fwd+bwd against cuDNN:
0.46x / 0.39x at density 0.25 where triton took 0.70x / 0.53x, 8/2/128 and 14/2/64). On an
H200 the fixed length cost the sparse runs of the long-document data set 30% padding
(``docs/results/gpu_check_h200_run1_train.json`` at a63cdd4: 45,780 real tokens of 65,536
positions per step on average)."""


@dataclass(frozen=True)
class SparseCallPrice:
    """One sparse kernel's cost per layer call, fwd+bwd, at its reference head shape."""

    backend: str
    """The kernel (a ``--sb-attention-backend`` value)."""
    source: str
    """Where the figures come from (a file and device, or 'ESTIMATE: ...')."""
    measured: bool
    """True: timed on a device; False: an estimate (said so in every row it prices)."""
    call_s: float
    """Seconds per call, constant part."""
    call_s_per_token: float
    """Seconds per call per token of the micro-batch the call is laid out in."""
    tile_s: float
    """Seconds per kept tile (query block x key block, every query head)."""
    ref_q_heads: int = 8
    ref_head_dim: int = 128
    ref_block: int = 128
    selection_in_call: bool = True
    """The call's figures include the block selection (measured end to end)."""
    tile_bwd_share: float = TILE_BWD_SHARE
    """The backward's share of a tile's fwd+bwd seconds."""
    stands_in_for: str = ""
    """Where this kernel's figures price another kernel's calls (the length-free kernels
    ``auto`` runs at variable lengths, before a device times them at two lengths): its names."""

    def __post_init__(self):
        for name in ("call_s", "call_s_per_token", "tile_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) \
                    or v < 0:
                raise ValueError(f"{name}={v!r}: expected finite seconds >= 0")

    def call_fwd_bwd_s(self, tokens: int, kept_tiles: float) -> float:
        """fwd+bwd seconds of one call at the reference shape: ``tokens`` in the micro-batch,
        ``kept_tiles`` kept (block ``ref_block``)."""
        return self.call_s + self.call_s_per_token * tokens + self.tile_s * kept_tiles

    def layer_terms(self, q_heads: int, head_dim: int, block_size: int,
                    microbatch_tokens: int) -> dict:
        """{fwd, bwd: {"call": s, "pair": s}} of one layer of a model with these heads, at
        ``block_size`` and micro-batches of ``microbatch_tokens`` (module docstring)."""
        width = q_heads * head_dim / (self.ref_q_heads * self.ref_head_dim)
        pair = self.tile_s * width * (block_size / self.ref_block) ** 2
        call = self.call_s + self.call_s_per_token * microbatch_tokens * width
        t = self.tile_bwd_share
        return {p: {"call": share_c * call, "pair": share_t * pair}
                for p, share_c, share_t in (("fwd", 1 - CALL_BWD_SHARE, 1 - t),
                                            ("bwd", CALL_BWD_SHARE, t))}

    def describe(self) -> str:
        """'flex (measured: ...)' / 'triton (ESTIMATE: ...)': what prices a row."""
        kind = "measured" if self.measured else "ESTIMATE"
        stand = (f"STANDING IN for {self.stands_in_for}, the length-free kernels auto runs at "
                 f"variable lengths, not yet timed at two lengths: " if self.stands_in_for else "")
        return (f"{self.backend} ({stand}{kind}: {self.call_s * 1e3:.2f} ms + "
                f"{self.call_s_per_token * 32768 * 1e3:.2f} ms per 32K tokens per call, "
                f"{self.tile_s * 1e6:.3f} us per kept tile at {self.ref_q_heads} q heads x "
                f"{self.ref_head_dim}, block {self.ref_block}; {self.source})")

    def as_dict(self) -> dict:
        return dict(asdict(self), described=self.describe())


# Fitted by ``fit_price`` on docs/results/attention_gpu_h100_run2.json (H100, torch 2.11, bf16,
# 8 q / 2 kv heads, hn 128, block 128, sink 1, one document; ``ours_ms``: selection + mask +
# flex's kernel, fwd+bwd): every row of 8K and 32K at densities 1 - 0.125 within 9%.
# test_sparse_call_price.py refits the file and checks these.
FLEX_H100 = SparseCallPrice(
    backend="flex", measured=True, call_s=2.50156e-3, call_s_per_token=1.19054e-7,
    tile_s=0.476205e-6,
    source="H100, docs/results/attention_gpu_h100_run2.json: selection + flex's kernel, fwd+bwd, "
           "one document of 8K and 32K at densities 1-0.125, fitted")


def auto_price(rows: Optional[list] = None, *, microbatch_tokens: int = 32768,
               density: float = 0.5, length_free: bool = False) -> SparseCallPrice:
    """The price of the kernel ``auto`` runs: without a device kernel table (``rows`` None),
    ``FLEX_H100`` (the only kernel timed on a GPU at two lengths, and ``auto``'s choice where
    nothing was measured); with ``kernel_rows(path)``, every backend's fitted price and the
    fastest of them on one document of ``microbatch_tokens`` at ``density`` (what
    ``fastest_backend`` times). ``length_free``: the micro-batches vary in length, so ``auto``
    chooses among ``LENGTH_FREE_BACKENDS`` only (``crossover.auto_candidates``); without rows,
    flex's figure then stands in for them, and its ``stands_in_for`` says so."""
    if rows is None:
        if not length_free:
            return FLEX_H100
        return replace(FLEX_H100, stands_in_for=" or ".join(LENGTH_FREE_BACKENDS))
    prices = fit_prices(rows)
    if length_free:
        prices = {b: p for b, p in prices.items() if b in LENGTH_FREE_BACKENDS}
    if not prices:
        which = (f"no length-free backend ({', '.join(LENGTH_FREE_BACKENDS)}: what auto runs at "
                 f"variable lengths)" if length_free else "no backend")
        raise ValueError(f"kernel table: {which} has rows at two lengths to price it from "
                         f"(expected single-document rows of {REFERENCE_SHAPE}, sink {SINK_BLOCKS})")
    kept = {p.backend: attention_work([microbatch_tokens], density, p.ref_block, SINK_BLOCKS)
            for p in prices.values()}
    return min(prices.values(),
               key=lambda p: p.call_fwd_bwd_s(microbatch_tokens, kept[p.backend]))


def kernel_rows(path: str) -> list:
    """Single-document rows ``{backend, tokens, density, ms, block_size}`` of a device kernel
    table at the reference shape, sink 1: ``scripts/bench_attention_gpu.py``'s JSON (``rows``
    with ``case`` / ``shape`` / ``backend``, the whole call in ``ours_ms``; runs 1-3 kept them
    under ``results``) or the older one of run2 (``results``, the flex path only)."""
    with open(path) as f:
        data = json.load(f)
    out = []
    results = data.get("results") or []
    if "rows" not in data and results and "case" in results[0]:
        data = {"rows": results}   # the per-backend table of runs 1-3, its rows in "results"
    elif "results" in data:        # scripts/bench_attention_gpu.py before the backends column
        if list(data.get("heads", [])) != [8, 2, 128]:
            raise ValueError(f"{path}: heads {data.get('heads')}: expected [8, 2, 128]")
        for r in data["results"]:
            if r.get("sink_blocks", SINK_BLOCKS) == SINK_BLOCKS and "ours_ms" in r:
                out.append(dict(backend=r.get("backend", "flex"), tokens=int(r["seq_len"]),
                                density=float(r["density"]), ms=float(r["ours_ms"]),
                                block_size=int(r.get("block_size", 128))))
        return out
    return price_rows(data.get("rows", []))


def price_rows(rows: list) -> list:
    """``kernel_rows``' rows from a kernel table's own (``scripts/bench_attention_gpu.py``): one
    document of the reference shape, no routing, the whole call timed (``ours_ms``)."""
    return [dict(backend=r["backend"], tokens=int(r["tokens"]), density=float(r["density"]),
                 ms=float(r["ours_ms"]), block_size=int(r.get("block_size", 128)))
            for r in rows if r.get("case") == "single" and r.get("shape") == REFERENCE_SHAPE
            and "ours_ms" in r and r.get("routing", "none") == "none"]


def fit_price(rows: list, backend: str, source: str) -> SparseCallPrice:
    """``backend``'s price from its kernel rows: ``ms = call + per_token x tokens + tile x
    kept`` (kept by ``latency.work.attention_work``, the simulator's own count), least squares
    on relative error, no coefficient below 0 (one that comes out negative is dropped)."""
    mine = [r for r in rows if r["backend"] == backend]
    if len({r["tokens"] for r in mine}) < 2 or len(mine) < 3:
        raise ValueError(f"backend {backend!r}: {len(mine)} rows at "
                         f"{len({r['tokens'] for r in mine})} lengths: expected at least 3 rows "
                         f"at 2 lengths to tell the per-call, per-token and per-tile costs apart")
    block = mine[0]["block_size"]
    x = np.array([[1.0, r["tokens"], attention_work([r["tokens"]], r["density"], block,
                                                    SINK_BLOCKS)] for r in mine])
    y = np.array([r["ms"] * 1e-3 for r in mine])
    w = 1.0 / y
    active = [0, 1, 2]
    while True:
        c, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (c >= 0).all() or len(active) == 1:
            break
        del active[int(np.argmin(c))]
    coef = np.zeros(3)
    coef[active] = np.maximum(c, 0.0)
    return SparseCallPrice(backend=backend, source=source, measured=True, call_s=float(coef[0]),
                           call_s_per_token=float(coef[1]), tile_s=float(coef[2]),
                           ref_block=block)


def fit_prices(rows: list, source: str = "device kernel table") -> dict:
    """{backend: price} for every backend of ``rows`` with enough of them (``fit_price``)."""
    out = {}
    for b in sorted({r["backend"] for r in rows}):
        try:
            out[b] = fit_price(rows, b, source)
        except ValueError:
            continue
    return out


def triton_estimate(device=None) -> SparseCallPrice:
    """The ``triton`` backend's price before a device times it: an ESTIMATE. Per kept tile:
    flex's measured seconds per tile (``FLEX_H100``, another Triton kernel on the same tensor
    cores) scaled by the FLOPs ``attention.work_model`` counts for each design (ours: 2 forward
    GEMMs and a one-pass backward of 5; flex's backward a separate dQ pass, 7), the backward no
    faster than its dQ atomic bytes at HBM bandwidth (``device.hbm_bytes_per_s``, default the
    H100's ``HBM_BYTES_PER_S``). Per call: its
    launches (7 forward with the maxkey selection, 3 backward: ``sparse_triton_select``) at
    ``TRITON_LAUNCH_S`` each and no density-independent kernel work (flex's padded layout has
    some; ours lays out the unpadded tokens): optimistic where flex's fixed cost is high. The
    selection's work is priced by FLOPs (``selection_work``), as the analytic table prices it."""
    from ..attention import work_model
    from ..attention.triton_launch import launch_config

    hbm = device.hbm_bytes_per_s if device is not None else HBM_BYTES_PER_S
    nq, hd, block = FLEX_H100.ref_q_heads, FLEX_H100.ref_head_dim, FLEX_H100.ref_block
    ours = work_model.attention_flops(1, nq, block, hd)
    flex = work_model.attention_flops(1, nq, block, hd, one_pass_backward=False)
    s_per_flop = FLEX_H100.tile_s / flex["total"]
    # the backward's key tile as launched (the default's 64 of a 128 block at hn 128 adds dQ
    # twice a tile; the H200's pin takes the whole block)
    key_tile = launch_config(hd, block, nq // REF_KV_HEADS).bwd_block_n
    dq_bytes = work_model.dq_traffic(1, nq, block, hd, key_tile)["atomic"]
    tile = ours["fwd"] * s_per_flop + max(ours["bwd"] * s_per_flop,
                                          dq_bytes / hbm)
    return SparseCallPrice(
        backend="triton", measured=False, call_s=TRITON_LAUNCHES * TRITON_LAUNCH_S,
        call_s_per_token=0.0, tile_s=tile, ref_q_heads=nq, ref_head_dim=hd, ref_block=block,
        selection_in_call=False,
        source=f"not measured: work_model FLOPs per tile ({ours['total'] / flex['total']:.3f}"
               f" of flex's) at flex's measured H100 rate, {TRITON_LAUNCHES} launches x "
               f"{TRITON_LAUNCH_S * 1e6:.0f} us per call, selection by FLOPs")


REF_KV_HEADS = 2
"""KV heads of the measured reference shape (8 q / 2 kv heads, ``attention_gpu_h100_run2.json``)."""
TRITON_LAUNCHES = 10
"""Launches of one ``triton`` layer call: 7 forward (selection, lists, kernel), 3 backward."""
TRITON_LAUNCH_S = 5e-6
"""Assumed seconds per launch (an H100 back-to-back kernel launch; not measured)."""


def price_named(name: str, rows: Optional[list] = None, **kw) -> SparseCallPrice:
    """``auto``, ``flex`` or ``triton``: the price the simulator uses for that backend (a
    device kernel table's rows, where given, replace the estimate or the committed figure)."""
    if name == "auto":
        return auto_price(rows, **kw)
    measured = fit_prices(rows) if rows is not None else {"flex": FLEX_H100}
    if name in measured:
        return measured[name]
    if name == "triton":
        return triton_estimate()
    raise ValueError(f"sparse kernel {name!r}: expected auto, triton or one of the measured "
                     f"backends {sorted(measured)}")


def table_sparse_kernel(table: dict) -> str:
    """What prices a latency table's sparse call, in words: an analytic table's
    ``sparse_call`` record, or a profiled table's kernel (``attention.backend``; 'auto' in a
    table profiled before auto timed the kernels ran flex, ``AUTO_UNMEASURED``)."""
    rec = table.get("sparse_call")
    if rec is not None:
        return rec.get("described") or rec.get("backend", "?")
    att = table.get("attention") or {}
    backend = att.get("backend", "auto")
    choice = att.get("backend_choice") or {}
    why = ""
    if backend == "auto":
        backend = choice.get("chosen") or (table.get("dense_crossover") or {}).get(
            "sparse_kernel")
        if backend is None:
            backend, why = "flex", "auto before any measurement; "
    return f"{backend} ({why}measured: {table.get('device', '?')} latency table)"


def kernel_labels(table: dict) -> dict:
    """{"sparse": (short, long), "dense": (short, long)}: the kernels that price a latency
    table's sparse and dense attention, a short name for a table column ('flex', 'triton est.',
    'cudnn') and the whole description (``table_sparse_kernel``)."""
    rec = table.get("sparse_call")
    if rec is not None:
        short = rec["backend"] + ("" if rec.get("measured") else " est.") + \
            (" stand-in" if rec.get("stands_in_for") else "")
    else:
        att = table.get("attention") or {}
        short = att.get("backend", "auto")
        if short == "auto":
            short = (att.get("backend_choice") or {}).get("chosen") or (
                table.get("dense_crossover") or {}).get("sparse_kernel") or "flex"
    cross = table.get("dense_crossover") or {}
    if table.get("source") == "analytic":
        dense = ("cudnn", "cuDNN, measured on an H100 (docs/results/attention_gpu_h100_run2.json)"
                          ", scaled to the model by FLOPs")
    else:
        name = cross.get("dense_kernel") or "dense"
        dense = (name.split()[0], f"{name} (measured: {table.get('device', '?')} latency table)")
    return {"sparse": (short, table_sparse_kernel(table)), "dense": dense}
