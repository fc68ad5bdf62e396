"""Layouts: the token order in which a rule's edges are cheap, found from the rule itself.

A block-sparse kernel pays for every key block that holds an edge. Some rules are only sparse in another
order: a dilated window (offsets 0, d, 2d, ...) touches every block of its span d w, yet each residue class
mod d is a plain sliding window of w keys. A layout is a permutation of the tokens, optionally extended
circularly by `halo` copies at both ends (stochastic attention's unrolled ring), in which the kernels run:

    to_layout(x)      (B, H, n, D) tokens -> (B, H, n + 2 halo, D) layout rows (a gather; its backward is the
                      inverse gather, plus the halo copies added back onto their tokens)
    from_layout(y)    layout rows -> tokens (each token's main copy; backward: the inverse gather into zeros)
    LaidOutRule       the rule over layout rows: allowed(i, j) is the rule's allowed() at their tokens' positions

`layout_groups` finds the layout of a static rule (attention/kernels.py plans with it): per head, the largest
d dividing every allowed offset q - k (`edge_divisors`, one scan of the rule's edges over its key_ranges, once
per length), unless the rule states it (`EdgeRule.residue_classes`). Heads with d > 1 run
their residue classes as sequences of their own (`residue_layout`); heads are grouped by d, each group at its
own cost. Stochastic attention's per-forward permutation (attention/stochastic.py) is a Layout drawn at every
forward. Caches and cached decoding stay in the original order: a layout lives only inside one kernel call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attention.edges import EdgeRule, candidate_keys, edge_blocks, head_values, union_of_runs


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """slot_of[t] = s where order[s] = t."""
    return torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order).contiguous())


@functools.lru_cache(maxsize=64)
def extended_slots(n: int, halo: int, device: str) -> torch.Tensor:
    """The slot at every row of n slots extended circularly by `halo` at both ends: (row - halo) mod n (cached: the
    same for every order, and stochastic attention draws an order per layer and forward)."""
    return (torch.arange(n + 2 * halo, device=device) - halo) % n


@dataclass(eq=False)
class Layout:
    """Slot s holds token order[s]; the slots are extended circularly by `halo` copies at both ends (layout row
    e holds slot (e - halo) mod n), so a layout has n + 2 halo rows and token t's main copy is row
    halo + slot_of[t]."""

    order: torch.Tensor
    halo: int = 0
    # [(first row, end row, first token, step)]: runs of rows holding evenly spaced tokens (a residue class),
    # which kernels read as strided views instead of gathers; None: gather by index
    runs: tuple | None = None

    def __post_init__(self):
        self.slot_of = inverse_permutation(self.order)
        self.slot = extended_slots(self.order.shape[0], self.halo, str(self.order.device))
        self.token = self.order[self.slot]  # the token at every layout row: the gather index

    @property
    def rows(self) -> int:
        return self.token.shape[0]

    def to(self, device) -> Layout:
        if self.order.device == torch.device(device):
            return self
        return Layout(self.order.to(device), self.halo, self.runs)

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int]] | None:
        """Rows lo..hi - 1 as strided runs of tokens [(first token, end, step, rows)], or None without runs."""
        if self.runs is None:
            return None
        out = []
        for first, end, token, step in self.runs:
            a, b = max(lo, first), min(hi, end)
            if a < b:
                start = token + step * (a - first)
                out.append((start, start + step * (b - a - 1) + 1, step, b - a))
        return out


def write_rows(x, pieces, rows, add: bool = False):
    """rows (B, H, r, D) in layout order into (or added onto, add=True) x's tokens of pieces."""
    first = 0
    for lo, hi, step, count in pieces:
        part = rows[:, :, first:first + count]
        if add:
            x[:, :, lo:hi:step] += part
        else:
            x[:, :, lo:hi:step] = part
        first += count


