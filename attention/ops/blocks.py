"""A rule's block structure: which key blocks hold edges of each query block, found from its key_ranges and
allowed() without an n x n mask. The chunked kernel's tiles and FlexAttention's block masks are built from it,
once per rule and length, outside compiled code."""

from __future__ import annotations

import torch

from attention.edges import EdgeRule
from attention.ops.span.spans import stated_spans, states_runs

SPAN_KEYS_PER_GROUP = 1 << 22  # candidate keys per group of query blocks from spans: int32 counts, 16 MiB


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


def block_grid(rule: EdgeRule, n: int, start: int, size: int, key_blocks: torch.Tensor, n_head: int, device,
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


def used_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0, valid: int | None = None):
    """Yields (first query block, their candidate key blocks (g, S), which candidate keys hold an allowed edge
    of some query of the block in any head (g, S size)) over the query blocks of `size` positions, a group of
    blocks at a time. From the rule's spans where it states its key runs (stated_block_spans), else candidates
    come from rule.key_ranges (a rule whose ranges are every earlier key costs O(n^2) time here, once per length,
    never n x n memory)."""
    spans = stated_block_spans(rule, n, n_head, start, valid)
    if spans is not None:
        yield from _span_used_keys(*spans, n, size)
        return
    candidates = candidate_key_blocks(rule, n, size, start)
    heads = n_head if rule.per_head else 1
    for first, last in scan_groups([len(blocks) for blocks in candidates], heads * size * size):
        group = candidates[first:last]
        widest = max(map(len, group), default=1) or 1
        slots = torch.full((len(group), widest), -1, dtype=torch.long)
        for i, blocks in enumerate(group):
            slots[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        grid = block_grid(rule, n, start, size, slots, n_head, "cpu", valid, first)
        grid = grid.any(0) if grid.dim() == 4 else grid  # (g, size, widest size); heads alike: no head axis
        rows = torch.arange(first, first + len(group))[:, None] * size + torch.arange(size)
        grid = grid & (rows < n)[:, :, None]  # padded query rows hold no edge
        yield first, slots, grid.any(1)


SCAN_ENTRIES_PER_GROUP = 1 << 22  # allowed() entries per group of query blocks in the scan: 4 MiB of bools


def scan_groups(widths: list[int], entries_per_slot: int) -> list[tuple[int, int]]:
    """Consecutive query blocks [first, last) whose candidate key blocks (widths) are scanned together, each group
    at most SCAN_ENTRIES_PER_GROUP entries with every block padded to the group's widest: a few wide blocks (a
    Longformer rule's global rows, which attend every key) are scanned in groups of their own, never padding the
    narrow ones to their width."""
    groups, first, widest = [], 0, 0
    for i, width in enumerate(widths):
        wider = max(widest, width, 1)
        if i > first and (i + 1 - first) * wider * entries_per_slot > SCAN_ENTRIES_PER_GROUP:
            groups.append((first, i))
            first, wider = i, max(width, 1)
        widest = wider
    if widths:
        groups.append((first, len(widths)))
    return groups


def stated_block_spans(rule: EdgeRule, n: int, n_head: int, start: int = 0, valid: int | None = None):
    """The rule's spans (lo, hi) (S, n) (attention/ops/span/spans.py) where it states its key runs and its rows are
    runs, over a sequence of its own length (no padding, no key sequence of its own): its block structure then
    comes from them in O(n) per head instead of allowed() over every candidate tile (at n = 32K a sliding window's
    block mask: 14 ms against 0.26 s, one thread). None otherwise."""
    if valid is not None or rule.key_count(n) != n or not states_runs(rule):
        return None
    return stated_spans(rule, n, n_head, start)


def _block_bounds(lo: torch.Tensor, hi: torch.Tensor, n: int, size: int):
    """Spans (S, n) as blocks of `size` rows: lo, hi (S, nb, size) with the rows past n empty (lo = hi = 0), which
    rows are empty, and each block's first and one-past-last key over its rows (n and 0 when it has none)."""
    S, nb = lo.shape[0], -(-n // size)
    lo = torch.nn.functional.pad(lo.long(), (0, nb * size - n)).view(S, nb, size)
    hi = torch.nn.functional.pad(hi.long(), (0, nb * size - n)).view(S, nb, size)
    empty = lo >= hi
    return lo, hi, empty, torch.where(empty, n, lo).amin(-1), torch.where(empty, 0, hi).amax(-1)


def _covered(lo: torch.Tensor, hi: torch.Tensor, empty: torch.Tensor, base: torch.Tensor, width: int) -> torch.Tensor:
    """Which of the positions base .. base + width - 1 of each block some row's [lo, hi) covers: (..., nb, width),
    from a difference array of the rows' runs (lo, hi, empty (..., nb, rows), base (nb,), the runs inside)."""
    counts = torch.zeros(*lo.shape[:-1], width + 1, dtype=torch.int32)
    step = torch.where(empty, 0, 1).to(torch.int32)
    counts.scatter_add_(-1, torch.where(empty, 0, lo - base[:, None]), step)
    counts.scatter_add_(-1, torch.where(empty, 0, hi - base[:, None]), -step)
    return counts.cumsum(-1, dtype=torch.int32)[..., :width] > 0


def _span_used_keys(lo: torch.Tensor, hi: torch.Tensor, n: int, size: int):
    """used_keys from spans (S, n): each query block's candidates are the key blocks from its first key to its
    last (over its rows and heads), its used keys those some row's span covers, SPAN_KEYS_PER_GROUP candidate
    keys at a time."""
    lo, hi, empty, first, end = _block_bounds(lo, hi, n, size)
    first, end = first.amin(0), end.amax(0)  # over heads
    first_block = torch.where(end > 0, first // size, 0)
    blocks = torch.where(end > 0, (end - 1) // size - first_block + 1, 0)
    widest = max(1, int(blocks.max()))
    slots = first_block[:, None] + torch.arange(widest)
    slots = torch.where(torch.arange(widest) < blocks[:, None], slots, -1)
    lo, hi, empty = (t.transpose(0, 1).reshape(len(slots), -1) for t in (lo, hi, empty))  # (nb, S size): any head
    per_group = max(1, SPAN_KEYS_PER_GROUP // (widest * size))
    for first_row in range(0, len(slots), per_group):
        rows = slice(first_row, first_row + per_group)
        used = _covered(lo[rows], hi[rows], empty[rows], first_block[rows] * size, widest * size)
        yield first_row, slots[rows], used & (slots[rows] >= 0).repeat_interleave(size, 1)


def span_tiles(lo: torch.Tensor, hi: torch.Tensor, n: int, size: int, key_blocks: torch.Tensor):
    """Per head, whether some allowed edge and whether every entry is allowed in each (query block, key block
    slot) tile of `size` x `size` (S, nb, K), from spans (S, n) and each query block's key blocks (nb, K), -1 for
    none (ascending): what allowed() over the tiles gives (block_grid), rows and keys past n never allowed."""
    lo, hi, empty, _, _ = _block_bounds(lo, hi, n, size)
    base = key_blocks[:, 0].clamp(min=0)
    width = max(1, int((key_blocks - base[:, None]).max()) + 1)
    block_lo, block_hi = lo // size, torch.where(empty, 0, (hi - 1) // size + 1)
    covered = _covered(block_lo, block_hi, empty, base, width)  # (S, nb, width) key blocks some row reaches
    slot = (key_blocks - base[:, None]).clamp(min=0).expand(lo.shape[0], -1, -1)
    present = key_blocks >= 0
    some = covered.gather(-1, slot) & present
    # every row of the block, each inside the sequence, attends every key of the key block
    full_from = torch.where(empty, n, -(-lo // size)).amax(-1)  # (S, nb): the first key block all rows cover
    full_to = torch.where(empty, 0, hi // size).amin(-1)
    every = (key_blocks >= full_from[..., None]) & (key_blocks < full_to[..., None]) & present
    return some, every


def padded_rows(rows: list[list[int]], fill: int) -> torch.Tensor:
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
    for _, slots, used in used_keys(rule, n, size, n_head, start, valid):
        used = used.view(len(slots), -1, size).any(-1)  # (g, S)
        kept += [slots[i][used[i]].tolist() for i in range(len(slots))]
    return padded_rows(kept, -1).to(device)


def edge_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0) -> list[list[int]]:
    """For each query block of `size` positions, the sorted key positions (from start, inside the sequence)
    with an allowed edge of some query of the block in any head: the compacted tiles' keys."""
    keys = []
    for _, slots, used in used_keys(rule, n, size, n_head, start):
        positions = (slots[:, :, None] * size + torch.arange(size)).flatten(1)
        keys += [positions[i][used[i]].tolist() for i in range(len(slots))]
    return keys


def refuse_while_compiling(what: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{what} would be built inside a compiled graph (at every forward of every layer): plan "
                           "attention outside compiled code (GPT.forward does, through Mixer.plan) and pass the plan in")
