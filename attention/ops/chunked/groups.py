"""A group of the chunked kernel's query chunks, as one call reads and writes them: their query rows, their key
tiles (a band's shifted slices, or gathered by index) and the keys' gradients, their mask and score bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.layouts import Layout, write_rows
from attention.ops.chunked.tiles import ChunkTiles


class TileGroup:
    """Chunks i0..i1 of a block-sparse attention call: their query rows, padded locally, and their keys: for a
    band (slot j of chunk i is chunk i - band + j) shifted slices of the group's keys, padded locally; for
    compacted tiles a gather by index from key_source's layout, as wide as the group's widest chunk (padded
    slots read its zero row)."""

    def __init__(self, i0, i1, n, tiles: ChunkTiles, layout: Layout | None = None):
        self.i0, self.i1, self.n, self.c, self.tiles = i0, i1, n, tiles.chunk, tiles
        self.n_chunks, self.band = tiles.n_chunks, tiles.band
        self.q_lo, self.q_hi = i0 * self.c, min(n, i1 * self.c)
        # tiles over a layout's rows read and write the tokens' tensors through its gather index (a permutation:
        # no halo), instead of whole copies of q, k, v and the output in layout order
        token = None if layout is None else layout.token.to(tiles.device)
        self.layout = layout
        self.q_rows = self._layout_rows(token, self.q_lo, self.q_hi)
        if self.band is None:
            self.width = max(tiles.widths[i0:i1]) or 1
            self.keys = tiles.key_index[i0:i1, :self.width]  # (g, width) rows, n: padding
            self.index = self.keys.flatten()
            if token is not None:
                self.index = torch.cat([token, token.new_full((1,), n)])[self.index]
        else:  # the group's band of key positions, possibly reaching outside the sequence, padded locally
            self.slots = tiles.slots
            self.width = self.slots * self.c
            self.key_chunks = tiles.key_chunks[i0:i1]  # (g, S), -1: outside the sequence
            first, last = (i0 - self.band) * self.c, (i1 - self.band + self.slots - 1) * self.c
            self.k_lo, self.k_hi = max(0, first), min(n, last)
            self.k_pad = (self.k_lo - first, last - self.k_hi)
            self.k_rows = self._layout_rows(token, self.k_lo, self.k_hi)

    def _layout_rows(self, token, lo, hi):
        """How rows lo..hi of the layout are read: None (no layout: a slice), strided pieces (a residue class's
        run: views), or the gather index."""
        if token is None:
            return None
        pieces = self.layout.pieces(lo, hi)
        return pieces if pieces is not None else token[lo:hi]

    @staticmethod
    def padded_rows(x, lo, hi, rows, before, after):
        """x's layout rows lo..hi along dim 2 (a slice, strided views, or a gather through the layout), with
        `before` and `after` zero rows around them: one copy."""
        if rows is None:
            return F.pad(x[:, :, lo:hi], (0, 0, before, after))
        B, H, _, D = x.shape
        out = x.new_empty(B, H, before + (hi - lo) + after, D)
        out[:, :, :before].zero_()
        out[:, :, before + hi - lo:].zero_()
        if isinstance(rows, list):
            first = before
            for start, stop, step, count in rows:
                out[:, :, first:first + count] = x[:, :, start:stop:step]
                first += count
        else:
            out[:, :, before:before + hi - lo] = x.index_select(2, rows)
        return out

    def tile_mask(self, closed: bool = False):
        """The group's part of its tiles' mask (or closed pairs): (..., g, c, width)."""
        return self.tiles.tile_mask(self.i0, self.i1, self.width, closed)

    def query_tiles(self, x):
        B, H, _, D = x.shape
        part = self.padded_rows(x, self.q_lo, self.q_hi, self.q_rows, 0,
                                 (self.i1 - self.i0) * self.c - (self.q_hi - self.q_lo))
        return part.reshape(B * H, self.i1 - self.i0, self.c, D)

    def key_tiles(self, source):
        """key_source's result -> (B * H, g, width, D): every chunk's keys side by side. A band: the group's key
        positions padded locally, each slot a shifted slice; compacted tiles: a gather by index."""
        g, c = self.i1 - self.i0, self.c
        if self.band is not None:
            B, H, _, D = source.shape
            part = self.padded_rows(source, self.k_lo, self.k_hi, self.k_rows, *self.k_pad).reshape(B * H, -1, c, D)
            return torch.cat([part[:, j:j + g] for j in range(self.slots)], dim=2)
        B, H, _, D = source.shape
        return source.index_select(2, self.index).view(B * H, g, self.width, D)

    def accumulate_keys(self, grad, tile_grads):
        """Add the gradients of every tile slot back onto the keys they came from, in key_grad_buffer's layout
        (padded slots onto the zero row, which is dropped)."""
        g, c = self.i1 - self.i0, self.c
        if self.band is not None:
            B, H, _, D = grad.shape
            local = tile_grads.new_zeros(B * H, g + self.slots - 1, c, D, dtype=grad.dtype)
            for j in range(self.slots):  # slot j of chunk i holds band chunk i - i0 + j
                local[:, j:j + g] += tile_grads[:, :, j * c:(j + 1) * c]
            local = local.reshape(B, H, -1, D)
            local = local[:, :, self.k_pad[0]:local.shape[2] - self.k_pad[1]]
            if self.k_rows is None:
                grad[:, :, self.k_lo:self.k_hi] += local
            elif isinstance(self.k_rows, list):
                write_rows(grad, self.k_rows, local, add=True)
            else:
                grad.index_add_(2, self.k_rows, local)
            return
        B, H, _, D = grad.shape
        grad.index_add_(2, self.index, tile_grads.reshape(B, H, g * self.width, D).to(grad.dtype))

    def documents(self, docs):
        """The documents of the group's query rows (B, g, c) and tile keys (B, g, width), from docs (B, n) in the
        order of the call's rows, read through the layout as q, k and v are. Padded rows and key slots read 0,
        which may be a document's own value: harmless, as the rule's mask never lets a real row reach a padded
        key, and padded rows are dropped."""
        B, g = docs.shape[0], self.i1 - self.i0
        rows = docs[:, None, :, None]
        return (self.query_tiles(rows).view(B, g, self.c),
                self.key_tiles(key_source(rows, self.tiles)).view(B, g, self.width))

    def apart(self, docs):
        """Which of the group's (query row, tile key) pairs lie in different documents: (B, 1, g, c, width)."""
        q_docs, k_docs = self.documents(docs)
        return q_docs[:, None, :, :, None] != k_docs[:, None, :, None, :]

    def batch_calls(self, B, docs=None):
        """The fused CPU kernel's calls over the group: (batch rows, the documents apart in them: None, or the
        chunks of one row whose tiles hold two documents (d,) and their pairs apart (d, c, width)). All rows at
        once under the rule's bias, without documents or where every tile lies inside one (found on the host,
        the CPU's way); else one row at a time, whose bias its heads share as they share the rule's (a bias
        over several rows would be copied for every head: at n = 8K, B = 2, 1.11-1.16x the time without documents),
        with the pairs of only the tiles that hold two documents (most tiles lie inside one)."""
        if docs is not None:
            q_docs, k_docs = self.documents(docs)
            ends = torch.cat([q_docs, k_docs], -1)
            mixed = ends.amin(-1) != ends.amax(-1)  # (B, g)
            if bool(mixed.any()):
                calls = []
                for b in range(B):
                    tiles = mixed[b].nonzero().flatten()
                    pairs = q_docs[b, tiles, :, None] != k_docs[b, tiles, None, :]
                    calls.append((slice(b, b + 1), (tiles, pairs) if len(tiles) else None))
                return calls
        return [(slice(0, B), None)]

    def bias(self, dtype, B, score_bias=None, heads=None, start=0, open_empty_rows=True, apart=None):
        """Additive mask of the group: -inf outside the rule's edges, plus score_bias (a ScoreBias) of the given
        heads inside them. For the fused softmax kernel, rows without any allowed key are opened everywhere
        (their outputs are zeroed by the caller). B: laid out as (B * H, ...) tiles; None: (H or 1, ...).
        apart: (chunks, their pairs in different documents) from batch_calls, -inf too (a row they leave without
        a key is -inf throughout: the fused CPU kernel gives it a zero output and no gradient)."""
        closed = self.tile_mask(closed=True) if open_empty_rows else ~self.tile_mask()
        device = closed.device
        if score_bias is None:  # one pass
            bias = torch.where(closed, torch.tensor(float("-inf"), dtype=dtype, device=device),
                               torch.tensor(0.0, dtype=dtype, device=device))
        else:
            bias = self.score_bias(score_bias, heads, start, device).to(dtype).expand(-1, closed.shape[-3], -1, -1)
            bias = bias.masked_fill(closed, float("-inf"))
        if apart is not None:
            tiles, pairs = apart
            bias.index_copy_(-3, tiles, bias.index_select(-3, tiles).masked_fill_(pairs, float("-inf")))
        return bias if B is None else per_batch_head(bias, B)

    def score_bias(self, score_bias, heads, start, device):
        """A ScoreBias over the group's tiles for the given heads: (H, chunks, c, S c), or (H, 1, c, S c) when it
        depends on q - k only (`relative`) and every chunk's slots are its band, so every tile has the same
        offsets."""
        h = torch.arange(heads.start, heads.stop, device=device)[:, None, None, None]  # a range: no host copy
        if score_bias.relative and self.band is not None:
            q_pos = self.band * self.c + torch.arange(self.c, device=device)
            k_pos = torch.arange(self.slots * self.c, device=device)
            return score_bias.bias(h, q_pos[None, :, None], k_pos[None, None, :])
        q_pos, k_pos = self.positions(start, device)
        return score_bias.bias(h, q_pos[:, :, None], k_pos[:, None, :])

    def positions(self, start, device):
        """Absolute positions of the group's query rows (chunks, c) and tile keys (chunks, width); padded slots
        get positions past the end, which no rule's mask allows here."""
        first = start + self.c * torch.arange(self.i0, self.i1, device=device)[:, None]
        if self.band is None:
            keys = self.keys.to(device)
        else:
            chunks = torch.where(self.key_chunks >= 0, self.key_chunks, self.n_chunks).to(device)
            keys = (chunks[:, :, None] * self.c + torch.arange(self.c, device=device)).flatten(1)
        return first + torch.arange(self.c, device=device), start + keys

    def scatter_queries(self, full, tiles):
        B, H, _, D = full.shape
        rows = tiles.reshape(B, H, -1, D)[:, :, :self.q_hi - self.q_lo]
        if self.q_rows is None:
            full[:, :, self.q_lo:self.q_hi] = rows
        elif isinstance(self.q_rows, list):
            write_rows(full, self.q_rows, rows)
        else:
            full.index_copy_(2, self.q_rows, rows)


