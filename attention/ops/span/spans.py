"""Which rules span attention runs, and their spans: derived from the rule's edges (in closed form from the key runs
it states, EdgeRule.key_runs, else from a scan of allowed()), never written per variant.

A rule's edges are spans when every query row's allowed keys are one contiguous run [lo, hi) (per head for a
per-head rule): a sliding window, multi-scale windows, fixed blocks, paper 004's bridge windows (rows outside
every write-back set have an empty span) and their union with the blocks. A rule drawn per forward over permuted
rows (stochastic attention's PermutedWindow, attention/stochastic.py) is its band with one more condition: the key's
original position (its `token`) is not after the query's; the kernel takes that order as well.

The backward's plan: for every group of KEY_GROUP keys, the first and one-past-last query row that attends to one
of them (from the spans of groups of KEY_GROUP rows: O(edges / KEY_GROUP^2) work, never n x n).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attention.edges import EdgeRule, candidate_keys, union_of_runs

KEY_GROUP = 16  # the granularity of the backward's plan: every block size of the kernels is a multiple of it
ROWS_PER_SCAN = 64  # query rows per block of the scan: its candidates are all its rows' keys, so few rows waste few
SCAN_ENTRIES = 1 << 18  # candidate (query, key) pairs per allowed() call of the scan


@dataclass(eq=False)
class Spans:
    """lo, hi (S, n) int32, S = 1 (every head) or H: row i attends keys lo[i] <= j < hi[i]; order (n,) int32 or
    None: a key is attended only if order[j] <= order[i]; key_first, key_end (S, ceil(n / KEY_GROUP)) int32: the
    rows attending some key of each group of KEY_GROUP keys lie in [key_first, key_end)."""

    lo: torch.Tensor
    hi: torch.Tensor
    order: torch.Tensor | None
    key_first: torch.Tensor
    key_end: torch.Tensor

    @property
    def n(self) -> int:
        return self.lo.shape[-1]

    def to(self, device) -> "Spans":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Spans(*(move(t) for t in (self.lo, self.hi, self.order, self.key_first, self.key_end)))


def rule_spans(rule: EdgeRule, n: int, n_head: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(lo, hi) (S, n) of a static rule over n rows at positions start.., in row indices, when every row's allowed
    keys among the n keys at the same positions are one contiguous run; None otherwise. In closed form from the
    rule's key_runs where it states them (stated_spans), else by scanning its edges (scanned_spans)."""
    if states_runs(rule):
        return stated_spans(rule, n, n_head, start)
    return scanned_spans(rule, n, n_head, start)


def states_runs(rule: EdgeRule) -> bool:
    """Whether the rule states its key_runs (asked of one query)."""
    one = torch.zeros(1, dtype=torch.long)
    return rule.key_runs(one, one[:, None] if rule.per_head else None) is not None


