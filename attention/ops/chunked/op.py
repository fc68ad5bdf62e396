"""The chunked kernel's entry point: softmax through PyTorch's fused CPU flash kernel, forward and backward
(ChunkedFlashCPU), sigmoid attention with a hand-written backward (ChunkedSigmoid), else batched SDPA or
explicit math over all tiles with autograd."""

from __future__ import annotations

import math

import torch

from attention import simulate_cuda
from attention.edges import EdgeRule
from attention.ops.chunked.groups import (KeyTiles, per_batch_head, TileGroup, key_grad, key_grad_buffer,
                                          key_source, tile_groups)
from attention.ops.chunked.tiles import ChunkTiles, cached_chunk_tiles, chunk_tiles
from attention.ops.dense import fused_softmax, masked_attention
from attention.ops.score_mod import ScoreBias


def fusable(score_mod) -> bool:
    """Whether the fused chunked kernels can take score_mod (none, or an additive ScoreBias)."""
    return score_mod is None or isinstance(score_mod, ScoreBias)


def chunked_attention(q, k, v, rule: EdgeRule, start: int = 0, chunk: int = 128, score_mod=None,
                      activation="softmax", dropout_p: float = 0.0, fused: bool = True, tiles: ChunkTiles = None,
                      cpu_flash: bool | None = None, docs=None):
    """Block-sparse attention, O(edges): query chunks of `chunk` positions, each over the key chunks that hold
    its allowed edges (tiles: the rule's ChunkTiles at this length, from plan_attention; built here when not
    given); docs (B, n), where each row's document begins (attention/documents.py), in the order of q's rows:
    the rule's edges between tokens of one document only.

    Without dropout and with no score_mod or a ScoreBias, softmax on CPU runs ChunkedFlashCPU (groups of tiles
    through PyTorch's fused CPU flash kernel, forward and backward) and sigmoid runs ChunkedSigmoid on any
    device; other cases build all tiles at once and use autograd (`fused=False` forces that path, for tests).
    cpu_flash=False (the plan's choice on the CPU standing in for CUDA) takes CUDA's branch on the CPU.
    """
    B, H, n, D = q.shape
    if tiles is None:
        tiles_of = cached_chunk_tiles if rule.static else chunk_tiles
        tiles = tiles_of(rule, n, start, chunk or rule.chunk_size(), H, str(q.device))
    c = tiles.chunk
    plain = score_mod is None and activation == "softmax"
    if fused and fusable(score_mod) and dropout_p == 0.0:
        if cpu_flash is None:  # not planned: CUDA's branch on CUDA and on the CPU standing in for it
            cpu_flash = not simulate_cuda.gpu_path(q.device)
        if activation == "softmax" and q.device.type == "cpu" and cpu_flash:
            return ChunkedFlashCPU.apply(q, k, v, ((0, H, tiles, None),), score_mod, start, docs)
        if activation == "sigmoid":
            return ChunkedSigmoid.apply(q, k, v, tiles, score_mod, start, docs)

    parts = []
    for first, end, mask, _ in tiles.segments:  # each segment's chunks at once: (B * H, s, c or S c, D) tiles
        group = TileGroup(first, end, n, tiles)
        q_tiles, k_tiles, v_tiles = group.query_tiles(q), KeyTiles.apply(k, group), KeyTiles.apply(v, group)
        if docs is not None:  # per batch row (B, H or 1, ...), on the device: no host check on CUDA's branch
            mask = mask & ~group.apart(docs)
        if plain:  # one batched fused SDPA over the segment's tiles
            y = fused_softmax(q_tiles, k_tiles, v_tiles, per_batch_head(mask, B, H), dropout_p)
        else:
            q_pos, k_pos = group.positions(start, q.device)
            y = masked_attention(*(t.view(B, H, *t.shape[1:]) for t in (q_tiles, k_tiles, v_tiles)), mask, q_pos,
                                 k_pos, score_mod, activation, dropout_p, fused=False)
        parts.append(y.reshape(B, H, (end - first) * c, D))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 2))[:, :, :n]


