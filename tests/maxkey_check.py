"""The Triton max-key kernel against the torch estimator on the same inputs: the CPU check (in
the ``TRITON_INTERPRET`` worker, ``tests/unit/test_attention_gpu_path.py``) and the GPU one
(``tests/gpu/test_flex_attention.py``) differ only in their shapes, device and tolerance."""

from sparsebalance_megatron.attention import build_layout


def maxkey_pair(cu, total: int, bs: int, q, k, device: str):
    """(kernel scores, estimator scores, the allowed entries, the layout) at scale 0.7."""
    from sparsebalance_megatron.attention import maxkey_triton
    from sparsebalance_megatron.attention.selection import (_maxkey_scores_torch, _mean,
                                                            query_block_sums_padded)
    lay = build_layout(cu, total, bs, device)
    qsum = query_block_sums_padded(lay.pad(q), lay, 2)
    keys = lay.pad(k)[:lay.num_blocks * bs].permute(1, 0, 2)
    assert maxkey_triton.usable(keys, bs)
    a = maxkey_triton.maxkey_scores(qsum, keys, lay, 0.7)
    b = _maxkey_scores_torch(_mean(qsum, lay), keys, lay) * 0.7
    return a, b, lay.allowed()[None, :, None, :].expand_as(a), lay
