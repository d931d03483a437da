"""The Triton kernels of the block-sparse FlashAttention (``sparse_triton`` launches them).

Layout every kernel sees: q/dO/out ``[T, np, hn]``, k/v ``[T, ng, hn]`` contiguous (token,
head, dim) in the caller's own token space: block ``i``'s tokens are rows ``BSTART[i] + t`` for
``t < BLEN[i]`` (``BSTART``/``BLEN [NB]`` int32). With unpadded tokens a document's blocks
follow each other from its first token (its last block may be short), so no padded copy of q,
k, v or the output is ever made: every load and store past a block's real length is masked.
``PADDED`` (the padded-layout entry point): ``BSTART[i] = i * BS`` and a block's rows past its
real length are padding slots that get output 0. ``lse``/``delta`` are ``[np, NB * BS]``
float32, indexed by block and position in the block.

Query head ``g * REP + r`` belongs to KV group ``g``. A query block's ``REP`` heads are stacked
as the M dimension: row ``m`` of the stacked ``[REP * BS, hn]`` matrix is head ``m // BS``,
token ``m % BS`` of the block; a program (or loop iteration) takes ``BLOCK_M`` consecutive rows,
so every K/V tile it holds serves all the heads in its rows. Rows past ``REP * BS`` are masked.

Softmax in float32 in base 2 (``qk_scale = softmax_scale * log2(e)``); ``lse`` is stored in
natural log. A row that is padding (token past its block's real length) gets ``lse = +inf``, so
the backward's ``p = exp(s - lse)`` is 0 there: padding queries add nothing to dK/dV and get
dQ = 0, whatever dO holds.

GEMMs per kept (query block, key block) tile, declared in ``GEMMS_PER_TILE`` and counted by a
test in the kernels' source: forward 2 (S = Q K^T, O += P V); backward 5, in ONE pass over the
transposed lists (``dkv_kernel``): S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q and
dQ += dS K, the last added into a float32 dQ accumulator with ``tl.atomic_add`` (why atomics and
not a reduction buffer: ``work_model``). The split (``ONE_PASS=False``, a launch config with
``dq_block_m``): ``dkv_kernel`` without the dQ GEMM (4) and ``dq_kernel`` over the forward's lists
(S, dP, dQ: 3), FlashAttention-2's two kernels, 7 GEMMs and no atomic dQ; every GEMM of both has
at least 64 rows on the M side, so none is left on mma.sync by a 32-row tile. Which is faster
is the device's to say (the autotune times both).

The per-micro-batch sizes (``NB``, list widths) are not specialised on (``do_not_specialize``):
one compiled kernel per head dim, block size, GQA ratio, dtype and launch config serves every
micro-batch. All index arithmetic is int32 (``sparse_triton`` checks that the token x head x
dim extents fit). Imported by ``sparse_triton`` only where triton is installed.
Pure triton; must not import megatron.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # the kernels' exp2/log2 base change

GEMMS_PER_TILE = {"fwd_kernel": 2, "dkv_kernel": 5, "dq_kernel": 3}
"""``tl.dot`` calls per kept tile in each kernel's list loop (``work_model`` prices them);
``dkv_kernel`` does 4 of its 5 when the split's ``dq_kernel`` takes dQ."""


