"""Attention kernels over an edge rule (attention/edges.py).

    dense    reference: explicit (B, H, Tq, Tk) scores in float32 or better, any device, O(n^2)
    chunked  O(n * lookback) time and memory with autograd on any device (the CPU training path): queries in
             chunks of c, each attending to a key band of its own chunk plus the ceil(lookback / c) chunks
             before it (and ceil(lookahead / c) after it). Plain softmax on CPU runs groups of tiles through
             PyTorch's fused CPU flash kernel, forward and backward (ChunkedFlashCPU), sigmoid attention runs
             ChunkedSigmoid on any device (both take a ScoreBias); elsewhere all tiles go through one batched
             SDPA call, or explicit math for other score_mods
    windows  chosen by the other backends for rules made of disjoint windows (EdgeRule.window_tiles: paper
             004's bridge path): one batched SDPA call over one tile per window, its rows by its keys
    flex     FlexAttention with a block mask built once per (rule, length) and shared by all layers;
             compiled on CUDA; forward-only on CPU (torch 2.13 has no CPU backward for it)
    sdpa     PyTorch's fused SDPA: is_causal for the causal rule, else a dense boolean mask (O(n^2) memory)

Every kernel takes the same optional `score_mod(score, b, h, q_idx, kv_idx)` (FlexAttention's signature, over
absolute positions, so one definition serves all backends) and `activation` ("softmax" or "sigmoid": no
normalisation), for variants that add position biases or change the score nonlinearity. A score_mod that is a
`ScoreBias` (an additive bias from head and positions only, such as ALiBi) stays on the fused paths: the CPU
flash kernel takes it in its additive mask, and sigmoid attention runs ChunkedSigmoid (groups of chunks, a
hand-written backward) on the chunked backend and FlexAttention's softmax of log-sigmoid scores rescaled
by exp(lse) on flex.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from attention.edges import Causal, EdgeRule

BACKENDS = ("auto", "dense", "chunked", "flex", "sdpa")
TILE_ROWS_PER_CALL = 16384  # chunked kernel on CPU: batch x heads x query positions per fused call


class ScoreBias:
    """A score_mod that adds bias(h, q_idx, kv_idx) to every score, independent of the score and the batch
    (ALiBi and other position biases). It is an ordinary FlexAttention score_mod; kernels that can add a
    precomputed bias tile (the fused CPU paths) recognise it and keep their fast path. `relative`: the bias
    depends on q_idx - kv_idx only, so one tile serves every chunk."""

    relative = False

    def bias(self, h, q_idx, kv_idx):
        raise NotImplementedError

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(h, q_idx, kv_idx)


def resolve_backend(name: str, rule: EdgeRule, device: torch.device) -> str:
    if name != "auto":
        return name
    if rule.lookback is None:
        return "sdpa"
    return "flex" if device.type == "cuda" else "chunked"


def attend(q, k, v, rule: EdgeRule, backend: str, start: int = 0, score_mod=None, activation="softmax",
           dropout_p: float = 0.0, chunk: int = 0):
    """Attention of q over k, v (B, H, T, D) at positions start..start+T-1 under rule, with one backend."""
    backend = resolve_backend(backend, rule, q.device)
    windowed = type(rule).window_tiles is not EdgeRule.window_tiles  # the rule defines disjoint windows
    if windowed and backend != "dense" and start == 0 and score_mod is None and activation == "softmax":
        return window_attention(q, k, v, rule, dropout_p)
    if backend == "dense":
        pos = torch.arange(start, start + q.shape[2], device=q.device)
        return dense_attention(q, k, v, rule, pos, score_mod=score_mod, activation=activation, dropout_p=dropout_p)
    if backend == "chunked":
        groups = rule.head_groups()
        if groups and len(groups) > 1:  # each head group at its own window's cost, not the largest one's
            heads = [torch.tensor(h, device=q.device) for h, _ in groups]
            in_order = [i for h, _ in groups for i in h] == list(range(q.shape[1]))  # plain lists: no device sync
            if in_order and _fusable(score_mod) and activation == "softmax" and dropout_p == 0.0 \
                    and q.device.type == "cpu":  # one fused call writing every group into the same output
                plans, first = [], 0
                for h, sub_rule in groups:
                    plan = _chunk_plan(sub_rule, q.shape[2], start, chunk or sub_rule.chunk_size(), len(h), q.device)
                    plans.append((first, first + len(h), *plan))
                    first += len(h)
                return ChunkedFlashCPU.apply(q, k, v, tuple(plans), score_mod, start)
            if in_order:  # consecutive groups: split, whose backward is one concatenation (no zero-filled
                sizes = [len(h) for h, _ in groups]  # full-size gradient per group, as indexing has)
                pieces = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))
            else:
                pieces = ((q[:, h], k[:, h], v[:, h]) for h in heads)
            parts = [chunked_attention(q_g, k_g, v_g, sub_rule, start, chunk or sub_rule.chunk_size(),
                                       _head_subset(score_mod, h), activation, dropout_p)
                     for (q_g, k_g, v_g), h, (_, sub_rule) in zip(pieces, heads, groups)]
            y = torch.cat(parts, dim=1)
            return y if in_order else y[:, torch.argsort(torch.cat(heads))]
        return chunked_attention(q, k, v, rule, start, chunk or rule.chunk_size(), score_mod, activation, dropout_p)
    if backend == "flex":
        return flex(q, k, v, rule, start, score_mod, activation, dropout_p)
    if backend == "sdpa":
        if score_mod is not None or activation != "softmax":
            raise ValueError("attn_backend=sdpa supports plain softmax attention only; use dense, chunked or flex")
        if isinstance(rule, Causal) and start == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        pos = torch.arange(start, start + q.shape[2], device=q.device)
        return _fused_softmax(q, k, v, rule.dense_mask(pos, n_head=q.shape[1]), dropout_p)
    raise ValueError(f"unknown attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def _fusable(score_mod) -> bool:
    """Whether the fused chunked kernels can take score_mod (none, or an additive ScoreBias)."""
    return score_mod is None or isinstance(score_mod, ScoreBias)


def _head_subset(score_mod, heads):
    """score_mod for a subset of heads: local head index i is global head heads[i]."""
    if score_mod is None:
        return None
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, heads[h], q_idx, kv_idx)


def _apply_score_mod(scores, score_mod, q_pos, k_pos):
    """scores (B, H, ..., Tq, Tk); q_pos (..., Tq, 1) and k_pos (..., 1, Tk) broadcast against its tail."""
    B, H = scores.shape[:2]
    extra = scores.dim() - 2
    b = torch.arange(B, device=scores.device).view(B, *([1] * (extra + 1)))
    h = torch.arange(H, device=scores.device).view(1, H, *([1] * extra))
    return score_mod(scores, b, h, q_pos, k_pos)


def masked_attention(q, k, v, mask, q_pos=None, k_pos=None, score_mod=None, activation="softmax",
                     dropout_p: float = 0.0, fused: bool = True):
    """Attention of q over k, v under a boolean mask broadcastable to (B, H, Tq, Tk) (or tiles of it).

    fused: plain softmax goes through SDPA; otherwise explicit math in float32 (float64 for float64 inputs),
    where a query with no allowed key gets a zero output (never NaN).
    """
    if fused and score_mod is None and activation == "softmax":
        return _fused_softmax(q, k, v, mask, dropout_p)
    compute = torch.promote_types(q.dtype, torch.float32)  # at least float32, float64 when given
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        scores = _apply_score_mod(scores, score_mod, q_pos.unsqueeze(-1), k_pos.unsqueeze(-2))
    if activation == "softmax":
        # the finite minimum (not -inf) keeps rows without any allowed key at exactly zero instead of NaN
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1) * mask
    elif activation == "sigmoid":
        probs = torch.sigmoid(scores) * mask
    else:
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v.to(compute)).to(q.dtype)


def _fused_softmax(q, k, v, mask, dropout_p=0.0):
    """SDPA under a boolean mask; a query with no allowed key gets a zero output, as in the explicit path.

    (SDPA alone returns NaN for such rows: here they attend to every key and their output is zeroed.)
    """
    has_key = mask.any(-1, keepdim=True)  # applied unconditionally: a data-dependent branch would sync GPUs
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p)
    return y * has_key


def dense_attention(q, k, v, rule: EdgeRule, q_pos, k_pos=None, key_valid=None, score_mod=None,
                    activation="softmax", dropout_p: float = 0.0, fused: bool = False):
    """The reference: explicit scores over all (query, key) pairs, masked by the rule."""
    k_pos = q_pos if k_pos is None else k_pos
    mask = rule.dense_mask(q_pos, k_pos, n_head=q.shape[1])
    if key_valid is not None:
        mask = mask & key_valid
    return masked_attention(q, k, v, mask, q_pos, k_pos, score_mod, activation, dropout_p, fused=fused)


def window_attention(q, k, v, rule: EdgeRule, dropout_p: float = 0.0):
    """Softmax attention under a rule made of disjoint windows (EdgeRule.window_tiles), one (rows x keys) tile per
    window, batched in one SDPA call: the cost is the windows' tiles, whatever n. Rows outside every window get
    zero. The tiles' mask is the rule's allowed() at their positions."""
    B, H, n, D = q.shape
    q_index, k_index, mask, rows = _window_plan(rule, n, str(q.device))
    J, R, K = mask.shape
    if J == 0:  # a sequence shorter than the first window's rows
        return q * 0  # zero, with q's graph
    tiles = lambda x, index, size: x.index_select(2, index).view(B, H * J, size, D)  # noqa: E731
    y = _fused_softmax(tiles(q, q_index, R), tiles(k, k_index, K), tiles(v, k_index, K),
                       mask.expand(H, J, R, K).reshape(H * J, R, K), dropout_p)
    y = y.view(B, H, J * R, D).index_select(2, rows)  # the tiles' rows inside the sequence, in order
    return q.new_zeros(B, H, n, D).index_copy(2, q_index.view(J * R).index_select(0, rows), y)


@functools.lru_cache(maxsize=64)
def _window_plan(rule: EdgeRule, n: int, device: str):
    """Row and key positions of every window's tile (clamped into the sequence), the tiles' mask, and which
    tile rows lie inside the sequence; built once per (rule, length, device), on the CPU (no device sync)."""
    first_row, first_key, R, K = rule.window_tiles(n)
    q_pos = first_row[:, None] + torch.arange(R)  # (J, R)
    k_pos = first_key[:, None] + torch.arange(K)  # (J, K)
    mask = rule.allowed(q_pos[:, :, None], k_pos[:, None, :]) & (k_pos < n)[:, None, :]
    outside = q_pos >= n  # rows past the end: any key keeps the fused kernel's rows non-empty; output dropped
    mask = mask | outside[:, :, None]
    rows = torch.nonzero(~outside.flatten()).flatten()
    to = lambda t: t.to(device)  # noqa: E731
    return to(q_pos.clamp(max=n - 1).flatten()), to(k_pos.clamp(max=n - 1).flatten()), to(mask), to(rows)


class KeyTiles(torch.autograd.Function):
    """Key (or value) bands of a _TileGroup's chunks, with a backward that adds each tile slot's gradient
    back in place (autograd through slices would zero-fill a full-size buffer per slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.shape = group, x.shape
        return group.key_tiles(x)

    @staticmethod
    def backward(ctx, grad_tiles):
        grad = grad_tiles.new_zeros(ctx.shape)
        ctx.group.accumulate_keys(grad, grad_tiles)
        return grad, None


def _per_batch_head(mask, B):
    """A tile mask (nc, c, K) or per-head (H, nc, c, K) in the (B * H, nc, c, K) layout of the tiles."""
    return mask.expand(B, *mask.shape).flatten(0, 1) if mask.dim() == 4 else mask[None]


def _tile_mask(rule: EdgeRule, n: int, start: int, c: int, prev: int, ahead: int, n_chunks: int, n_head: int,
               device) -> torch.Tensor:
    """Allowed (query, key) pairs of every tile: (nc, c, K), or (H, nc, c, K) for per-head rules."""
    tile_start = start + c * torch.arange(n_chunks, device=device)[:, None]
    q_pos = tile_start + torch.arange(c, device=device)  # (nc, c)
    k_pos = tile_start - prev * c + torch.arange((prev + 1 + ahead) * c, device=device)  # (nc, K)
    h = torch.arange(n_head, device=device)[:, None, None, None] if rule.per_head else None
    inside = (k_pos >= start) & (k_pos < start + n)  # keys padded before or after the sequence never count
    last = start + n - 1  # clamped positions keep rules that index tensors by position in range
    mask = rule.allowed(q_pos.clamp(max=last)[:, :, None], k_pos.clamp(start, last)[:, None, :], h)
    mask = mask & inside[:, None, :]
    # padded queries past the end attend to every key of their tile: their outputs are dropped, and a full
    # row keeps the fused kernels free of empty rows
    return mask | (q_pos > last)[:, :, None]


def _chunk_plan(rule: EdgeRule, n: int, start: int, chunk: int, n_head: int, device):
    """(tile mask, chunk, earlier chunks, later chunks) of a rule's chunked attention over n positions."""
    lookback = rule.chunk_lookback(chunk, start)
    if lookback is None:
        raise ValueError(f"{type(rule).__name__} has no bounded lookback: the chunked kernel would be O(n^2); "
                         "use attn_backend=sdpa (or flex on CUDA)")
    prev = -(-lookback // chunk)  # earlier chunks in each tile's key band
    ahead = -(-rule.lookahead // chunk)  # later chunks (rules over permuted slots only)
    mask = _tile_mask(rule, n, start, chunk, prev, ahead, -(-n // chunk), n_head, device)
    return mask, chunk, prev, ahead


def chunked_attention(q, k, v, rule: EdgeRule, start: int = 0, chunk: int = 128, score_mod=None,
                      activation="softmax", dropout_p: float = 0.0, fused: bool = True):
    """O(n * lookback) attention: query chunks of `chunk` positions, each over its band of keys.

    Without dropout and with no score_mod or a ScoreBias, softmax on CPU runs ChunkedFlashCPU (groups of tiles
    through PyTorch's fused CPU flash kernel, forward and backward) and sigmoid runs ChunkedSigmoid on any
    device; other cases build all tiles at once and use autograd (`fused=False` forces that path, for tests).
    """
    B, H, n, D = q.shape
    mask, c, prev, ahead = _chunk_plan(rule, n, start, chunk, H, q.device)
    n_chunks = mask.shape[-3]
    plain = score_mod is None and activation == "softmax"
    if fused and _fusable(score_mod) and dropout_p == 0.0:
        if activation == "softmax" and q.device.type == "cpu":
            return ChunkedFlashCPU.apply(q, k, v, ((0, H, mask, c, prev, ahead),), score_mod, start)
        if activation == "sigmoid":
            return ChunkedSigmoid.apply(q, k, v, (mask, c, prev, ahead), score_mod, start)

    group = _TileGroup(0, n_chunks, n, c, prev, ahead)  # every chunk at once: (B * H, nc, c or K, D) tiles
    q_tiles, k_tiles, v_tiles = group.query_tiles(q), KeyTiles.apply(k, group), KeyTiles.apply(v, group)
    if plain:  # one batched fused SDPA over all tiles
        y = _fused_softmax(q_tiles, k_tiles, v_tiles, _per_batch_head(mask, B), dropout_p)
    else:
        tile_start = start + c * torch.arange(n_chunks, device=q.device)[:, None]
        q_pos = tile_start + torch.arange(c, device=q.device)
        k_pos = tile_start - prev * c + torch.arange(k_tiles.shape[2], device=q.device)
        y = masked_attention(*(t.view(B, H, *t.shape[1:]) for t in (q_tiles, k_tiles, v_tiles)), mask, q_pos,
                             k_pos, score_mod, activation, dropout_p, fused=False)
    return y.reshape(B, H, n_chunks * c, D)[:, :, :n]


class ChunkedFlashCPU(torch.autograd.Function):
    """Chunked softmax attention through the fused CPU flash kernel, a fixed number of query positions per
    call in forward and backward.

    plans: one (first head, end head, tile mask, chunk, earlier chunks, later chunks) per group of heads
    (one group for a plain rule; one per window for multi-scale windows), each written straight into the
    shared output and gradients. Only the inputs, output and gradients are full-size; tiles, masks and padding
    are built per group of chunks, so large temporaries are neither allocated nor page-faulted at every call,
    and time stays linear in n (one call over all tiles grew ~2.5x from n=8K to 16K on a 2-core CPU; see
    docs/benchmarks.md).
    """

    @staticmethod
    def forward(ctx, q, k, v, plans, score_bias=None, start=0):
        B, _, n, _ = q.shape
        out = torch.empty_like(q)
        lses = []
        for h0, h1, mask, c, prev, ahead in plans:
            q_h, k_h, v_h, out_h = (t[:, h0:h1] for t in (q, k, v, out))
            lse = q.new_empty(B * (h1 - h0), mask.shape[-3], c, dtype=torch.promote_types(q.dtype, torch.float32))
            for g in ChunkedFlashCPU._groups(n, mask.shape[-3], c, prev, ahead, B * (h1 - h0)):
                y, lse[:, g.i0:g.i1] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    g.query_tiles(q_h), g.key_tiles(k_h), g.key_tiles(v_h), 0.0, False,
                    attn_mask=g.bias(mask, q.dtype, B, score_bias, range(h0, h1), start))
                g.scatter_queries(out_h, y)
            empty_rows = ~mask.any(-1)
            if empty_rows.any():  # such rows attended everywhere inside the kernel: their output is zero
                out_h.mul_(ChunkedFlashCPU._rows_to_keep(empty_rows, out_h, c))
            lses.append(lse)
        ctx.plans, ctx.score_bias, ctx.start = plans, score_bias, start
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, out, *lses = ctx.saved_tensors
        B, _, n, _ = q.shape
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (h0, h1, mask, c, prev, ahead), lse in zip(ctx.plans, lses):
            q_h, k_h, v_h, out_h, grad_y_h = (t[:, h0:h1] for t in (q, k, v, out, grad_y))
            empty_rows = ~mask.any(-1)
            if empty_rows.any():
                grad_y_h = grad_y_h * ChunkedFlashCPU._rows_to_keep(empty_rows, grad_y_h, c)
            for g in ChunkedFlashCPU._groups(n, mask.shape[-3], c, prev, ahead, B * (h1 - h0)):
                g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g.query_tiles(grad_y_h), g.query_tiles(q_h), g.key_tiles(k_h), g.key_tiles(v_h),
                    g.query_tiles(out_h), lse[:, g.i0:g.i1].contiguous(), 0.0, False,
                    attn_mask=g.bias(mask, q.dtype, B, ctx.score_bias, range(h0, h1), ctx.start))
                g.scatter_queries(grad_q[:, h0:h1], g_q)
                g.accumulate_keys(grad_k[:, h0:h1], g_k)
                g.accumulate_keys(grad_v[:, h0:h1], g_v)
        return grad_q, grad_k, grad_v, None, None, None

    @staticmethod
    def _rows_to_keep(empty_rows, like, c):
        n = like.shape[2]
        keep = (~empty_rows).reshape(*empty_rows.shape[:-2], -1)[..., :n]  # (n,) or (H, n)
        return keep.to(like.dtype)[..., None]

    @staticmethod
    def _groups(n, n_chunks, c, prev, ahead, batch_heads):
        per_call = max(1, TILE_ROWS_PER_CALL // (batch_heads * c))  # narrow head groups take more chunks
        for i0 in range(0, n_chunks, per_call):
            yield _TileGroup(i0, min(n_chunks, i0 + per_call), n, c, prev, ahead)


class ChunkedSigmoid(torch.autograd.Function):
    """Chunked sigmoid attention y_i = sum_j sigmoid(s_ij) v_j over the rule's edges (s = q.k / sqrt(d) plus an
    optional ScoreBias), in groups of chunks as ChunkedFlashCPU, on any device.

    Forward keeps each group's probabilities p = sigmoid(s) for backward when gradients are needed (O(n * band)
    memory, as autograd over the tiles; recomputing them cost a sixth more time on CPU). dv = p^T dy,
    ds = (dy v^T) p (1 - p), dq = ds k / sqrt(d), dk = ds^T q / sqrt(d). Scores are in float32 (float64 for
    float64 inputs); disallowed scores are -inf, so their p and ds are exactly zero.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, score_bias=None, start=0):
        mask, c, prev, ahead = plan
        B, H, n, D = q.shape
        out = torch.empty_like(q)
        kept, keep = [], any(ctx.needs_input_grad[:3])  # no gradients needed (evaluation): keep nothing
        with torch.autocast(q.device.type, enabled=False):  # scores in float32 even inside an autocast region
            for g in ChunkedFlashCPU._groups(n, mask.shape[-3], c, prev, ahead, B * H):
                probs = ChunkedSigmoid._probs(g, q, k, mask, score_bias, start)
                y = probs @ ChunkedSigmoid._tiles(g.key_tiles(v), B, probs.dtype)
                g.scatter_queries(out, y.flatten(0, 1).to(q.dtype))
                if keep:
                    kept.append(probs)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, *kept)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, *kept = ctx.saved_tensors
        mask, c, prev, ahead = ctx.plan
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        # key and value gradients sum over band slots and groups: accumulated in the compute dtype
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k, dtype=compute), torch.zeros_like(v, dtype=compute)
        scale = 1 / math.sqrt(D)
        groups = ChunkedFlashCPU._groups(n, mask.shape[-3], c, prev, ahead, B * H)
        with torch.autocast(q.device.type, enabled=False):
            for g, probs in zip(groups, kept):
                tiles = lambda x, group_of: ChunkedSigmoid._tiles(group_of(x), B, compute)
                dy, q_t = tiles(grad_y, g.query_tiles), tiles(q, g.query_tiles)
                k_t, v_t = tiles(k, g.key_tiles), tiles(v, g.key_tiles)
                d_scores = torch.ops.aten.sigmoid_backward(dy @ v_t.transpose(-1, -2), probs)  # dp * p * (1 - p)
                g.scatter_queries(grad_q, (d_scores @ k_t * scale).flatten(0, 1).to(q.dtype))
                g.accumulate_keys(grad_k, (d_scores.transpose(-1, -2) @ q_t * scale).flatten(0, 1))
                g.accumulate_keys(grad_v, (probs.transpose(-1, -2) @ dy).flatten(0, 1))
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None

    @staticmethod
    def _tiles(tiles, B, dtype):
        """(B * H, g, rows, D) tiles as (B, H, g, rows, D) in the compute dtype."""
        return tiles.view(B, -1, *tiles.shape[1:]).to(dtype)

    @staticmethod
    def _probs(g, q, k, mask, score_bias, start):
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        q_t = ChunkedSigmoid._tiles(g.query_tiles(q), B, compute)
        k_t = ChunkedSigmoid._tiles(g.key_tiles(k), B, compute)
        scores = (q_t * (1 / math.sqrt(D))) @ k_t.transpose(-1, -2)  # (B, H, chunks, c, K)
        if score_bias is not None:
            scores.add_(g.score_bias(score_bias, range(H), start, mask.device))
        return scores.masked_fill_(~mask[..., g.i0:g.i1, :, :], float("-inf")).sigmoid_()


class _TileGroup:
    """Chunks i0..i1 of a chunked attention call: their query rows and key band, padded locally."""

    def __init__(self, i0, i1, n, c, prev, ahead):
        self.i0, self.i1, self.n, self.c, self.prev, self.span = i0, i1, n, c, prev, prev + 1 + ahead
        self.q_lo, self.q_hi = i0 * c, min(n, i1 * c)
        first, last = (i0 - prev) * c, (i1 + ahead) * c  # key band in (possibly out-of-range) positions
        self.k_lo, self.k_hi = max(0, first), min(n, last)
        self.k_pad = (self.k_lo - first, last - self.k_hi)

    def query_tiles(self, x):
        B, H, _, D = x.shape
        part = F.pad(x[:, :, self.q_lo:self.q_hi], (0, 0, 0, (self.i1 - self.i0) * self.c - (self.q_hi - self.q_lo)))
        return part.reshape(B * H, self.i1 - self.i0, self.c, D)

    def key_tiles(self, x):
        B, H, _, D = x.shape
        part = F.pad(x[:, :, self.k_lo:self.k_hi], (0, 0, *self.k_pad)).reshape(B * H, -1, self.c, D)
        g = self.i1 - self.i0
        return torch.cat([part[:, j:j + g] for j in range(self.span)], dim=2)

    def bias(self, mask, dtype, B, score_bias=None, heads=None, start=0, open_empty_rows=True):
        """Additive mask of the group: -inf outside the rule's edges, plus score_bias (a ScoreBias) of the given
        heads inside them. For the fused softmax kernel, rows without any allowed key are opened everywhere
        (their outputs are zeroed by the caller). B: laid out as (B * H, ...) tiles; None: (H or 1, ...)."""
        allowed = mask[..., self.i0:self.i1, :, :]
        if open_empty_rows:
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        if score_bias is None:
            bias = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        else:
            bias = self.score_bias(score_bias, heads, start, mask.device).to(dtype).expand(-1, allowed.shape[-3], -1, -1)
        bias = bias.masked_fill(~allowed, float("-inf"))
        return bias if B is None else _per_batch_head(bias, B)

    def score_bias(self, score_bias, heads, start, device):
        """A ScoreBias over the group's tiles for the given heads: (H, chunks, c, K), or (H, 1, c, K) when it
        depends on q - k only (`relative`), since every tile then has the same offsets."""
        h = torch.arange(heads.start, heads.stop, device=device)[:, None, None, None]  # a range: no host copy
        if score_bias.relative:
            q_pos = self.prev * self.c + torch.arange(self.c, device=device)
            k_pos = torch.arange(self.span * self.c, device=device)
            return score_bias.bias(h, q_pos[None, :, None], k_pos[None, None, :])
        q_pos, k_pos = self.positions(start, device)
        return score_bias.bias(h, q_pos[:, :, None], k_pos[:, None, :])

    def positions(self, start, device):
        """Absolute positions of the group's query rows (chunks, c) and key bands (chunks, K)."""
        first = start + self.c * torch.arange(self.i0, self.i1, device=device)[:, None]
        return first + torch.arange(self.c, device=device), first - self.prev * self.c + torch.arange(
            self.span * self.c, device=device)

    def scatter_queries(self, full, tiles):
        B, H, _, D = full.shape
        full[:, :, self.q_lo:self.q_hi] = tiles.reshape(B, H, -1, D)[:, :, :self.q_hi - self.q_lo]

    def accumulate_keys(self, full, tile_grads):
        """Add the gradients of every tile slot back onto the key positions they were copied from."""
        B, H, _, D = full.shape
        g, c = self.i1 - self.i0, self.c
        local = tile_grads.new_zeros(B * H, g + self.span - 1, c, D)
        for j in range(self.span):  # slot j of chunk i holds band chunk i - i0 + j
            local[:, j:j + g] += tile_grads[:, :, j * c:(j + 1) * c]
        local = local.reshape(B, H, -1, D)
        full[:, :, self.k_lo:self.k_hi] += local[:, :, self.k_pad[0]:local.shape[2] - self.k_pad[1]]


# ---- FlexAttention ---------------------------------------------------------------------------------------

FLEX_BLOCK = 128  # FlexAttention's default block size


def flex_block_mask(rule: EdgeRule, n: int, n_head: int | None, device: str, start: int = 0):
    """The block mask of a rule at one length. A static rule's is built once and shared by every layer using
    it; a per-forward rule (a permutation) gets the block structure of its band, which depends only on the
    length and the band, with the rule's mask_mod evaluated inside every block of it."""
    if rule.static:
        return _static_block_mask(rule, n, n_head, device, start)
    if rule.lookback is None:
        raise ValueError(f"{type(rule).__name__} is drawn per forward and unbounded: flex needs a banded layout")
    from torch.nn.attention.flex_attention import BlockMask

    kv_num_blocks, kv_indices = _band_blocks(n, rule.lookback, rule.lookahead, device)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_shifted_mask_mod(rule, start), seq_lengths=(n, n))


def _shifted_mask_mod(rule, start):
    mask_mod = rule.mask_mod()
    return mask_mod if start == 0 else (lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + start, kv_idx + start))


@functools.lru_cache(maxsize=64)
def _static_block_mask(rule, n, n_head, device, start):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_shifted_mask_mod(rule, start), B=None, H=n_head if rule.per_head else None, Q_LEN=n, KV_LEN=n,
                             device=device)


@functools.lru_cache(maxsize=64)
def _band_blocks(n: int, lookback: int, lookahead: int, device: str):
    """kv_num_blocks and kv_indices (1, 1, query blocks, kv blocks) of the band -lookback <= k - q <=
    lookahead: every block it touches is partial (its mask_mod decides inside). Entries past a row's count
    are padding, as in create_block_mask's output."""
    n_blocks = -(-n // FLEX_BLOCK)
    first_query = torch.arange(n_blocks) * FLEX_BLOCK
    lo = (first_query - lookback).clamp(min=0) // FLEX_BLOCK
    hi = (first_query + FLEX_BLOCK - 1 + lookahead).clamp(max=n - 1) // FLEX_BLOCK
    count = hi - lo + 1
    indices = (lo[:, None] + torch.arange(n_blocks)).clamp(max=n_blocks - 1)
    as_mask = lambda t: t.to(device=device, dtype=torch.int32)[None, None].contiguous()
    return as_mask(count), as_mask(indices)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, rule: EdgeRule, start: int = 0, score_mod=None, activation="softmax", dropout_p: float = 0.0):
    """FlexAttention under the rule's block mask. Sigmoid attention is computed by the softmax kernel: with
    scores replaced by log sigmoid(s), softmax gives sigmoid(s_j) / sum_k sigmoid(s_k), and the row's
    log-sum-exp is log sum_k sigmoid(s_k), so out * exp(lse) = sum_j sigmoid(s_j) v_j (rows without keys: 0)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if dropout_p > 0:
        raise ValueError("the flex backend has no attention dropout: set dropout=0 or use attn_backend=chunked")
    on_cuda = q.device.type == "cuda"
    if not on_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("FlexAttention has no CPU backward in this torch version: train on CPU with "
                           "attn_backend=chunked (or auto)")
    block_mask = flex_block_mask(rule, q.shape[2], q.shape[1], str(q.device), start)
    mod = _flex_score_mod(score_mod, start, activation)
    fn = _compiled_flex() if on_cuda else flex_attention  # eager on CPU: forward checks and inference only
    if activation == "softmax":
        return fn(q, k, v, score_mod=mod, block_mask=block_mask)
    out, aux = fn(q, k, v, score_mod=mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    return (out.float() * aux.lse.float().exp()[..., None]).to(q.dtype)


@functools.lru_cache(maxsize=64)
def _flex_score_mod(score_mod, start, activation):
    """The score_mod handed to FlexAttention, one object per (score_mod, start, activation): compiled flex
    recompiles for a new function object."""
    mod = score_mod
    if mod is not None and start:
        mod = lambda s, b, h, qi, ki: score_mod(s, b, h, qi + start, ki + start)
    if activation == "sigmoid":
        inner = mod
        mod = lambda s, b, h, qi, ki: F.logsigmoid(s if inner is None else inner(s, b, h, qi, ki))
    return mod
