"""FlexAttention's block masks of a rule: from its block structure (attention/ops/blocks.py) for a static rule,
from its band for one drawn per forward, with the rule's mask_mod (shifted to a start, or over a padded length);
a rule's block mask narrowed to a batch's documents; and the compacted key order that reads sparsely attended
keys from a prefix of copies."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.edges import EdgeRule
from attention.ops.blocks import block_grid, used_keys, block_structure, span_tiles, stated_block_spans

FLEX_BLOCK = 128  # FlexAttention's default block size
SPARSE_KEYS = 16  # a key block of which a query block attends at most this many keys is read from the prefix


def flex_block_mask(rule: EdgeRule, n: int, n_head: int | None, device: str, start: int = 0, valid: int | None = None):
    """The block mask of a rule at one length. A static rule's is built once and shared by every layer using
    it; a per-forward rule (a permutation) gets the block structure of its band, which depends only on the
    length and the band, with the rule's mask_mod evaluated inside every block of it. valid < n: positions
    valid.. are padding (no key there is allowed; see flex)."""
    if rule.static:
        return _static_block_mask(rule, n, n_head, device, start, valid)
    if rule.lookback is None:
        raise ValueError(f"{type(rule).__name__} is drawn per forward and unbounded: flex needs a banded layout")
    if valid is not None:
        raise ValueError("a rule drawn per forward is not padded: plan it at its own length")
    from torch.nn.attention.flex_attention import BlockMask

    kv_num_blocks, kv_indices = _band_blocks(n, rule.lookback, rule.lookahead, device)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_shifted_mask_mod(rule, start), seq_lengths=(n, n))


def _shifted_mask_mod(rule, start):
    mask_mod = rule.mask_mod()
    return mask_mod if start == 0 else (lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + start, kv_idx + start))


def _padded_mask_mod(mask_mod, valid: torch.Tensor):
    """mask_mod over the first `valid` positions of a padded sequence: no key at or past valid, and positions
    clamped into the sequence before the rule sees them (rules may index tensors by position). valid is a
    0-d tensor, not a python int, so compiled flex treats every length alike instead of recompiling for each."""
    def padded(b, h, q_idx, kv_idx):
        last = valid - 1
        return (kv_idx < valid) & mask_mod(b, h, torch.minimum(q_idx, last), torch.minimum(kv_idx, last))
    return padded


@functools.lru_cache(maxsize=64)
def _static_block_mask(rule, n, n_head, device, start, valid=None):
    """The block mask from the rule's block structure (block_structure: each query block's key blocks that hold
    an allowed edge, found from rule.key_ranges), each block marked full or partial from allowed() over its
    tile, or from the rows' spans for a rule that states its key runs (span_tiles): O(edges) memory, never the
    n x n mask that eager create_block_mask materialises (~11 bytes per element: 716 MiB at n = 8192)."""
    from torch.nn.attention.flex_attention import BlockMask

    size = FLEX_BLOCK
    n_blocks, kv_blocks = -(-n // size), -(-rule.key_count(n) // size)
    key_blocks = block_structure(rule, n, size, n_head or 1, "cpu", start, valid)  # (nb, S), -1: none
    heads = n_head if rule.per_head else 1
    spans = stated_block_spans(rule, n, n_head or 1, start, valid)
    if spans is not None:  # the tiles' any and all from the rows' spans, not allowed() over every tile
        some, every = (t.expand(heads, *t.shape[1:]) for t in span_tiles(*spans, n, size, key_blocks))
        partial, full = [some & ~every], [every]
    else:
        partial, full = [], []
        per_group = max(1, (1 << 24) // (heads * size * key_blocks.shape[1] * size))
        for first in range(0, n_blocks, per_group):
            slots = key_blocks[first:first + per_group]
            grid = block_grid(rule, n, start, size, slots, n_head or 1, "cpu", valid, first)
            rows = (first + torch.arange(len(slots)))[:, None] * size + torch.arange(size)
            grid = grid & (rows < n)[:, :, None]  # entries past the length count as not allowed, as create_block_mask's
            grid = grid.expand(heads, *grid.shape[-3:]).reshape(heads, len(slots), size, slots.shape[1], size)
            present = (slots >= 0)[None]
            partial.append(grid.any(-1).any(-2) & ~grid.all(-1).all(-2) & present)
            full.append(grid.all(-1).all(-2) & present)

    def as_kv_blocks(present):  # (heads, nb, S) -> counts (1, heads, nb), indices (1, heads, nb, kv blocks)
        index = key_blocks.expand_as(present)
        order = torch.where(present, index, 3 * kv_blocks + index).argsort(dim=-1, stable=True)  # present first
        indices = index.gather(-1, order).clamp(0, kv_blocks - 1)
        pad = indices.new_zeros(*indices.shape[:-1], max(0, kv_blocks - indices.shape[-1]))
        indices = torch.cat([indices, pad], -1)[..., :kv_blocks]
        to = lambda t: t.to(device=device, dtype=torch.int32)[None].contiguous()  # noqa: E731
        return to(present.sum(-1)), to(indices)

    kv_num, kv_idx = as_kv_blocks(torch.cat(partial, 1))
    full_num, full_idx = as_kv_blocks(torch.cat(full, 1))
    mask_mod = _shifted_mask_mod(rule, start)
    if valid is not None:
        mask_mod = _padded_mask_mod(mask_mod, torch.tensor(valid, device=device))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=size, mask_mod=mask_mod,
                                    seq_lengths=(n, rule.key_count(n)))


def document_block_mask(block_mask, docs: torch.Tensor, key_docs: torch.Tensor | None = None):
    """A rule's block mask (batch 1) narrowed to a batch's documents: its edges AND same document, one mask per row
    of the batch. docs (B, rows) and key_docs (B, keys; None: docs) say each query row's and key's document
    (attention/documents.py) in the order flex sees them, compared by equality, so any order of rows and keys
    (a layout, a prefix of copied keys, stochastic attention's slots) works alike. A key block whose documents
    cannot meet the query block's (their ranges of values are disjoint: in token order, exactly when they share
    none) is dropped, and a full block stays full only where its rows and keys are all one document, so a batch
    computes no more blocks than the rule alone. Built on the device, no host synchronisation: per forward."""
    from torch.nn.attention.flex_attention import BlockMask

    key_docs = docs if key_docs is None else key_docs
    q_size, kv_size = block_mask.BLOCK_SIZE
    q_lo, q_hi = (t[:, None, :, None] for t in _block_range(docs, q_size))  # (B, 1, query blocks, 1)
    k_lo, k_hi = _block_range(key_docs, kv_size)  # (B, kv blocks)
    kv_blocks = block_mask.kv_indices.shape[-1]

    def narrowed(num_blocks, indices):
        """Which listed blocks meet the query block's documents, and which lie in the one document of its rows."""
        present = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        at = indices.long().expand(len(docs), *indices.shape[1:])
        lo = k_lo[:, None, None, :].expand(*at.shape[:-1], kv_blocks).gather(-1, at)
        hi = k_hi[:, None, None, :].expand(*at.shape[:-1], kv_blocks).gather(-1, at)
        meets = present & (q_lo <= hi) & (lo <= q_hi)
        return at, meets, meets & (lo == hi) & (q_lo == q_hi) & (lo == q_lo)

    def listed(keep, indices):  # the kept blocks first, in their order, as kv_num_blocks and kv_indices
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :kv_blocks]
        return keep.sum(-1, dtype=torch.int32), indices.gather(-1, order).to(torch.int32).contiguous()

    indices, meets, _ = narrowed(block_mask.kv_num_blocks, block_mask.kv_indices)
    full_num = full_idx = None
    if block_mask.full_kv_num_blocks is not None:
        full_indices, full_meets, one_document = narrowed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        full_num, full_idx = listed(one_document, full_indices)
        indices, meets = torch.cat([indices, full_indices], -1), torch.cat([meets, full_meets & ~one_document], -1)
    kv_num, kv_idx = listed(meets, indices)
    rule_mod = block_mask.mask_mod

    def same_document(b, h, q_idx, kv_idx):
        return rule_mod(b, h, q_idx, kv_idx) & (docs[b, q_idx] == key_docs[b, kv_idx])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                    mask_mod=same_document, seq_lengths=block_mask.seq_lengths)