def stated_spans(rule: EdgeRule, n: int, n_head: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rule_spans of a rule that states its key_runs, from them: O(n) per head."""
    heads = n_head if rule.per_head else 1
    lo, hi, size = union_of_runs(rule.key_runs(torch.arange(start, start + n),
                                               torch.arange(heads)[:, None] if rule.per_head else None),
                                 start, start + n)
    if bool((size != hi - lo).any()):
        return None
    return _one_per_head((lo - start).expand(heads, n), (hi - start).expand(heads, n))


def scanned_spans(rule: EdgeRule, n: int, n_head: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rule_spans from allowed() alone: the reference, and the spans of a rule that states no key_runs. One scan of
    the rule's edges: rows in blocks of ROWS_PER_SCAN, each against the keys its key_ranges name (O(edges) for
    rules that name their keys, never n x n), several blocks and every head in one allowed() call of some
    SCAN_ENTRIES candidates. Calls of that size measured fastest (a sliding window of 256 at n = 32K, one thread:
    55 ms, against 80 ms block by block and 160 ms for all rows at once, whose elementwise passes stream from memory
    instead of the cache). The rule's head_groups() is not read: the spans are allowed()'s, whatever it states."""
    heads = n_head if rule.per_head else 1
    h = torch.arange(heads)[:, None, None, None] if rule.per_head else None
    lo, hi = torch.zeros(heads, n, dtype=torch.long), torch.zeros(heads, n, dtype=torch.long)
    reach = (rule.lookback if rule.lookback is not None else n) + rule.lookahead
    rows = max(16, min(ROWS_PER_SCAN, SCAN_ENTRIES // (heads * (reach + ROWS_PER_SCAN))))
    per_call = max(1, SCAN_ENTRIES // (heads * rows * (reach + rows)))
    for r0 in range(0, n, rows * per_call):
        firsts = list(range(r0, min(n, r0 + rows * per_call), rows))
        keys = [candidate_keys(rule, start + a, start + min(n, a + rows), start + n) for a in firsts]
        keys = [k[k >= start] for k in keys] if start else keys
        width = max(map(len, keys))
        if width == 0:
            continue
        keys = torch.stack([torch.nn.functional.pad(k, (0, width - len(k)), value=-1) for k in keys])  # (g, K)
        real = keys >= 0
        keys = torch.where(real, keys, start)  # padding at a key inside the sequence: rules may index by position
        q = (torch.tensor(firsts)[:, None] + torch.arange(rows)).clamp(max=n - 1) + start  # (g, rows)
        allowed = torch.broadcast_to(rule.allowed(q[:, :, None], keys[:, None, :], h) & real[:, None, :],
                                     (heads, len(firsts), rows, width)).view(torch.uint8)
        count = allowed.sum(-1, dtype=torch.int16 if width < 1 << 15 else torch.int32)
        keys = keys.expand(heads, -1, -1)
        first = keys.gather(-1, allowed.argmax(-1))
        last = keys.gather(-1, width - 1 - allowed.flip(-1).argmax(-1))
        has = count > 0
        if bool((has & (count != last - first + 1)).any()):
            return None
        r1 = min(n, r0 + rows * per_call)
        lo[:, r0:r1] = torch.where(has, first - start, 0).flatten(1)[:, :r1 - r0]
        hi[:, r0:r1] = torch.where(has, last - start + 1, 0).flatten(1)[:, :r1 - r0]
    return _one_per_head(lo, hi)


def _one_per_head(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spans (S, n) as int32, one row for every head when the heads' spans are all the same."""
    if lo.shape[0] > 1 and bool((lo == lo[:1]).all() and (hi == hi[:1]).all()):
        lo, hi = lo[:1], hi[:1]
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def key_plan(lo: torch.Tensor, hi: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key_first, key_end (S, ceil(n / KEY_GROUP)) from spans (S, n): rows grouped by KEY_GROUP, each group's keys
    the union of its rows' spans; a key group's rows are the row groups whose union reaches it. Where the row
    groups' first and last key groups never decrease (windows, blocks) those row groups are one run, found by
    binary search; else each row group's key groups are listed (every head at once, side by side)."""
    S, g = lo.shape[0], KEY_GROUP
    groups = -(-n // g)
    pad = groups * g - n
    lo_p = torch.nn.functional.pad(lo.to(torch.int32), (0, pad), value=n)  # int32: its reductions 4-20x int64's
    hi_p = torch.nn.functional.pad(hi.to(torch.int32), (0, pad), value=0)
    empty = lo_p >= hi_p
    g_lo = torch.where(empty, n, lo_p).view(S, groups, g).amin(-1)
    g_hi = torch.where(empty, 0, hi_p).view(S, groups, g).amax(-1)
    first_kg, end_kg = g_lo // g, (g_hi + g - 1) // g  # key groups [first_kg, end_kg) per row group
    if bool((first_kg[:, 1:] >= first_kg[:, :-1]).all() and (end_kg[:, 1:] >= end_kg[:, :-1]).all()):
        key_groups = torch.arange(groups, dtype=torch.int32).expand(S, groups).contiguous()
        first_row_group = torch.searchsorted(end_kg.contiguous(), key_groups, right=True)
        end_row_group = torch.searchsorted(first_kg.contiguous(), key_groups, right=True)
        reached = first_row_group < end_row_group
        key_first = torch.where(reached, first_row_group * g, n)
        key_end = torch.where(reached, torch.clamp(end_row_group * g, max=n), 0)
        return key_first.to(torch.int32), key_end.to(torch.int32)
    count = (end_kg - first_kg).clamp(min=0).flatten().long()
    row_group = torch.repeat_interleave(torch.arange(S * groups), count)  # head s's row groups: s * groups + r
    offset = torch.arange(len(row_group)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    key_group = first_kg.flatten()[row_group].long() + offset + row_group // groups * groups
    row_group = row_group % groups
    key_first = torch.full((S * groups,), n, dtype=torch.long)
    key_end = torch.zeros(S * groups, dtype=torch.long)
    key_first.scatter_reduce_(0, key_group, row_group * g, "amin")
    key_end.scatter_reduce_(0, key_group, torch.clamp((row_group + 1) * g, max=n), "amax")
    return key_first.view(S, groups).to(torch.int32), key_end.view(S, groups).to(torch.int32)


def spans_problem(rule: EdgeRule) -> str:
    """Why span attention cannot run this rule ("" when it can), judged at a length that holds several of its
    windows and blocks."""
    if not rule.static:
        if getattr(rule, "token", None) is None or rule.lookback is None:
            return "a rule drawn per forward runs as spans only as a band over permuted rows (its token order)"
        return ""
    return _static_problem(rule)


@functools.lru_cache(maxsize=256)
def _static_problem(rule: EdgeRule) -> str:
    """Judged at a length of several windows, over the heads the rule's head groups name (a per-head rule without
    them: its first head; plan_attention checks the layer's own heads and falls back to FlexAttention)."""
    reach = rule.lookback if rule.lookback is not None else 256
    n = max(512, min(4096, 4 * (reach + 1)))
    groups = rule.head_groups() if rule.per_head else None
    heads = 1 + max((h for heads, _ in groups for h in heads), default=0) if groups else 1
    if rule_spans(rule, n, heads) is None:
        return "some query's allowed keys are not one contiguous run"
    return ""


@functools.lru_cache(maxsize=64)
def static_spans(rule: EdgeRule, n: int, n_head: int, start: int, device: str) -> Spans | None:
    """The spans and backward plan of a static rule at one length (cached: every layer with the rule shares them)."""
    spans = rule_spans(rule, n, n_head, start)
    if spans is None:
        return None
    lo, hi = spans
    return Spans(lo, hi, None, *key_plan(lo, hi, n)).to(device)


def band_spans(rule: EdgeRule, n: int, device) -> Spans:
    """A rule drawn per forward: the band -lookback <= j - i <= lookahead, causal in the rule's token order. It is
    planned at every forward, so only the tokens are new: the band's spans and backward plan are the same for every
    order drawn (band_plan, cached), and nothing synchronises with the device."""
    lo, hi, key_first, key_end = band_plan(n, rule.lookback, rule.lookahead, str(torch.device(device)))
    return Spans(lo, hi, rule.token.to(device=device, dtype=torch.int32), key_first, key_end)


@functools.lru_cache(maxsize=64)
def band_plan(n: int, lookback: int, lookahead: int, device: str) -> tuple[torch.Tensor, ...]:
    """(lo, hi, key_first, key_end) of the band -lookback <= j - i <= lookahead over n rows (cached: the layers
    share them, and a forward that draws a new order pays one conversion of its tokens, not 20 kernels)."""
    rows = torch.arange(n, device=device)
    lo = (rows - lookback).clamp(min=0).to(torch.int32)[None]
    hi = (rows + lookahead + 1).clamp(max=n).to(torch.int32)[None]
    groups = torch.arange(-(-n // KEY_GROUP), device=device) * KEY_GROUP
    key_first = (groups - lookahead).clamp(min=0).to(torch.int32)[None]
    key_end = (groups + KEY_GROUP + lookback).clamp(max=n).to(torch.int32)[None]
    return lo, hi, key_first, key_end


def document_rows(docs: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) (B, n) int32 of rows in token order at positions start..: each row's document is its rows
    [first, end) (docs: attention/documents.py). Built on docs' device with no host synchronisation."""
    docs = docs.contiguous()
    # docs never decrease along a row, and the next document's first row holds its own position: the first row
    # whose value exceeds a row's is where its document ends (one search per row: no flips or scans)
    end = torch.searchsorted(docs, docs, right=True, out_int32=True)
    return (docs - start).to(torch.int32).contiguous(), end


def span_scores(spans: Spans, n_head: int, block_m: int, block_n: int, rows: slice = slice(None)) -> int:
    """The scores the kernels compute over all heads: every tile of block_m rows (of `rows`: sa in slots runs its
    main rows only) over the key blocks of block_n between its rows' smallest lo and largest hi (masked entries
    included: what it costs)."""
    keys = spans.lo.shape[-1]
    lo, hi = spans.lo.long().cpu()[:, rows], spans.hi.long().cpu()[:, rows]
    S, n = lo.shape
    tiles = -(-n // block_m)
    pad = tiles * block_m - n
    empty = lo >= hi
    first = torch.nn.functional.pad(torch.where(empty, keys, lo), (0, pad), value=keys).view(S, tiles, block_m).amin(-1)
    end = torch.nn.functional.pad(torch.where(empty, 0, hi), (0, pad), value=0).view(S, tiles, block_m).amax(-1)
    blocks = (-(-(end - first // block_n * block_n) // block_n)).clamp(min=0)
    tile_rows = torch.clamp(n - torch.arange(tiles) * block_m, max=block_m)
    total = int((blocks * block_n * tile_rows).sum())
    return total * (n_head if S == 1 else 1)
