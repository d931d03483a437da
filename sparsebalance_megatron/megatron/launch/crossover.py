"""Measure this device's dense/sparse crossover for the profiler (``profile.profile_table``).

For documents of 1, 2, 3, 4, 6, 8, 12, ... blocks, up to the micro-batch length
(``latency.crossover.crossover_lengths``), one packed micro-batch of as many such documents as
fit (``packed_counts``) is timed forward + backward through the run's two kernels:
``dense_varlen_attention`` with ``--sb-dense-kernel``, and ``block_sparse_attention`` at the base
density ``--sb-density`` with ``--sb-attention-backend`` and the run's selection knobs, padded as
the whole micro-batch (``pad_to_tokens``), so flex runs the one compiled shape the profiled grid
and training use. Packed, not one document per call: routing moves a document between two calls
that a micro-batch makes anyway, so what decides is each kernel's cost per document with the
per-call costs (launches, the selection's fixed work) shared by a micro-batch's documents. One
short document per call charged the sparse call's whole fixed cost to it: on an H200 that put the
crossover at 12,288 tokens (triton, density 0.5, 14 / 2 heads x 64), while packed 32K micro-batches
of 30-77 documents of at most 4,513-15,459 tokens ran 0.41-0.92x the dense varlen call unrouted
and 0.97-1.05x routed (``docs/results/attention_gpu_h200_run1.json`` at a63cdd4).
The head shape is the profiled model's (TP = 1), the dtype that of its stage (bfloat16 on CUDA,
float32 on CPU). Repeats are passes over all lengths (a burst of load spoils one sample of many
points); the median is kept. ``latency.crossover.crossover_tokens`` turns the times into the
crossover, stored in the table with what it was measured with.

On CPU the kernels are functional stand-ins (the blockwise torch kernel against SDPA), not what
a GPU run trades, so the profiler measures the crossover on CUDA only unless asked
(``profile_cli --dense-crossover``).
Pure torch (megatron is not imported); it lives in the adapter because only the profiler runs it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ...attention import block_sparse_attention, resolve_backend
from ...attention.api import backend_missing, set_auto_backend
from ...attention.dense import dense_varlen_attention, packed_docs, resolve_dense_kernel
from ...config import SparseBalanceConfig
from ...latency.crossover import crossover_entries, crossover_lengths, crossover_tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_fwd_bwd(fn, inputs, w, device) -> float:
    for x in inputs:
        x.grad = None
    _sync(device)
    t0 = time.perf_counter()
    (fn(*inputs).float() * w).sum().backward()
    _sync(device)
    return time.perf_counter() - t0


def _sparse_fn(sb: SparseBalanceConfig, bounds, backend: str, pad_to_tokens=None):
    """``f(q, k, v) -> out``: the run's sparse attention of the documents between the token
    boundaries ``bounds`` (``[0, ..., t]``) through ``backend`` (``f.backend``), with a cache of
    its own: one micro-batch, the layout built once, as in training."""
    cache = {}

    def sparse(q, k, v):
        return block_sparse_attention(
            q, k, v, bounds, sb.density, block_size=sb.block_size,
            sink_blocks=sb.sink_blocks, local_blocks=sb.local_blocks,
            selection_mode=sb.selection_mode, mass_threshold=sb.mass_threshold,
            min_density=sb.min_density, max_density=sb.max_density, estimator=sb.estimator,
            backend=backend, query_chunk_blocks=sb.query_chunk_blocks, cache=cache,
            pad_to_tokens=pad_to_tokens)[0]
    sparse.backend = backend
    return sparse


def packed_counts(lengths, max_tokens: int) -> list[int]:
    """How many documents of each length one micro-batch of ``max_tokens`` holds (at least 1)."""
    return [max(1, int(max_tokens) // int(n)) for n in lengths]


def measure_crossover(sb: SparseBalanceConfig, *, num_heads: int, num_groups: int,
                      head_dim: int, max_tokens: int, device, dtype: torch.dtype,
                      repeats: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """The crossover record of this device (kernels, head shape, dtype, density, lengths, the
    documents per timed micro-batch, median seconds of each kernel per micro-batch, ``tokens``:
    the crossover; ``latency.crossover.crossover_entries`` makes it table entries)."""
    device = torch.device(device)
    lengths = crossover_lengths(sb.block_size, max_tokens)
    counts = packed_counts(lengths, max_tokens)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cases = []
    for n, count in zip(lengths, counts):
        t = n * count
        q, k, v = (torch.randn(t, h, head_dim, generator=g).to(device, dtype).requires_grad_()
                   for h in (num_heads, num_groups, num_groups))
        w = torch.randn(t, num_heads, head_dim, generator=g).to(device)
        bounds = [i * n for i in range(count + 1)]
        docs = packed_docs(bounds, t, device)

        def dense(q_, k_, v_, docs=docs):
            return dense_varlen_attention(q_, k_, v_, docs, kernel=sb.dense_kernel)

        cases.append(((q, k, v), w, dense,
                      _sparse_fn(sb, bounds, sb.attention_backend, pad_to_tokens=max_tokens)))
    samples = np.zeros((repeats, len(lengths), 2))
    for r in range(warmup + repeats):
        for j, (inputs, w, dense, sparse) in enumerate(cases):
            for i, fn in enumerate((dense, sparse)):
                t = _time_fwd_bwd(fn, inputs, w, device)
                if r >= warmup:
                    samples[r - warmup, j, i] = t
    dense_s, sparse_s = (np.median(samples[:, :, i], axis=0).tolist() for i in (0, 1))
    return {"source": "profiled", "sparse_kernel": resolve_backend(sb.attention_backend, device),
            "dense_kernel": resolve_dense_kernel(sb.dense_kernel, device, dtype),
            "num_attention_heads": num_heads, "num_query_groups": num_groups,
            "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
            "block_size": sb.block_size, "density": sb.density, "repeats": repeats,
            "layout": "packed", "lengths": lengths, "docs_per_call": counts,
            "dense_s": dense_s, "sparse_s": sparse_s,
            "tokens": crossover_tokens(lengths, dense_s, sparse_s)}


AUTO_CANDIDATES = ("triton", "fa4", "flex", "flash")
"""What ``--sb-attention-backend auto`` chooses among on CUDA: each one that can run here."""


def auto_candidates(sb: SparseBalanceConfig) -> tuple:
    """The kernels 'auto' chooses among: the length-free ones for variable-length micro-batches
    (``latency.sparse_call.LENGTH_FREE_BACKENDS``: a kernel compiled per length is no choice
    there; the simulator's ``auto_price(length_free=True)`` chooses among the same), else every
    one (``AUTO_CANDIDATES``)."""
    from ...latency.sparse_call import LENGTH_FREE_BACKENDS
    return LENGTH_FREE_BACKENDS if sb.length_multiple else AUTO_CANDIDATES


def fastest_backend(sb: SparseBalanceConfig, *, num_heads: int, num_groups: int, head_dim: int,
                    tokens: int, device, dtype: torch.dtype, repeats: int = 3,
                    warmup: int = 1, seed: int = 0, candidates=None) -> dict:
    """``{"chosen": backend, "seconds": {backend: median fwd+bwd s}, "tokens", "density"}``:
    every one of ``candidates`` (None: ``AUTO_CANDIDATES``) that can run here timed on one
    document of ``tokens`` tokens at the base density (the long documents the sparse kernel is
    for); a candidate that fails is recorded with its error and not chosen."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g).to(device, dtype).requires_grad_()
               for h in (num_heads, num_groups, num_groups))
    w = torch.randn(tokens, num_heads, head_dim, generator=g).to(device)
    seconds, failed = {}, {}
    for backend in AUTO_CANDIDATES if candidates is None else candidates:
        why = backend_missing(backend, device, dtype=dtype, head_dim=head_dim,
                              block_size=sb.block_size)
        if why is not None:
            failed[backend] = why
            continue
        sparse = _sparse_fn(sb, [0, tokens], backend)
        try:
            times = [_time_fwd_bwd(sparse, (q, k, v), w, device)
                     for _ in range(warmup + repeats)][warmup:]
        except Exception as e:  # noqa: BLE001 - a kernel that does not run here is not chosen
            failed[backend] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        seconds[backend] = float(np.median(times))
    if not seconds:
        raise RuntimeError(f"--sb-attention-backend auto: no sparse kernel ran on {device} "
                           f"({'; '.join(f'{b}: {w}' for b, w in failed.items())})")
    return {"chosen": min(seconds, key=seconds.get), "seconds": seconds, "failed": failed,
            "tokens": tokens, "density": sb.density, "dtype": str(dtype).replace("torch.", "")}


