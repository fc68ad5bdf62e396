"""MoBA's blockwise kernel in PyTorch: FlashAttention's forward and backward over groups of (queries, key block), the
path everywhere the Triton kernels (op.py) do not run: the CPU, decoding over a cache, attention dropout. Each query's
own block is one batched causal attention within blocks; every other chosen block j takes the queries of every head
that chose it in one batched matmul. O(n c k) scores, each group's only while it is computed; autograd keeps q, k,
v, the output and one log-sum-exp per query. Held to the reference (naive.py) forward and backward.

With packed documents (docs, naive.py) the groups are the same: each query's keys are cut at where its document
begins (the queries are in token order and MoBA is causal), which only the block holding that start can cut."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from attention.ops.moba.naive import chosen_block_edges

OWN_SCORES_PER_CALL = 1 << 22  # scores of the own-block attention computed (and recomputed in backward) at once


@torch.compiler.disable  # its per-block group sizes are data: a compiled block runs it eagerly (one graph break)
def moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p=0.0, docs=None):
    """Each query over the keys of its chosen blocks only, one key block at a time: O(Tq k c) scores, never
    Tq x Tk, and no copy of the keys per query. Forward and backward are FlashAttention's, over groups:

    - a prompt's forward (queries at the keys' positions) takes every query's own block (moba_choose puts it
      first) as one batched causal attention within blocks, a few blocks per call;
    - every other chosen block j (earlier, so wholly allowed; or any block with its causal mask when decoding
      over a cache) gathers the queries of every head that chose it and multiplies them by its c keys in one
      batched matmul, padded to the head with the most.

    Each group's scores exist only while it is computed: forward merges the groups by their log-sum-exps into
    one softmax per query, and backward recomputes each group's probabilities from the saved log-sum-exp
    (autograd keeps q, k, v, the output and one float per query and head). docs (B, Tq): where each query's
    document begins, or None."""
    if dropout_p > 0:  # dropout's masks would have to be redrawn in backward: autograd over the same groups
        return _moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p, docs)
    return MobaBlockwise.apply(q, k, v, q_pos, chosen, block, docs)


class _Groups:
    """Which queries meet which key blocks: the own blocks (a prompt's forward) and the other chosen blocks,
    their pairs sorted by (block, head) with each pair's row in its block's padded batch; and, with documents,
    where each query's document begins."""

    def __init__(self, chosen, q_pos, Tq, Tk, block, docs=None):
        BH = chosen.shape[0]
        self.BH, self.Tq, self.Tk, self.block = BH, Tq, Tk, block
        self.n_blocks = -(-Tk // block)
        self.own = Tq == Tk
        others = chosen[..., 1:] if self.own else chosen
        self.slots = others.shape[-1]
        flat = others.reshape(-1)
        pair_bh = torch.arange(BH, device=flat.device).repeat_interleave(Tq * self.slots)
        order = torch.where(flat >= 0, flat * BH + pair_bh, self.n_blocks * BH).argsort(stable=True)
        self.order = order[:int((flat >= 0).sum())]
        group = flat[self.order] * BH + pair_bh[self.order]
        counts = torch.bincount(group, minlength=self.n_blocks * BH)
        self.rows = torch.arange(len(self.order), device=flat.device) - (counts.cumsum(0) - counts)[group]
        per_block = counts.view(self.n_blocks, BH)
        self.widths, self.sizes = per_block.amax(1).tolist(), per_block.sum(1).tolist()
        self.bh, self.query = pair_bh[self.order], self.order // self.slots % Tq
        self.q_pos, self.docs = q_pos, docs
        self.heads = BH if docs is None else BH // docs.shape[0]

    def blocks(self):
        """(block j, the slice of its pairs) for every block some query chose besides its own."""
        lo = 0
        for j, size in enumerate(self.sizes):
            if size:
                yield j, slice(lo, lo + size)
            lo += size

    def padded(self, j, part, values, fill=0.0):
        """values of block j's pairs (one row per pair) laid out as its batch: (BH, width, ...)."""
        out = values.new_full((self.BH, self.widths[j], *values.shape[1:]), fill)
        return out.index_put_((self.bh[part], self.rows[part]), values)

    def allowed(self, j, part):
        """Block j's keys each of its pairs may read, by MoBA's edge (padding rows, at position -1: none)."""
        positions = self.padded(j, part, self.q_pos[self.query[part]], fill=-1)
        key_pos = j * self.block + torch.arange(self.block, device=positions.device)
        edges = chosen_block_edges(positions[..., None], key_pos, j, self.block)
        if self.docs is None:
            return edges
        starts = self.padded(j, part, self.docs[self.bh[part] // self.heads, self.query[part]])
        return edges & (key_pos >= starts[..., None])

    def own_block_edges(self, chunk, device):
        """MoBA's edge within a query's own block, at offsets inside it: the same for every block, or with documents
        (B, 1, blocks of the chunk, block, block), the same for every head (_scores)."""
        offsets = torch.arange(self.block, device=device)
        causal = chosen_block_edges(offsets[:, None], offsets, 0, self.block)
        if self.docs is None:
            return causal
        return (causal & (offsets >= self.own_starts[:, chunk, :, None]))[:, None]

    @functools.cached_property
    def own_starts(self):
        """(B, n_blocks, block): where each query's document begins, as an offset into its own block (<= 0: before
        it; padding rows 0)."""
        pos = torch.arange(self.Tq, device=self.docs.device)
        starts = (self.docs - pos // self.block * self.block)[..., None]
        return _padded_blocks(starts, self.n_blocks, self.block)[..., 0]

    def own_chunks(self):
        step = max(1, OWN_SCORES_PER_CALL // (self.BH * self.block * self.block))
        return [slice(i, i + step) for i in range(0, self.n_blocks, step)]


def _scores(queries, keys, allowed):
    """Scaled scores (BH, ..., queries, keys), -inf where not allowed: allowed broadcasts against them, or is
    (B, 1, ...), one mask per batch row for all its heads (never copied per head)."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(queries.shape[-1])
    if allowed.dim() > scores.dim():
        return scores.view(allowed.shape[0], -1, *scores.shape[1:]).masked_fill(~allowed, -math.inf).flatten(0, 1)
    return scores.masked_fill(~allowed, -math.inf)


def _padded_blocks(x, n_blocks, block):
    """(BH, T, D) -> (BH, n_blocks, block, D), zeros after T."""
    return F.pad(x, (0, 0, 0, n_blocks * block - x.shape[1])).view(x.shape[0], n_blocks, block, x.shape[-1])


class MobaBlockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, chosen, block, docs):
        with torch.autocast(q.device.type, enabled=False):  # scores and softmax in float32 also under autocast
            return MobaBlockwise._forward(ctx, q, k, v, q_pos, chosen, block, docs)

    @staticmethod
    def _forward(ctx, q, k, v, q_pos, chosen, block, docs):
        flat_q, key_blocks, value_blocks, groups, lse, outs = _attend_groups(q, k, v, q_pos, chosen, block, 0.0,
                                                                             docs)
        out, total_lse = _merge(lse, outs)
        ctx.save_for_backward(flat_q, key_blocks, value_blocks, out, total_lse)
        ctx.groups, ctx.shape, ctx.dtype = groups, q.shape, q.dtype
        return out.view(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):
            return MobaBlockwise._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        flat_q, key_blocks, value_blocks, out, lse = ctx.saved_tensors
        groups, (B, H, Tq, D) = ctx.groups, ctx.shape
        grad = grad.reshape(B * H, Tq, D).to(out.dtype)
        delta = (grad * out).sum(-1)  # rowsum(dO o O): FlashAttention's backward
        scale = 1 / math.sqrt(D)
        d_q, d_keys, d_values = torch.zeros_like(flat_q), torch.zeros_like(key_blocks), torch.zeros_like(value_blocks)

        def group_grads(queries, keys, values, allowed, g, group_lse, group_delta):
            probs = torch.exp(_scores(queries, keys, allowed) - group_lse[..., None])
            d_scores = probs * (g @ values.transpose(-1, -2) - group_delta[..., None])
            return d_scores @ keys * scale, d_scores.transpose(-1, -2) @ queries * scale, probs.transpose(-1, -2) @ g

        if groups.own:
            n, block = groups.n_blocks, groups.block
            query_blocks, grad_blocks = _padded_blocks(flat_q, n, block), _padded_blocks(grad, n, block)
            # padding rows: an infinite log-sum-exp gives them zero probability
            lse_blocks = F.pad(lse, (0, n * block - Tq), value=math.inf).view(-1, n, block)
            delta_blocks = F.pad(delta, (0, n * block - Tq)).view(-1, n, block)
            d_query_blocks = torch.zeros_like(query_blocks)
            for c in groups.own_chunks():
                dq, dk, dv = group_grads(query_blocks[:, c], key_blocks[:, c], value_blocks[:, c],
                                         groups.own_block_edges(c, grad.device), grad_blocks[:, c], lse_blocks[:, c],
                                         delta_blocks[:, c])
                d_query_blocks[:, c] = dq
                d_keys[:, c] += dk
                d_values[:, c] += dv
            d_q += d_query_blocks.flatten(1, 2)[:, :Tq]
        for j, part in groups.blocks():
            bh, t = groups.bh[part], groups.query[part]
            queries, g = groups.padded(j, part, flat_q[bh, t]), groups.padded(j, part, grad[bh, t])
            group_lse = groups.padded(j, part, lse[bh, t], fill=math.inf)
            dq, dk, dv = group_grads(queries, key_blocks[:, j], value_blocks[:, j], groups.allowed(j, part), g,
                                     group_lse, groups.padded(j, part, delta[bh, t]))
            d_q.index_put_((bh, t), dq[bh, groups.rows[part]], accumulate=True)
            d_keys[:, j] += dk
            d_values[:, j] += dv
        Tk = groups.Tk
        unblock = lambda x: x.flatten(1, 2)[:, :Tk].reshape(B, H, Tk, D).to(ctx.dtype)  # noqa: E731
        return d_q.view(B, H, Tq, D).to(ctx.dtype), unblock(d_keys), unblock(d_values), None, None, None, None


def _softmax(queries, keys, values, allowed, dropout_p=0.0):
    """Softmax attention of each batch of queries over its keys where allowed: (log-sum-exp, normalised output)
    per query; a query with no allowed key (a padding row) gets -inf and a zero output."""
    scores = _scores(queries, keys, allowed)
    peak = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    probs = torch.exp(scores - peak)
    total = probs.sum(-1, keepdim=True)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    out = (probs @ values) / total.clamp(min=torch.finfo(scores.dtype).tiny)
    return (peak + torch.log(total))[..., 0], out


def _attend_groups(q, k, v, q_pos, chosen, block, dropout_p, docs):
    """Every group's softmax: the inputs as the groups read them (flat q, padded key and value blocks), the
    groups, and per query and slot the log-sum-exp (B H, Tq, topk) and normalised output (B H, Tq, topk, D)."""
    B, H, Tq, D = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    flat_q, flat_k, flat_v = (t.reshape(B * H, -1, D).to(compute) for t in (q, k, v))
    groups = _Groups(chosen.reshape(B * H, Tq, -1), q_pos, Tq, k.shape[2], block, docs)
    key_blocks = _padded_blocks(flat_k, groups.n_blocks, block)
    value_blocks = _padded_blocks(flat_v, groups.n_blocks, block)
    lse_parts, out_parts = [], []
    if groups.own:
        query_blocks = _padded_blocks(flat_q, groups.n_blocks, block)
        own = [_softmax(query_blocks[:, c], key_blocks[:, c], value_blocks[:, c], groups.own_block_edges(c, q.device),
                        dropout_p) for c in groups.own_chunks()]
        lse_parts.append(torch.cat([lse for lse, _ in own], 1).flatten(1)[:, :Tq, None])
        out_parts.append(torch.cat([out for _, out in own], 1).flatten(1, 2)[:, :Tq, None])
    if groups.slots:
        lse = torch.full((B * H * Tq * groups.slots,), -math.inf, device=q.device, dtype=compute)
        outs = torch.zeros(B * H * Tq * groups.slots, D, device=q.device, dtype=compute)
        for j, part in groups.blocks():
            queries = groups.padded(j, part, flat_q[groups.bh[part], groups.query[part]])
            block_lse, block_out = _softmax(queries, key_blocks[:, j], value_blocks[:, j], groups.allowed(j, part),
                                            dropout_p)
            lse[groups.order[part]] = block_lse[groups.bh[part], groups.rows[part]]
            outs[groups.order[part]] = block_out[groups.bh[part], groups.rows[part]]
        lse_parts.append(lse.view(B * H, Tq, -1))
        out_parts.append(outs.view(B * H, Tq, -1, D))
    return flat_q, key_blocks, value_blocks, groups, torch.cat(lse_parts, -1), torch.cat(out_parts, 2)


def _merge(lse, outs):
    """The slots' outputs as one softmax per query: weighted by their shares exp(lse - logsumexp(lse))."""
    total = torch.logsumexp(lse, -1)
    return (torch.exp(lse - total[..., None])[..., None, :] @ outs)[..., 0, :], total


def _moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p, docs=None):
    """The same groups under autograd, with dropout on each group's probabilities (training with dropout)."""
    with torch.autocast(q.device.type, enabled=False):  # scores and softmax in float32 also under autocast
        *_, lse, outs = _attend_groups(q, k, v, q_pos, chosen, block, dropout_p, docs)
        return _merge(lse, outs)[0].view(q.shape).to(q.dtype)
