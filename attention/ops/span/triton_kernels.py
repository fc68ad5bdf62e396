"""Span attention in Triton: every query row attends to one contiguous span of keys [lo, hi) (per head when the
rule varies by head), optionally only to keys not after it in a second order of the rows (stochastic attention's
original positions), with softmax or sigmoid scores and an optional ALiBi bias slope_h (i - j) + offset.

FlashAttention-2's algorithm over those spans: the forward walks each tile of BLOCK_M query rows over the key
blocks between its rows' smallest lo and largest hi (online softmax, or a plain sum of sigmoid(s) v with no row
maximum or sum, as in FlashSigmoid); the backward computes dk and dv per key block over the query rows that
attend to it (planned per 16 keys: attention/ops/span/spans.py), key-major (k q^T, so no tile is transposed), and
dq per query tile as the forward walks. A tile's cost is its rows' spans, so a rule costs what its edges cost,
whatever n. Rows whose span is empty get a zero output (and an infinite log-sum-exp, so that backward gives them
no gradient).

What a score costs, as FlashAttention keeps it: a tile's key blocks split into the interior, where every row of
the tile attends every key (a sliding window's band but its two edges), and the blocks at its edges; only the
latter compare, select and carry -inf. ALiBi's slope (i - j) + offset is a per-row term plus a per-key term;
under softmax the per-row term cancels and enters the log-sum-exp only, so a score pays one addition. Sigmoid
is 0.5 + 0.5 tanh(x / 2) with the hardware's tanh on the GPU: one special-function operation per score (two with
1 / (1 + exp(-x))); in float32 (the tests' precision) and under the interpreter the exact form runs.

Packed documents (attention/documents.py): a row attends only keys of its own document. Rows in token order have
their spans clipped to their documents, one set per row of the batch (span_b), so a tile walks only the key blocks
its rows' documents reach and no block pays for documents; with DOCS (each row's document's first row) and DOC_END
(one past its last) the backward's walk over query rows for a key block stops at its keys' documents. Rows in a
second order (HAS_ORDER: stochastic attention's slots) read only each row's DOCS (per query row: in slots the op
gathers them to slot order, as it keeps the log-sum-exps and deltas per slot), as a token index: a document is
a run of tokens, so a key of the row's document at or before it is a key whose token lies between the document's
first token and the row's, one comparison beside the causal one and no document read per key.

In slots (IN_SLOTS, stochastic attention's band, attention/stochastic.py): the rows are a layout's (attention/
layouts.py) N = N_MEM + 2 HALO rows, row r holding token ORDER[r]; the queries are the main rows HALO ..
HALO + N_MEM - 1 (each token once) and every row is read and written at its token's row of q, k, v, the output
and the gradients, which stay in token order: no copy gathers them to the layout or scatters them back. dk and dv
sum over each token's copies in one program per block of main rows (span_backward_kv_slots_kernel), which reads
each row tile's tokens an iteration ahead, so that the pipeliner can prefetch the rows they address, over row tiles
half the usual height (what the gathered rows' addresses in flight leave registers for), and computes the band's
mask from the halo rather than reading spans.

Layout: q, k, v (B, H, n, D) with any strides but a unit stride along D; k and v may have fewer heads
(grouped-query attention: query head h reads key head h // (H / H_kv)). Batch and head offsets are 64-bit.
Checked against attention/ops/span/naive.py in tests/ops/test_span_kernel.py, under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tile_dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
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
def _sigmoid(s, FAST: tl.constexpr):
    """sigmoid(x) of scores s = x log2(e): one MUFU.TANH with FAST (tanh.approx, relative error 2^-11: bfloat16's
    own rounding is 2^-8), else the exact 1 / (1 + 2^-s)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * 0.34657359027997264],
                                      dtype=tl.float32, is_pure=True, pack=1)
        p = 0.5 + 0.5 * t
    else:
        p = 1.0 / (1.0 + tl.exp2(-s))
    return p


