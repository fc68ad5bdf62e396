"""Edge rules: the one definition of each attention variant.

An edge rule says which key positions k a query at position q may attend to (per head h when the rule
varies across heads): `allowed(q, k, h)` over broadcastable integer tensors. Everything else is derived from
that single predicate, never written again:

    dense_mask(positions)      the reference mask of the dense backend and of cached decoding
    mask_mod()                 FlexAttention's mask_mod(b, h, q_idx, kv_idx) for block masks
    the block-sparse tiles     attention/ops/blocks.py evaluates allowed() on each query block's candidate key
                               blocks (the chunked kernel's tiles, FlexAttention's block masks)
    count_edges(n)             score accounting (scripts/mask_stats.py)

Besides the predicate a rule states `lookback`, the largest q - k it allows (None when unbounded),
`lookahead`, the largest k - q (0 for causal rules), and `key_ranges(q_lo, q_hi)`, the key positions where
the queries of a block may have edges (by default the band the lookback and lookahead give, or every earlier
key when the lookback is unbounded; a rule with a few far keys, such as global tokens, names them). A rule may
also state its keys as runs of positions (`key_runs`: a window's [q - w + 1, q + 1)), which planning and edge
counts then take in closed form instead of scanning allowed(). They only size things (where the kernels look
for edges, the rolling KV cache, the spans of span attention) and tests check them against the predicate; the
kernels then keep only the keys that hold an allowed edge, in the layout the edges call for
(attention/layouts.py), so a rule costs what its edges cost, written with these or as allowed() alone.
Rules are frozen dataclasses, so they are hashable: block masks and edge counts are cached per rule. Rules
drawn afresh at every forward (stochastic attention's permutations) are `static = False`: kernels build
their masks per call instead of caching them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EdgeRule:
    lookback = None  # largest q - k with an allowed edge; None: unbounded (full causal)
    lookahead = 0  # largest k - q (positive only for rules over permuted slots, where later slots can be
    #                earlier tokens); the chunked kernel's key band extends this far past each chunk
    per_head = False  # True when allowed() depends on the head index
    static = True  # False for rules holding per-forward state (a permutation): never cached by kernels

    def allowed(self, q: torch.Tensor, k: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def key_ranges(self, q_lo: int, q_hi: int) -> list[tuple[int, int]]:
        """Key positions [lo, hi) (several ranges, possibly overlapping or reaching outside the sequence) that
        hold every allowed edge of the queries at positions q_lo .. q_hi - 1. The kernels look for edges only
        there: the band of lookback and lookahead by default, every earlier key when the lookback is unbounded
        (correct for any rule, and then its plan costs O(n^2) time once per length: a rule with a few far keys
        says which)."""
        lo = 0 if self.lookback is None else q_lo - self.lookback
        return [(lo, q_hi + self.lookahead)]

    def key_runs(self, q: torch.Tensor, h: torch.Tensor | None = None) -> list | None:
        """For rules that state their layout: the keys query positions q (of heads h, as allowed() takes them)
        attend as runs of positions [lo, hi), a list of (lo, hi) tensors broadcast against q and h whose union is
        exactly the keys allowed() admits (not cropped to the sequence; a run with lo >= hi is empty). Span
        attention's spans, the block structures and FlexAttention block masks of rules whose rows are runs, the
        residue survey and the edge counts are then computed from them in O(n) instead of a scan of allowed()
        over every candidate key (tests/test_planning.py checks them against that scan for every rule of the
        registry). None (the default): found by the scan."""
        return None

    def head_groups(self):
        """For per-head rules made of plain rules: [(head indices, rule)] so kernels can run each group at its
        own cost (the chunked kernel's band is set by the largest lookback it serves). None otherwise."""
        return None

    def head_windows(self, n_head: int) -> list[int] | None:
        """The window of each head, for rules that are sliding windows (summed-window cost accounting)."""
        return None

    def key_count(self, n: int) -> int:
        """The keys of a sequence of n queries: n, except for rules over a key sequence of their own (FlexAttention's
        key prefix, attention/layouts.py: KeyPrefixRule)."""
        return n

    def residue_classes(self, n_head: int) -> list[int] | None:
        """Per head, a d dividing every allowed offset q - k (a dilated window's dilation), when the rule
        states its layout: the kernels then run each residue class mod d as a sequence of its own
        (attention/layouts.py). None (the default): found from allowed() by a scan of the edges."""
        return None

    def window_tiles(self, n: int):
        """For rules whose edges fall into disjoint windows, each a run of query rows over a run of keys:
        (first row of each window, first key of each window, rows per window, keys per window), for the
        windows with a row in [0, n) (tensors of shape (J,) and two ints). The window kernel computes exactly
        these tiles, masked by allowed(); None for other rules."""
        return None

    def chunk_size(self) -> int:
        """The query chunk of the chunked kernel: small enough to waste little on masked-out tile entries,
        large enough for efficient matmuls (128 measured best for w=256 on CPU, see docs/benchmarks.md). A rule
        with far keys (unbounded lookback: global tokens, sinks, summary columns) runs compacted tiles, where a
        far key costs itself rather than a key chunk: 128 (a window of 256 plus 4 sinks: 418 ms against 437 ms
        with 64, n = 8K, one thread)."""
        if self.lookback is None:
            return 128
        return max(16, min(128, _pow2_floor(max(1, (self.lookback + 1) // 2))))

    # ---- derived from allowed() -------------------------------------------------------------------------
    def dense_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor | None = None, n_head: int | None = None):
        """Boolean mask (Tq, Tk), or (H, Tq, Tk) for per-head rules, of allowed (query, key) pairs."""
        k_pos = q_pos if k_pos is None else k_pos
        if self.per_head:
            h = torch.arange(n_head, device=q_pos.device)[:, None, None]
            return self.allowed(q_pos[None, :, None], k_pos[None, None, :], h)
        return self.allowed(q_pos[:, None], k_pos[None, :])

    def mask_mod(self):
        """FlexAttention mask_mod over absolute positions q_idx, kv_idx."""
        if self.per_head:
            return lambda b, h, q_idx, kv_idx: self.allowed(q_idx, kv_idx, h)
        return lambda b, h, q_idx, kv_idx: self.allowed(q_idx, kv_idx)

    def count_edges(self, n: int, head: int = 0) -> int:
        """Number of allowed (query, key) pairs in a sequence of n tokens (for one head)."""
        return _count_edges(self, n, head)


@functools.lru_cache(maxsize=256)
def _count_edges(rule: EdgeRule, n: int, head: int) -> int:
    """The sizes of the rule's key_runs where it states them (O(n)); else rows in blocks, each against the keys
    its key_ranges name (each key once): O(edges) for rules that name their keys, never an n x n tensor."""
    h = torch.tensor(head) if rule.per_head else None
    runs = rule.key_runs(torch.arange(n), h)
    if runs is not None:
        return int(union_of_runs(runs, 0, n)[2].sum())
    return sum(int(allowed.sum()) for _, _, allowed in edge_blocks(rule, n, h))


def union_of_runs(runs: list, lo_bound: int, hi_bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query, the union of its key runs ([(lo, hi), ...] as key_runs gives them) cropped to keys lo_bound ..
    hi_bound - 1: (its first key, one past its last key, its size), lo = hi = lo_bound where it is empty. The union
    is one run exactly where size == hi - lo. The runs are swept in order of their first keys, elementwise over
    the few runs of a rule (a sort or reduction over the runs' axis is a strided pass, 10-50x slower)."""
    runs = [(torch.as_tensor(lo), torch.as_tensor(hi)) for lo, hi in runs]
    shape = torch.broadcast_shapes(*(t.shape for run in runs for t in run))
    if len(runs) == 1:
        lo, hi = runs[0][0].expand(shape).clamp(lo_bound, hi_bound), runs[0][1].expand(shape).clamp(lo_bound, hi_bound)
        empty = lo >= hi
        return torch.where(empty, lo_bound, lo), torch.where(empty, lo_bound, hi), (hi - lo).clamp_(min=0)
    firsts, ends = [], []
    for lo, hi in runs:  # an empty run becomes [hi_bound, lo_bound): last in order, and it adds nothing
        lo, hi = lo.expand(shape).clamp(lo_bound, hi_bound), hi.expand(shape).clamp(lo_bound, hi_bound)
        empty = lo >= hi
        firsts.append(torch.where(empty, hi_bound, lo))
        ends.append(torch.where(empty, lo_bound, hi))
    for sweep in range(len(runs) - 1):  # compare-and-swap passes: in order of first keys
        for r in range(len(runs) - 1 - sweep):
            a, b, swap = firsts[r], firsts[r + 1], firsts[r + 1] < firsts[r]
            firsts[r], firsts[r + 1] = torch.minimum(a, b), torch.maximum(a, b)
            ends[r], ends[r + 1] = torch.where(swap, ends[r + 1], ends[r]), torch.where(swap, ends[r], ends[r + 1])
    size = torch.zeros(shape, dtype=torch.long)
    reach = torch.full(shape, lo_bound, dtype=torch.long)  # one past the last key of the runs swept so far
    for first, end in zip(firsts, ends):
        size += (end - torch.maximum(first, reach)).clamp(min=0)
        reach = torch.maximum(reach, end)
    return torch.where(size > 0, firsts[0], lo_bound), reach, size


def edge_blocks(rule: EdgeRule, n: int, h=None, start: int = 0, rows: int = 256):
    """allowed() of the n queries at positions start.. in blocks of `rows`, each against the candidate keys its
    key_ranges name among the n keys at the same positions: yields (first row, key positions (K,), allowed (rows,
    K), or per head (H, rows, K) for h a (H, 1, 1) tensor). The scans that count, bound or lay out a rule's edges
    read them so: O(edges) for rules that name their keys, never an n x n tensor."""
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        keys = candidate_keys(rule, start + r0, start + r1, start + n)
        keys = keys[keys >= start]
        q = torch.arange(start + r0, start + r1)
        yield r0, keys, rule.allowed(q[:, None], keys[None, :], h)


def candidate_keys(rule: EdgeRule, q_lo: int, q_hi: int, n: int) -> torch.Tensor:
    """The key positions inside [0, n) that rule.key_ranges names for queries q_lo .. q_hi - 1, each once, in
    order (the ranges merged: O(keys named), not O(n), per block of queries)."""
    merged = []
    for lo, hi in sorted((max(0, lo), min(n, hi)) for lo, hi in rule.key_ranges(q_lo, q_hi)):
        if lo >= hi:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if not merged:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(lo, hi) for lo, hi in merged])


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


# ---- the rules (torchtitan-style factories: small, composable, reused by every backend) -------------------

@dataclass(frozen=True)
class Causal(EdgeRule):
    """full: every earlier position and the query itself."""

    def allowed(self, q, k, h=None):
        return k <= q

    def key_runs(self, q, h=None):
        return [(torch.zeros_like(q), q + 1)]


def window_edges(q, k, window):
    """The sliding-window edge: the `window` most recent positions including the query, 0 <= q - k < window
    (window an int, or a tensor of per-head windows broadcast against q and k)."""
    return (k <= q) & (q - k < window)


@dataclass(frozen=True)
class SlidingWindow(EdgeRule):
    """swa(w): the w most recent positions including the query itself."""

    window: int = 256

    @property
    def lookback(self):
        return self.window - 1

    def allowed(self, q, k, h=None):
        return window_edges(q, k, self.window)

    def key_runs(self, q, h=None):
        return [(q - self.window + 1, q + 1)]

    def head_windows(self, n_head):
        return [self.window] * n_head


def head_values(values: tuple, h):
    """values[h] for a tensor of head indices h, as a torch.where chain over the runs of equal values (python
    ints only: a tensor built here would be a constant that compiled FlexAttention's mask_mod cannot lower)."""
    out = values[0]
    for head in range(1, len(values)):
        if values[head] != values[head - 1]:
            out = torch.where(h >= head, values[head], out)
    return out


@dataclass(frozen=True)
class HeadWindows(EdgeRule):
    """Sliding windows that differ by head (multi-scale window attention): head h sees windows[h] positions."""

    windows: tuple = (256,)
    per_head = True

    @property
    def lookback(self):
        return max(self.windows) - 1

    def allowed(self, q, k, h=None):
        return window_edges(q, k, head_values(self.windows, h))

    def key_runs(self, q, h=None):
        return [(q - head_values(self.windows, h) + 1, q + 1)]

    def head_groups(self):
        heads_of = {}
        for head, window in enumerate(self.windows):
            heads_of.setdefault(window, []).append(head)
        return [(heads, SlidingWindow(window)) for window, heads in sorted(heads_of.items())]

    def head_windows(self, n_head):
        return list(self.windows)

    def chunk_size(self):
        return SlidingWindow(min(self.windows)).chunk_size()


@dataclass(frozen=True)
class FixedBlock(EdgeRule):
    """block(b): causal attention inside fixed blocks [m b, (m + 1) b)."""

    block: int = 128

    @property
    def lookback(self):
        return self.block - 1

    def allowed(self, q, k, h=None):
        return (k <= q) & (q // self.block == k // self.block)

    def key_runs(self, q, h=None):
        return [(q // self.block * self.block, q + 1)]

    def key_ranges(self, q_lo, q_hi):
        return [(q_lo // self.block * self.block, q_hi)]  # from the first query's block start

    def chunk_size(self):
        if self.block <= 256:
            return self.block
        largest_pow2_divisor = self.block & -self.block
        return min(256, largest_pow2_divisor) if largest_pow2_divisor >= 32 else 128


@dataclass(frozen=True)
class AnyOf(EdgeRule):
    """The union of several rules' edges (an edge allowed by any of them): one softmax over all of them."""

    rules: tuple = ()

    @property
    def lookback(self):
        lookbacks = [rule.lookback for rule in self.rules]
        return None if None in lookbacks else max(lookbacks)

    @property
    def lookahead(self):
        return max(rule.lookahead for rule in self.rules)

    @property
    def per_head(self):
        return any(rule.per_head for rule in self.rules)

    def allowed(self, q, k, h=None):
        allowed = self.rules[0].allowed(q, k, h)
        for rule in self.rules[1:]:
            allowed = allowed | rule.allowed(q, k, h)
        return allowed

    def key_ranges(self, q_lo, q_hi):
        return [r for rule in self.rules for r in rule.key_ranges(q_lo, q_hi)]

    def key_runs(self, q, h=None):
        runs = [rule.key_runs(q, h) for rule in self.rules]
        return None if None in runs else [run for rule_runs in runs for run in rule_runs]

    def chunk_size(self) -> int:
        """With far keys beside local rules (a window plus global keys), the local rules' chunk, at most 64: a
        small window keeps its small chunks (a window of 32 plus 4 global keys: 1.2x faster than chunks of 64)."""
        if self.lookback is not None:
            return super().chunk_size()
        return min([64, *(rule.chunk_size() for rule in self.rules if rule.lookback is not None)])


@dataclass(frozen=True)
class GlobalKeys(EdgeRule):
    """The first `count` positions, seen by every later query (attention sinks, global tokens); combine it with
    a window through AnyOf. Unbounded lookback, but its key_ranges name the few keys, so the kernels cost the
    window plus `count` keys per query."""

    count: int = 4

    def allowed(self, q, k, h=None):
        return (k <= q) & (k < self.count)

    def key_runs(self, q, h=None):
        return [(torch.zeros_like(q), (q + 1).clamp(max=self.count))]

    def key_ranges(self, q_lo, q_hi):
        return [(0, min(self.count, q_hi))]


# ---- boundary bridges (paper 004): causal windows across the boundaries of fixed blocks ------------------

BRIDGE_KINDS = ("bridge", "pbb", "se_bridge")


@dataclass(frozen=True)
class BoundaryWindows(EdgeRule):
    """The bridge path of paper 004 (Sec. 4, Table 1): one causal window per block boundary p = j b, j >= 1.
    Window j has a source interval and a write-back set:

        bridge     sources [p - w/2, p + w/2)    write-back [p - w/2, p + w/2)
        pbb        sources [p - w/2, p + w/2)    write-back [p, p + w/2)           (post-boundary bridge)
        se_bridge  sources [p - b, p + e)        write-back [p, p + e)             (the source-extended block
                                                                                    [s, s + b + e), s = p - b)

    A position in window j's write-back set attends causally to the window's sources: k in [start_j, q].
    Write-back sets never overlap (the settings are checked), so every position gets at most one window and
    positions outside every write-back set have no bridge edges (their bridge output is zero).
    `width` is w for bridge and pbb, e for se_bridge.

    Within the configured context the boundaries are the paper's, j = 1 .. ceil(context / b) - 1: the first
    boundary at or past the context's end (j = last_window + 1) is not one in training, so the bridge kind's
    pre-boundary half of its window is never written back. Past the context every boundary is bridged as in
    training, so a model keeps its trained local structure at any evaluation length. A position's edges
    depend on its position alone, never on how many tokens follow it.
    """

    kind: str = "pbb"
    block: int = 128
    width: int = 128
    context: int = 1024

    @property
    def last_window(self) -> int:
        """The last window inside the configured context."""
        return -(-self.context // self.block) - 1

    @property
    def lookback(self):
        return self.width - 1 if self.kind != "se_bridge" else self.block + self.width - 1

    def source(self, j):
        """[start, end) of window j's sources (j an int or a tensor; not cropped to the sequence)."""
        p = j * self.block
        if self.kind == "se_bridge":
            return p - self.block, p + self.width
        return p - self.width // 2, p + self.width // 2

    def window_of(self, q):
        """The window whose write-back set holds position q (a tensor), 0 where there is none."""
        j, r = q // self.block, q % self.block
        if self.kind == "bridge":  # post-boundary half of window j, pre-boundary half of window j + 1
            half = self.width // 2
            pre = r >= self.block - half
            j = torch.where(r < half, j, torch.where(pre, j + 1, 0))
            j = torch.where(pre & (j == self.last_window + 1), 0, j)  # the context's end is not a boundary
        else:
            j = torch.where(r < (self.width // 2 if self.kind == "pbb" else self.width), j, 0)
        return torch.where(j >= 1, j, 0)

    def _windows(self, n):
        """The windows whose write-back sets start inside [0, n): their indices and sources' [start, end)."""
        j = torch.arange(1, max(self.last_window, -(-n // self.block)) + 1)
        start, end = self.source(j)
        written_from = end - (self.width if self.kind != "pbb" else self.width // 2)
        if self.kind == "bridge":  # only the post-boundary half of window last_window + 1 is written back
            written_from = torch.where(j == self.last_window + 1, j * self.block, written_from)
        inside = written_from < n
        return j[inside], start[inside], end[inside]

    def allowed(self, q, k, h=None):
        j = self.window_of(q)
        return (j >= 1) & (k >= self.source(j)[0]) & (k <= q)

    def key_runs(self, q, h=None):
        j = self.window_of(q)
        return [(torch.where(j >= 1, self.source(j)[0], 0), torch.where(j >= 1, q + 1, 0))]

    def window_tiles(self, n):
        # each window's write-back rows over its sources up to the last row: the bridge path's only scores
        # (rows a window does not write back, the pre-boundary half at the context's end, are masked out)
        _, first_key, end = self._windows(n)
        rows = self.width if self.kind != "pbb" else self.width // 2
        keys = self.width if self.kind != "se_bridge" else self.block + self.width
        return end - rows, first_key, rows, keys  # write-back sets end where the sources do

    def computed_scores(self, n: int) -> int:
        """Scores the branch form computes over n positions: each window's whole causal triangle over its
        sources inside the sequence, before write-back pruning (paper 004's Table 2 accounting)."""
        _, starts, ends = self._windows(n)
        sizes = [min(n, int(end)) - max(0, int(start)) for start, end in zip(starts, ends)]
        return sum(size * (size + 1) // 2 for size in sizes)


# ---- stochastic attention (paper 000): a sliding window over a random permutation ----------------------

def circular_distance(a, b, n):
    """|a - b|_n: distance between slots a and b on a ring of n slots (n None: a line, |a - b|)."""
    if n is None:
        return (a - b).abs()
    d = (a - b) % n
    return torch.minimum(d, n - d)


def in_circular_window(q_slot, k_slot, window, n):
    """Paper 000's circular window N_w (Eq. 3): slots at circular distance < window/2, the query's own included."""
    return 2 * circular_distance(q_slot, k_slot, n) < window


def stochastic_window_edges(q_slot, k_slot, q_pos, k_pos, window, n):
    """The SA edge (paper 000, Eq. 3 and App. B): the key's slot lies in the circular window of the query's
    slot in permuted space, and the key is not after the query in original positions."""
    return (k_pos <= q_pos) & in_circular_window(q_slot, k_slot, window, n)


def stochastic_halo(window: int) -> int:
    """The largest slot distance the circular window admits: distance d is inside iff 2 d < window."""
    return (window - 1) // 2


@dataclass(frozen=True, eq=False)
class StochasticWindow(EdgeRule):
    """sa(w) in original positions, for one permutation: token t sits in slot slot_of[t] (the reference form,
    used by the dense backend and the analysis tools; O(n^2) to evaluate over all pairs)."""

    slot_of: torch.Tensor = None  # (n,) slot of every token
    window: int = 256
    static = False

    def allowed(self, q, k, h=None):
        n = self.slot_of.shape[0]
        return stochastic_window_edges(self.slot_of[q], self.slot_of[k], q, k, self.window, n)


@dataclass(frozen=True, eq=False)
class PermutedWindow(EdgeRule):
    """sa(w) laid out in permuted space, where it is a band: the efficient kernels' form.

    The n slots (slot s holds token order[s]) are extended circularly by `halo` slots at both ends:
    extended slot e holds slot (e - halo) mod n, so the ring is unrolled into a line and the circular window
    becomes the band |e_q - e_k| <= halo. Queries at extended slots halo .. halo + n - 1 are the real ones;
    each finds every slot of its window exactly once inside the band (this needs 2 halo + 1 <= n: below that
    length sa is causal attention). The edge is stochastic_window_edges over the unrolled line, with the
    tokens' original positions, as in StochasticWindow.
    """

    order: torch.Tensor = None  # (n,) token in every slot
    window: int = 256
    static = False

    def __post_init__(self):
        # the original position of the token at every extended slot (the gather index of the layout)
        object.__setattr__(self, "token", self.order[self.extended_slots()])

    @property
    def halo(self):
        return stochastic_halo(self.window)

    @property
    def lookback(self):
        return self.halo

    @property
    def lookahead(self):
        return self.halo

    def extended_slots(self) -> torch.Tensor:
        """The slot held by every extended position."""
        n = self.order.shape[0]
        return (torch.arange(n + 2 * self.halo, device=self.order.device) - self.halo) % n

    def allowed(self, q, k, h=None):
        return stochastic_window_edges(q, k, self.token[q], self.token[k], self.window, None)


# ---- MoBA (Lu et al. 2025): each query's own choice of key blocks --------------------------------------

def chosen_block_edges(q_pos, k_pos, chosen, block):
    """The MoBA edge: the key lies in one of the blocks of `block` positions that the query chose (block
    indices broadcast against k_pos // block; -1 chooses none) and is not after the query. The choice is
    data-dependent (attention/moba.py: moba_choose), so MoBA has no static rule: its dense reference and its
    blockwise kernel both evaluate this predicate."""
    return (k_pos <= q_pos) & (k_pos // block == chosen)