@triton.jit
def _query_tile(BLEN, BSTART, NB, NP: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr,
                BS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The stacked query rows of a (m tile, group, query block) program, as the forward and
    ``dq_kernel`` take them: group g, block i (the latest first), rows m, their tokens t and
    heads, the block's real length and first token, which rows are real, their offsets."""
    g = tl.program_id(1)
    i = NB - 1 - tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m % BS
    head = g * REP + m // BS
    blen = tl.load(BLEN + i)
    start_i = tl.load(BSTART + i)
    real = (m < REP * BS) & (t < blen)
    q_off = ((start_i + t) * NP + head)[:, None] * HN + tl.arange(0, HN)[None, :]
    return g, i, m, t, head, blen, start_i, real, q_off


@triton.jit(do_not_specialize=["NB", "WQ"])
def fwd_kernel(Q, K, V, O, LSE, Q_NUM, Q_IDX, BLEN, BSTART, NB, WQ, qk_scale,
               NP: tl.constexpr, NG: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr,
               BS: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
               PADDED: tl.constexpr):
    """Grid (m tiles of the stacked rows, ng, NB): output and lse of one tile of query block i
    (the latest blocks first: their lists are the longest)."""
    g, i, m, t, head, blen, start_i, real, q_off = _query_tile(BLEN, BSTART, NB, NP, REP, HN,
                                                               BS, BLOCK_M)
    d = tl.arange(0, HN)
    n = tl.arange(0, BS)
    q = tl.load(Q + q_off, mask=real[:, None], other=0.0)
    kv_cols = (n * NG + g)[:, None] * HN + d[None, :]     # block j's tile: + BSTART[j]*NG*HN
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HN], tl.float32)
    entries = Q_IDX + (g * NB + i) * WQ
    for e in range(0, tl.load(Q_NUM + g * NB + i)):       # full blocks: no mask
        kv_off = tl.load(BSTART + tl.load(entries + e)) * (NG * HN) + kv_cols
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    # the diagonal block: causal, and only its real keys
    kv_off = start_i * (NG * HN) + kv_cols
    k = tl.load(K + kv_off, mask=(n < blen)[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=(n < blen)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    s = tl.where((n[None, :] <= t[:, None]) & (n[None, :] < blen), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    out = tl.where(real[:, None], acc / l_i[:, None], 0.0).to(O.dtype.element_ty)
    if PADDED:      # the padding slots of the block get 0
        tl.store(O + q_off, out, mask=(m < REP * BS)[:, None])
    else:
        tl.store(O + q_off, out, mask=real[:, None])
    lse = tl.where(real, (m_new + tl.math.log2(l_i)) / LOG2E, float("inf"))
    tl.store(LSE + head * (NB * BS) + i * BS + t, lse, mask=m < REP * BS)


@triton.jit(do_not_specialize=["NB"])
def bwd_pre_kernel(O, DO, DELTA, DQ, DK, DV, BLEN, BSTART, NB, NP: tl.constexpr,
                   NG: tl.constexpr, HN: tl.constexpr, BS: tl.constexpr,
                   PADDED: tl.constexpr):
    """Grid (NB, np): ``delta[h, block i] = rowsum(dO * O)`` (float32), and the float32 dQ
    (head h) and dK/dV (group h, for h < ng) accumulators zeroed on the block's rows: one
    launch instead of a delta kernel and three memsets."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, BS)
    d = tl.arange(0, HN)
    blen = tl.load(BLEN + i)
    start_i = tl.load(BSTART + i)
    real = t < blen
    rows = (t < BS) if PADDED else real       # the rows block i owns in the token space
    off = ((start_i + t) * NP + h)[:, None] * HN + d[None, :]
    o = tl.load(O + off, mask=real[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=real[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * (NB * BS) + i * BS + t, tl.sum(o * do, 1))
    zero = tl.zeros([BS, HN], tl.float32)
    tl.store(DQ + off, zero, mask=rows[:, None])
    if h < NG:
        kv_off = ((start_i + t) * NG + h)[:, None] * HN + d[None, :]
        tl.store(DK + kv_off, zero, mask=rows[:, None])
        tl.store(DV + kv_off, zero, mask=rows[:, None])


@triton.jit
def bwd_post_kernel(DQ_ACC, DK_ACC, DV_ACC, DQ, DK, DV, N_Q, N_KV, BLOCK: tl.constexpr):
    """Grid (ceil(N_Q / BLOCK)): the float32 accumulators cast to the gradients' dtype (dQ's
    and dK's softmax scale is already applied), three casts in one launch."""
    x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DQ + x, tl.load(DQ_ACC + x, mask=x < N_Q).to(DQ.dtype.element_ty), mask=x < N_Q)
    kv = x < N_KV
    tl.store(DK + x, tl.load(DK_ACC + x, mask=kv).to(DK.dtype.element_ty), mask=kv)
    tl.store(DV + x, tl.load(DV_ACC + x, mask=kv).to(DV.dtype.element_ty), mask=kv)


@triton.jit(do_not_specialize=["NB", "WK", "CHUNK"])
def dkv_kernel(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, KV_NUM, KV_IDX, BLEN, BSTART, NB, WK,
               CHUNK, qk_scale, scale, NP: tl.constexpr, NG: tl.constexpr,
               REP: tl.constexpr, HN: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_M: tl.constexpr, PREC: tl.constexpr, ONE_PASS: tl.constexpr):
    """Grid (chunks x key sub-tiles, ng, NB): the whole backward of ``BLOCK_N`` keys of key
    block j (the whole block where registers allow) against at most ``CHUNK`` entries of its
    transposed list (chunk c: entries ``[c * CHUNK, (c + 1) * CHUNK)``; chunk 0 also takes the
    diagonal, first), in ONE flattened loop over (entry x row tile of the stacked rows): the
    software pipeline runs across entries instead of restarting per entry, and Q/dO rows are
    read once per key tile. dQ of every row tile goes out by float32 atomic adds; dK/dV are
    stored once at the end (atomically where the column is split over several programs).
    ``ONE_PASS=False``: dK and dV only (``dq_kernel`` makes dQ)."""
    NSUB: tl.constexpr = BS // BLOCK_N
    MT: tl.constexpr = (REP * BS + BLOCK_M - 1) // BLOCK_M     # row tiles per query block
    c = tl.program_id(0) // NSUB
    n = (tl.program_id(0) % NSUB) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    j = tl.program_id(2)
    num = tl.load(KV_NUM + g * NB + j)
    e0 = c * CHUNK
    if (e0 < num) | (c == 0):
        d = tl.arange(0, HN)
        kv_len = tl.load(BLEN + j)
        kv_off = ((tl.load(BSTART + j) + n) * NG + g)[:, None] * HN + d[None, :]
        key_ok = n < kv_len
        k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HN], tl.float32)
        dv = tl.zeros([BLOCK_N, HN], tl.float32)
        entries = KV_IDX + (g * NB + j) * WK
        diag = (c == 0).to(tl.int32)                   # chunk 0: the diagonal is entry -1
        first = e0 - diag
        for it in range(0, (tl.minimum(num, e0 + CHUNK) - first) * MT):
            e = first + it // MT
            i = tl.where(e < e0, j, tl.load(entries + tl.maximum(e, 0)))
            m = (it % MT) * BLOCK_M + tl.arange(0, BLOCK_M)
            t = m % BS
            head = g * REP + m // BS
            real = (m < REP * BS) & (t < tl.load(BLEN + i))
            q_off = ((tl.load(BSTART + i) + t) * NP + head)[:, None] * HN + d[None, :]
            q = tl.load(Q + q_off, mask=real[:, None], other=0.0)
            do = tl.load(DO + q_off, mask=real[:, None], other=0.0)
            stat = head * (NB * BS) + i * BS + t
            lse2 = tl.load(LSE + stat, mask=real, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + stat, mask=real, other=0.0)
            pt = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
                              - lse2[None, :])                   # P^T [keys, rows]
            pt = tl.where((i != j) | (n[:, None] <= t[None, :]), pt, 0.0)   # causal diagonal
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = (pt * (dpt - delta[None, :])).to(q.dtype)      # dS^T
            dk = tl.dot(dst, q, dk, input_precision=PREC)
            if ONE_PASS:
                dq = tl.dot(tl.trans(dst), k, input_precision=PREC)
                tl.atomic_add(DQ + q_off, dq * scale, mask=real[:, None], sem="relaxed")
        dk = dk * scale
        if num > CHUNK:
            tl.atomic_add(DK + kv_off, dk, mask=key_ok[:, None], sem="relaxed")
            tl.atomic_add(DV + kv_off, dv, mask=key_ok[:, None], sem="relaxed")
        else:
            tl.store(DK + kv_off, dk, mask=key_ok[:, None])
            tl.store(DV + kv_off, dv, mask=key_ok[:, None])


