"""A rule's block structure: which key blocks hold edges of each query block, found from its key_ranges and
allowed() without an n x n mask. The chunked kernel's tiles and FlexAttention's block masks are built from it,
once per rule and length, outside compiled code."""

from __future__ import annotations

import torch

from attention.edges import EdgeRule


def candidate_key_blocks(rule: EdgeRule, n: int, size: int, start: int = 0) -> list[list[int]]:
    """For each query block of `size` positions (from position start), the key blocks inside the sequence where
    rule.key_ranges says its queries may have edges."""
    candidates, keys = [], rule.key_count(n)
    for i in range(-(-n // size)):
        q_lo, q_hi = start + i * size, start + min(n, (i + 1) * size)
        blocks = set()
        for lo, hi in rule.key_ranges(q_lo, q_hi):
            lo, hi = max(lo, start) - start, min(hi, start + keys) - start
            if lo < hi:
                blocks.update(range(lo // size, (hi - 1) // size + 1))
        candidates.append(sorted(blocks))
    return candidates


def _block_grid(rule: EdgeRule, n: int, start: int, size: int, key_blocks: torch.Tensor, n_head: int, device,
                valid: int | None = None, first: int = 0) -> torch.Tensor:
    """allowed() on every (query block, key block slot) tile: (nb, size, S * size), or per head (H, nb, size,
    S * size), for the query blocks first, first + 1, ... of `size` positions (from position start) and their
    slots key_blocks (nb, S), -1 for none. Keys outside the sequence (or at or past `valid`) are never allowed;
    positions are clamped into it before the rule sees them (rules may index tensors by position)."""
    nb, S = key_blocks.shape
    real = n if valid is None else valid
    q = (first + torch.arange(nb, device=device))[:, None] * size + torch.arange(size, device=device)  # (nb, size)
    offsets = torch.arange(size, device=device)
    k = (key_blocks.to(device)[:, :, None] * size + offsets).flatten(1)  # (nb, S size)
    keys = rule.key_count(real)
    inside = (key_blocks.to(device) >= 0).repeat_interleave(size, 1) & (k >= 0) & (k < keys)
    h = torch.arange(n_head, device=device)[:, None, None, None] if rule.per_head else None
    allowed = rule.allowed(q.clamp(max=real - 1)[:, :, None] + start, k.clamp(0, keys - 1)[:, None, :] + start, h)
    return allowed & inside[:, None, :]


def _used_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0, valid: int | None = None):
    """Yields (first query block, their candidate key blocks (g, S), which candidate keys hold an allowed edge
    of some query of the block in any head (g, S size)) over the query blocks of `size` positions, a group of
    blocks at a time. Candidates come from rule.key_ranges (a rule whose ranges are every earlier key costs
    O(n^2) time here, once per length, never n x n memory)."""
    candidates = candidate_key_blocks(rule, n, size, start)
    widest = max(map(len, candidates), default=1) or 1
    heads = n_head if rule.per_head else 1
    per_group = max(1, (1 << 24) // (heads * size * widest * size))
    for first in range(0, len(candidates), per_group):
        group = candidates[first:first + per_group]
        slots = torch.full((len(group), widest), -1, dtype=torch.long)
        for i, blocks in enumerate(group):
            slots[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        grid = _block_grid(rule, n, start, size, slots, n_head, "cpu", valid, first)
        grid = grid.any(0) if rule.per_head else grid  # (g, size, widest size)
        rows = torch.arange(first, first + len(group))[:, None] * size + torch.arange(size)
        grid = grid & (rows < n)[:, :, None]  # padded query rows hold no edge
        yield first, slots, grid.any(1)


def _padded_rows(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max(map(len, rows), default=1) or 1
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def block_structure(rule: EdgeRule, n: int, size: int, n_head: int, device, start: int = 0,
                    valid: int | None = None) -> torch.Tensor:
    """(nb, S) key blocks per query block of `size` positions that hold at least one allowed edge (in any head),
    -1 for unused slots: FlexAttention's block masks and the chunked kernel's band, O(n S size) memory."""
    kept = []
    for _, slots, used in _used_keys(rule, n, size, n_head, start, valid):
        used = used.view(len(slots), -1, size).any(-1)  # (g, S)
        kept += [slots[i][used[i]].tolist() for i in range(len(slots))]
    return _padded_rows(kept, -1).to(device)


def edge_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0) -> list[list[int]]:
    """For each query block of `size` positions, the sorted key positions (from start, inside the sequence)
    with an allowed edge of some query of the block in any head: the compacted tiles' keys."""
    keys = []
    for _, slots, used in _used_keys(rule, n, size, n_head, start):
        positions = (slots[:, :, None] * size + torch.arange(size)).flatten(1)
        keys += [positions[i][used[i]].tolist() for i in range(len(slots))]
    return keys


def _refuse_while_compiling(what: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{what} would be built inside a compiled graph (at every forward of every layer): plan "
                           "attention outside compiled code (GPT.forward does, through Mixer.plan) and pass the plan in")
