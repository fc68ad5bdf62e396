"""Heads a kernel runs apart, each group at its own cost: the groups of a rule (heads with the same edges, found from
allowed(), each run by the rule head_groups() names for it where that rule has its edges: attention/layouts.py), each in its layout (residue classes, wide rows last)
or key order; and running a kernel over them, joined back in head order. The chunked and FlexAttention kernels
plan and run through these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.edges import EdgeRule
from attention.layouts import Layout, edge_head_groups, from_layout, layout_groups, to_layout


@dataclass(eq=False)
class HeadGroup:
    """Heads a kernel runs together at their own cost: their rule (over their layout's rows when they have
    one), the kernel's data for it (ChunkTiles, or a BlockMask for flex), their layout (None: the tokens' own
    order) and, for flex, the gather index of their keys (key_prefix; None: the keys as they are)."""

    heads: tuple
    rule: EdgeRule
    data: object
    layout: Layout | None = None
    key_index: torch.Tensor | None = None


def may_reorder(rule: EdgeRule, start: int, score_mod) -> bool:
    """Whether a plan may run in another order of queries or keys: a static rule from position 0 (a cached
    prefill's offset keeps the tokens' order), without a score_mod (it sees positions)."""
    return rule.static and start == 0 and score_mod is None


def head_groups(rule: EdgeRule, n: int, n_head: int, device: str, start: int, score_mod) -> tuple:
    """(heads, rule, layout) per group of heads: the rule's head groups (stated, or found from allowed()), each
    static rule's heads split by the residue-class layout their edges have (attention/layouts.py). A score_mod
    sees positions, so rules with one and calls from a position offset (cached prefill) run in the tokens'
    order."""
    if may_reorder(rule, start, score_mod):
        return layout_groups(rule, n, n_head, device)
    # a static rule's groups follow allowed() whatever head_groups() says (edge_head_groups checks a stated one)
    groups = edge_head_groups(rule, n, n_head) if rule.static else rule.head_groups()
    if not groups or len(groups) == 1:
        groups = [(list(range(n_head)), rule)]
    return tuple((heads, sub_rule, None) for heads, sub_rule in groups)


def per_group(q, k, v, groups, run):
    """run(q, k, v, group) over every HeadGroup's heads, in its layout, joined in head order."""
    order = [i for group in groups for i in group.heads]
    in_order = order == list(range(q.shape[1]))
    if in_order:  # consecutive groups: split, whose backward is one concatenation (no zero-filled
        sizes = [len(group.heads) for group in groups]  # full-size gradient per group, as indexing has)
        pieces = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))
    else:
        index = [torch.tensor(group.heads, device=q.device) for group in groups]
        pieces = ((q[:, h], k[:, h], v[:, h]) for h in index)
    parts = []
    for (q_g, k_g, v_g), group in zip(pieces, groups):
        if group.key_index is not None:  # keys with a prefix of copies, queries as they are
            k_g, v_g = k_g.index_select(2, group.key_index), v_g.index_select(2, group.key_index)
        if group.layout is None:
            parts.append(run(q_g, k_g, v_g, group))
        else:
            parts.append(from_layout(run(*(to_layout(t, group.layout) for t in (q_g, k_g, v_g)), group),
                                     group.layout))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return y if in_order else y[:, torch.argsort(torch.tensor(order, device=q.device))]


def head_subset(score_mod, heads, device):
    """score_mod for a subset of heads: local head index i is global head heads[i]."""
    if score_mod is None:
        return None
    heads = torch.tensor(heads, device=device)
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, heads[h], q_idx, kv_idx)