def choose_backend(shape, sb: SparseBalanceConfig, repeats: int, warmup: int):
    """(the config the profiler runs, the choice record or None): on CUDA, ``auto`` becomes the
    fastest kernel measured here (``fastest_backend``); elsewhere nothing changes."""
    import dataclasses

    if sb.attention_backend != "auto" or not torch.cuda.is_available():
        return sb, None
    choice = fastest_backend(sb, num_heads=shape.num_attention_heads,
                             num_groups=shape.num_query_groups, head_dim=shape.head_dim,
                             tokens=shape.seq_length, device="cuda", dtype=torch.bfloat16,
                             repeats=repeats, warmup=max(warmup, 1),
                             candidates=auto_candidates(sb))
    set_auto_backend(choice["chosen"], "timed at profiling by crossover.fastest_backend")
    return dataclasses.replace(sb, attention_backend=choice["chosen"]), choice


def crossover_of_shape(shape, sb: SparseBalanceConfig, repeats: int, warmup: int) -> dict:
    """The latency-table entries of this device's crossover for a ``ModelShape`` (its heads,
    its longest document ``seq_length``), in the dtype the profiler's stages run in."""
    cuda = torch.cuda.is_available()
    return crossover_entries(measure_crossover(
        sb, num_heads=shape.num_attention_heads, num_groups=shape.num_query_groups,
        head_dim=shape.head_dim, max_tokens=shape.seq_length, device="cuda" if cuda else "cpu",
        dtype=torch.bfloat16 if cuda else torch.float32, repeats=repeats,
        warmup=max(warmup, 1)))