def tile_groups(n, tiles: ChunkTiles, batch_heads, layout=None):
    """The groups of chunks of calls of at most TILE_ROWS_PER_CALL rows (ChunkTiles.calls)."""
    for i0, i1 in tiles.calls(batch_heads):
        yield TileGroup(i0, i1, n, tiles, layout)


class KeyTiles(torch.autograd.Function):
    """Key (or value) tiles of a TileGroup's chunks, with a backward that adds each tile slot's gradient back
    onto its chunk in place (autograd through the gather would allocate a full-size buffer per slot)."""

    @staticmethod
    def forward(ctx, x, group):
        source = key_source(x, group.tiles)
        ctx.group, ctx.source_shape = group, source.shape
        return group.key_tiles(source)

    @staticmethod
    def backward(ctx, grad_tiles):
        grad = grad_tiles.new_zeros(ctx.source_shape)
        ctx.group.accumulate_keys(grad, grad_tiles)
        return key_grad(grad, ctx.group.tiles), None


def key_source(x, tiles: ChunkTiles):
    """What TileGroup.key_tiles reads for keys or values x (B, H, n, D): x itself for a band (each group of chunks
    pads and copies its own band right before the kernel reads it, while it is in cache: 15% faster on CPU than
    a whole chunked copy made first), else x with one zero row after the end (B, H, n + 1, D), which padded
    key slots read, gathered by index."""
    if tiles.band is not None:
        return x
    B, H, n, D = x.shape
    out = x.new_empty(B, H, n + 1, D)
    out[:, :, n].zero_()
    out[:, :, :n] = x
    return out


def key_grad_buffer(source, tiles: ChunkTiles, dtype=None):
    """Zeros shaped like key_source's result, which TileGroup.accumulate_keys adds into."""
    return torch.zeros_like(source, dtype=dtype)


def key_grad(buffer, tiles: ChunkTiles):
    """The (B, H, n, D) gradient from key_grad_buffer's accumulated buffer."""
    return buffer if tiles.band is not None else buffer[:, :, :-1]


def per_batch_head(mask, B, H=None):
    """A tile mask (nc, c, K), per head (H, nc, c, K) or per batch row (B or 1, H or 1, nc, c, K: documents) in
    the (B * H, nc, c, K) layout of the tiles, broadcast where the layout allows."""
    if mask.dim() == 5:
        return mask[0] if mask.shape[0] == 1 else mask.expand(B, H, *mask.shape[2:]).flatten(0, 1)
    return mask.expand(B, *mask.shape).flatten(0, 1) if mask.dim() == 4 else mask[None]
