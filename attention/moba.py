"""MoBA, Mixture of Block Attention (Lu et al. 2025; paper 000's fourth baseline, §4.2).

The keys are split into blocks of `moba_block` (c) positions. Each query scores every earlier block by
q . mean(k over the block) and attends, causally, to the keys of its `moba_topk` (k) best blocks, its own
block always among them: MoBA's reference code gives the query's own block an infinite score before the
top-k, so a query sees at most c * k keys (paper 000 calls c x k the effective window, Fig. 4). Where fewer
than k blocks exist the query takes all of them. The choice is discrete and carries no gradient (as in MoBA);
the scores over the chosen keys are one softmax.

The edge is defined once (attention/edges.py: chosen_block_edges) and the choice once (moba_choose,
attention/ops/moba/naive.py). Three kernels evaluate them: `dense` masks all n x n scores (the reference); on CUDA
training and prompts run attention/ops/moba's Triton kernels (the choice in one kernel, each query's own block as
span attention over fixed blocks, the other chosen blocks as tiles of the queries that chose one block, merged by
log-sum-exp: no host synchronisation, no graph break under torch.compile); everywhere else (the CPU, decoding over
a cache, attention dropout) `moba_blockwise` runs FlashAttention's forward and backward over groups of (queries,
key block) in PyTorch: each query's own
block as one batched causal attention within blocks, and every other chosen block with the queries of every
head that chose it, in one batched matmul. O(n c k) scores, each group's only while it is computed; autograd
keeps q, k, v, the output and one log-sum-exp per query (memory and time within 2x of swa at c k keys per
query: docs/benchmarks.md). Generation keeps every key (a full KV cache): a new query may choose any earlier
block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.cache import KVCache
from attention.edges import chosen_block_edges
from attention.kernels import span_available
from attention.layer import Attention
from attention.ops.dense import masked_attention
from attention.ops.moba.naive import chosen_mask, moba_choose  # the choice and its mask, beside their kernels
from attention.ops.moba.op import moba_attention
from attention.memory import linear_inputs, padded, rope_tables
from attention.registry import Setting, refuse_whole_context, register

# each query reads the moba_topk key blocks of moba_block positions scoring best against it, its own block among
# them (at most moba_block * moba_topk keys: paper 000's effective window)
MOBA_BLOCK = Setting("moba_block", int, 128, "moba: the key blocks' length")
MOBA_TOPK = Setting("moba_topk", int, 2, "moba: the blocks each query reads, its own among them")

OWN_SCORES_PER_CALL = 1 << 22  # scores of the own-block attention computed (and recomputed in backward) at once

def moba_dense(q, k, v, q_pos, chosen, block, dropout_p=0.0):
    """The reference: all Tq x Tk scores, masked by the chosen blocks."""
    return masked_attention(q, k, v, chosen_mask(q_pos, k.shape[2], chosen, block), fused=False, dropout_p=dropout_p)


@torch.compiler.disable  # its per-block group sizes are data: a compiled block runs it eagerly (one graph break)
def moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p=0.0):
    """Each query over the keys of its chosen blocks only, one key block at a time: O(Tq k c) scores, never
    Tq x Tk, and no copy of the keys per query. Forward and backward are FlashAttention's, over groups:

    - a prompt's forward (queries at the keys' positions) takes every query's own block (moba_choose puts it
      first) as one batched causal attention within blocks, a few blocks per call;
    - every other chosen block j (earlier, so wholly allowed; or any block with its causal mask when decoding
      over a cache) gathers the queries of every head that chose it and multiplies them by its c keys in one
      batched matmul, padded to the head with the most.

    Each group's scores exist only while it is computed: forward merges the groups by their log-sum-exps into
    one softmax per query, and backward recomputes each group's probabilities from the saved log-sum-exp
    (autograd keeps q, k, v, the output and one float per query and head)."""
    if dropout_p > 0:  # dropout's masks would have to be redrawn in backward: autograd over the same groups
        return _moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p)
    return MobaBlockwise.apply(q, k, v, q_pos, chosen, block)


class _Groups:
    """Which queries meet which key blocks: the own blocks (a prompt's forward) and the other chosen blocks,
    their pairs sorted by (block, head) with each pair's row in its block's padded batch."""

    def __init__(self, chosen, q_pos, Tq, Tk, block):
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
        self.q_pos = q_pos

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
        return chosen_block_edges(positions[..., None], key_pos, j, self.block)

    def own_block_edges(self, device):
        """MoBA's edge within a query's own block, at offsets inside it (the same for every block)."""
        offsets = torch.arange(self.block, device=device)
        return chosen_block_edges(offsets[:, None], offsets, 0, self.block)

    def own_chunks(self):
        step = max(1, OWN_SCORES_PER_CALL // (self.BH * self.block * self.block))
        return [slice(i, i + step) for i in range(0, self.n_blocks, step)]


def _scores(queries, keys, allowed):
    scores = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(queries.shape[-1])
    return scores.masked_fill(~allowed, -math.inf)


def _padded_blocks(x, n_blocks, block):
    """(BH, T, D) -> (BH, n_blocks, block, D), zeros after T."""
    return F.pad(x, (0, 0, 0, n_blocks * block - x.shape[1])).view(x.shape[0], n_blocks, block, x.shape[-1])


class MobaBlockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, chosen, block):
        with torch.autocast(q.device.type, enabled=False):  # scores and softmax in float32 also under autocast
            return MobaBlockwise._forward(ctx, q, k, v, q_pos, chosen, block)

    @staticmethod
    def _forward(ctx, q, k, v, q_pos, chosen, block):
        flat_q, key_blocks, value_blocks, groups, lse, outs = _attend_groups(q, k, v, q_pos, chosen, block, 0.0)
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
            causal = groups.own_block_edges(grad.device)
            query_blocks, grad_blocks = _padded_blocks(flat_q, n, block), _padded_blocks(grad, n, block)
            # padding rows: an infinite log-sum-exp gives them zero probability
            lse_blocks = F.pad(lse, (0, n * block - Tq), value=math.inf).view(-1, n, block)
            delta_blocks = F.pad(delta, (0, n * block - Tq)).view(-1, n, block)
            d_query_blocks = torch.zeros_like(query_blocks)
            for c in groups.own_chunks():
                dq, dk, dv = group_grads(query_blocks[:, c], key_blocks[:, c], value_blocks[:, c], causal,
                                         grad_blocks[:, c], lse_blocks[:, c], delta_blocks[:, c])
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
        return d_q.view(B, H, Tq, D).to(ctx.dtype), unblock(d_keys), unblock(d_values), None, None, None


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


def _attend_groups(q, k, v, q_pos, chosen, block, dropout_p):
    """Every group's softmax: the inputs as the groups read them (flat q, padded key and value blocks), the
    groups, and per query and slot the log-sum-exp (B H, Tq, topk) and normalised output (B H, Tq, topk, D)."""
    B, H, Tq, D = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    flat_q, flat_k, flat_v = (t.reshape(B * H, -1, D).to(compute) for t in (q, k, v))
    groups = _Groups(chosen.reshape(B * H, Tq, -1), q_pos, Tq, k.shape[2], block)
    key_blocks = _padded_blocks(flat_k, groups.n_blocks, block)
    value_blocks = _padded_blocks(flat_v, groups.n_blocks, block)
    lse_parts, out_parts = [], []
    if groups.own:
        causal = groups.own_block_edges(q.device)
        query_blocks = _padded_blocks(flat_q, groups.n_blocks, block)
        own = [_softmax(query_blocks[:, c], key_blocks[:, c], value_blocks[:, c], causal, dropout_p)
               for c in groups.own_chunks()]
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


def _moba_blockwise(q, k, v, q_pos, chosen, block, dropout_p):
    """The same groups under autograd, with dropout on each group's probabilities (training with dropout)."""
    with torch.autocast(q.device.type, enabled=False):  # scores and softmax in float32 also under autocast
        *_, lse, outs = _attend_groups(q, k, v, q_pos, chosen, block, dropout_p)
        return _merge(lse, outs)[0].view(q.shape).to(q.dtype)


@register("moba")
class MixtureOfBlockAttention(Attention):
    """Each query attends to the moba_topk key blocks (of moba_block positions) that score best against it,
    its own block included."""
    paper = "000 (baseline)"
    summary = "j <= i in the k blocks of c positions scoring best against i by q_i . mean(k), i's own among them"

    settings = Attention.settings + (MOBA_BLOCK, MOBA_TOPK)

    @classmethod
    def example_settings(cls, window):
        return {"moba_block": max(8, window // 2), "moba_topk": 2}

    def pretrained_problem(self):
        return ""  # no parameters of its own: the block choice reads the model's own q and k

    def attend_cached(self, q, keys, values, pos, key_pos):
        return self.attend_over(q, keys, values, pos)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.moba_block < 1 or config.moba_topk < 1:
            raise ValueError(f"moba_block={config.moba_block}, moba_topk={config.moba_topk}: both must be >= 1")
        refuse_whole_context(config, "moba_block", config.moba_block, "one block holds")
        if config.attn_gate:
            raise ValueError("attn_gate is paper 000's gate for its own variants; moba runs without it")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.block, self.topk = config.moba_block, config.moba_topk
        self.kernel = moba_dense if config.attn_backend == "dense" else moba_blockwise

    def plan(self, batch_size, seq_len, device, start=0):
        """Whether this forward runs the Triton kernels: decided here, outside compiled code (a compiled block then
        guards on the answer instead of asking the environment at every call)."""
        return self.uses_triton(device)

    def attend(self, q, k, v, pos, cache, plan=None):
        if cache is not None:
            k, v, _ = cache.update(k, v, pos)
        return self.attend_over(q, k, v, pos, self.kernel, plan)

    def attend_over(self, q, keys, values, pos, kernel=None, triton=None):
        """Queries at positions pos over the keys at 0 .. len - 1 (a prompt, or decoding over a cache). triton:
        plan()'s answer (None: asked now)."""
        dropout_p = self.dropout if self.training else 0.0
        triton = self.uses_triton(q.device) if triton is None else triton
        if kernel is moba_blockwise and triton and q.shape[2] == keys.shape[2] and dropout_p == 0:
            return moba_attention(q, keys, values, self.block, self.topk)  # training and prompts, on CUDA
        chosen = moba_choose(q, keys, pos, self.block, self.topk)
        return (kernel or moba_dense)(q, keys, values, pos, chosen, self.block, dropout_p)

    def uses_triton(self, device) -> bool:
        """Whether training and prompts run the Triton kernels (attention/ops/moba): on CUDA (and the CPU standing
        in for it) with Triton installed, with the blockwise kernel configured (not the dense reference)."""
        return self.kernel is moba_blockwise and simulate_cuda.gpu_path(device) and span_available()

    def expected_graph_breaks(self, device, dtype):
        if self.kernel is moba_blockwise and not self.uses_triton(device):
            return "moba's blockwise kernel groups queries by the blocks they chose (data-dependent sizes): it runs eagerly"
        return ""

    def init_cache(self, batch_size, max_len, device, dtype):
        return KVCache((batch_size, self.n_head, max_len, self.head_dim), device, dtype)

    def describe(self):
        return f"moba: blocks of {self.block}, top {self.topk} (own block included), at most {self.block * self.topk} keys"

    def edge_counts(self, seq_len):
        """Scores per head over a sequence: each query's own block up to itself, plus topk - 1 earlier
        blocks where it has them (the blocks differ by query, the number does not)."""
        pos = torch.arange(seq_len)
        own = pos // self.block
        count = int(((pos - own * self.block + 1) + self.block * own.clamp(max=self.topk - 1)).sum())
        return [(count, count)] * self.n_head

    def edge_mask(self, seq_len, device="cpu"):
        """Every causal pair: which blocks a query reads depends on the data, and any earlier one may win."""
        pos = torch.arange(seq_len, device=device)
        return pos[None, :] <= pos[:, None]

    def mixing_flops(self, seq_len):
        block_scores = 2 * self.head_dim * self.n_head * (-(-seq_len // self.block))  # q . every block mean
        return super().mixing_flops(seq_len) + block_scores

    def saved_activations(self, m, k, B: int, T: int):
        """MoBA (attention/moba.py): the blockwise kernel keeps what FlashAttention's backward needs, in float32:
        q (after RoPE; without RoPE a view that keeps all of qkv; a float32 copy under bf16), the keys and values
        padded to whole blocks (float32 copies), the output and one log-sum-exp per query and head, and the
        groups' pair indices (int64: the order, row, head and query of each pair beyond the own block). Each
        group's scores exist only while it is computed or recomputed. The dense backend is the n x n reference:
        no estimate."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        if self.kernel is not moba_blockwise:
            raise ValueError("no memory model for moba's dense reference (n x n scores): use attn_backend=auto")
        f32, width = 4, H * D
        saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
        if a != f32:
            saved["q (float32 copy)"] = f32 * width * tokens
        elif self.rope_theta is not None:
            saved["q after RoPE"] = a * width * tokens
        else:
            saved["qkv"] = 3 * a * width * tokens
        if self.rope_theta is not None:
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        saved["k, v padded to whole blocks (float32)"] = 2 * f32 * B * width * padded(T, self.block)
        saved["output and log-sum-exp (float32)"] = f32 * B * H * T * (D + 1)
        saved["pair indices (int64)"] = 4 * 8 * B * H * T * (self.topk - 1)
        saved["merged heads"] = a * C * tokens
        return saved, a * tokens * 5 * C  # c_attn's and c_proj's outputs, the chunks' joined output
