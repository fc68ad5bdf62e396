"""MoBA in Triton: the block choice, and attention over the chosen blocks other than a query's own.

    choose        each tile of BLOCK_M queries walks the mean keys of the blocks before its own a chunk of BLOCK_C
                  at a time (q . mean by tl.dot, IEEE float32), each column of the chunk keeping its best TOPK - 1
                  blocks in registers by elementwise compares, merged into every row's best once at the end; its own
                  block (MoBA's infinite score) is slot 0 without a compare; never the (n, n / c) score matrix
    pairs         (query, chosen block) pairs sorted by (batch x head, block) are cut into tiles of BLOCK_M pairs
                  that read one key block (MoBA's own implementation: varlen attention over the queries of each
                  block; FlashMoBA fuses the same grouping): a tile gathers its queries and runs one softmax over
                  the block's c keys, returning each pair's normalised output and log-sum-exp; its backward
                  recomputes the probabilities from the query's final log-sum-exp and writes each pair's dq; dk and
                  dv come from one program per block of keys over the pairs that chose its block (contiguous
                  in the sorted order: no atomics), added to the own blocks' part as they are stored

A query's own block (causal) runs span attention over fixed blocks (attention/ops/span), and the parts are merged
by their log-sum-exps (attention/ops/moba/op.py). Checked against attention/ops/moba/naive.py and the dense
reference in tests/ops/test_moba_kernel.py, under Triton's interpreter on the CPU.

With packed documents (HAS_DOCS; DOCS (B, N): where each token's document begins) a row chooses among the blocks
from its document's first on (their means over its document's keys: op.py), and its keys are cut at its
document's start: the rows are in token order and MoBA is causal, so a row's document holds
exactly its keys from that start on. Every pair of one key block then has the same start (only one document of a
row runs past the block's end), so a tile skips the keys before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attention.ops.span.triton_kernels import tile_dot


@triton.jit
def moba_choose_kernel(Q, MEANS, CHOSEN, DOCS, sqb, sqh, sqn, smb, smh, smn, H, N, D, NB, block,
                       TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                       HAS_DOCS: tl.constexpr):
    """Each row's own block (slot 0: MoBA's infinite score, never compared) and its TOPK - 1 best earlier blocks,
    best first, -1 past the blocks a row has: naive.py's choice, from IEEE float32 scores as its own; among equal
    scores the lower block first (torch.topk there leaves ties in no stated order). Each column of the chunk
    (blocks c0 + column) keeps its own best TOPK - 1 in registers by elementwise compares: no reduction across
    threads in the walk (a block enters its column's list only past the entries at least as good, all earlier
    blocks); the columns' lists are merged into each row's once, after it."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    own = rows // block
    at = CHOSEN + (pid_bh * N + rows) * TOPK
    tl.store(at, own.to(CHOSEN.dtype.element_ty), mask=row_ok)
    if TOPK > 1:
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :],
                    mask=row_ok[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
        last_own = tl.max(tl.where(row_ok, own, 0), 0)
        lowest = 0
        if HAS_DOCS:
            first = (tl.load(DOCS + b * N + rows, mask=row_ok, other=0) // block).to(tl.int32)  # its document's first
            lowest = tl.min(tl.where(row_ok, first, last_own), 0)
        # the columns' lists: values[place], picks[place] the score and block in that place, best first (-inf, -1:
        # none; a list fills from its head)
        values = ()
        picks = ()
        for _ in tl.static_range(TOPK - 1):
            values = values + (tl.full([BLOCK_M, BLOCK_C], float("-inf"), dtype=tl.float32),)
            picks = picks + (tl.full([BLOCK_M, BLOCK_C], -1, dtype=tl.int32),)
        for c0 in range(lowest // BLOCK_C * BLOCK_C, last_own, BLOCK_C):  # the blocks before the last row's own
            blocks = c0 + tl.arange(0, BLOCK_C)
            means = tl.load(MEANS + b * smb + h * smh + blocks[:, None] * smn + dims[None, :],
                            mask=(blocks[:, None] < NB) & (dims[None, :] < D), other=0.0)
            s = tile_dot(q, tl.trans(means), True, False)
            earlier = blocks[None, :] < own[:, None]  # before the row's own block (so before NB)
            if HAS_DOCS:
                earlier = earlier & (blocks[None, :] >= first[:, None])
            s = tl.where(earlier, s, float("-inf"))
            block_of = tl.broadcast_to(blocks[None, :], [BLOCK_M, BLOCK_C])
            kept_v = ()
            kept_i = ()
            for place in tl.static_range(TOPK - 1):  # the score sinks down its column's list: a place keeps the better
                better = s > values[place]
                kept_v = kept_v + (tl.where(better, s, values[place]),)
                kept_i = kept_i + (tl.where(better, block_of, picks[place]),)
                s, block_of = tl.where(better, values[place], s), tl.where(better, picks[place], block_of)
            values, picks = kept_v, kept_i
        # the merge, TOPK - 1 times: the best of the columns' heads (the lowest block among equal scores) is taken,
        # and its column's list moves up one place
        for slot in tl.static_range(1, TOPK):
            top = tl.max(values[0], 1)
            pick = tl.min(tl.where(values[0] == top[:, None], picks[0], NB), 1)
            taken = picks[0] == pick[:, None]
            moved_v = ()
            moved_i = ()
            for place in tl.static_range(TOPK - 2):
                moved_v = moved_v + (tl.where(taken, values[place + 1], values[place]),)
                moved_i = moved_i + (tl.where(taken, picks[place + 1], picks[place]),)
            values = moved_v + (tl.where(taken, float("-inf"), values[TOPK - 2]),)
            picks = moved_i + (picks[TOPK - 2],)
            tl.store(at + slot, tl.where(top > float("-inf"), pick, -1).to(CHOSEN.dtype.element_ty), mask=row_ok)


@triton.jit
def _tile(TILE_GROUP, TILE_START, PAIR_START, COUNTS, ORDER, t, n_groups, H, N, NB, SLOTS, BLOCK_M: tl.constexpr):
    """Tile t: its pairs (sorted pair ids), which of its BLOCK_M rows are real, the batch, head and key block they
    share, and each pair's query row."""
    g = tl.load(TILE_GROUP + t)
    valid = g < n_groups
    g = tl.where(valid, g, 0)
    local = t - tl.load(TILE_START + g)
    first = tl.load(PAIR_START + g) + local * BLOCK_M
    count = tl.where(valid, tl.minimum(tl.load(COUNTS + g) - local * BLOCK_M, BLOCK_M), 0)
    r = tl.arange(0, BLOCK_M)
    pair = tl.load(ORDER + first + r, mask=r < count, other=0).to(tl.int64)  # pair x D passes 2^31 at long lengths
    bh, j = (g // NB).to(tl.int64), g % NB  # 64-bit: batch x head offsets pass 2^31 elements at long lengths
    return pair, r < count, bh, bh // H, bh % H, j, pair // SLOTS % N


@triton.jit
def _block_keys(K, V, b, h, j, block, start, N, D, dims, skb, skh, skn, svb, svh, svn, BLOCK_N: tl.constexpr):
    """BLOCK_N keys and values of key block j from position start (masked past the block and the sequence)."""
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = (cols < j * block + block) & (cols < N)
    kv_mask = col_ok[:, None] & (dims[None, :] < D)
    k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + dims[None, :], mask=kv_mask, other=0.0)
    return cols, col_ok, kv_mask, k, v


@triton.jit
def _document_starts(DOCS, b, rows, real, N):
    """Where each row's document begins (32 bits: positions stay below 2^31)."""
    return tl.load(DOCS + b * N + rows, mask=real, other=0).to(tl.int32)


@triton.jit
def moba_pairs_forward_kernel(Q, K, V, OUT, LSE, TILE_GROUP, TILE_START, PAIR_START, COUNTS, ORDER, DOCS,
                              sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, H, N, D, NB, SLOTS, block, qk_scale,
                              n_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              IEEE: tl.constexpr, WIDEN: tl.constexpr, HAS_DOCS: tl.constexpr):
    pair, real, bh, b, h, j, rows = _tile(TILE_GROUP, TILE_START, PAIR_START, COUNTS, ORDER, tl.program_id(0),
                                          n_groups, H, N, NB, SLOTS, BLOCK_M)
    if tl.max(real.to(tl.int32), 0) > 0:
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :],
                    mask=real[:, None] & (dims[None, :] < D), other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        key_lo = j * block
        if HAS_DOCS:
            doc_start = _document_starts(DOCS, b, rows, real, N)
            key_lo = tl.maximum(key_lo, tl.min(tl.where(real, doc_start, N), 0))
        for start in range(key_lo, tl.minimum(j * block + block, N), BLOCK_N):
            cols, col_ok, kv_mask, k, v = _block_keys(K, V, b, h, j, block, start, N, D, dims, skb, skh, skn, svb,
                                                      svh, svn, BLOCK_N)
            # a chosen block other than the own one is earlier than the query: all its keys (of the query's
            # document) are allowed
            allowed = col_ok[None, :]
            if HAS_DOCS:
                allowed = allowed & (cols[None, :] >= doc_start[:, None])
            s = tl.where(allowed, tile_dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
            if HAS_DOCS:  # a row whose document begins after these keys has none yet
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, IEEE, WIDEN)
            m_i = m_new
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + pair[:, None] * D + dims[None, :], acc, mask=real[:, None] & (dims[None, :] < D))
        tl.store(LSE + pair, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, mask=real)


@triton.jit
def moba_pairs_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ_PAIRS, TILE_GROUP, TILE_START, PAIR_START, COUNTS, ORDER, DOCS,
                         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, H, N, D, NB, SLOTS, block,
                         sm_scale, qk_scale, n_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Each pair's dq over its chosen block, from the query's final log-sum-exp and rowsum(dO * O)."""
    pair, real, bh, b, h, j, rows = _tile(TILE_GROUP, TILE_START, PAIR_START, COUNTS, ORDER, tl.program_id(0),
                                          n_groups, H, N, NB, SLOTS, BLOCK_M)
    if tl.max(real.to(tl.int32), 0) > 0:
        dims = tl.arange(0, BLOCK_D)
        row_mask = real[:, None] & (dims[None, :] < D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :], mask=row_mask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdon + dims[None, :], mask=row_mask, other=0.0)
        lse = tl.load(LSE + bh * N + rows, mask=real, other=float("inf"))
        delta = tl.load(DELTA + bh * N + rows, mask=real, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        key_lo = j * block
        if HAS_DOCS:
            doc_start = _document_starts(DOCS, b, rows, real, N)
            key_lo = tl.maximum(key_lo, tl.min(tl.where(real, doc_start, N), 0))
        for start in range(key_lo, tl.minimum(j * block + block, N), BLOCK_N):
            cols, col_ok, kv_mask, k, v = _block_keys(K, V, b, h, j, block, start, N, D, dims, skb, skh, skn, svb,
                                                      svh, svn, BLOCK_N)
            s = tile_dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale
            allowed = col_ok[None, :] & real[:, None]
            if HAS_DOCS:
                allowed = allowed & (cols[None, :] >= doc_start[:, None])
            p = tl.where(allowed, tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)
            dp = tile_dot(do, tl.trans(v), IEEE, WIDEN)
            ds = p * (dp - delta[:, None])
            dq += tile_dot(ds.to(k.dtype), k, IEEE, WIDEN)
        tl.store(DQ_PAIRS + pair[:, None] * D + dims[None, :], dq * sm_scale, mask=row_mask)


@triton.jit
def moba_pairs_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK_OWN, DV_OWN, DK, DV, PAIR_START, COUNTS, ORDER, DOCS,
                           sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sdkb, sdkh, sdkn,
                           sdvb, sdvh, sdvn, H, N, D, NB, SLOTS, block, sm_scale, qk_scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                           WIDEN: tl.constexpr, HAS_DOCS: tl.constexpr):
    """dk, dv of BLOCK_N keys of block j: the own blocks' part (span attention's backward, DK_OWN, DV_OWN) plus
    every pair that chose block j, walked in its sorted order by this program alone (no atomics: the pairs of a
    block are contiguous in ORDER), key-major (k q^T) so that no tile is transposed. Each tile's pairs are read an
    iteration ahead of the rows they address, so that Triton's pipeliner prefetches those rows while the tile
    before computes (read in the same iteration, they left it none: every copy waited for at once)."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    per_block = (block + BLOCK_N - 1) // BLOCK_N
    j = pid_n // per_block
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    cols, col_ok, kv_mask, k, v = _block_keys(K, V, b, h, j, block, j * block + pid_n % per_block * BLOCK_N, N, D,
                                              dims, skb, skh, skn, svb, svh, svn, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    g = bh * NB + j
    first, count = tl.load(PAIR_START + g), tl.load(COUNTS + g)
    next_pairs = tl.load(ORDER + first + tl.arange(0, BLOCK_M), mask=tl.arange(0, BLOCK_M) < count, other=0)
    for r0 in range(0, count, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        real = r < count
        pair = next_pairs.to(tl.int64)
        next_pairs = tl.load(ORDER + first + r + BLOCK_M, mask=r + BLOCK_M < count, other=0)
        rows = pair // SLOTS % N
        row_mask = real[:, None] & (dims[None, :] < D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :], mask=row_mask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdon + dims[None, :], mask=row_mask, other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * N + rows, mask=real, other=float("inf"))
        delta = tl.load(DELTA + bh.to(tl.int64) * N + rows, mask=real, other=0.0)
        s_t = tile_dot(k, tl.trans(q), IEEE, WIDEN) * qk_scale  # (keys, pairs)
        allowed_t = col_ok[:, None] & real[None, :]
        if HAS_DOCS:
            allowed_t = allowed_t & (cols[:, None] >= _document_starts(DOCS, b, rows, real, N)[None, :])
        p_t = tl.where(allowed_t, tl.exp2(s_t - lse[None, :] * 1.4426950408889634), 0.0)
        dp_t = tile_dot(v, tl.trans(do), IEEE, WIDEN)
        ds_t = p_t * (dp_t - delta[None, :])
        dv += tile_dot(p_t.to(do.dtype), do, IEEE, WIDEN)
        dk += tile_dot(ds_t.to(q.dtype), q, IEEE, WIDEN)
    own = b * sdkb + h * sdkh + cols[:, None] * sdkn + dims[None, :]
    tl.store(DK + own, (dk * sm_scale + tl.load(DK_OWN + own, mask=kv_mask, other=0.0).to(tl.float32))
             .to(DK.dtype.element_ty), mask=kv_mask)
    own = b * sdvb + h * sdvh + cols[:, None] * sdvn + dims[None, :]
    tl.store(DV + own, (dv + tl.load(DV_OWN + own, mask=kv_mask, other=0.0).to(tl.float32)).to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _row_tile(H, N, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's BLOCK_M rows of one batch row and head, over the head dimension: (b, h, rows, dims, the rows
    inside the sequence, the (rows, dims) mask, the rows' index in a (B, H, N) tensor)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    mask = row_ok[:, None] & (dims[None, :] < D)
    return b, h, rows, dims, row_ok, mask, bh.to(tl.int64) * N + rows


@triton.jit
def moba_merge_kernel(OWN, OWN_LSE, PAIR_OUT, PAIR_LSE, OUT, LSE, sab, sah, san, sob, soh, son, H, N, D, SLOTS,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A query's parts as one softmax: its own block's output and each chosen block's, weighted by their
    log-sum-exps (a pair never filled keeps -inf: weight 0, its output not read), in one pass over the partials."""
    b, h, rows, dims, row_ok, mask, at = _row_tile(H, N, D, BLOCK_M, BLOCK_D)
    own_lse = tl.load(OWN_LSE + at, mask=row_ok, other=0.0)
    m = own_lse
    for s in range(0, SLOTS):
        m = tl.maximum(m, tl.load(PAIR_LSE + at * SLOTS + s, mask=row_ok, other=float("-inf")))
    weight = tl.exp(own_lse - m)
    total = weight
    acc = weight[:, None] * tl.load(OWN + b * sab + h * sah + rows[:, None] * san + dims[None, :], mask=mask,
                                    other=0.0).to(tl.float32)
    for s in range(0, SLOTS):
        pair = at * SLOTS + s
        pair_lse = tl.load(PAIR_LSE + pair, mask=row_ok, other=float("-inf"))
        weight = tl.exp(pair_lse - m)
        total += weight
        # a pair never filled is never read: its partial output is left unwritten (no zero fill beforehand)
        filled = mask & (pair_lse > float("-inf"))[:, None]
        acc += weight[:, None] * tl.load(PAIR_OUT + pair[:, None] * D + dims[None, :], mask=filled, other=0.0)
    tl.store(OUT + b * sob + h * soh + rows[:, None] * son + dims[None, :], (acc / total[:, None])
             .to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE + at, m + tl.log(total), mask=row_ok)


@triton.jit
def moba_dq_merge_kernel(DQ, DQ_PAIRS, CHOSEN, sdb, sdh, sdn, H, N, D, SLOTS, BLOCK_M: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """dq += the chosen blocks' parts, in place, in one pass: each query's own-block dq (in q's strides) plus its
    pairs' float32 partials, the pairs of no chosen block (-1) never read (left unwritten by the pairs' kernel)."""
    b, h, rows, dims, row_ok, mask, at = _row_tile(H, N, D, BLOCK_M, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, SLOTS):
        chosen = tl.load(CHOSEN + at * (SLOTS + 1) + 1 + s, mask=row_ok, other=-1)
        pair = at * SLOTS + s
        acc += tl.load(DQ_PAIRS + pair[:, None] * D + dims[None, :], mask=mask & (chosen >= 0)[:, None], other=0.0)
    own = DQ + b * sdb + h * sdh + rows[:, None] * sdn + dims[None, :]
    tl.store(own, (tl.load(own, mask=mask, other=0.0).to(tl.float32) + acc).to(DQ.dtype.element_ty), mask=mask)
