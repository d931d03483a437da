"""The start-up compile of the fused selection's Triton kernels on CUDA (``attention/
triton_warmup.py``): after ``warm_selection``, real per-layer calls over micro-batches of varied
documents and densities compile no selection kernel (the CPU test compares cache keys against
a stand-in driver; this one counts compiles on the device)."""

import pytest
import torch

from sparsebalance_megatron.attention.triton_warmup import SelectionShape, warm_selection

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SELECTION = {"_block_sums_kernel", "_maxkey_kernel", "_shares_kernel", "_lists_kernel"}


def test_no_selection_kernel_compiles_after_the_warm_up():
    import numpy as np
    from triton import knobs

    from sparsebalance_megatron.attention.api import _density
    from sparsebalance_megatron.attention.blocks import build_layout
    from sparsebalance_megatron.attention.sparse_triton_select import triton_block_sparse
    nh, ng, hn, bs, tokens = 14, 2, 64, 128, 8192
    got = warm_selection(SelectionShape(nh, ng, hn, bs, tokens), "cuda")
    assert got["compiles"] == 3 + 28 and got["widths"] == 28, got
    compiled = []
    prev = knobs.runtime.jit_cache_hook

    def hook(**kw):
        if kw["fn"].name in SELECTION:
            compiled.append(kw["fn"].name)
        return prev(**kw) if prev is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        rng = np.random.default_rng(0)
        for _ in range(12):
            t = int(rng.integers(8, tokens // 128 + 1)) * 128
            cut = sorted(set(rng.integers(1, t, size=int(rng.integers(0, 5))).tolist()))
            cu = [0] + cut + [t]
            layout = build_layout(cu, t, bs, torch.device("cuda"), fixed_length=False)
            density, host = _density(layout, float(rng.uniform(0.05, 1.0)))
            q = torch.randn(t, nh, hn, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(t, ng, hn, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            triton_block_sparse(q, k, v, layout, density, density_host=host,
                                estimator="maxkey", softmax_scale=0.125, sink_blocks=1,
                                local_blocks=0, selection_mode="density", mass_threshold=0.9,
                                min_density=0.0, max_density=1.0)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = prev
    assert compiled == [], compiled
