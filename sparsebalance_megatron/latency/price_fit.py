"""A sparse call's price fitted from a device kernel table (``scripts/bench.py attention_gpu``'s
rows, ``sparse_call``'s docstring): the rows read (``kernel_rows``, ``price_rows``: one document
and packed micro-batches, their kept tiles), the fit (``fit_price``: per call, per token and per
kept tile, each pass apart, by ``fit.fit_nonneg``), and a profiled latency table given the price
(``attach_price``: ``LatencyModel.fit`` then prices its sparse calls by it).

Pure Python + numpy; must not import torch or megatron.
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from .fit import fit_nonneg
from .price import (CALL_BWD_SHARE, REFERENCE_SHAPE, SINK_BLOCKS, TILE_BWD_SHARE,
                    SparseCallPrice)
from .work import attention_work


def kernel_rows(path: str) -> list:
    """Single-document rows ``{backend, tokens, density, ms, block_size}`` of a device kernel
    table at the reference shape, sink 1: ``scripts/bench.py attention_gpu``'s JSON (``rows``
    with ``case`` / ``shape`` / ``backend``, the whole call in ``ours_ms``; runs 1-3 kept them
    under ``results``) or the older one of run2 (``results``, the flex path only)."""
    with open(path) as f:
        data = json.load(f)
    out = []
    results = data.get("results") or []
    if "rows" not in data and results and "case" in results[0]:
        data = {"rows": results}   # the per-backend table of runs 1-3, its rows in "results"
    elif "results" in data:        # the kernel table before the backends column
        if list(data.get("heads", [])) != [8, 2, 128]:
            raise ValueError(f"{path}: heads {data.get('heads')}: expected [8, 2, 128]")
        for r in data["results"]:
            if r.get("sink_blocks", SINK_BLOCKS) == SINK_BLOCKS and "ours_ms" in r:
                out.append(dict(backend=r.get("backend", "flex"), tokens=int(r["seq_len"]),
                                density=float(r["density"]), ms=float(r["ours_ms"]),
                                block_size=int(r.get("block_size", 128))))
        return out
    return price_rows(data.get("rows", []))


def price_rows(rows: list, shape: str = REFERENCE_SHAPE, kind: str = "call") -> list:
    """``kernel_rows``' rows from a kernel table's own (``scripts/bench.py attention_gpu``) at
    ``shape``, no routing: ``kind`` "call" (the whole call: ``ours_ms``, its passes
    ``call_fwd_ms`` / ``call_bwd_ms``) or "kernel" (a kernel alone: ``fwd_ms`` / ``bwd_ms``, its
    ``variant``). Kept tiles per row: the kernel rows' count of the same micro-batch and density
    (``tiles`` over the query heads), else, for one document, ``attention_work``; a packed row
    with no count is left out. Each row: backend, variant, case, tokens, density, kept,
    longest, ms and, where timed, fwd_ms and bwd_ms."""
    heads = int(shape.split("/")[0])
    counted = {(r.get("case"), r.get("shape"), r.get("tokens"), r.get("density")):
               r["tiles"] / heads for r in rows if r.get("kind") == "kernel" and r.get("tiles")}
    out = []
    for r in rows:
        if r.get("shape") != shape or r.get("routing", "none") != "none":
            continue
        if kind == "call" and r.get("kind", "call") == "call" and "ours_ms" in r:
            ms, fwd, bwd = r["ours_ms"], r.get("call_fwd_ms"), r.get("call_bwd_ms")
        elif kind == "kernel" and r.get("kind") == "kernel" and r.get("fwd_ms") \
                and r.get("bwd_ms"):
            ms, fwd, bwd = r["fwd_ms"] + r["bwd_ms"], r["fwd_ms"], r["bwd_ms"]
        else:
            continue
        tokens, d = int(r["tokens"]), float(r["density"])
        kept = counted.get((r.get("case"), shape, r["tokens"], r["density"]))
        block = int(r.get("block_size", 128))
        if kept is None and r.get("case") == "single":
            kept = attention_work([tokens], d, block, SINK_BLOCKS)
        if kept is None:
            continue
        row = dict(backend=r["backend"], variant=r.get("variant") or r["backend"],
                   case=r.get("case", "single"), tokens=tokens, density=d, kept=float(kept),
                   longest=int(r.get("longest", tokens)), ms=float(ms), block_size=block)
        if fwd and bwd:
            row.update(fwd_ms=float(fwd), bwd_ms=float(bwd))
        out.append(row)
    return out


def price_design(rows: list) -> np.ndarray:
    """[n, 3] the price's features of ``rows``: a call, its tokens, its kept tiles."""
    return np.array([[1.0, r["tokens"], r["kept"] if "kept" in r else attention_work(
        [r["tokens"]], r["density"], r.get("block_size", 128), SINK_BLOCKS)] for r in rows])