@triton.jit
def _bias_terms(rows, slope, offset, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr):
    """ALiBi's slope (i - j) + offset in log2 units as row_term[i] + slope2 * -j: (row_term, slope2). Softmax
    drops the row term from the scores (it cancels) and adds it to the log-sum-exp."""
    row_term = tl.zeros(rows.shape, dtype=tl.float32)
    slope2 = 0.0
    if HAS_BIAS:
        slope2 = slope * LOG2E
        row_term = (rows.to(tl.float32) * slope + offset) * LOG2E
    return row_term, slope2


@triton.jit
def _scores(q, k, cols, row_term, slope2, qk_scale, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
            IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """Scores of a (rows, cols) tile in log2 units (times log2(e)): q.k / sqrt(d) plus the bias's key term, and
    its row term under sigmoid (softmax keeps that one in the log-sum-exp)."""
    s = tile_dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale
    if HAS_BIAS:
        if SIGMOID:
            s += row_term[:, None] - slope2 * cols[None, :].to(tl.float32)
        else:
            s -= slope2 * cols[None, :].to(tl.float32)
    return s


@triton.jit
def _allowed(cols, lo, hi, row_order, row_doc, col_order, HAS_ORDER: tl.constexpr, HAS_DOCS: tl.constexpr):
    ok = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    if HAS_ORDER:
        if HAS_DOCS:  # row_doc <= key's token <= row's token, in one unsigned comparison: its document's keys
            ok = ok & ((col_order[None, :] - row_doc[:, None]).to(tl.uint32)
                       <= (row_order - row_doc).to(tl.uint32)[:, None])
        else:
            ok = ok & (col_order[None, :] <= row_order[:, None])
    return ok


@triton.jit
def _order_and_address(index, ok, ORDER, HAS_ORDER: tl.constexpr, IN_SLOTS: tl.constexpr):
    """Rows' (or keys') order, ORDER's entry where the rows have a second one, and where they are in memory: their
    own index, or IN_SLOTS their token."""
    order = index
    if HAS_ORDER:
        order = tl.load(ORDER + index, mask=ok, other=0)
    address = index
    if IN_SLOTS:
        address = order
    return order, address


@triton.jit
def _tokens(ORDER, start, end, BLOCK: tl.constexpr):
    """The tokens of the BLOCK rows from `start` in slots, 0 from `end` on. The dk/dv walk reads them one iteration
    ahead of the rows they address: read in the iteration that gathers its rows, a token leaves Triton's pipeliner
    no stage to prefetch the rows in, and every iteration waits for all its copies at once (sm_90a: DEPBAR 0)."""
    return tl.load(ORDER + start + tl.arange(0, BLOCK), mask=start + tl.arange(0, BLOCK) < end, other=0)


@triton.jit
def _query_tile(spans_lo, spans_hi, ORDER, docs, pid_m, ROW0, ROW_END, N, HAS_ORDER: tl.constexpr,
                HAS_DOCS: tl.constexpr, IN_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile of BLOCK_M query rows from ROW0 (rows before ROW_END are real): the rows, where they are in memory
    (IN_SLOTS: their tokens), their spans, their order and (in that order) documents, and its key blocks: [first,
    inner) at its leading edge, [inner, outer) the interior (every row attends every key), [outer, end) at its
    trailing edge. Without an interior (a row empty or past the sequence, spans shorter than a block, an order)
    every block is an edge block."""
    rows = ROW0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROW_END
    lo = tl.load(spans_lo + rows, mask=row_ok, other=0)
    hi = tl.load(spans_hi + rows, mask=row_ok, other=0)
    row_order, addr = _order_and_address(rows, row_ok, ORDER, HAS_ORDER, IN_SLOTS)
    row_doc = rows
    if HAS_ORDER and HAS_DOCS:
        row_doc = tl.load(docs - ROW0 + rows, mask=row_ok, other=0)  # per query row (in slots: per slot)
    nonempty = lo < hi
    first = tl.maximum(tl.min(tl.where(nonempty, lo, N), 0), 0) // BLOCK_N * BLOCK_N
    end = tl.minimum(tl.max(tl.where(nonempty, hi, 0), 0), N)
    inner = (tl.max(lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    outer = tl.min(tl.where(nonempty, hi, 0), 0) // BLOCK_N * BLOCK_N
    if HAS_ORDER:
        outer = inner
    has_interior = inner < outer
    inner = tl.where(has_interior, tl.maximum(inner, first), first)
    outer = tl.where(has_interior, outer, first)
    return rows, row_ok, addr, lo, hi, first, inner, outer, end, row_order, row_doc


@triton.jit
def _key_block(k_base, v_base, skn, svn, start, ORDER, N, D: tl.constexpr, EDGE: tl.constexpr,
               HAS_ORDER: tl.constexpr, IN_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The keys and values of the block from `start` (IN_SLOTS: read from their tokens' rows), with their order
    where the rows have a second one: bounded by the sequence at a tile's edges only (an interior block lies inside
    every row's span, so inside the sequence)."""
    cols = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    if EDGE:
        kv_mask = (cols < N)[:, None] & (dims < D)[None, :]
    else:
        kv_mask = (dims < D)[None, :]
    col_order, addr = _order_and_address(cols, cols < N, ORDER, HAS_ORDER, IN_SLOTS)
    k = tl.load(k_base + addr[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + addr[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
    return cols, k, v, col_order


@triton.jit
def _forward_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, block_lo, block_hi, lo, hi, row_order, row_doc,
                    row_term, slope2, ORDER, N, D: tl.constexpr, qk_scale, EDGE: tl.constexpr,
                    SIGMOID: tl.constexpr, FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr,
                    HAS_DOCS: tl.constexpr, IN_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                    WIDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The forward over key blocks [block_lo, block_hi): masked where EDGE, else every score counts."""
    for start in range(block_lo, block_hi, BLOCK_N):
        cols, k, v, col_order = _key_block(k_base, v_base, skn, svn, start, ORDER, N, D, EDGE, HAS_ORDER, IN_SLOTS,
                                           BLOCK_N, BLOCK_D)
        s = _scores(q, k, cols, row_term, slope2, qk_scale, HAS_BIAS, SIGMOID, IEEE, WIDEN)
        if SIGMOID:
            p = _sigmoid(s, FAST_SIGMOID)
            if EDGE:
                allowed = _allowed(cols, lo, hi, row_order, row_doc, col_order, HAS_ORDER, HAS_DOCS)
                p = tl.where(allowed, p, 0.0)
        else:
            if EDGE:
                allowed = _allowed(cols, lo, hi, row_order, row_doc, col_order, HAS_ORDER, HAS_DOCS)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:  # every score is finite: so is the new maximum
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = m_new
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        acc += tile_dot(p.to(v.dtype), v, IEEE, WIDEN)
    return acc, m_i, l_i


@triton.jit
def span_forward_kernel(Q, K, V, O, LSE, LO, HI, ORDER, SLOPES, DOCS, PREV,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, span_b, span_h,
                        H, GROUP, N, N_MEM, ROW0, ROW_END, D: tl.constexpr, qk_scale, offset,
                        SIGMOID: tl.constexpr, FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr,
                        HAS_DOCS: tl.constexpr, IN_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        WIDEN: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """The output of one tile of BLOCK_M query rows (and their log-sum-exp); ACCUMULATE: plus PREV's (another
    path's output with O's strides: a sum of separately normalised paths written in one pass, no addition after)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    docs = DOCS + b * N_MEM
    rows, row_ok, addr, lo, hi, first, inner, outer, end, row_order, row_doc = _query_tile(
        LO + b * span_b + h * span_h, HI + b * span_b + h * span_h, ORDER, docs, pid_m, ROW0, ROW_END, N,
        HAS_ORDER, HAS_DOCS, IN_SLOTS, BLOCK_M, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h.to(tl.int64) * sqh + addr[:, None] * sqn + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(SLOPES + h)
    row_term, slope2 = _bias_terms(rows, slope, offset, HAS_BIAS, SIGMOID)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, first, inner, lo, hi, row_order,
                                    row_doc, row_term, slope2, ORDER, N, D, qk_scale, True, SIGMOID,
                                    FAST_SIGMOID, HAS_ORDER, HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N,
                                    BLOCK_D)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, inner, outer, lo, hi, row_order,
                                    row_doc, row_term, slope2, ORDER, N, D, qk_scale, False, SIGMOID,
                                    FAST_SIGMOID, HAS_ORDER, HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N,
                                    BLOCK_D)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, outer, end, lo, hi, row_order,
                                    row_doc, row_term, slope2, ORDER, N, D, qk_scale, True, SIGMOID,
                                    FAST_SIGMOID, HAS_ORDER, HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N,
                                    BLOCK_D)
    if not SIGMOID:
        has_key = l_i > 0
        acc = acc / tl.where(has_key, l_i, 1.0)[:, None]
        lse = tl.where(has_key, (m_i + row_term + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                       float("inf"))
        tl.store(LSE + (pid_bh.to(tl.int64) * N_MEM - ROW0) + rows, lse, mask=row_ok)
    at = b * sob + h.to(tl.int64) * soh + addr[:, None] * son + dims[None, :]
    if ACCUMULATE:
        acc += tl.load(PREV + at, mask=row_ok[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
    tl.store(O + at, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < D))


@triton.jit
def span_delta_kernel(O, DO, DELTA, O_SUM, DELTA_REST, TOKENS, sob, soh, son, sdb, sdh, sdn, H, N, D,
                      PAIR: tl.constexpr, IN_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) in float32: FlashAttention's backward preprocessing (softmax only). PAIR: O is one
    path's output of a sum of two (O_SUM, O's strides), and DELTA_REST the other path's, rowsum(dO * (O_SUM - O)),
    from the one read of dO. IN_SLOTS: row r is slot r, read at its token TOKENS[r] (the log-sum-exps of rows in
    slots are per slot too)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (dims[None, :] < D)
    at = rows
    if IN_SLOTS:
        at = tl.load(TOKENS + rows, mask=rows < N, other=0)
    o = tl.load(O + b * sob + h * soh + at[:, None] * son + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + at[:, None] * sdn + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * N + rows, delta, mask=rows < N)
    if PAIR:
        total = tl.load(O_SUM + b * sob + h * soh + at[:, None] * son + dims[None, :], mask=mask, other=0.0)
        tl.store(DELTA_REST + pid_bh.to(tl.int64) * N + rows, tl.sum(total.to(tl.float32) * do, 1) - delta,
                 mask=rows < N)


@triton.jit
def _kv_rows(dk, dv, k, v, cols, col_order, rows, row_ok, row_tokens, q_base, do_base, sqn, sdon, span_lo, span_hi,
             halo, LSE, DELTA, row_base, ORDER, docs, slope, offset, qk_scale, D: tl.constexpr, SIGMOID: tl.constexpr,
             FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_DOCS: tl.constexpr, IN_SLOTS: tl.constexpr,
             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """dk, dv of a block of keys (at positions cols of the rows' spans) plus what the query rows `rows` give them.
    Key-major: the tiles are (keys, rows), k q^T, so p^T and dS^T come out as the products dv and dk take.
    Row r's log-sum-exp, delta and document start are at row_base + r and docs + r (in slots the caller offsets
    them by the halo: they are per slot). IN_SLOTS: the rows are read at `row_tokens`, and their spans are the
    band, keys within `halo` of the row."""
    dims = tl.arange(0, BLOCK_D)
    if IN_SLOTS:
        row_order, addr = row_tokens, row_tokens
    else:
        row_order, addr = _order_and_address(rows, row_ok, ORDER, HAS_ORDER, False)
    q_mask = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(q_base + addr[:, None] * sqn + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(do_base + addr[:, None] * sdon + dims[None, :], mask=q_mask, other=0.0)
    row_term, slope2 = _bias_terms(rows, slope, offset, HAS_BIAS, SIGMOID)
    s_t = tile_dot(k, tl.trans(q), IEEE, WIDEN) * qk_scale  # (keys, rows)
    if HAS_BIAS:
        if SIGMOID:
            s_t += row_term[None, :] - slope2 * cols[:, None].to(tl.float32)
        else:
            s_t -= slope2 * cols[:, None].to(tl.float32)
    if IN_SLOTS:  # -halo <= key - row <= halo, in one unsigned comparison
        ok_t = (cols[:, None] - rows[None, :] + halo).to(tl.uint32) <= 2 * halo
    else:
        lo = tl.load(span_lo + rows, mask=row_ok, other=0)
        hi = tl.load(span_hi + rows, mask=row_ok, other=0)
        ok_t = (cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :])
    if HAS_ORDER:
        ok_t = ok_t & (col_order[:, None] <= row_order[None, :])
        if HAS_DOCS:  # from the row's document's first token (see _allowed; two comparisons compile shorter here)
            row_doc = tl.load(docs + rows, mask=row_ok, other=0)
            ok_t = ok_t & (col_order[:, None] >= row_doc[None, :])
    dp_t = tile_dot(v, tl.trans(do), IEEE, WIDEN)
    if SIGMOID:
        p_t = tl.where(ok_t, _sigmoid(s_t, FAST_SIGMOID), 0.0)
        ds_t = dp_t * p_t * (1.0 - p_t)
    else:
        # the log-sum-exp less the bias's row term, which the scores leave out
        lse = tl.load(LSE + row_base + rows, mask=row_ok, other=float("inf")) * LOG2E - row_term
        delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
        p_t = tl.where(ok_t, tl.exp2(s_t - lse[None, :]), 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
    dv += tile_dot(p_t.to(do.dtype), do, IEEE, WIDEN)
    dk += tile_dot(ds_t.to(q.dtype), q, IEEE, WIDEN)
    return dk, dv


@triton.jit
def span_backward_kv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, ORDER, SLOPES, KEY_FIRST, KEY_END, DOCS,
                            DOC_END, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                            sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, span_b, span_h, plan_h, plan_len,
                            H, H_KV, GROUP, N, D: tl.constexpr, sm_scale, qk_scale, offset,
                            SIGMOID: tl.constexpr, FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr,
                            HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                            ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, KEY_GROUP: tl.constexpr):
    """dk, dv of one block of BLOCK_N keys of key head hk: over the GROUP query heads that read it, each over the
    query rows that attend to some key of the block (KEY_FIRST / KEY_END per KEY_GROUP keys; in token order, in the
    documents of its keys). ACCUMULATE: added to what DK and DV hold (another path's)."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hk = (pid_bh // H_KV).to(tl.int64), pid_bh % H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < N
    kv_mask = col_ok[:, None] & (dims[None, :] < D)
    k = tl.load(K + b * skb + hk.to(tl.int64) * skh + cols[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk.to(tl.int64) * svh + cols[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    groups = pid_n * (BLOCK_N // KEY_GROUP) + tl.arange(0, BLOCK_N // KEY_GROUP)
    col_order = cols
    if HAS_ORDER:
        col_order = tl.load(ORDER + cols, mask=col_ok, other=0)
    docs = DOCS + b * N
    rows_first, rows_end = 0, N  # the rows of the block's documents
    if HAS_DOCS and not HAS_ORDER:
        rows_first = tl.load(docs + pid_n * BLOCK_N)
        rows_end = tl.load(DOC_END + b * N + tl.minimum(pid_n * BLOCK_N + BLOCK_N, N) - 1)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        first = tl.maximum(tl.min(tl.load(KEY_FIRST + h * plan_h + groups, mask=groups < plan_len, other=N), 0),
                           rows_first)
        end = tl.minimum(tl.max(tl.load(KEY_END + h * plan_h + groups, mask=groups < plan_len, other=0), 0),
                         rows_end)
        slope = 0.0
        if HAS_BIAS:
            slope = tl.load(SLOPES + h)
        q_base = Q + b * sqb + h.to(tl.int64) * sqh
        do_base = DO + b * sdob + h.to(tl.int64) * sdoh
        row_base = (b * H + h) * N
        for start in range(first // BLOCK_M * BLOCK_M, end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            dk, dv = _kv_rows(dk, dv, k, v, cols, col_order, rows, rows < N, rows, q_base, do_base, sqn, sdon,
                              LO + b * span_b + h * span_h, HI + b * span_b + h * span_h, 0, LSE, DELTA, row_base,
                              ORDER, docs, slope, offset, qk_scale, D, SIGMOID, FAST_SIGMOID, HAS_ORDER, HAS_DOCS,
                              False, HAS_BIAS, IEEE, WIDEN, BLOCK_D)
    dk_at = DK + b * sdkb + hk.to(tl.int64) * sdkh + cols[:, None] * sdkn + dims[None, :]
    dv_at = DV + b * sdvb + hk.to(tl.int64) * sdvh + cols[:, None] * sdvn + dims[None, :]
    dk = dk * sm_scale
    if ACCUMULATE:
        dk += tl.load(dk_at, mask=kv_mask, other=0.0).to(tl.float32)
        dv += tl.load(dv_at, mask=kv_mask, other=0.0).to(tl.float32)
    tl.store(dk_at, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def span_backward_kv_slots_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, ORDER, DOCS,
                                  sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                                  sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, H, H_KV, GROUP, N, N_MEM, HALO,
                                  D: tl.constexpr, sm_scale, qk_scale, HAS_DOCS: tl.constexpr, IEEE: tl.constexpr,
                                  WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_D: tl.constexpr):
    """dk, dv of BLOCK_N tokens in slot space (stochastic attention's band over N = N_MEM + 2 HALO rows: row r holds
    token ORDER[r], the main rows HALO .. HALO + N_MEM - 1 each slot once, the others a copy of a slot at either
    end): each key's main row and its copy, shifted by -N_MEM or +N_MEM, meet the main query rows within HALO
    of them; so every token's dk and dv are summed here, read and written at its own row, with no scatter."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hk = (pid_bh // H_KV).to(tl.int64), pid_bh % H_KV
    cols = HALO + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < HALO + N_MEM
    kv_mask = col_ok[:, None] & (dims[None, :] < D)
    tokens = tl.load(ORDER + cols, mask=col_ok, other=0)
    k = tl.load(K + b * skb + hk.to(tl.int64) * skh + tokens[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk.to(tl.int64) * svh + tokens[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
    docs = DOCS + (b * N_MEM - HALO)  # per slot: main row r's at r - HALO, as the log-sum-exps and deltas
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lowest = tl.min(tl.where(col_ok, cols, N), 0)
    highest = tl.max(tl.where(col_ok, cols, 0), 0)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h.to(tl.int64) * sqh
        do_base = DO + b * sdob + h.to(tl.int64) * sdoh
        row_base = (b * H + h) * N_MEM - HALO
        for shift in range(-N_MEM, N_MEM + 1, N_MEM):  # the copy before the main rows, the main row, the copy after
            first = tl.maximum(lowest + shift - HALO, HALO)
            end = tl.minimum(highest + shift + HALO + 1, HALO + N_MEM)
            row_tokens = _tokens(ORDER, first, end, BLOCK_M)
            for start in range(first, end, BLOCK_M):
                rows = start + tl.arange(0, BLOCK_M)
                block_tokens = row_tokens
                row_tokens = _tokens(ORDER, start + BLOCK_M, end, BLOCK_M)
                dk, dv = _kv_rows(dk, dv, k, v, cols + shift, tokens, rows, rows < end, block_tokens, q_base,
                                  do_base, sqn, sdon, None, None, HALO, LSE, DELTA, row_base, ORDER, docs,
                                  0.0, 0.0, qk_scale, D, False, False, True, HAS_DOCS, True, False, IEEE, WIDEN,
                                  BLOCK_D)
    tl.store(DK + b * sdkb + hk.to(tl.int64) * sdkh + tokens[:, None] * sdkn + dims[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + hk.to(tl.int64) * sdvh + tokens[:, None] * sdvn + dims[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, block_lo, block_hi, lo, hi, row_order, row_doc,
               row_term, slope2, ORDER, N, D: tl.constexpr, qk_scale, EDGE: tl.constexpr,
               SIGMOID: tl.constexpr, FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_DOCS: tl.constexpr,
               IN_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq over key blocks [block_lo, block_hi): masked where EDGE, else every score counts."""
    for start in range(block_lo, block_hi, BLOCK_N):
        cols, k, v, col_order = _key_block(k_base, v_base, skn, svn, start, ORDER, N, D, EDGE, HAS_ORDER, IN_SLOTS,
                                           BLOCK_N, BLOCK_D)
        s = _scores(q, k, cols, row_term, slope2, qk_scale, HAS_BIAS, SIGMOID, IEEE, WIDEN)
        dp = tile_dot(do, tl.trans(v), IEEE, WIDEN)
        if SIGMOID:
            p = _sigmoid(s, FAST_SIGMOID)
        else:
            p = tl.exp2(s - lse[:, None])
        if EDGE:
            allowed = _allowed(cols, lo, hi, row_order, row_doc, col_order, HAS_ORDER, HAS_DOCS)
            p = tl.where(allowed, p, 0.0)
        if SIGMOID:
            ds = dp * p * (1.0 - p)
        else:
            ds = p * (dp - delta[:, None])
        dq += tile_dot(ds.to(k.dtype), k, IEEE, WIDEN)
    return dq


@triton.jit
def span_backward_q_kernel(Q, K, V, DO, LSE, DELTA, DQ, LO, HI, ORDER, SLOPES, DOCS,
                           sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sdqb, sdqh, sdqn,
                           span_b, span_h, H, GROUP, N, N_MEM, ROW0, ROW_END, D: tl.constexpr, sm_scale, qk_scale,
                           offset, SIGMOID: tl.constexpr, FAST_SIGMOID: tl.constexpr, HAS_ORDER: tl.constexpr,
                           HAS_DOCS: tl.constexpr, IN_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                           WIDEN: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq of one tile of BLOCK_M query rows, walking its key blocks as the forward does; ACCUMULATE: added to what
    DQ holds (another path's)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    docs = DOCS + b * N_MEM
    rows, row_ok, addr, lo, hi, first, inner, outer, end, row_order, row_doc = _query_tile(
        LO + b * span_b + h * span_h, HI + b * span_b + h * span_h, ORDER, docs, pid_m, ROW0, ROW_END, N,
        HAS_ORDER, HAS_DOCS, IN_SLOTS, BLOCK_M, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Q + b * sqb + h.to(tl.int64) * sqh + addr[:, None] * sqn + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h.to(tl.int64) * sdoh + addr[:, None] * sdon + dims[None, :], mask=q_mask,
                 other=0.0)
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(SLOPES + h)
    row_term, slope2 = _bias_terms(rows, slope, offset, HAS_BIAS, SIGMOID)
    lse = tl.zeros([BLOCK_M], dtype=tl.float32)
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not SIGMOID:
        # in log2 units, less the bias's row term, which the scores leave out
        row_base = pid_bh.to(tl.int64) * N_MEM - ROW0  # per query row (in slots: per slot)
        lse = tl.load(LSE + row_base + rows, mask=row_ok, other=float("inf")) * LOG2E - row_term
        delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, first, inner, lo, hi, row_order, row_doc,
                    row_term, slope2, ORDER, N, D, qk_scale, True, SIGMOID, FAST_SIGMOID, HAS_ORDER,
                    HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N, BLOCK_D)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, inner, outer, lo, hi, row_order, row_doc,
                    row_term, slope2, ORDER, N, D, qk_scale, False, SIGMOID, FAST_SIGMOID, HAS_ORDER,
                    HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N, BLOCK_D)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, outer, end, lo, hi, row_order, row_doc,
                    row_term, slope2, ORDER, N, D, qk_scale, True, SIGMOID, FAST_SIGMOID, HAS_ORDER,
                    HAS_DOCS, IN_SLOTS, HAS_BIAS, IEEE, WIDEN, BLOCK_N, BLOCK_D)
    dq_at = DQ + b * sdqb + h.to(tl.int64) * sdqh + addr[:, None] * sdqn + dims[None, :]
    dq = dq * sm_scale
    if ACCUMULATE:
        dq += tl.load(dq_at, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(dq_at, dq.to(DQ.dtype.element_ty), mask=q_mask)
