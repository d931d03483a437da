"""Work counts of budgeted block-sparse attention: the features of the latency model.

``attention_work`` counts exactly the (query-block, key-block) pairs the sparse kernel computes:
every document is cut into ``ceil(L / block_size)`` blocks; query block i (0-based, inside its
document) has ``i + 1`` causal key blocks available and keeps
``max(ceil(density * (i + 1)), forced_i)`` of them, where ``forced_i = min(i + 1,
sink_blocks + local_blocks + 1)`` counts the diagonal, the sink blocks and the local window (their
union inside [0, i]). The ceil is taken in float64 as ``ceil((density - 1e-6) * available)``, exactly
like ``attention/selection.py``'s ``kept_count`` (the tolerance keeps ceil(0.7 * 10) at 7 and a
float32 0.3 at 3 of 10).
A short last block counts as one full pair: the kernels work on padded ``block_size`` tiles
(see ``attention/blocks.py``), so a short tile costs what a full one does.

``selection_work`` is the scoring cost of the current estimator (``attention/selection.py``): it
fills a dense ``[NB, NB]`` share matrix over all ``NB`` blocks of the micro-batch (then masks it
to causal, in-document pairs and takes a top-k), so it costs ``NB ** 2`` block pairs per micro-batch,
whatever the documents are. If the estimator becomes per-document, change it here.

The CPU kernel (``attention/kernels.py``, backend ``torch``) pads every chunk of
``query_chunk_blocks`` consecutive query blocks of the micro-batch to the chunk's largest kept
count, so what it computes is ``chunked_attention_work``: sum over chunks of
``chunk blocks x max kept``. FlexAttention (GPU) computes exactly the kept pairs.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

DocLengths = Union[Sequence[int], np.ndarray]


def check_block_params(block_size: int, sink_blocks: int, local_blocks: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size <= 0 or (block_size & (block_size - 1)):
        raise ValueError(f"block_size={block_size!r}: expected a positive power of two")
    for name, v in (("sink_blocks", sink_blocks), ("local_blocks", local_blocks)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}={v!r}: expected an integer >= 0")


def as_doc_lengths(doc_lengths, what: str = "doc_lengths") -> np.ndarray:
    """Validate a 1-D array of positive document lengths in tokens -> int64 array."""
    a = np.asarray(doc_lengths)
    if a.ndim != 1:
        raise ValueError(f"{what} has shape {a.shape}: expected a 1-D list of token counts")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise ValueError(f"{what}={a[:8].tolist()}: expected integer token counts")
    a = a.astype(np.int64)
    if np.any(a <= 0):
        raise ValueError(f"{what} contains {a[a <= 0][0]}: expected lengths >= 1 token")
    return a


def check_densities(density) -> np.ndarray:
    d = np.asarray(density, dtype=np.float64)
    bad = ~((d > 0) & (d <= 1))
    if np.any(bad):
        raise ValueError(f"density={d[bad].ravel()[0]!r}: expected a value in (0, 1]")
    return d


# Must equal attention/selection.py's _DENSITY_RTOL (a test compares with the kernel's selection).
DENSITY_RTOL = 1e-6


def num_blocks(doc_lengths: np.ndarray, block_size: int) -> np.ndarray:
    return (doc_lengths + block_size - 1) // block_size


def cumulative_work_table(densities: np.ndarray, max_blocks: int, sink_blocks: int,
                          local_blocks: int) -> np.ndarray:
    """[len(densities), max_blocks + 1]: entry [j, N] = kept pairs of a document of N blocks."""
    d = check_densities(densities).reshape(-1, 1)                 # [D, 1]
    n = np.arange(1, max_blocks + 1, dtype=np.float64)[None, :]   # [1, N] available blocks
    forced = np.minimum(n, float(sink_blocks + local_blocks + 1))
    kept = np.maximum(np.ceil((d - DENSITY_RTOL) * n), forced)              # [D, N]
    out = np.zeros((d.shape[0], max_blocks + 1))
    np.cumsum(kept, axis=1, out=out[:, 1:])
    return out


def attention_work(doc_lengths: DocLengths, density: float, block_size: int,
                   sink_blocks: int = 1, local_blocks: int = 0) -> float:
    """Kept (query-block, key-block) pairs of these documents at this density (module docstring)."""
    check_block_params(block_size, sink_blocks, local_blocks)
    nb = num_blocks(as_doc_lengths(doc_lengths), block_size)
    if nb.size == 0:
        return 0.0
    table = cumulative_work_table(np.asarray([density]), int(nb.max()), sink_blocks,
                                  local_blocks)[0]
    return float(table[nb].sum())


def scaled_to_work(profile: Sequence[float], work, density: float,
                   weights: Optional[Sequence[float]] = None) -> list:
    """``profile`` (one density per layer) times the one factor that makes the layers' summed
    ``work(density)`` that of every layer at uniform ``density``, each density capped at 1
    (bisection, 50 halvings; the result rounded to 4 digits): a per-layer allocation's shape at
    uniform d0's cost. ``work``: a layer's kept work at a density in (0, 1], increasing;
    ``weights``: how many layers each entry of ``profile`` stands for (default 1 each)."""
    weights = [1.0] * len(profile) if weights is None else weights
    target = sum(weights) * work(density)
    lo, hi = 0.0, 1.0 / max(min(profile), 1e-12)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        got = sum(w * work(min(1.0, mid * p)) for p, w in zip(profile, weights))
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return [round(min(1.0, hi * p), 4) for p in profile]


def selection_work(doc_lengths: DocLengths, block_size: int) -> float:
    """Scoring cost in block pairs: ``NB ** 2`` for the ``NB`` blocks of the micro-batch."""
    check_block_params(block_size, 0, 0)
    nb = float(num_blocks(as_doc_lengths(doc_lengths), block_size).sum())
    return nb * nb


def block_kept(block_local: np.ndarray, density: np.ndarray, sink_blocks: int,
               local_blocks: int) -> np.ndarray:
    """Kept key blocks of every query block (``block_local``: index inside its document)."""
    n = block_local.astype(np.float64) + 1.0
    forced = np.minimum(n, float(sink_blocks + local_blocks + 1))
    return np.maximum(np.ceil((density - DENSITY_RTOL) * n), forced)


def chunked_attention_work(doc_lengths: DocLengths, density: float, block_size: int,
                           sink_blocks: int = 1, local_blocks: int = 0,
                           query_chunk_blocks: int = 16) -> float:
    """Block pairs the CPU kernel computes: chunks of ``query_chunk_blocks`` consecutive query
    blocks (documents in the given order) padded to the chunk's largest kept count."""
    check_block_params(block_size, sink_blocks, local_blocks)
    nb = num_blocks(as_doc_lengths(doc_lengths), block_size)
    if nb.size == 0:
        return 0.0
    local = np.concatenate([np.arange(n) for n in nb])
    k = block_kept(local, np.float64(check_densities(density)), sink_blocks, local_blocks)
    pad = (-k.size) % query_chunk_blocks
    k = np.concatenate([k, np.zeros(pad)]).reshape(-1, query_chunk_blocks)
    sizes = np.full(k.shape[0], float(query_chunk_blocks))
    sizes[-1] -= pad
    return float((k.max(axis=1) * sizes).sum())


def kept_pairs_bruteforce(doc_lengths: DocLengths, density: float, block_size: int,
                          sink_blocks: int = 1, local_blocks: int = 0) -> int:
    """Slow set-based count used by tests as the oracle of ``attention_work``."""
    total = 0
    for length in as_doc_lengths(doc_lengths).tolist():
        nb = -(-length // block_size)
        for i in range(nb):
            forced = set(range(min(sink_blocks, i + 1))) | set(range(max(0, i - local_blocks), i + 1))
            k = int(np.ceil((np.float64(density) - DENSITY_RTOL) * (i + 1)))
            total += min(i + 1, max(k, len(forced)))
    return total
