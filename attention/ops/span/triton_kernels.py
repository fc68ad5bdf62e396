"""Span attention in Triton: every query row attends to one contiguous span of keys [lo, hi) (per head when the
rule varies by head), optionally only to keys not after it in a second order of the rows (stochastic attention's
original positions), with softmax or sigmoid scores and an optional ALiBi bias slope_h (i - j) + offset.

FlashAttention-2's algorithm over those spans: the forward walks each tile of BLOCK_M query rows over the key
blocks between its rows' smallest lo and largest hi (online softmax, or a plain sum of sigmoid(s) v with no row
maximum or sum, as in FlashSigmoid); the backward computes dk and dv per key block over the query rows that
attend to it (planned per 16 keys: attention/ops/span/spans.py) and dq per query tile as the forward walks. A
tile's cost is its rows' spans, so a rule costs what its edges cost, whatever n. Rows whose span is empty get a
zero output (and an infinite log-sum-exp, so that backward gives them no gradient).

Layout: q, k, v (B, H, n, D) with any strides but a unit stride along D; k and v may have fewer heads
(grouped-query attention: query head h reads key head h // (H / H_kv)). Checked against attention/ops/span/
naive.py in tests/test_span_kernel.py, under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 products for float32 inputs (not TF32); WIDEN casts bfloat16 tiles
    to float32 first, for Triton's interpreter, whose tl.dot multiplies bfloat16 bit patterns as integers (3.7.1)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE or WIDEN:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _scores(q, k, rows, cols, slope, offset, qk_scale, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
            WIDEN: tl.constexpr):
    """Scores of a (rows, cols) tile in log2 units (times log2(e)): q.k / sqrt(d) + slope (i - j) + offset."""
    s = _dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale
    if HAS_BIAS:
        s += (slope * (rows[:, None] - cols[None, :]).to(tl.float32) + offset) * 1.4426950408889634
    return s


@triton.jit
def _allowed(rows, cols, lo, hi, row_order, ORDER, N, HAS_ORDER: tl.constexpr):
    ok = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    if HAS_ORDER:
        col_order = tl.load(ORDER + cols, mask=cols < N, other=0)
        ok = ok & (col_order[None, :] <= row_order[:, None])
    return ok


@triton.jit
def _query_tile(LO, HI, ORDER, h, pid_m, span_h, N, HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile of BLOCK_M query rows: the rows, which are inside the sequence, their spans, their order, and the
    keys [first, end) the tile walks (its rows' smallest lo and largest hi; none when every span is empty)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    lo = tl.load(LO + h * span_h + rows, mask=row_ok, other=0)
    hi = tl.load(HI + h * span_h + rows, mask=row_ok, other=0)
    nonempty = lo < hi
    first = tl.maximum(tl.min(tl.where(nonempty, lo, N), 0), 0)
    end = tl.minimum(tl.max(tl.where(nonempty, hi, 0), 0), N)
    row_order = rows
    if HAS_ORDER:
        row_order = tl.load(ORDER + rows, mask=row_ok, other=0)
    return rows, row_ok, lo, hi, first, end, row_order


@triton.jit
def span_forward_kernel(Q, K, V, O, LSE, LO, HI, ORDER, SLOPES,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, span_h,
                        H, GROUP, N, D, qk_scale, offset,
                        SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // GROUP
    rows, row_ok, lo, hi, first, end, row_order = _query_tile(LO, HI, ORDER, h, pid_m, span_h, N, HAS_ORDER, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(SLOPES + h)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(first // BLOCK_N * BLOCK_N, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        kv_mask = col_ok[:, None] & (dims[None, :] < D)
        k = tl.load(k_base + cols[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, rows, cols, slope, offset, qk_scale, HAS_BIAS, IEEE, WIDEN)
        ok = _allowed(rows, cols, lo, hi, row_order, ORDER, N, HAS_ORDER)
        if SIGMOID:  # sigmoid(x) with x = s / log2(e): 1 / (1 + 2^-s)
            p = tl.where(ok, 1.0 / (1.0 + tl.exp2(-s)), 0.0)
        else:
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        acc += _dot(p.to(v.dtype), v, IEEE, WIDEN)
    if not SIGMOID:
        has_key = l_i > 0
        acc = acc / tl.where(has_key, l_i, 1.0)[:, None]
        lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("inf"))
        tl.store(LSE + pid_bh * N + rows, lse, mask=row_ok)
    tl.store(O + b * sob + h * soh + rows[:, None] * son + dims[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < D))


@triton.jit
def span_delta_kernel(O, DO, DELTA, sob, soh, son, sdb, sdh, sdn, H, N, D,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) in float32: FlashAttention's backward preprocessing (softmax only)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (dims[None, :] < D)
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh * N + rows, tl.sum(o * do, 1), mask=rows < N)


@triton.jit
def _score_grads(q, k, v, do, rows, cols, lo, hi, row_order, lse, delta, slope, offset, qk_scale, ORDER, N,
                 SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 WIDEN: tl.constexpr):
    """p and dS (the gradient of the scores before scaling) of a (rows, cols) tile, float32."""
    s = _scores(q, k, rows, cols, slope, offset, qk_scale, HAS_BIAS, IEEE, WIDEN)
    ok = _allowed(rows, cols, lo, hi, row_order, ORDER, N, HAS_ORDER)
    dp = _dot(do, tl.trans(v), IEEE, WIDEN)
    if SIGMOID:
        p = tl.where(ok, 1.0 / (1.0 + tl.exp2(-s)), 0.0)
        ds = dp * p * (1.0 - p)
    else:
        p = tl.where(ok, tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)
        ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def span_backward_kv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, ORDER, SLOPES, KEY_FIRST, KEY_END,
                            sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                            sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, span_h, plan_h, plan_len,
                            H, H_KV, GROUP, N, D, sm_scale, qk_scale, offset,
                            SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr,
                            IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, KEY_GROUP: tl.constexpr):
    """dk, dv of one block of BLOCK_N keys of key head hk: over the GROUP query heads that read it, each over the
    query rows that attend to some key of the block (KEY_FIRST / KEY_END per KEY_GROUP keys)."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hk = pid_bh // H_KV, pid_bh % H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < N
    kv_mask = col_ok[:, None] & (dims[None, :] < D)
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    groups = pid_n * (BLOCK_N // KEY_GROUP) + tl.arange(0, BLOCK_N // KEY_GROUP)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        first = tl.maximum(tl.min(tl.load(KEY_FIRST + h * plan_h + groups, mask=groups < plan_len, other=N), 0), 0)
        end = tl.minimum(tl.max(tl.load(KEY_END + h * plan_h + groups, mask=groups < plan_len, other=0), 0), N)
        slope = 0.0
        if HAS_BIAS:
            slope = tl.load(SLOPES + h)
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        row_base = (b * H + h) * N
        for start in range(first // BLOCK_M * BLOCK_M, end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            q_mask = row_ok[:, None] & (dims[None, :] < D)
            q = tl.load(q_base + rows[:, None] * sqn + dims[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows[:, None] * sdon + dims[None, :], mask=q_mask, other=0.0)
            lo = tl.load(LO + h * span_h + rows, mask=row_ok, other=0)
            hi = tl.load(HI + h * span_h + rows, mask=row_ok, other=0)
            row_order = rows
            if HAS_ORDER:
                row_order = tl.load(ORDER + rows, mask=row_ok, other=0)
            lse = tl.zeros([BLOCK_M], dtype=tl.float32)
            delta = tl.zeros([BLOCK_M], dtype=tl.float32)
            if not SIGMOID:
                lse = tl.load(LSE + row_base + rows, mask=row_ok, other=float("inf"))
                delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
            p, ds = _score_grads(q, k, v, do, rows, cols, lo, hi, row_order, lse, delta, slope, offset, qk_scale,
                                 ORDER, N, SIGMOID, HAS_ORDER, HAS_BIAS, IEEE, WIDEN)
            dv += _dot(tl.trans(p).to(do.dtype), do, IEEE, WIDEN)
            dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE, WIDEN)
    tl.store(DK + b * sdkb + hk * sdkh + cols[:, None] * sdkn + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + cols[:, None] * sdvn + dims[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def span_backward_q_kernel(Q, K, V, DO, LSE, DELTA, DQ, LO, HI, ORDER, SLOPES,
                           sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sdqb, sdqh, sdqn, span_h,
                           H, GROUP, N, D, sm_scale, qk_scale, offset,
                           SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr,
                           IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq of one tile of BLOCK_M query rows, walking its key blocks as the forward does."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // GROUP
    rows, row_ok, lo, hi, first, end, row_order = _query_tile(LO, HI, ORDER, h, pid_m, span_h, N, HAS_ORDER, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdon + dims[None, :], mask=q_mask, other=0.0)
    lse = tl.zeros([BLOCK_M], dtype=tl.float32)
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not SIGMOID:
        lse = tl.load(LSE + pid_bh * N + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + pid_bh * N + rows, mask=row_ok, other=0.0)
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(SLOPES + h)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(first // BLOCK_N * BLOCK_N, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < N) & (dims[None, :] < D)
        k = tl.load(k_base + cols[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
        p, ds = _score_grads(q, k, v, do, rows, cols, lo, hi, row_order, lse, delta, slope, offset, qk_scale,
                             ORDER, N, SIGMOID, HAS_ORDER, HAS_BIAS, IEEE, WIDEN)
        dq += _dot(ds.to(k.dtype), k, IEEE, WIDEN)
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqn + dims[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=q_mask)
