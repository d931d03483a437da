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
(``analytic``): tiles 1 : 2.5, calls 1 : 2, unless the price was fitted from rows that timed the
passes apart (a device kernel table, ``bench_attention_gpu.py``), whose shares it then carries
(``tile_bwd_share``, ``call_bwd_share``: on the H200, run 5, FA4's backward holds 60-70% of
its fixed cost per call).

The fixed cost per call is the price's ``call_s`` (and ``call_s_per_token``), fitted with the
tiles by the one fitter (``fit.fit_nonneg``, per pass) from the whole call's rows of every
micro-batch the table timed (one document, and packed micro-batches whose kept tiles the
kernel rows count): the kernel table's summary reports it per kernel (``fixed_ms``) from the
same fit, no line of its own. Rows at one length price that length only: the per-token part
is then not identifiable and sits in ``call_s`` (``lengths`` says which were timed).

Pure Python + numpy; must not import torch or megatron (``triton_estimate`` imports
``attention.work_model`` lazily: importing the attention package loads torch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from .fit import fit_nonneg
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
(``docs/results/gpu_check_h200_run1_train.json``: 45,780 real tokens of 65,536 positions per
step on average)."""


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
    call_bwd_share: float = CALL_BWD_SHARE
    """The backward's share of a call's fixed seconds (measured where the passes were timed
    apart, else the launches' 2 : 1)."""
    lengths: tuple = ()
    """Micro-batch lengths (tokens) the price was fitted at; one length prices that one only."""

    def __post_init__(self):
        for name in ("call_s", "call_s_per_token", "tile_s", "call_bwd_share"):
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
        t, c = self.tile_bwd_share, self.call_bwd_share
        return {p: {"call": share_c * call, "pair": share_t * pair}
                for p, share_c, share_t in (("fwd", 1 - c, 1 - t), ("bwd", c, t))}

    def describe(self) -> str:
        """'flex (measured: ...)' / 'triton (ESTIMATE: ...)': what prices a row."""
        kind = "measured" if self.measured else "ESTIMATE"
        stand = (f"STANDING IN for {self.stands_in_for}, the length-free kernels auto runs at "
                 f"variable lengths, not yet timed at two lengths: " if self.stands_in_for else "")
        at = (f" at {self.lengths[0]} tokens only" if len(self.lengths) == 1 else "")
        return (f"{self.backend} ({stand}{kind}: {self.call_s * 1e3:.2f} ms + "
                f"{self.call_s_per_token * 32768 * 1e3:.2f} ms per 32K tokens per call{at}, "
                f"{self.tile_s * 1e6:.3f} us per kept tile at {self.ref_q_heads} q heads x "
                f"{self.ref_head_dim}, block {self.ref_block}; {self.source})")

    def as_dict(self) -> dict:
        return dict(asdict(self), described=self.describe())

    @classmethod
    def from_dict(cls, rec: dict) -> "SparseCallPrice":
        """The price an ``as_dict`` record holds (a latency table's ``sparse_call``)."""
        names = {f for f in cls.__dataclass_fields__}
        out = {k: v for k, v in rec.items() if k in names}
        out["lengths"] = tuple(out.get("lengths", ()))
        return cls(**out)

    def pass_ms(self, tokens: int, kept_tiles: float) -> dict:
        """{fwd, bwd: ms} of one call at the reference shape (the fixed part and the tiles
        split by the price's shares)."""
        call = self.call_s + self.call_s_per_token * tokens
        tile = self.tile_s * kept_tiles
        c, t = self.call_bwd_share, self.tile_bwd_share
        return {"fwd": 1e3 * ((1 - c) * call + (1 - t) * tile),
                "bwd": 1e3 * (c * call + t * tile)}


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
                         f"(expected rows of {REFERENCE_SHAPE} at 2 densities, sink {SINK_BLOCKS})")
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


def price_rows(rows: list, shape: str = REFERENCE_SHAPE, kind: str = "call") -> list:
    """``kernel_rows``' rows from a kernel table's own (``scripts/bench_attention_gpu.py``) at
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
