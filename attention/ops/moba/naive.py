"""The reference of MoBA (Lu et al. 2025): its edge (chosen_block_edges), the block choice in float32, and attention
under the chosen blocks as explicit (n, n) scores (attn_backend=dense, tests, and the CPU standing in for CUDA)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention.ops.dense import masked_attention


def chosen_block_edges(q_pos, k_pos, chosen, block):
    """The MoBA edge: the key lies in one of the blocks of `block` positions that the query chose (block
    indices broadcast against k_pos // block; -1 chooses none) and is not after the query. The choice is
    data-dependent (moba_choose, below), so MoBA has no static rule: its dense reference and its blockwise kernel
    both evaluate this predicate."""
    return (k_pos <= q_pos) & (k_pos // block == chosen)


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
        scores.masked_fill_(blocks > own, -math.inf).masked_fill_(blocks == own, math.inf)  # in place: n x n / c
        best, chosen = scores.topk(min(topk, n_blocks), dim=-1)
        chosen = chosen.masked_fill(best == -math.inf, -1)
        return F.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)


def chosen_mask(q_pos, k_len: int, chosen, block: int):
    """(B, H, Tq, Tk) boolean: MoBA's edges under the choice."""
    k_pos = torch.arange(k_len, device=chosen.device)
    return chosen_block_edges(q_pos[:, None, None], k_pos[None, :, None], chosen[..., None, :], block).any(-1)


def moba_naive(q, k, v, chosen, block: int):
    """Softmax attention of queries at 0 .. n - 1 over keys at 0 .. n - 1 under the choice: the output (q's dtype)
    and the log-sum-exp (B, H, n) in float32 or better."""
    n = q.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    mask = chosen_mask(torch.arange(n, device=q.device), k.shape[2], chosen, block)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ v.to(compute)).to(q.dtype), lse.float()


def moba_dense(q, k, v, q_pos, chosen, block, dropout_p=0.0):
    """The reference: all Tq x Tk scores, masked by the chosen blocks."""
    return masked_attention(q, k, v, chosen_mask(q_pos, k.shape[2], chosen, block), fused=False, dropout_p=dropout_p)