@triton.jit(do_not_specialize=["NB", "WQ"])
def dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, Q_NUM, Q_IDX, BLEN, BSTART, NB, WQ, qk_scale, scale,
              NP: tl.constexpr, NG: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr,
              BS: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
              PADDED: tl.constexpr):
    """Grid (m tiles of the stacked rows, ng, NB), the split backward's second kernel: dQ of one
    tile of query block i over its forward list (full blocks, unmasked), then the diagonal
    (causal, real keys only); 3 GEMMs per kept tile (S, dP, dQ), dQ stored once in float32
    (scaled; no atomics: the tile's rows are this program's alone). A padding row (``lse =
    +inf``) gets dQ = 0."""
    g, i, m, t, head, blen, start_i, real, q_off = _query_tile(BLEN, BSTART, NB, NP, REP, HN,
                                                               BS, BLOCK_M)
    d = tl.arange(0, HN)
    n = tl.arange(0, BS)
    q = tl.load(Q + q_off, mask=real[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=real[:, None], other=0.0)
    stat = head * (NB * BS) + i * BS + t
    lse2 = tl.load(LSE + stat, mask=real, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + stat, mask=real, other=0.0)
    kv_cols = (n * NG + g)[:, None] * HN + d[None, :]
    dq = tl.zeros([BLOCK_M, HN], tl.float32)
    entries = Q_IDX + (g * NB + i) * WQ
    for e in range(0, tl.load(Q_NUM + g * NB + i)):       # full blocks: no mask
        kv_off = tl.load(BSTART + tl.load(entries + e)) * (NG * HN) + kv_cols
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
                         - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dq = tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, dq, input_precision=PREC)
    # the diagonal block: causal, and only its real keys
    kv_off = start_i * (NG * HN) + kv_cols
    k = tl.load(K + kv_off, mask=(n < blen)[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=(n < blen)[:, None], other=0.0)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
    p = tl.where((n[None, :] <= t[:, None]) & (n[None, :] < blen), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    dq = tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, dq, input_precision=PREC)
    if PADDED:      # the padding slots of the block get 0
        tl.store(DQ + q_off, dq * scale, mask=(m < REP * BS)[:, None])
    else:
        tl.store(DQ + q_off, dq * scale, mask=real[:, None])
