"""The reference of MoBA (Lu et al. 2025): its edge (chosen_block_edges), the block choice in float32, and attention
under the chosen blocks as explicit (n, n) scores (attn_backend=dense, tests, and the CPU standing in for CUDA).

With packed documents (docs (B, Tq), where each query's document begins: attention/documents.py) a query chooses
among the blocks its document overlaps, scoring each by the mean of the document's keys in it, and attends to the
keys of its document only. Keys are in token order and MoBA is causal, so a query's document holds exactly the
keys from docs[q] to the query: only the block where the document begins can hold keys of another document."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention.documents import keys_in_document
from attention.ops.dense import masked_attention


def chosen_block_edges(q_pos, k_pos, chosen, block):
    """The MoBA edge: the key lies in one of the blocks of `block` positions that the query chose (block
    indices broadcast against k_pos // block; -1 chooses none) and is not after the query. The choice is
    data-dependent (moba_choose, below), so MoBA has no static rule: its dense reference and its blockwise kernel
    both evaluate this predicate."""
    return (k_pos <= q_pos) & (k_pos // block == chosen)


def moba_choose(q, k, q_pos, block: int, topk: int, docs=None):
    """The blocks each query attends to: (B, H, Tq, topk) block indices, best first, -1 where the query has
    fewer than topk blocks. Keys are at positions 0 .. Tk - 1; q_pos (Tq,) are the queries' positions; docs
    (B, Tq): where each query's document begins, for queries at the last Tq positions (a prompt, or new tokens over
    a cache), or None."""
    B, H, Tq, D = q.shape
    n_blocks = -(-k.shape[2] // block)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # the choice in float32, also under autocast
        means = block_means(k, block, docs)
        scores = q.detach().float() @ means.transpose(-1, -2)  # (B, H, Tq, n_blocks)
        own = (q_pos // block)[:, None]
        blocks = torch.arange(n_blocks, device=q.device)
        unseen = blocks > own
        if docs is not None:  # and the blocks before the one where the query's document begins
            unseen = unseen | (blocks < (docs // block)[:, None, :, None])
        scores.masked_fill_(unseen, -math.inf).masked_fill_(blocks == own, math.inf)  # in place: n x n / c
        best, chosen = scores.topk(min(topk, n_blocks), dim=-1)
        chosen = chosen.masked_fill(best == -math.inf, -1)
        return F.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)


def block_means(k, block: int, docs=None):
    """Each block's mean key (B, H, n_blocks, D) in float32, the scores' keys (the Triton choice reads the same
    tensor, so both choose alike to the bit); with docs (B, Tq), document_means. Without documents the means are
    reduced from k as it is, with no float32 copy of it (at 32K a pass over 0.5 GB and a reduction over it); a
    partial last block's mean is never compared (it is the own block or a later one of every query): its keys'
    sum over the block size, as if padded with zeros."""
    B, H, n, D = k.shape
    n_blocks, full = -(-n // block), n // block
    k = k.detach()
    if docs is not None:
        keys = F.pad(k.float(), (0, 0, 0, n_blocks * block - n))
        return document_means(keys, keys.reshape(B, H, n_blocks, block, D).mean(3), docs, n, block)
    means = torch.empty(B, H, n_blocks, D, device=k.device, dtype=torch.float32)
    means[:, :, :full] = k[:, :, :full * block].unflatten(2, (full, block)).mean(3, dtype=torch.float32)
    if full < n_blocks:
        means[:, :, full] = k[:, :, full * block:].float().sum(2) / block
    return means


def document_means(keys, means, docs, n_keys: int, block: int):
    """The blocks' means (B, H, n_blocks, D) over the keys of the document that runs past each block's end: the
    only document whose later queries compare the block (the query's own document; the others end inside it).
    keys (B, H, n_blocks * block, D) in float32, zeros past n_keys; means: their plain means, kept where that
    document covers the block. docs (B, Tq) of the last Tq keys' positions: a key before them lies in the first
    query's document, or in one no query compares."""
    B, H, _, D = keys.shape
    n_blocks = means.shape[2]
    key_docs = torch.cat([docs[:, :1].expand(B, n_keys - docs.shape[1]), docs], 1)
    block_start = torch.arange(n_blocks, device=keys.device) * block
    starts = key_docs[:, (block_start + block - 1).clamp(max=n_keys - 1)] - block_start  # (B, n_blocks), in the block
    inside = torch.arange(block, device=keys.device) >= starts[..., None]
    # zeros, not products, in place of the other document's keys: its values reach no sum
    sums = torch.where(inside[:, None, ..., None], keys.view(B, H, n_blocks, block, D), 0.0).sum(3)
    partial = sums / inside.sum(-1).clamp(min=1)[:, None, :, None]
    return torch.where((starts > 0)[:, None, :, None], partial, means)


def chosen_mask(q_pos, k_len: int, chosen, block: int, docs=None):
    """(B, H, Tq, Tk) boolean: MoBA's edges under the choice (and, given docs, within each query's document)."""
    k_pos = torch.arange(k_len, device=chosen.device)
    mask = chosen_block_edges(q_pos[:, None, None], k_pos[None, :, None], chosen[..., None, :], block).any(-1)
    return mask if docs is None else mask & keys_in_document(docs, k_pos)


def moba_naive(q, k, v, chosen, block: int, docs=None):
    """Softmax attention of queries at 0 .. n - 1 over keys at 0 .. n - 1 under the choice: the output (q's dtype)
    and the log-sum-exp (B, H, n) in float32 or better."""
    n = q.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    mask = chosen_mask(torch.arange(n, device=q.device), k.shape[2], chosen, block, docs)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ v.to(compute)).to(q.dtype), lse.float()


def moba_dense(q, k, v, q_pos, chosen, block, dropout_p=0.0, docs=None):
    """The reference: all Tq x Tk scores, masked by the chosen blocks (and the queries' documents)."""
    return masked_attention(q, k, v, chosen_mask(q_pos, k.shape[2], chosen, block, docs), fused=False,
                            dropout_p=dropout_p)
