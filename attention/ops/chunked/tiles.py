"""The chunked kernel's tiles of a rule at one length (ChunkTiles): each query chunk's keys as a band of key chunks
or compacted to the keys its edges reach, with their masks, stored in segments of similar widths; and the
calls they run in."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.edges import EdgeRule
from attention.ops.blocks import block_grid, padded_rows, edge_keys

TILE_ROWS_PER_CALL = 16384  # chunked kernel on CPU: batch x heads x query positions per fused call
WIDTH_SPREAD = 1.25  # compacted tiles: a segment's widest chunk at most this many times its narrowest
BAND_SLACK = 1.1  # a band whose tiles hold at most this much more than the compacted keys runs as a band


@dataclass(eq=False)
class ChunkTiles:
    """The block-sparse kernel's tiles over n positions: chunks of `chunk` queries, each over the keys that
    hold an allowed edge of some query of the chunk, in one of two layouts:

        band       (a sliding window's) key_chunks[i] (S of them, -1 outside the sequence) are chunks
                   i - band .. i - band + S - 1: each tile is a slice of the keys, and relative position biases
                   have the same tile everywhere
        compacted  (every other rule) key_index[i] are the positions of the keys chunk i's queries attend, the
                   union of their edges (own block, summary columns, sinks, global tokens), padded with n (a
                   zero row); widths[i] how many are real. Tiles are gathered by index, each group of chunks
                   as wide as its widest chunk

    `segments` are runs of chunks (first, end, mask, closed) whose tiles are stored at one width: a band is one
    segment; compacted chunks are cut where their widths part by more than WIDTH_SPREAD, so that a few wide
    chunks (the rows of global tokens) never widen the others' stored masks (n x n for a rule with a dense row).
    `mask` (s, c, K) or per head (H, s, c, K) are the allowed pairs of a segment's tiles (K = S c or its widest
    chunk), `closed` the pairs the fused softmax kernel masks out (outside the edges, except in rows without any:
    opened everywhere, their outputs are zeroed); `keep` is None when every query has an allowed key, else a 0/1
    factor (n, 1) or (H, n, 1) that zeroes the rows without one."""

    segments: tuple
    chunk: int
    key_chunks: torch.Tensor | None
    band: int | None
    keep: torch.Tensor | None
    key_index: torch.Tensor | None = None
    widths: tuple = ()

    @property
    def n_chunks(self) -> int:
        return self.segments[-1][1]

    @property
    def device(self):
        return self.segments[0][2].device

    @property
    def slots(self) -> int:
        return self.key_chunks.shape[1]

    def tile_mask(self, i0: int, i1: int, width: int, closed: bool = False) -> torch.Tensor:
        """The mask (or closed pairs) of chunks i0..i1 - 1, which lie in one segment, over their first `width`
        keys: (..., i1 - i0, c, width)."""
        for first, end, mask, closed_pairs in self.segments:
            if first <= i0 < end:
                return (closed_pairs if closed else mask)[..., i0 - first:i1 - first, :, :width]
        raise IndexError(f"chunk {i0} is outside the tiles' {self.n_chunks} chunks")

    @property
    def mask(self) -> torch.Tensor:
        """Every chunk's mask, padded to the widest (tests; the kernels read segments)."""
        width = max(m.shape[-1] for _, _, m, _ in self.segments)
        return torch.cat([F.pad(m, (0, width - m.shape[-1])) for _, _, m, _ in self.segments], -3)

    def calls(self, batch_heads: int):
        """Chunks [i0, i1) of each call of at most TILE_ROWS_PER_CALL rows, inside one segment (chunks of similar
        widths: a call's compacted tiles are as wide as its widest chunk)."""
        per_call = max(1, TILE_ROWS_PER_CALL // (batch_heads * self.chunk))  # narrow head groups take more chunks
        for first, end, _, _ in self.segments:
            for i0 in range(first, end, per_call):
                yield i0, min(end, i0 + per_call)

    def scores(self, n: int, heads: int = 1) -> int:
        """Scores the kernel evaluates per head over n queries of a batch of one with `heads` heads (query rows
        past the end not counted; compacted tiles are as wide as each call's widest chunk)."""
        c, nc = self.chunk, self.n_chunks
        rows = [min(c, n - i * c) for i in range(nc)]
        if self.band is not None:
            slots = (self.key_chunks.cpu() >= 0).sum(1).tolist()
            return sum(r * s * c for r, s in zip(rows, slots))
        return sum(sum(rows[i0:i1]) * (max(self.widths[i0:i1]) or 1) for i0, i1 in self.calls(heads))


def _as_band(key_chunks: list[list[int]], nc: int, keys: int, chunk: int) -> tuple[torch.Tensor | None, int | None]:
    """The key chunks as a band when they fit one: every chunk i's key chunks inside i - back .. i + ahead,
    slot j holding chunk i - back + j (-1 outside the sequence), so that tiles are slices of the keys and
    relative position biases have the same tile for every chunk, while the band's keys stay within
    BAND_SLACK of the `keys` compacted tiles would hold (a dilated window's residue classes in their layout:
    the first chunks of a class have no edge in the band's earlier chunks). (None, None) otherwise."""
    back = max((i - row[0] for i, row in enumerate(key_chunks) if row), default=0)
    ahead = max((row[-1] - i for i, row in enumerate(key_chunks) if row), default=0)
    band = torch.arange(nc)[:, None] - back + torch.arange(back + 1 + ahead)
    band = torch.where((band >= 0) & (band < nc), band, -1)
    if int((band >= 0).sum()) * chunk > BAND_SLACK * max(keys, 1):
        return None, None
    return band, back


def chunk_tiles(rule: EdgeRule, n: int, start: int, chunk: int, n_head: int, device) -> ChunkTiles:
    """The block-sparse kernel's tiles of a rule over n positions (uncached: rules drawn per forward use it
    directly). A static rule's are a band when its edges make one, else compacted; a rule drawn per forward
    (sa's permutation) keeps its lookback band without the check for empty blocks (it is planned at every
    forward)."""
    nc = -(-n // chunk)
    index, widths = None, ()
    if rule.static:
        keys = edge_keys(rule, n, chunk, n_head, start)
        chunks_of = [sorted({k // chunk for k in row}) for row in keys]
        key_chunks, band = _as_band(chunks_of, nc, sum(map(len, keys)), chunk)
        if band is None:
            widths = tuple(map(len, keys))
            index = padded_rows(keys, n)
    else:
        band, ahead = -(-rule.lookback // chunk), -(-rule.lookahead // chunk)
        key_chunks = torch.arange(nc)[:, None] - band + torch.arange(band + 1 + ahead)
        key_chunks = torch.where((key_chunks >= 0) & (key_chunks < nc), key_chunks, -1)
    bounds = [(0, nc)] if index is None else width_segments(widths)
    if index is None:
        masks = [block_grid(rule, n, start, chunk, key_chunks, n_head, device)]
    else:
        masks = [_key_grid(rule, n, start, chunk, index[first:end, :max(1, max(widths[first:end]))], n_head, device,
                           first) for first, end in bounds]
    if masks[0].dim() == 4 and all(bool((m == m[:1]).all()) for m in masks):  # per head, the same edges in each
        masks = [m[0] for m in masks]
    segments, has_key = [], []
    for (first, end), mask in zip(bounds, masks):
        # padded queries past the end attend to every key of their tile: their outputs are dropped, and a full
        # row keeps the fused kernels free of empty rows
        q_pos = torch.arange(first, end, device=device)[:, None] * chunk + torch.arange(chunk, device=device)
        mask = mask | (q_pos >= n)[:, :, None]
        segments.append((first, end, mask, ~(mask | ~mask.any(-1, keepdim=True))))
        has_key.append(mask.any(-1))
    has_key = torch.cat(has_key, -2)
    has_key = has_key.reshape(*has_key.shape[:-2], -1)[..., :n, None]  # (n, 1) or (H, n, 1)
    keep = None if bool(has_key.all()) else has_key.to(torch.float32)
    return ChunkTiles(tuple(segments), chunk, None if key_chunks is None else key_chunks.to(device), band, keep,
                      None if index is None else index.to(device), widths)


def width_segments(widths: tuple) -> list[tuple[int, int]]:
    """Runs [first, end) of chunks whose widths stay within WIDTH_SPREAD of each other: compacted tiles are
    stored and computed at their run's widest, never at the widest chunk of the sequence."""
    out, first, low, high = [], 0, None, None
    for i, width in enumerate(widths):
        width = max(1, width)
        if low is not None and max(high, width) > WIDTH_SPREAD * min(low, width):
            out.append((first, i))
            first, low, high = i, width, width
        else:
            low, high = (width, width) if low is None else (min(low, width), max(high, width))
    out.append((first, len(widths)))
    return out


def _key_grid(rule: EdgeRule, n: int, start: int, chunk: int, index: torch.Tensor, n_head: int, device,
              first: int = 0):
    """allowed() of query chunks first, first + 1, ... against their compacted keys index (g, K), n for padding:
    (g, c, K), or per head (H, g, c, K)."""
    nc = index.shape[0]
    q = torch.arange(first, first + nc, device=device)[:, None] * chunk + torch.arange(chunk, device=device)
    k = index.to(device)
    h = torch.arange(n_head, device=device)[:, None, None, None] if rule.per_head else None
    last = n - 1
    allowed = rule.allowed(q.clamp(max=last)[:, :, None] + start, k.clamp(max=last)[:, None, :] + start, h)
    return allowed & (k < n)[:, None, :]


cached_chunk_tiles = functools.lru_cache(maxsize=64)(chunk_tiles)