def _block_range(docs: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest docs value of every block of `size` columns (the last one may be short): (B, blocks)."""
    pad = -docs.shape[1] % size
    extreme = torch.iinfo(docs.dtype).max
    lowest = F.pad(docs, (0, pad), value=extreme).unflatten(1, (-1, size)).amin(-1)
    highest = F.pad(docs, (0, pad), value=-extreme).unflatten(1, (-1, size)).amax(-1)
    return lowest, highest


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


@dataclass(eq=False)
class KeyPrefix:
    """FlexAttention's compacted key order (KeyPrefixRule): the keys gathered by `index` (the prefix copies,
    -1 padding read as key 0, then every key in order)."""

    prefix_keys: torch.Tensor
    from_prefix: torch.Tensor
    index: torch.Tensor


@functools.lru_cache(maxsize=64)
def key_prefix(rule: EdgeRule, n: int, n_head: int) -> KeyPrefix | None:
    """FlexAttention's compacted order for a static rule: copies of the keys that query blocks attend only
    sparsely in a key block (a summary column's key in every earlier block, sinks) in a prefix of whole
    blocks, when that leaves fewer blocks to compute (a block mask pays for every key block that holds one
    edge); None otherwise. The chunked kernel compacts every chunk's keys exactly instead (ChunkTiles)."""
    if not rule.static:
        return None
    size = FLEX_BLOCK
    nb = -(-n // size)
    copied = torch.zeros(nb, nb, dtype=torch.bool)
    keys = torch.zeros(n, dtype=torch.bool)
    blocks_before = 0
    for first, slots, used in used_keys(rule, n, size, n_head):
        per_block = used.view(len(slots), -1, size)  # (g, S, size)
        counts = per_block.sum(-1)
        blocks_before += int((counts > 0).sum())
        sparse = (counts > 0) & (counts <= SPARSE_KEYS)
        rows = (first + torch.arange(len(slots)))[:, None].expand_as(slots)
        copied[rows[sparse], slots[sparse]] = True
        positions = (slots[:, :, None] * size + torch.arange(size)).clamp(0, n - 1)
        keys[positions[sparse[:, :, None] & per_block]] = True
    count = int(keys.sum())
    if count == 0:
        return None
    padded = -(-count // size) * size
    prefix_keys = torch.full((padded,), -1, dtype=torch.long)
    prefix_keys[:count] = torch.nonzero(keys).flatten()
    blocks_after = blocks_before - int(copied.sum()) + int(copied.any(1).sum()) * (padded // size)
    if blocks_after >= 0.9 * blocks_before:
        return None
    index = torch.cat([prefix_keys.clamp(min=0), torch.arange(n)])
    return KeyPrefix(prefix_keys, copied, index)
