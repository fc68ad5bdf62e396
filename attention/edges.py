"""Edge rules: the one definition of each attention variant, and the machinery every rule shares (the generic rules
are here; a paper's own rules live beside its variant: bridge.py, stochastic.py, ops/moba/naive.py).

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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "allowed" in cls.__dict__:
            cls.allowed = with_head_axis(cls.__dict__["allowed"])

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
        over every candidate key (tests/ops/test_planning.py checks them against that scan for every rule of the
        registry). None (the default): found by the scan."""
        return None

    def head_groups(self):
        """For per-head rules made of plain rules: [(head indices, rule)], the rule a group of heads runs (its heads
        indexed from 0), so that a group runs at its own cost (the chunked kernel's band is set by the largest
        lookback it serves). The kernels group heads by their edges, from allowed(); a stated rule is taken for a
        group of exactly its heads where it has their edges (attention/layouts.py: edge_head_groups), and is never
        asked for groups of its own. None otherwise."""
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

    def translation_invariant(self, n_head: int = 1) -> bool:
        """Whether the edges depend on q - k alone (causal, windows, per-head windows), so that a document's edges
        are the same wherever it starts: the edges over a stretch against the same stretch moved by a few offsets
        (a stretch of twice the lookback, so that block boundaries show in it)."""
        span = max(64, 2 * (self.lookback + 1)) if self.lookback is not None else 64
        pos = torch.arange(span)
        edges = self.dense_mask(pos, n_head=n_head)
        return all(torch.equal(edges, self.dense_mask(pos + shift, n_head=n_head))
                   for shift in (1, span // 2 + 1, 3 * span + 5))

    def mask_mod(self):
        """FlexAttention mask_mod over absolute positions q_idx, kv_idx."""
        if self.per_head:
            return lambda b, h, q_idx, kv_idx: self.allowed(q_idx, kv_idx, h)
        return lambda b, h, q_idx, kv_idx: self.allowed(q_idx, kv_idx)

    def count_edges(self, n: int, head: int = 0) -> int:
        """Number of allowed (query, key) pairs in a sequence of n tokens (for one head)."""
        return _count_edges(self, n, head)


def with_head_axis(allowed):
    """allowed() whose result always has the shape of q, k and h broadcast together: a per-head rule may leave the
    head axis out where its heads agree (head_values gives a plain int when every head's value is the same), and
    every kernel, scan and mask still reads one value per head (a view: no copy)."""
    @functools.wraps(allowed)
    def allowed_per_head(self, q, k, h=None):
        out = allowed(self, q, k, h)
        if not isinstance(h, torch.Tensor) or not isinstance(out, torch.Tensor):
            return out
        shape = torch.broadcast_shapes(out.shape, h.shape)
        return out if out.shape == shape else out.expand(shape)
    return allowed_per_head


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
