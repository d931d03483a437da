"""The Triton kernels of the block-sparse FlashAttention (``sparse_triton`` launches them).

Layout every kernel sees: q/dO/out ``[P, np, hn]``, k/v ``[P, ng, hn]`` contiguous (token,
head, dim), ``lse``/``delta`` ``[np, P]`` float32, the block lists of ``block_lists`` (int32),
``BLEN [NB]`` int32 real tokens per block. Query head ``g * REP + r`` belongs to KV group
``g``. A query block's ``REP`` heads are stacked as the M dimension: row ``m`` of the stacked
``[REP * BS, hn]`` matrix is head ``m // BS``, token ``m % BS`` of the block; one program takes
``BLOCK_M`` consecutive rows (several heads when ``BLOCK_M > BS``), so the heads it holds share
every K/V tile it loads. Rows past ``REP * BS`` are masked.

Softmax in float32 in base 2 (``qk_scale = softmax_scale * log2(e)``); ``lse`` is stored in
natural log. A row that is padding (token past its block's real length) gets output 0 and
``lse = +inf``, so the backward's ``p = exp(s - lse)`` is 0 there: padding queries contribute
nothing to dK/dV and get dQ = 0, whatever dO holds.

The per-micro-batch sizes (``NB``, ``P``, list widths) are not specialised on
(``do_not_specialize``): one compiled kernel per head dim, block size and GQA ratio serves every
micro-batch. All index arithmetic is int32 (``sparse_triton`` checks that the token x head x
dim extents fit). Imported by ``sparse_triton`` only where triton is installed.
Pure triton; must not import megatron.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # the kernels' exp2/log2 base change


@triton.jit(do_not_specialize=["NB", "P", "WQ"])
def fwd_kernel(Q, K, V, O, LSE, Q_NUM, Q_IDX, BLEN, NB, P, WQ, qk_scale,
               NP: tl.constexpr, NG: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr,
               BS: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    """Grid (m tiles of the stacked rows, ng, NB): output and lse of one tile of query block i
    (the latest blocks first: their lists are the longest)."""
    g = tl.program_id(1)
    i = NB - 1 - tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m % BS
    row_ok = m < REP * BS
    head = g * REP + m // BS
    d = tl.arange(0, HN)
    n = tl.arange(0, BS)
    q_off = ((i * BS + t) * NP + head)[:, None] * HN + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    kv_rows = (n * NG + g)[:, None] * HN + d[None, :]     # block j's tile: + j * BS * NG * HN
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HN], tl.float32)
    entries = Q_IDX + (g * NB + i) * WQ
    for e in range(0, tl.load(Q_NUM + g * NB + i)):       # full blocks: no mask
        kv_off = tl.load(entries + e) * (BS * NG * HN) + kv_rows
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
    blen = tl.load(BLEN + i)
    kv_off = i * (BS * NG * HN) + kv_rows
    k = tl.load(K + kv_off, mask=(n < blen)[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=(n < blen)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    s = tl.where((n[None, :] <= t[:, None]) & (n[None, :] < blen), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    real = row_ok & (t < blen)
    tl.store(O + q_off, tl.where(real[:, None], acc / l_i[:, None], 0.0).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse = tl.where(real, (m_new + tl.math.log2(l_i)) / LOG2E, float("inf"))
    tl.store(LSE + head * P + i * BS + t, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T", "P"])
def delta_kernel(O, DO, DELTA, T, P, NP: tl.constexpr, HN: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Grid (token tiles, np): delta[h, t] = sum_d dO * O (float32)."""
    h = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok < T
    off = (tok * NP + h)[:, None] * HN + tl.arange(0, HN)[None, :]
    o = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * P + tok, tl.sum(o * do, 1), mask=ok)


