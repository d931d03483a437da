"""Latency tables for the device calls, made from committed device measurements, not profiled
there: the analytic table (``latency.analytic``: the GEMMs at published throughputs) with the
attention as the H200 measured it in run 5 (cuDNN's dense kernel per causal tile, and the
sparse call's price of the backend the call will run, ``latency.sparse_call.fit_price``, at the
model's own head shape).

The end-to-end call trains a 24-layer model that no committed table describes (the H200's fa4
table is the 8-layer one's, with no middle stage to scale from), and the DST call plans a
PP 4 x DP 4 step of it: both plan with ``priced_table`` and say so.

Pure Python + numpy; imports neither torch nor megatron.
"""

from __future__ import annotations

import json
import os

from .common import ROOT

KERNEL_TABLES = {"fa4": "kernel_table_h200_run5_fa4_flash.json",
                 "triton": "kernel_table_h200_run5_triton_flex.json"}
MODEL_SHAPE = "14/2/64"                 # Qwen2.5-0.5B's query / KV heads x head dim


def kernel_table_path(backend: str) -> str:
    if backend not in KERNEL_TABLES:
        raise ValueError(f"backend {backend!r}: expected one of {sorted(KERNEL_TABLES)} (the "
                         f"kernels run 5 timed at {MODEL_SHAPE})")
    return os.path.join(ROOT, "docs", "results", KERNEL_TABLES[backend])


def length_free_backend() -> str:
    """What ``--sb-attention-backend auto`` runs at variable lengths here: fa4 where it can
    run, else triton (``latency.sparse_call.LENGTH_FREE_BACKENDS``' order; the launch's rule,
    ``megatron/launch/lengths.py``)."""
    from sparsebalance_megatron.attention.api import backend_missing
    return "fa4" if backend_missing("fa4", "cuda") is None else "triton"


def h200_profile(rows: list):
    """``DeviceProfile`` of the H200 with cuDNN's kernel as the kernel table timed it (one 32K
    document at the model's heads: seconds per causal tile, its call cost the H100's)."""
    from sparsebalance_megatron.latency.analytic import DeviceProfile

    dense = next(r for r in rows if r.get("kind") == "dense" and r["case"] == "single"
                 and r["shape"] == MODEL_SHAPE and r.get("dense_cudnn_ms"))
    nb = -(-int(dense["tokens"]) // 128)
    nh, _, hd = (int(v) for v in MODEL_SHAPE.split("/"))
    return DeviceProfile(name="NVIDIA H200 (analytic GEMMs; cuDNN and the sparse call measured, "
                              "run 5)", dense_tile_s=dense["dense_cudnn_ms"] * 1e-3 /
                         (nb * (nb + 1) / 2), dense_reference_heads_dim=nh * hd,
                         hbm_bytes_per_s=4.8e12)


def priced_table(backend: str, *, layers: int = 24, pp: int = 1, seq_length: int = 32768,
                 kernel_table: str | None = None) -> dict:
    """The analytic table of Qwen2.5-0.5B with ``layers`` layers in ``pp`` stages at
    ``seq_length`` tokens per micro-batch, block 128, its attention priced by the kernel
    table (default: run 5's of ``backend``)."""
    from sparsebalance_megatron.latency import ModelShape, analytic_table
    from sparsebalance_megatron.latency.sparse_call import fit_price, price_rows

    path = kernel_table or kernel_table_path(backend)
    rows = json.load(open(path))["rows"]
    price = fit_price(price_rows(rows, MODEL_SHAPE), backend, os.path.relpath(path, ROOT),
                      shape=MODEL_SHAPE)
    table = analytic_table(ModelShape(num_layers=layers, seq_length=seq_length, pp=pp),
                           h200_profile(rows), pp=pp, block_size=128, sparse_price=price,
                           transformer_impl="local")
    table["notes"] = (f"made by scripts/studies/_device_tables.priced_table({backend!r}, "
                      f"layers={layers}, pp={pp}, seq_length={seq_length}) from "
                      f"{os.path.relpath(path, ROOT)}; " + table["notes"])
    return table


__all__ = ["h200_profile", "kernel_table_path", "length_free_backend", "priced_table"]
