"""Which rules span attention runs, and their spans: derived from the rule's edges, never written per variant.

A rule's edges are spans when every query row's allowed keys are one contiguous run [lo, hi) (per head for a
per-head rule): a sliding window, multi-scale windows, fixed blocks, paper 004's bridge windows (rows outside
every write-back set have an empty span) and their union with the blocks. A rule drawn per forward over permuted
rows (stochastic attention's PermutedWindow, attention/edges.py) is its band with one more condition: the key's
original position (its `token`) is not after the query's; the kernel takes that order as well.

The backward's plan: for every group of KEY_GROUP keys, the first and one-past-last query row that attends to one
of them (from the spans of groups of KEY_GROUP rows: O(edges / KEY_GROUP^2) work, never n x n).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attention.edges import EdgeRule, edge_blocks

KEY_GROUP = 16  # the granularity of the backward's plan: every block size of the kernels is a multiple of it
ROWS_PER_SCAN = 256


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
    keys among the n keys at the same positions are one contiguous run; None otherwise. One scan of the rule's
    edges over its key_ranges (edges.edge_blocks: O(edges) for rules that name their keys)."""
    heads = [torch.tensor(h) for h in range(n_head)] if rule.per_head else [None]
    los, his = [], []
    for h in heads:
        lo, hi = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        for r0, keys, allowed in edge_blocks(rule, n, h, start, ROWS_PER_SCAN):
            if len(keys) == 0:
                continue
            r1 = r0 + allowed.shape[0]
            count = allowed.sum(1)
            first = keys[allowed.to(torch.int8).argmax(1)]
            last = keys[len(keys) - 1 - allowed.flip(1).to(torch.int8).argmax(1)]
            has = count > 0
            if bool((has & (count != last - first + 1)).any()):
                return None
            lo[r0:r1] = torch.where(has, first - start, 0)
            hi[r0:r1] = torch.where(has, last - start + 1, 0)
        los.append(lo)
        his.append(hi)
    lo, hi = torch.stack(los), torch.stack(his)
    if rule.per_head and bool((lo == lo[:1]).all() and (hi == hi[:1]).all()):
        lo, hi = lo[:1], hi[:1]
    return lo.to(torch.int32), hi.to(torch.int32)


def key_plan(lo: torch.Tensor, hi: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key_first, key_end (S, ceil(n / KEY_GROUP)) from spans (S, n): rows grouped by KEY_GROUP, each group's keys
    the union of its rows' spans; a key group's rows are the row groups whose union reaches it."""
    S, g = lo.shape[0], KEY_GROUP
    groups = -(-n // g)
    pad = groups * g - n
    lo_p = torch.nn.functional.pad(lo.long(), (0, pad), value=n)
    hi_p = torch.nn.functional.pad(hi.long(), (0, pad), value=0)
    empty = lo_p >= hi_p
    g_lo = torch.where(empty, n, lo_p).view(S, groups, g).amin(-1)
    g_hi = torch.where(empty, 0, hi_p).view(S, groups, g).amax(-1)
    first_kg, end_kg = g_lo // g, (g_hi + g - 1) // g  # key groups [first_kg, end_kg) per row group
    count = (end_kg - first_kg).clamp(min=0)
    key_first = torch.full((S, groups), n, dtype=torch.long)
    key_end = torch.zeros((S, groups), dtype=torch.long)
    for s in range(S):
        row_group = torch.repeat_interleave(torch.arange(groups), count[s])
        offset = torch.arange(len(row_group)) - torch.repeat_interleave(count[s].cumsum(0) - count[s], count[s])
        key_group = first_kg[s][row_group] + offset
        key_first[s].scatter_reduce_(0, key_group, row_group * g, "amin")
        key_end[s].scatter_reduce_(0, key_group, torch.clamp((row_group + 1) * g, max=n), "amax")
    return key_first.to(torch.int32), key_end.to(torch.int32)


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
    """A rule drawn per forward: the band -lookback <= j - i <= lookahead, causal in the rule's token order (built
    on the device with no host synchronisation: it is planned at every forward)."""
    rows = torch.arange(n, device=device)
    lo = (rows - rule.lookback).clamp(min=0).to(torch.int32)[None]
    hi = (rows + rule.lookahead + 1).clamp(max=n).to(torch.int32)[None]
    groups = torch.arange(-(-n // KEY_GROUP), device=device) * KEY_GROUP
    key_first = (groups - rule.lookahead).clamp(min=0).to(torch.int32)[None]
    key_end = (groups + KEY_GROUP + rule.lookback).clamp(max=n).to(torch.int32)[None]
    return Spans(lo, hi, rule.token.to(device=device, dtype=torch.int32), key_first, key_end)


def span_scores(spans: Spans, n_head: int, block_m: int, block_n: int) -> int:
    """The scores the kernels compute over all heads: every tile of block_m rows over the key blocks of block_n
    between its rows' smallest lo and largest hi (masked entries included: what it costs)."""
    lo, hi = spans.lo.long().cpu(), spans.hi.long().cpu()
    S, n = lo.shape
    tiles = -(-n // block_m)
    pad = tiles * block_m - n
    empty = lo >= hi
    first = torch.nn.functional.pad(torch.where(empty, n, lo), (0, pad), value=n).view(S, tiles, block_m).amin(-1)
    end = torch.nn.functional.pad(torch.where(empty, 0, hi), (0, pad), value=0).view(S, tiles, block_m).amax(-1)
    blocks = (-(-(end - first // block_n * block_n) // block_n)).clamp(min=0)
    rows = torch.clamp(n - torch.arange(tiles) * block_m, max=block_m)
    total = int((blocks * block_n * rows).sum())
    return total * (n_head if S == 1 else 1)