def fit_price(rows: list, backend: str, source: str, *, variant: Optional[str] = None,
              shape: str = REFERENCE_SHAPE) -> SparseCallPrice:
    """``backend``'s (and ``variant``'s) price from its rows (``price_rows``): ``ms = call +
    per_token x tokens + tile x kept`` by ``fit.fit_nonneg`` (relative error, no work cost
    below 0), per pass where every row timed the passes apart (the shares then measured),
    else on the whole call. At one length the per-token part is not identifiable and stays in
    the call's cost (``lengths`` records it)."""
    mine = [r for r in rows if r["backend"] == backend
            and (variant is None or r.get("variant", backend) == variant)]
    lengths = tuple(sorted({r["tokens"] for r in mine}))
    if len(mine) < 3 or len({r["density"] for r in mine}) < 2:
        raise ValueError(f"backend {backend!r}: {len(mine)} rows at {len(lengths)} lengths: "
                         f"expected at least 3 rows at 2 densities to tell the per-call cost "
                         f"from the per-tile one (two lengths add the per-token one)")
    x = price_design(mine)
    parts = ("fwd", "bwd") if all("fwd_ms" in r for r in mine) else ("ms",)
    coef = {p: fit_nonneg(x, np.array([r[p if p == "ms" else p + "_ms"] * 1e-3 for r in mine]))
            for p in parts}
    total = sum(coef.values())
    shares = {}
    if parts == ("fwd", "bwd"):
        def share(j, default):
            return float(coef["bwd"][j] / total[j]) if total[j] > 0 else default
        shares = dict(call_bwd_share=share(0, CALL_BWD_SHARE),
                      tile_bwd_share=share(2, TILE_BWD_SHARE))
    nq, _, hd = (int(v) for v in shape.split("/"))
    return SparseCallPrice(backend=backend, source=source, measured=True,
                           call_s=float(max(total[0], 0.0)), call_s_per_token=float(total[1]),
                           tile_s=float(total[2]), ref_q_heads=nq, ref_head_dim=hd,
                           ref_block=mine[0]["block_size"], lengths=lengths, **shares)


def fit_prices(rows: list, source: str = "device kernel table", **kw) -> dict:
    """{backend: price} for every backend of ``rows`` with enough of them (``fit_price``)."""
    out = {}
    for b in sorted({r["backend"] for r in rows}):
        try:
            out[b] = fit_price(rows, b, source, **kw)
        except ValueError:
            continue
    return out


def attach_price(table: dict, price: SparseCallPrice) -> dict:
    """A copy of a profiled latency table that carries ``price`` (a measured one, from a device
    kernel table of the same device), without its stored coefficients: ``LatencyModel.fit``
    then prices its sparse calls by it and fits the rest (``model``'s docstring)."""
    if table.get("source") != "profiled" or not price.measured:
        raise ValueError(f"attach_price: a {table.get('source')!r} table and "
                         f"{'a measured' if price.measured else 'an estimated'} price: expected a "
                         f"profiled table and a price measured on its device")
    out = {k: v for k, v in table.items() if k not in ("coefficients", "call_coefficients",
                                                       "dense_coefficients")}
    out["sparse_call"] = price.as_dict()
    return out