class ToLayout(torch.autograd.Function):
    """Tokens (B, H, n, D) -> layout rows (B, H, n + 2 halo, D). Backward gathers each token's main copy by the
    inverse permutation and adds the halo copies (indexing's generic backward would scatter-add everything
    into a zero-filled buffer)."""

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return x.index_select(2, layout.token)

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        h, n = layout.halo, layout.order.shape[0]
        grad_x = grad.index_select(2, layout.slot_of + h)
        if h:  # the first slots repeated after the end, the last ones before the start
            rows = torch.arange(h, device=grad.device)
            halo_rows = torch.cat([rows, rows + n + h])
            grad_x.index_add_(2, layout.token[halo_rows], grad.index_select(2, halo_rows))
        return grad_x, None


class FromLayout(torch.autograd.Function):
    """Layout rows' outputs -> tokens: token t's output is its main copy's (the halo rows' are unused)."""

    @staticmethod
    def forward(ctx, y, layout):
        ctx.layout, ctx.length = layout, y.shape[2]
        return y.index_select(2, layout.slot_of + layout.halo)

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        h, n = layout.halo, layout.order.shape[0]
        grad_rows = grad.new_zeros(*grad.shape[:2], ctx.length, grad.shape[3])
        grad_rows[:, :, h:h + n] = grad.index_select(2, layout.order)
        return grad_rows, None


def to_layout(x, layout: Layout):
    return ToLayout.apply(x, layout)


def from_layout(y, layout: Layout):
    return FromLayout.apply(y, layout)


def residue_layout(n: int, d: int) -> Layout:
    """The tokens in residue classes mod d, each class in order: r, r + d, r + 2d, ... for r = 0 .. d - 1."""
    classes = [torch.arange(r, n, d) for r in range(min(d, n))]
    runs, first = [], 0
    for r, tokens in enumerate(classes):
        runs.append((first, first + len(tokens), r, d))
        first += len(tokens)
    return Layout(torch.cat(classes), runs=tuple(runs))


@dataclass(frozen=True, eq=False)
class LaidOutRule(EdgeRule):
    """`rule` over the rows of a layout: rows i and j are an edge when the rule allows their tokens. lookback
    and lookahead are over layout rows (for a residue layout, the rule's bounds divided by d: within a class,
    rows are d positions apart, and no edge crosses classes). layout None: the tokens' own order, with the
    bounds a scan of the edges found (a rule written without them)."""

    rule: EdgeRule = None
    layout: Layout | None = None
    lookback: int | None = None
    lookahead: int = 0

    # one object per layout_groups entry (cached): kernels cache its tiles by identity, never by its fields
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def per_head(self):
        return self.rule.per_head

    def allowed(self, q, k, h=None):
        if self.layout is None:
            return self.rule.allowed(q, k, h)
        token = self.layout.token
        if token.device != q.device:
            token = token.to(q.device)
        return self.rule.allowed(token[q], token[k], h)


