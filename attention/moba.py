"""MoBA, Mixture of Block Attention (Lu et al. 2025; paper 000's fourth baseline, §4.2).

The keys are split into blocks of `moba_block` (c) positions. Each query scores every earlier block by
q . mean(k over the block) and attends, causally, to the keys of its `moba_topk` (k) best blocks, its own
block always among them: MoBA's reference code gives the query's own block an infinite score before the
top-k, so a query sees at most c * k keys (paper 000 calls c x k the effective window, Fig. 4). Where fewer
than k blocks exist the query takes all of them. The choice is discrete and carries no gradient (as in MoBA);
the scores over the chosen keys are one softmax.

The edge is defined once (attention/edges.py: chosen_block_edges) and the choice once (moba_choose). Two
kernels evaluate them: `dense` masks all n x n scores (the reference), every other backend gathers each
query's chosen blocks, O(n c k) scores, in chunks of queries that are recomputed in backward, so the
gathered keys and values are never held for a whole sequence (the block scores are n x n / c).
Generation keeps every key (a full KV cache): a new query may choose any earlier block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from attention.cache import KVCache
from attention.edges import chosen_block_edges
from attention.kernels import BACKENDS, masked_attention
from attention.layer import Attention
from attention.memory import linear_inputs, padded, rope_tables
from attention.registry import MAX_COMPILED_CHUNKS, Setting, refuse_whole_context, register

# each query reads the moba_topk key blocks of moba_block positions scoring best against it, its own block among
# them (at most moba_block * moba_topk keys: paper 000's effective window)
MOBA_BLOCK = Setting("moba_block", int, 128, "moba: the key blocks' length")
MOBA_TOPK = Setting("moba_topk", int, 2, "moba: the blocks each query reads, its own among them")

GATHERED_PER_CALL = 1 << 27  # elements of gathered keys per chunk of queries (512 MiB in float32)


def moba_choose(q, k, q_pos, block: int, topk: int):
    """The blocks each query attends to: (B, H, Tq, topk) block indices, best first, -1 where the query has
    fewer than topk blocks. Keys are at positions 0 .. Tk - 1; q_pos (Tq,) are the queries' positions."""
    B, H, Tq, D = q.shape
    n_blocks = -(-k.shape[2] // block)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # the choice in float32, also under autocast
        keys = F.pad(k.detach().float(), (0, 0, 0, n_blocks * block - k.shape[2]))
        # a partial last block's mean is never compared: it is the own block or a later one of every query
        means = keys.reshape(B, H, n_blocks, block, D).mean(3)
        scores = q.detach().float() @ means.transpose(-1, -2)  # (B, H, Tq, n_blocks)
        own = (q_pos // block)[:, None]
        blocks = torch.arange(n_blocks, device=q.device)
        scores = scores.masked_fill(blocks > own, -math.inf).masked_fill(blocks == own, math.inf)
        best, chosen = scores.topk(min(topk, n_blocks), dim=-1)
        chosen = chosen.masked_fill(best == -math.inf, -1)
        return F.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)


def moba_dense(q, k, v, q_pos, chosen, block, dropout_p=0.0):
    """The reference: all Tq x Tk scores, masked by the chosen blocks."""
    k_pos = torch.arange(k.shape[2], device=q.device)
    mask = chosen_block_edges(q_pos[:, None, None], k_pos[None, :, None], chosen[..., None, :], block).any(-1)
    return masked_attention(q, k, v, mask, fused=False, dropout_p=dropout_p)


def moba_gathered(q, k, v, q_pos, chosen, block, dropout_p=0.0):
    """Each query over the keys of its chosen blocks only: O(Tq c k) scores, never Tq x Tk."""
    B, H, Tq, D = q.shape
    n_blocks = -(-k.shape[2] // block)
    pad = (0, 0, 0, n_blocks * block - k.shape[2])
    key_blocks = F.pad(k, pad).reshape(B, H, n_blocks, block * D)
    value_blocks = F.pad(v, pad).reshape(B, H, n_blocks, block * D)
    rows = query_rows(B, H, chosen.shape[-1], block, D)
    outputs = []
    for start in range(0, Tq, rows):
        part = slice(start, start + rows)
        args = (q[:, :, part], key_blocks, value_blocks, q_pos[part], chosen[:, :, part], block, dropout_p)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            # recomputed in backward: only the chunk's inputs are kept, not its gathered keys and values
            outputs.append(checkpoint(_attend_chosen, *args, use_reentrant=False))
        else:
            outputs.append(_attend_chosen(*args))
    return torch.cat(outputs, dim=2)


def query_rows(batch_size, n_head, topk, block, head_dim) -> int:
    """Queries per chunk of the gathered kernel."""
    return max(1, GATHERED_PER_CALL // (batch_size * n_head * topk * block * head_dim))


def _attend_chosen(q, key_blocks, value_blocks, q_pos, chosen, block, dropout_p):
    B, H, Tq, D = q.shape
    topk = chosen.shape[-1]
    index = chosen.clamp(min=0)
    flat = index.reshape(B, H, Tq * topk, 1).expand(-1, -1, -1, block * D)
    keys = key_blocks.gather(2, flat).view(B, H, Tq, topk * block, D)
    values = value_blocks.gather(2, flat).view(B, H, Tq, topk * block, D)
    k_pos = (index[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)
    mask = chosen_block_edges(q_pos[:, None], k_pos, chosen.repeat_interleave(block, dim=-1), block)
    compute = torch.promote_types(q.dtype, torch.float32)
    # scores and their softmax in float32 also under autocast, which would run the einsums in bf16 (and the
    # float32 minimum below would then overflow)
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.einsum("bhtd,bhtkd->bhtk", q.to(compute), keys.to(compute)) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1) * mask
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        return torch.einsum("bhtk,bhtkd->bhtd", probs, values.to(compute)).to(q.dtype)


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
        if config.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend={config.attn_backend!r}: expected one of {', '.join(BACKENDS)}")
        if config.moba_block < 1 or config.moba_topk < 1:
            raise ValueError(f"moba_block={config.moba_block}, moba_topk={config.moba_topk}: both must be >= 1")
        refuse_whole_context(config, "moba_block", config.moba_block, "one block holds")
        if config.attn_gate:
            raise ValueError("attn_gate is paper 000's gate for its own variants; moba runs without it")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.block, self.topk = config.moba_block, config.moba_topk
        self.kernel = moba_dense if config.attn_backend == "dense" else moba_gathered

    def attend(self, q, k, v, pos, cache, plan=None):
        if cache is not None:
            k, v, _ = cache.update(k, v, pos)
        return self.attend_over(q, k, v, pos, self.kernel)

    def attend_over(self, q, keys, values, pos, kernel=None):
        """Queries at positions pos over the keys at 0 .. len - 1 (a prompt, or decoding over a cache)."""
        chosen = moba_choose(q, keys, pos, self.block, self.topk)
        dropout_p = self.dropout if self.training else 0.0
        return (kernel or moba_dense)(q, keys, values, pos, chosen, self.block, dropout_p)

    def compile_problem(self, seq_len, device, dtype):
        chunks = -(-seq_len // query_rows(1, self.n_head, self.topk, self.block, self.head_dim))
        if chunks <= MAX_COMPILED_CHUNKS:
            return ""
        return (f"moba gathers its chosen blocks in {chunks} chunks of queries at length {seq_len}, and "
                "torch.compile would unroll them: train with compile=False, or a shorter block_size")

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
        edges = sum(computed for computed, _ in self.edge_counts(seq_len))
        block_scores = 2 * self.head_dim * self.n_head * (-(-seq_len // self.block))  # q . every block mean
        return 4 * self.head_dim * edges / seq_len + block_scores

    def saved_activations(self, m, k, B: int, T: int):
        """MoBA (attention/moba.py): the gathered kernel runs each chunk of queries under activation checkpointing,
        so autograd keeps only the chunks' inputs: q (after RoPE; without RoPE a view that keeps all of qkv), the
        keys and values padded to whole blocks (copies, a C each), and the chosen block indices (int64, topk per
        head and position). The gathered keys and values of one chunk (at most 2 GATHERED_PER_CALL elements) exist
        only while that chunk runs or is recomputed, and are not counted. The dense backend is the n x n
        reference: no estimate."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        if self.kernel is not moba_gathered:
            raise ValueError("no memory model for moba's dense reference (n x n scores): use attn_backend=auto")
        saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
        if self.rope_theta is not None:
            saved["q after RoPE"] = a * C * tokens
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        else:
            saved["qkv"] = 3 * a * C * tokens
        saved["k, v padded to whole blocks"] = 2 * a * B * C * padded(T, self.block)
        saved["chosen blocks (int64)"] = 8 * B * H * T * self.topk
        saved["merged heads"] = a * C * tokens
        return saved, a * tokens * 5 * C  # c_attn's and c_proj's outputs, the chunks' joined output
