"""The profile's grid: the document-length mixes the profiler times (``default_mixes``, the quick
grid's ``QUICK_MIXES``) and the warning for a grid whose micro-batches would compile flex's
kernel at several padded lengths (``padded_length_warning``). ``profile.py`` times them.

Pure Python + numpy (the attention blocks' padded length is imported lazily).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...data.packing import packed_length, padding_lengths

QUICK_MIXES = 7
"""How many of ``default_mixes`` the quick profile (``profile_cli --quick``) times."""


def default_mixes(seq_length: int, count: int, seed: int = 0,
                  block_size: Optional[int] = None,
                  length_multiple: int = 0) -> list[list[int]]:
    """Document-length mixes of exactly ``seq_length`` tokens each, packed as training packs them.

    With ``length_multiple`` K > 0 (``--sb-microbatch-multiple``: variable-length micro-batches)
    training packs a micro-batch to its documents rounded up to K, so the mixes are padded that
    way and the grid holds several token totals (the quick grid: ``seq_length``, a half and a
    quarter), which is what lets the fit tell token work from the intercept and from selection
    work. The one-token-count reasoning below is about the flex kernel, which variable lengths
    do not run (refused at launch).

    Training fills every micro-batch to ``seq_length`` tokens and cuts the rest into padding
    sequences of at most ``PAD_SEQ_TOKENS`` tokens (``data.packing.padding_lengths``), so a mix
    with fewer real tokens gets that padding too: the grid holds only micro-batches a run can
    have. One token count is also what keeps a CUDA profile in the state training runs in: the
    flex kernel's padded length follows the token count, and the first micro-batch of a second
    length recompiles it with that length dynamic (torch.compile's automatic dynamic shapes);
    every later call, those of the first length included, then runs the dynamic graph, which
    dynamo tries first. On the H100 the earlier grid (totals of 16K, 12K and 8K) timed the
    backward of its 16K points 8-21% slower after its first 8K point than before it
    (docs/results/latency_table_h100_full.json: one 16K document, 45.7-53.9 ms against
    38.0-44.9 ms; the held-out micro-batches, all of 16K tokens, matched the earlier state to
    0.1 ms): the held-out bias of docs/benchmarks/attention-gpu.md "GPU latency model (H100)".
    With one token count the ``tokens`` feature is constant; the fit folds it into the intercept
    (``latency/fit.fit_nonneg``). With ``block_size``, a mix whose documents' short last
    blocks would overflow the padded length of ``seq_length`` tokens
    (``attention.blocks.fixed_padded_blocks``: another compiled shape) is left out or drawn again.

    The first seven (the --quick grid, ``QUICK_MIXES``) vary the document count and the longest
    document: one document, 4 and 16 equal ones, half a micro-batch of one document plus
    padding, 64 short sequences (a fully padded micro-batch; sequences of one block each when
    ``seq_length / 64`` is shorter than a block), half a micro-batch of one document beside 64
    documents of ``seq_length / 128`` tokens (at least a block each), and a micro-batch of those
    short documents alone. With short documents routed dense, the last three are what tell a
    per-document cost from the dense kernel's work (short documents of two lengths) and the
    dense and sparse calls' fixed costs from each other (a micro-batch with both calls): with
    only the 64 short sequences, the H200's quick profile put the backward's per-document cost
    into the dense work (``docs/results/latency_gpu_h200_run2.json`` at a63cdd4) and predicted
    micro-batches of 100+ documents 16-26% short. The others: two equal documents with and
    without padding, then random cuts of 100%, 75% or 50% of the tokens into 2-15 documents,
    padded.
    """
    from ...attention.blocks import fixed_padded_blocks

    t = seq_length

    def packed(docs: list[int]) -> list[int]:
        return docs + padding_lengths(packed_length(sum(docs), t, length_multiple) - sum(docs))

    def one_shape(mix: list[int]) -> bool:
        if block_size is None or length_multiple:
            return True
        nb = sum(-(-x // block_size) for x in mix)
        return (fixed_padded_blocks(t, nb, block_size)
                == fixed_padded_blocks(t, -(-t // block_size), block_size))

    short = max(t // 64, block_size or 1)
    # short documents of a second length (t/128 tokens): all of a micro-batch, and beside half a
    # micro-batch of one document (a long document and short ones in the same micro-batch)
    tiny = max(t // 128, block_size or 1)
    mixed = [t // 2] + [tiny] * ((t - t // 2) // tiny)
    fixed = [[t], [t // 4] * 4, [t // 16] * 16, [t // 2], [short] * (t // short), mixed,
             [tiny] * (t // tiny), [t // 2] * 2, [3 * t // 8] * 2]
    if length_multiple:          # the quick grid spans three token totals: t, t/2, t/4
        fixed = [[t], [t // 4] * 4, [t // 2], [t // 4], [short] * (t // short), mixed,
                 [tiny] * (t // tiny), [t // 16] * 16, [t // 2] * 2, [3 * t // 8] * 2]
    out = [m for m in (packed(m) for m in fixed if m and all(x > 0 for x in m))
           if one_shape(m)][:count]
    rng = np.random.default_rng(seed)
    while len(out) < count:
        total = int(t * rng.choice([1.0, 1.0, 0.75, 0.5]))
        k = min(int(rng.integers(2, 16)), total)
        cuts = np.sort(rng.choice(np.arange(1, total), size=k - 1, replace=False))
        mix = packed(np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist())
        if one_shape(mix):
            out.append(mix)
    return out


def padded_length_warning(mixes: Sequence[Sequence[int]], block_size: int,
                          device_type: str) -> Optional[str]:
    """Why a CUDA profile of ``mixes`` would not time the kernels training runs (see
    ``default_mixes``): the flex kernel's padded length (``attention.blocks.fixed_padded_blocks``
    of the token count and the documents' blocks) differs between mixes. None when it does not,
    or without a compiled kernel (CPU)."""
    from ...attention.blocks import fixed_padded_blocks

    if device_type != "cuda":
        return None
    shapes = {}
    for m in mixes:
        nb = sum(-(-int(x) // block_size) for x in m)
        shapes.setdefault(fixed_padded_blocks(int(sum(m)), nb, block_size), int(sum(m)))
    if len(shapes) <= 1:
        return None
    return (f"the profile grid's micro-batches have {len(shapes)} padded lengths "
            f"({', '.join(f'{p} blocks' for p in sorted(shapes))}; token counts "
            f"{sorted({int(sum(m)) for m in mixes})}): on CUDA the first micro-batch of a "
            f"second length recompiles the flex kernel with a dynamic length, and every later "
            f"sample (the first length's included) times that graph, which a run whose "
            f"micro-batches all hold seq_length tokens never uses (an 8-21% slower backward on "
            f"an H100); pad every mix to one token count (default_mixes does)")