class ChunkedFlashCPU(torch.autograd.Function):
    """Block-sparse softmax attention through the fused CPU flash kernel, a fixed number of query positions per
    call in forward and backward.

    plans: one (first head, end head, ChunkTiles) per group of heads
    (one group for a plain rule; one per window for multi-scale windows), each written straight into the
    shared output and gradients. Only the inputs, output and gradients are full-size (and each one's chunked
    copy, made once per call); tiles, masks and padding are built per group of chunks, so large temporaries
    are neither allocated nor page-faulted at every call, and time stays linear in the edges (one call over all
    tiles grew ~2.5x from n=8K to 16K on a 2-core CPU; see docs/benchmarks.md). docs (B, n): each batch row's
    documents (TileGroup.batch_calls); a row they leave without a key gets a zero output and no gradient from
    the kernel itself.
    """

    @staticmethod
    def forward(ctx, q, k, v, plans, score_bias=None, start=0, docs=None):
        B, _, n, _ = q.shape
        out = torch.empty_like(q)
        lses, chunked = [], []
        for h0, h1, tiles, layout in plans:
            c, nc, heads = tiles.chunk, tiles.n_chunks, h1 - h0
            q_h, out_h = q[:, h0:h1], out[:, h0:h1]
            k_chunks, v_chunks = key_source(k[:, h0:h1], tiles), key_source(v[:, h0:h1], tiles)
            chunked += [k_chunks, v_chunks]  # kept for backward (instead of k and v: no more memory, no new copy)
            lse = q.new_empty(B * heads, nc, c, dtype=torch.promote_types(q.dtype, torch.float32))
            for g in tile_groups(n, tiles, B * heads, layout):
                q_t, k_t, v_t = g.query_tiles(q_h), g.key_tiles(k_chunks), g.key_tiles(v_chunks)
                for rows, apart in g.batch_calls(B, docs):
                    t = slice(rows.start * heads, rows.stop * heads)  # the rows' tiles
                    y, lse[t, g.i0:g.i1] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q_t[t], k_t[t], v_t[t], 0.0, False,
                        attn_mask=g.bias(q.dtype, rows.stop - rows.start, score_bias, range(h0, h1), start,
                                         apart=apart))
                    g.scatter_queries(out_h[rows], y)
            if tiles.keep is not None:  # rows without a key attended everywhere inside the kernel: zero them
                out_h.mul_(_in_token_order(tiles.keep, layout).to(out_h.dtype))
            lses.append(lse)
        ctx.plans, ctx.score_bias, ctx.start, ctx.k_shape, ctx.docs = plans, score_bias, start, k.shape, docs
        ctx.save_for_backward(q, out, *lses, *chunked)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, out, *saved = ctx.saved_tensors
        lses, chunked = saved[:len(ctx.plans)], saved[len(ctx.plans):]
        B, _, n, D = q.shape
        grad_q, grad_k, grad_v = torch.empty_like(q), [], []
        for i, ((h0, h1, tiles, layout), lse) in enumerate(zip(ctx.plans, lses)):
            heads = h1 - h0
            q_h, out_h, grad_y_h = (t[:, h0:h1] for t in (q, out, grad_y))
            k_chunks, v_chunks = chunked[2 * i], chunked[2 * i + 1]
            grad_k_chunks, grad_v_chunks = key_grad_buffer(k_chunks, tiles), key_grad_buffer(v_chunks, tiles)
            if tiles.keep is not None:
                grad_y_h = grad_y_h * _in_token_order(tiles.keep, layout).to(grad_y_h.dtype)
            for g in tile_groups(n, tiles, B * heads, layout):
                dy_t, q_t, k_t, v_t, out_t = (g.query_tiles(grad_y_h), g.query_tiles(q_h), g.key_tiles(k_chunks),
                                              g.key_tiles(v_chunks), g.query_tiles(out_h))
                for rows, apart in g.batch_calls(B, ctx.docs):
                    t = slice(rows.start * heads, rows.stop * heads)
                    g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dy_t[t], q_t[t], k_t[t], v_t[t], out_t[t], lse[t, g.i0:g.i1].contiguous(), 0.0, False,
                        attn_mask=g.bias(q.dtype, rows.stop - rows.start, ctx.score_bias, range(h0, h1), ctx.start,
                                         apart=apart))
                    g.scatter_queries(grad_q[rows, h0:h1], g_q)
                    g.accumulate_keys(grad_k_chunks[rows], g_k)
                    g.accumulate_keys(grad_v_chunks[rows], g_v)
            grad_k.append(key_grad(grad_k_chunks, tiles))  # no copy for a single group of heads
            grad_v.append(key_grad(grad_v_chunks, tiles))
        join = (lambda parts: parts[0]) if len(grad_k) == 1 else (lambda parts: torch.cat(parts, dim=1))  # noqa: E731
        return grad_q, join(grad_k), join(grad_v), None, None, None, None



def _in_token_order(keep, layout):
    """A per-row factor (n, 1) or (H, n, 1) over layout rows, in the tokens' order."""
    return keep if layout is None else keep.index_select(-2, layout.slot_of.to(keep.device) + layout.halo)