@triton.jit(do_not_specialize=["NB", "P", "WQ"])
def dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, Q_NUM, Q_IDX, BLEN, NB, P, WQ, qk_scale, scale,
              NP: tl.constexpr, NG: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr,
              BS: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    """Grid (m tiles, ng, NB): dQ of one tile of query block i over its forward list and its
    diagonal."""
    g = tl.program_id(1)
    i = NB - 1 - tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m % BS
    row_ok = m < REP * BS
    head = g * REP + m // BS
    d = tl.arange(0, HN)
    n = tl.arange(0, BS)
    q_off = ((i * BS + t) * NP + head)[:, None] * HN + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
    stat = head * P + i * BS + t
    lse2 = tl.load(LSE + stat, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    kv_rows = (n * NG + g)[:, None] * HN + d[None, :]
    dq = tl.zeros([BLOCK_M, HN], tl.float32)
    entries = Q_IDX + (g * NB + i) * WQ
    for e in range(0, tl.load(Q_NUM + g * NB + i)):
        kv_off = tl.load(entries + e) * (BS * NG * HN) + kv_rows
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    blen = tl.load(BLEN + i)
    kv_off = i * (BS * NG * HN) + kv_rows
    k = tl.load(K + kv_off, mask=(n < blen)[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=(n < blen)[:, None], other=0.0)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
    p = tl.where((n[None, :] <= t[:, None]) & (n[None, :] < blen), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkv_rows(dk, dv, k, v, Q, DO, LSE, DELTA, i, g, n, kv_len, P, qk_scale,
              NP: tl.constexpr, REP: tl.constexpr, HN: tl.constexpr, BS: tl.constexpr,
              BLOCK_M: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr):
    """Add query block i's contribution (its REP heads' stacked rows, BLOCK_M at a time) to
    the dK/dV tile of keys ``n`` (``DIAG``: i is the key block itself, causal)."""
    d = tl.arange(0, HN)
    for m0 in range(0, REP * BS, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        t = m % BS
        row_ok = m < REP * BS
        head = g * REP + m // BS
        q_off = ((i * BS + t) * NP + head)[:, None] * HN + d[None, :]
        q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
        stat = head * P + i * BS + t
        lse2 = tl.load(LSE + stat, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
                          - lse2[None, :])                      # [keys, rows]
        if DIAG:
            pt = tl.where((n[:, None] <= t[None, :]) & (n[:, None] < kv_len), pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit(do_not_specialize=["NB", "P", "WK", "CHUNK"])
def dkv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, KV_NUM, KV_IDX, BLEN, NB, P, WK, CHUNK,
               qk_scale, scale, NP: tl.constexpr, NG: tl.constexpr, REP: tl.constexpr,
               HN: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks x key sub-tiles, ng, NB): dK/dV of ``BLOCK_N`` keys of key block j from at
    most ``CHUNK`` entries of its transposed list (chunk c: entries ``[c * CHUNK, (c + 1) *
    CHUNK)``; chunk 0 also takes the diagonal). A column longer than ``CHUNK`` (the sink) is
    spread over several programs that add their partial sums atomically into the float32
    ``DK``/``DV``; a shorter one is stored by its single program."""
    NSUB: tl.constexpr = BS // BLOCK_N
    c = tl.program_id(0) // NSUB
    n = (tl.program_id(0) % NSUB) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    j = tl.program_id(2)
    num = tl.load(KV_NUM + g * NB + j)
    e0 = c * CHUNK
    if (e0 < num) | (c == 0):
        kv_len = tl.load(BLEN + j)
        kv_off = ((j * BS + n) * NG + g)[:, None] * HN + tl.arange(0, HN)[None, :]
        k = tl.load(K + kv_off, mask=(n < kv_len)[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=(n < kv_len)[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HN], tl.float32)
        dv = tl.zeros([BLOCK_N, HN], tl.float32)
        entries = KV_IDX + (g * NB + j) * WK
        for e in range(e0, tl.minimum(num, e0 + CHUNK)):
            dk, dv = _dkv_rows(dk, dv, k, v, Q, DO, LSE, DELTA, tl.load(entries + e), g, n,
                               kv_len, P, qk_scale, NP, REP, HN, BS, BLOCK_M, PREC, False)
        if c == 0:
            dk, dv = _dkv_rows(dk, dv, k, v, Q, DO, LSE, DELTA, j, g, n, kv_len, P, qk_scale,
                               NP, REP, HN, BS, BLOCK_M, PREC, True)
        dk = dk * scale
        if num > CHUNK:
            tl.atomic_add(DK + kv_off, dk, sem="relaxed")
            tl.atomic_add(DV + kv_off, dv, sem="relaxed")
        else:
            tl.store(DK + kv_off, dk)
            tl.store(DV + kv_off, dv)