@dataclass(frozen=True, eq=False)
class KeyPrefixRule(EdgeRule):
    """`rule` over a key sequence with a prefix: key slots 0 .. P - 1 hold copies of the keys `prefix_keys` (P a
    multiple of `block`, padded with -1), slots P .. P + n - 1 every key in order. A (query block, key block)
    pair marked in `from_prefix` (nb x nb) reads its edges from the prefix copies, every other pair from the
    keys in place, so each edge is attended once. FlexAttention's compacted order
    (attention/ops/flex/block_mask.py: key_prefix): the few keys far queries attend (summary columns, sinks)
    cost each query block one block of copies instead of every key block that holds one."""

    rule: EdgeRule = None
    prefix_keys: torch.Tensor = None
    from_prefix: torch.Tensor = None
    block: int = 128

    __eq__ = object.__eq__  # one object per (rule, length): kernels cache its block mask by identity
    __hash__ = object.__hash__

    @property
    def per_head(self):
        return self.rule.per_head

    @property
    def lookahead(self):
        return self.rule.lookahead + self.prefix_keys.shape[0]

    def allowed(self, q, k, h=None):
        prefix, table = self.prefix_keys, self.from_prefix
        if prefix.device != k.device:
            prefix, table = prefix.to(k.device), table.to(k.device)
        P = prefix.shape[0]
        in_prefix = k < P
        key = torch.where(in_prefix, prefix[k.clamp(max=P - 1)], k - P)
        copied = table[q // self.block, key.clamp(min=0) // self.block]
        return torch.where(in_prefix, copied & (key >= 0), ~copied) & self.rule.allowed(q, key.clamp(min=0), h)

    def key_count(self, n):
        return n + self.prefix_keys.shape[0]

    def key_ranges(self, q_lo, q_hi):
        P = self.prefix_keys.shape[0]
        return [(0, P)] + [(lo + P, hi + P) for lo, hi in self.rule.key_ranges(q_lo, q_hi)]


@dataclass(frozen=True)
class HeadSubset(EdgeRule):
    """A per-head rule restricted to some of its heads: local head i is the rule's head heads[i] (kernels
    that run a group of heads at its own cost index heads from 0)."""

    rule: EdgeRule = None
    heads: tuple = ()
    per_head = True

    @property
    def lookback(self):
        return self.rule.lookback

    @property
    def lookahead(self):
        return self.rule.lookahead

    def allowed(self, q, k, h=None):
        return self.rule.allowed(q, k, self._rule_heads(h))

    def key_runs(self, q, h=None):
        return self.rule.key_runs(q, self._rule_heads(h))

    def _rule_heads(self, h):
        heads = head_values(self.heads, h)
        return heads if isinstance(heads, torch.Tensor) else torch.full_like(h, heads)

    def key_ranges(self, q_lo, q_hi):
        return self.rule.key_ranges(q_lo, q_hi)

    def chunk_size(self):
        return self.rule.chunk_size()


@functools.lru_cache(maxsize=64)
def edge_head_groups(rule: EdgeRule, n: int, n_head: int) -> list | None:
    """A per-head rule's heads grouped by their edges over n positions (heads with the same edges together, in
    order of their first head), [(heads, the rule over them)], so that kernels run each group at its own cost; None
    when every head has the same edges. The groups come from allowed() alone (heads_by_edges), once per length.
    head_groups() may only name the rule a group runs (a plain window for heads of one window: its own band and
    chunk): taken where it states a group of the same heads whose rule has their edges (same_edges), else the group
    runs the rule restricted to its heads (HeadSubset). A stated rule is never asked for groups of its own, so
    whatever head_groups() returns (per-head rules whose heads agree, the rule itself over every head, groups or
    rules that disagree with allowed()) plans without recursion, and the plan follows allowed()."""
    if not rule.per_head or n_head < 2 or not rule.static:
        return None
    groups = heads_by_edges(rule, n, n_head)
    if len(groups) == 1:
        return None
    stated = {tuple(sorted(heads)): (tuple(heads), sub_rule) for heads, sub_rule in rule.head_groups() or ()}
    out = []
    for heads in groups:
        named, sub_rule = stated.get(tuple(heads), (None, None))
        if sub_rule is None or not same_edges(HeadSubset(rule, named), sub_rule, n, len(heads)):
            sub_rule = HeadSubset(rule, tuple(heads))
        out.append((heads, sub_rule))
    return out


def heads_by_edges(rule: EdgeRule, n: int, n_head: int) -> list[list[int]]:
    """The heads of a per-head rule in groups with the same edges over n positions, each group in order, the groups
    in order of their first head: in closed form from the rule's key_runs where it states them (O(n) per head and
    group), else from one scan of its edges over its key_ranges (as the kernels' own block scan)."""
    q, h = torch.arange(n), torch.arange(n_head)[:, None]
    runs = rule.key_runs(q, h)
    if runs is not None:
        runs = [tuple(torch.as_tensor(t).expand(n_head, n) for t in run) for run in runs]
        union = union_of_runs(runs, 0, n)
        groups, left = [], list(range(n_head))
        while left:
            first = left[0]
            same = same_keys(runs, union, [(lo[first], hi[first]) for lo, hi in runs], [t[first] for t in union], n)
            same = same.all(-1).tolist()
            groups.append([head for head in left if same[head]])
            left = [head for head in left if not same[head]]
        return groups
    groups = [list(range(n_head))]
    for _, _, allowed in edge_blocks(rule, n, h[:, :, None], rows=SURVEY_BLOCK):
        edges = allowed.expand(n_head, *allowed.shape[-2:]).flatten(1)
        refined = []
        for heads in groups:
            while heads:
                same = (edges[heads] == edges[heads[0]]).all(1).tolist()
                refined.append([head for head, s in zip(heads, same) if s])
                heads = [head for head, s in zip(heads, same) if not s]
        groups = refined
    return sorted(groups)


def same_edges(a: EdgeRule, b: EdgeRule, n: int, n_head: int) -> bool:
    """Whether two rules have the same edges over n positions in each of heads 0 .. n_head - 1 (a rule that does
    not vary by head has its edges in every head): in closed form where both state key_runs, else from a scan of
    both over the keys that either's key_ranges names (each holds its own rule's edges)."""
    q = torch.arange(n)
    runs = [r.key_runs(q, torch.arange(n_head)[:, None] if r.per_head else None) for r in (a, b)]
    if None not in runs:
        return bool(same_keys(runs[0], union_of_runs(runs[0], 0, n), runs[1], union_of_runs(runs[1], 0, n), n).all())
    h = torch.arange(n_head)[:, None, None]
    for q_lo in range(0, n, SURVEY_BLOCK):
        q_hi = min(n, q_lo + SURVEY_BLOCK)
        keys = torch.cat([candidate_keys(a, q_lo, q_hi, n), candidate_keys(b, q_lo, q_hi, n)]).unique()
        rows = torch.arange(q_lo, q_hi)[:, None]
        edges = [r.allowed(rows, keys, h if r.per_head else None).expand(n_head, q_hi - q_lo, len(keys))
                 for r in (a, b)]
        if not torch.equal(*edges):
            return False
    return True


def same_keys(runs_a: list, union_a: tuple, runs_b: list, union_b: tuple, n: int) -> torch.Tensor:
    """Per query (broadcast over the runs' shapes), whether two lists of key runs (as key_runs gives them) hold the
    same keys among 0 .. n - 1, given each list's union_of_runs: by their bounds where every union is one run
    (windows, blocks: two elementwise passes), else as sets, equal where each is as large as their union."""
    (lo_a, hi_a, size_a), (lo_b, hi_b, size_b) = union_a, union_b
    if bool((size_a == hi_a - lo_a).all() and (size_b == hi_b - lo_b).all()):
        return (lo_a == lo_b) & (hi_a == hi_b)
    return (size_a == size_b) & (size_a == union_of_runs(runs_a + runs_b, 0, n)[2])


@dataclass(frozen=True)
class HeadSurvey:
    """What a scan of one head's edges found: the largest d dividing every allowed offset q - k (0: no edge
    at a nonzero offset), and the largest q - k and k - q with an edge."""

    divisor: int
    lookback: int
    lookahead: int


SURVEY_BLOCK = 128


@functools.lru_cache(maxsize=64)
def edge_divisors(rule: EdgeRule, n: int, n_head: int) -> tuple[HeadSurvey, ...]:
    """Per head (one entry for rules that do not vary by head): the offsets' common divisor and bounds over
    n positions, from a scan of query blocks against their key_ranges, as the kernels' own block scan (O(edges)
    for a rule with bounded key ranges; a rule without them costs O(n^2) time once per length, never an n x n
    tensor). Offsets are marked in a (heads, 2n) table; the divisor is their gcd. A rule that states its key_runs
    has them in O(n) per head instead (stated_surveys)."""
    heads = n_head if rule.per_head else 1
    q, h = torch.arange(n), torch.arange(heads)[:, None] if rule.per_head else None
    runs = rule.key_runs(q, h)
    if runs is not None:
        return stated_surveys(runs, q, n, heads)
    present = torch.zeros(heads, 2 * n, dtype=torch.bool)  # offset q - k + n
    h = torch.arange(heads)[:, None, None] if rule.per_head else None
    for q_lo in range(0, n, SURVEY_BLOCK):
        q_hi = min(n, q_lo + SURVEY_BLOCK)
        k = candidate_keys(rule, q_lo, q_hi, n)
        q = torch.arange(q_lo, q_hi)
        head, row, col = rule.allowed(q[:, None], k[None, :], h).expand(heads, len(q), len(k)).nonzero().unbind(1)
        present[head, q[row] - k[col] + n] = True
    surveys = []
    for head in range(heads):
        offsets = (torch.nonzero(present[head]).flatten() - n).tolist()
        if not offsets:
            surveys.append(HeadSurvey(0, 0, 0))
            continue
        surveys.append(HeadSurvey(math.gcd(*map(abs, offsets)), max(0, max(offsets)), max(0, -min(offsets))))
    return tuple(surveys)


def stated_surveys(runs: list, q: torch.Tensor, n: int, heads: int) -> tuple[HeadSurvey, ...]:
    """edge_divisors from key runs (key_runs of queries q = 0 .. n - 1, keys cropped to [0, n)): a run of two keys
    or more holds two consecutive offsets, so its head's divisor is 1; else the divisor is the gcd of the offsets
    of the single keys."""
    runs = [tuple(torch.as_tensor(t).expand(heads, n).clamp(0, n) for t in run) for run in runs]
    back = torch.stack([torch.where(lo < hi, q - lo, -n).amax(-1) for lo, hi in runs], -1).amax(-1)  # largest q - k
    ahead = torch.stack([torch.where(lo < hi, hi - 1 - q, -n).amax(-1) for lo, hi in runs], -1).amax(-1)
    wide = torch.stack([(hi - lo >= 2).any(-1) for lo, hi in runs], -1).any(-1)
    surveys = []
    for head in range(heads):
        if int(back[head]) == -n:  # no edge
            surveys.append(HeadSurvey(0, 0, 0))
            continue
        divisor = 1
        if not bool(wide[head]):
            offsets = torch.cat([torch.where(lo[head] < hi[head], q - lo[head], 0) for lo, hi in runs])
            divisor = math.gcd(*offsets.abs().unique().tolist())
        surveys.append(HeadSurvey(divisor, max(0, int(back[head])), max(0, int(ahead[head]))))
    return tuple(surveys)


WIDE_ROW_FACTOR = 2  # a row is wide when it attends more than this many times the median row's keys
WIDE_ROW_KEYS = 256  # ... and more keys than this
WIDE_ROWS_AT_MOST = 1 / 16  # and wide rows are at most this share of the rows (a few dense rows, not a dense rule)


@functools.lru_cache(maxsize=64)
def wide_rows(rule: EdgeRule, n: int, n_head: int) -> torch.Tensor | None:
    """The few rows that attend far more keys than the others (global tokens: Longformer, BigBird), sorted, or
    None: from a count of every row's keys over the rule's key_ranges, once per length. A tile pays for its
    widest row, so such rows are run apart (wide_rows_layout)."""
    h = torch.arange(n_head)[:, None, None] if rule.per_head else None
    counts = torch.zeros(n, dtype=torch.long)
    for r0, _, allowed in edge_blocks(rule, n, h, rows=SURVEY_BLOCK):
        count = allowed.sum(-1)
        counts[r0:r0 + count.shape[-1]] = count.amax(0) if rule.per_head else count
    typical = int(counts.float().median())
    wide = torch.nonzero(counts > max(WIDE_ROW_KEYS, WIDE_ROW_FACTOR * typical)).flatten()
    if len(wide) == 0 or len(wide) > WIDE_ROWS_AT_MOST * n:
        return None
    return wide


def wide_rows_layout(n: int, wide: torch.Tensor) -> Layout:
    """The tokens in order with the wide rows moved to the end: the other rows keep their neighbours (a window
    stays a band), and the wide rows fill tiles of their own. Runs of consecutive tokens are read as views."""
    kept = torch.ones(n, dtype=torch.bool)
    kept[wide] = False
    order = torch.cat([torch.nonzero(kept).flatten(), wide])
    runs = []
    starts = torch.nonzero(torch.diff(order, prepend=order.new_tensor([-2])) != 1).flatten().tolist() + [n]
    for a, b in zip(starts, starts[1:]):
        runs.append((a, b, int(order[a]), 1))
    return Layout(order, runs=tuple(runs))


@dataclass(frozen=True, eq=False)
class WideRowsLast(EdgeRule):
    """`rule` over wide_rows_layout's rows: the kept tokens in order, then the wide ones. Its key_ranges are the
    rule's, moved onto rows (a range of tokens is a range of kept rows), plus the wide rows at the end."""

    rule: EdgeRule = None
    layout: Layout = None
    wide: torch.Tensor = None  # the moved tokens, sorted

    __eq__ = object.__eq__  # one object per layout_groups entry: kernels cache its tiles by identity
    __hash__ = object.__hash__

    @property
    def per_head(self):
        return self.rule.per_head

    def allowed(self, q, k, h=None):
        token = self.layout.token
        if token.device != q.device:
            token = token.to(q.device)
        return self.rule.allowed(token[q], token[k], h)

    def chunk_size(self) -> int:
        """64: the chunk that holds both the last kept rows and the first wide ones is as wide as the sequence, and
        smaller chunks make it cheaper (at n = 8K, window 256, a global token every 256: 1.44 scores per edge
        against 1.88 with chunks of 128; swa(256) computes 1.50)."""
        return min(64, self.rule.chunk_size())

    def _row(self, t: int) -> int:
        """The row of the first kept token at or after t."""
        n = self.layout.rows
        t = min(max(t, 0), n)
        return t - int(torch.searchsorted(self.wide, torch.tensor(t)))

    def key_ranges(self, q_lo, q_hi):
        tokens = self.layout.token[q_lo:q_hi]
        n, moved = self.layout.rows, len(self.wide)
        ranges = [(self._row(lo), self._row(hi))
                  for lo, hi in self.rule.key_ranges(int(tokens.min()), int(tokens.max()) + 1)]
        return ranges + [(n - moved, n)]


@functools.lru_cache(maxsize=64)
def layout_groups(rule: EdgeRule, n: int, n_head: int, device: str = "cpu") -> tuple:
    """((heads, the rule the kernel runs over them, their layout or None), ...) for a static rule over n
    positions: its heads grouped by their edges (edge_head_groups, each at its own cost), split further by
    residue-class divisor; a group with d > 1 runs in residue_layout(n, d) under a LaidOutRule. Cached, so every
    layer with the rule shares one LaidOutRule and with it one set of tiles."""
    groups = edge_head_groups(rule, n, n_head) or [(list(range(n_head)), rule)]
    out = []
    for heads, sub_rule in groups:
        stated = sub_rule.residue_classes(len(heads))
        if stated is not None:
            surveys = [HeadSurvey(d, sub_rule.lookback, sub_rule.lookahead) for d in stated]
        else:
            surveys = list(edge_divisors(sub_rule, n, len(heads)))
            if not sub_rule.per_head:
                surveys *= len(heads)
        by_divisor = {}
        for local, survey in enumerate(surveys):
            by_divisor.setdefault(max(1, survey.divisor), []).append(local)
        for d, local in sorted(by_divisor.items()):
            rule_d = sub_rule if len(by_divisor) == 1 else HeadSubset(sub_rule, tuple(local))
            group_heads = [heads[i] for i in local]
            if d == 1 or n <= d:
                backs = [surveys[i].lookback for i in local]
                if stated is None and sub_rule.lookback is None and max(backs) < n // 2:
                    # unbounded as written, a window at this length: its band and chunk (the scan saw every edge)
                    ahead = max(surveys[i].lookahead for i in local)
                    rule_d = LaidOutRule(rule_d, None, max(backs), ahead)
                elif sub_rule.lookback is None and (wide := wide_rows(rule_d, n, len(group_heads))) is not None:
                    layout = wide_rows_layout(n, wide).to(device)  # a few dense rows: in tiles of their own
                    out.append((group_heads, WideRowsLast(rule_d, layout, wide), layout))
                    continue
                out.append((group_heads, rule_d, None))
                continue
            backs = [surveys[i].lookback for i in local]
            lookback = None if None in backs else -(-max(backs) // d)
            lookahead = -(-max(surveys[i].lookahead or 0 for i in local) // d)
            layout = residue_layout(n, d).to(device)
            out.append((group_heads, LaidOutRule(rule_d, layout, lookback, lookahead), layout))
    return tuple(out)