class ChunkedSigmoid(torch.autograd.Function):
    """Block-sparse sigmoid attention y_i = sum_j sigmoid(s_ij) v_j over the rule's edges (s = q.k / sqrt(d)
    plus an optional ScoreBias), in groups of chunks as ChunkedFlashCPU, on any device; with docs (B, n), the
    edges inside each batch row's documents (masked on the device, for every group).

    Forward keeps each group's probabilities p = sigmoid(s) for backward when gradients are needed (O(edges)
    memory, as autograd over the tiles; recomputing them cost a sixth more time on CPU). dv = p^T dy,
    ds = (dy v^T) p (1 - p), dq = ds k / sqrt(d), dk = ds^T q / sqrt(d). Scores are in float32 (float64 for
    float64 inputs); disallowed scores are -inf, so their p and ds are exactly zero.
    """

    @staticmethod
    def forward(ctx, q, k, v, tiles, score_bias=None, start=0, docs=None):
        B, H, n, D = q.shape
        out = torch.empty_like(q)
        kept, keep = [], any(ctx.needs_input_grad[:3])  # no gradients needed (evaluation): keep nothing
        k_chunks, v_chunks = key_source(k, tiles), key_source(v, tiles)
        with torch.autocast(q.device.type, enabled=False):  # scores in float32 even inside an autocast region
            for g in tile_groups(n, tiles, B * H):
                probs = ChunkedSigmoid._probs(g, q, k_chunks, score_bias, start, docs)
                y = probs @ ChunkedSigmoid._tiles(g.key_tiles(v_chunks), B, probs.dtype)
                g.scatter_queries(out, y.flatten(0, 1).to(q.dtype))
                if keep:
                    kept.append(probs)
        ctx.tiles = tiles
        ctx.save_for_backward(q, k, v, *kept)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, *kept = ctx.saved_tensors
        tiles = ctx.tiles
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        # key and value gradients sum over tile slots and groups: accumulated in the compute dtype
        grad_q = torch.empty_like(q)
        k_chunks, v_chunks = key_source(k, tiles), key_source(v, tiles)
        grad_k, grad_v = key_grad_buffer(k_chunks, tiles, compute), key_grad_buffer(v_chunks, tiles, compute)
        scale = 1 / math.sqrt(D)
        groups = tile_groups(n, tiles, B * H)
        with torch.autocast(q.device.type, enabled=False):
            for g, probs in zip(groups, kept):
                dy = ChunkedSigmoid._tiles(g.query_tiles(grad_y), B, compute)
                q_t = ChunkedSigmoid._tiles(g.query_tiles(q), B, compute)
                k_t = ChunkedSigmoid._tiles(g.key_tiles(k_chunks), B, compute)
                v_t = ChunkedSigmoid._tiles(g.key_tiles(v_chunks), B, compute)
                d_scores = torch.ops.aten.sigmoid_backward(dy @ v_t.transpose(-1, -2), probs)  # dp * p * (1 - p)
                g.scatter_queries(grad_q, (d_scores @ k_t * scale).flatten(0, 1).to(q.dtype))
                g.accumulate_keys(grad_k, (d_scores.transpose(-1, -2) @ q_t * scale).flatten(0, 1))
                g.accumulate_keys(grad_v, (probs.transpose(-1, -2) @ dy).flatten(0, 1))
        return (grad_q, key_grad(grad_k, tiles).to(k.dtype), key_grad(grad_v, tiles).to(v.dtype), None,
                None, None, None)

    @staticmethod
    def _tiles(tiles, B, dtype):
        """(B * H, g, rows, D) tiles as (B, H, g, rows, D) in the compute dtype."""
        return tiles.view(B, -1, *tiles.shape[1:]).to(dtype)

    @staticmethod
    def _probs(g, q, k_chunks, score_bias, start, docs=None):
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        q_t = ChunkedSigmoid._tiles(g.query_tiles(q), B, compute)
        k_t = ChunkedSigmoid._tiles(g.key_tiles(k_chunks), B, compute)
        scores = (q_t * (1 / math.sqrt(D))) @ k_t.transpose(-1, -2)  # (B, H, chunks, c, S c)
        if score_bias is not None:
            scores.add_(g.score_bias(score_bias, range(H), start, q.device))
        allowed = g.tile_mask() if docs is None else g.tile_mask() & ~g.apart(docs)
        return scores.masked_fill_(~allowed, float("-inf")).sigmoid_()
