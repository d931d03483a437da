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
  (``scripts/bench.py attention_gpu``) from its own rows and takes the fastest at the
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
(``analytic``): tiles 1 : 2.5, calls 1 : 2, unless the price was fitted from rows that timed the
passes apart (a device kernel table, ``attention_gpu``), whose shares it then carries
(``tile_bwd_share``, ``call_bwd_share``: on the H200, run 5, FA4's backward holds 60-70% of
its fixed cost per call).

The fixed cost per call is the price's ``call_s`` (and ``call_s_per_token``), fitted with the
tiles by the one fitter (``fit.fit_nonneg``, per pass) from the whole call's rows of every
micro-batch the table timed (one document, and packed micro-batches whose kept tiles the
kernel rows count): the kernel table's summary reports it per kernel (``fixed_ms``) from the
same fit, no line of its own. Rows at one length price that length only: the per-token part
is then not identifiable and sits in ``call_s`` (``lengths`` says which were timed).

The price itself is ``price.SparseCallPrice``; its fit from a device kernel table is
``price_fit.py``'s (both re-exported here).

Pure Python + numpy; must not import torch or megatron (``triton_estimate`` imports
``attention.work_model`` lazily: importing the attention package loads torch).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .price import (CALL_BWD_SHARE, HBM_BYTES_PER_S, REFERENCE_SHAPE,  # noqa: F401
                    SINK_BLOCKS, TILE_BWD_SHARE, SparseCallPrice)
from .work import attention_work

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
    if length_free:   # variable lengths: a price for every length, so timed at two
        prices = {b: p for b, p in prices.items()
                  if b in LENGTH_FREE_BACKENDS and len(p.lengths) >= 2}
    if not prices:
        which = (f"no length-free backend ({', '.join(LENGTH_FREE_BACKENDS)}: what auto runs at "
                 f"variable lengths)" if length_free else "no backend")
        raise ValueError(f"kernel table: {which} has rows at two lengths to price it from "
                         f"(expected rows of {REFERENCE_SHAPE} at 2 densities, sink {SINK_BLOCKS})")
    kept = {p.backend: attention_work([microbatch_tokens], density, p.ref_block, SINK_BLOCKS)
            for p in prices.values()}
    return min(prices.values(),
               key=lambda p: p.call_fwd_bwd_s(microbatch_tokens, kept[p.backend]))


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


# the fit from a device kernel table (price_fit.py), here for the callers that import it here
from .price_fit import (attach_price, fit_price, fit_prices, kernel_rows,  # noqa: E402,F401
                        price_design, price_rows)
