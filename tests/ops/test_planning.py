"""Planning on the host: the spans, backward plans, edge counts, block structures, FlexAttention block masks and
residue surveys that rules stating their key runs get in closed form equal what the scan of allowed() and the
dense masks give, for every static rule of the registry, at odd lengths and offsets, per head; a rule written as
allowed() alone still gets them from the scan, without an n x n tensor."""

from dataclasses import dataclass

import pytest
import torch

from attention import simulate_cuda
from attention.bridge import BoundaryWindows
from attention.edges import (AnyOf, Causal, EdgeRule, FixedBlock, HeadWindows, SlidingWindow, edge_blocks,
                             head_values, union_of_runs)
from attention.kernels import plans_in
from attention.layouts import edge_divisors, edge_head_groups, layout_groups
from attention.ops.blocks import block_structure, edge_keys
from attention.ops.flex.block_mask import _static_block_mask
from attention.ops.span.spans import KEY_GROUP, SCAN_ENTRIES, key_plan, rule_spans, scanned_spans
from attention.registry import build_mixer, example_cases, pattern_names
from config import ModelConfig
from helpers import LargestTensor

HEADS = 4


def registry_rules() -> dict:
    """Every static rule a layer of the registry plans or counts (its paths, their union, the rules of its plans on
    the CUDA path), each once, named by the first case with it, for layers of HEADS heads (the deepest layer: MSWA's
    widest windows)."""
    rules = {}
    with simulate_cuda.simulating():
        for name, settings in example_cases(64).items():
            if len(pattern_names(settings["attn_pattern"])) > 1:
                continue  # a pattern of several mixers (swax): each is a case of its own
            cfg = ModelConfig(**{"arch": "llama", "n_layer": 1, "n_head": HEADS, "n_embd": 64, "block_size": 256,
                                 "bias": False, **settings})
            layer = build_mixer(cfg, cfg.n_layer - 1)
            found = [p.rule for p in plans_in(layer.plan(1, 128, "cpu"))]
            found += list(layer.paths()) + [layer.edge_rule()] if hasattr(layer, "paths") else []
            for rule in found:
                if rule.static and rule not in rules.values():
                    rules[f"{name}:{type(rule).__name__}"] = rule
    return rules


RULES = registry_rules()


def dense_spans(rule: EdgeRule, n: int, start: int):
    """(lo, hi) (H, n) in row indices from the rule's dense mask over positions start.., None when a row's keys are
    not one run: the reference, independent of key_runs and of the scan."""
    pos = torch.arange(start, start + n, device="cpu")
    mask = rule.dense_mask(pos, n_head=HEADS)
    mask = mask if rule.per_head else mask[None]
    count = mask.sum(-1)
    first = mask.int().argmax(-1)
    last = n - 1 - mask.flip(-1).int().argmax(-1)
    has = count > 0
    if bool((has & (count != last - first + 1)).any()):
        return None
    return torch.where(has, first, 0).expand(HEADS, n), torch.where(has, last + 1, 0).expand(HEADS, n)


def per_head(spans):
    return None if spans is None else tuple(t.long().expand(HEADS, -1) for t in spans)


def library_rule(rule: EdgeRule) -> bool:
    """A rule of attention/edges.py's library or paper 004's bridges (attention/bridge.py; a union of them included):
    a variant's own rule need not state runs."""
    parts = rule.rules if isinstance(rule, AnyOf) else ()
    return type(rule).__module__ in ("attention.edges", "attention.bridge") and all(map(library_rule, parts))


def test_every_library_rule_of_the_registry_states_its_key_runs():
    """The closed form is what keeps planning cheap at warm-up: a library rule that loses it falls back to the
    scan (python -m scripts.bench_plan: 80-330 ms at n = 32K instead of 1-35 ms)."""
    assert {"full:Causal", "swa:SlidingWindow", "block:FixedBlock", "bridge:BoundaryWindows", "pbb:AnyOf",
            "se_bridge:AnyOf", "mswa:HeadWindows", "mswa_h:HeadWindows"} <= set(RULES)
    q = torch.arange(10, device="cpu")
    for name, rule in RULES.items():
        if library_rule(rule):
            heads = torch.arange(HEADS, device="cpu")[:, None] if rule.per_head else None
            assert rule.key_runs(q, heads) is not None, name


@pytest.mark.parametrize("name", sorted(RULES))
def test_spans_in_closed_form_equal_the_scan_and_the_dense_mask(name):
    rule = RULES[name]
    for n, start in ((97, 0), (301, 0), (131, 37)):
        reference = dense_spans(rule, n, start)
        closed, scanned = rule_spans(rule, n, HEADS, start), scanned_spans(rule, n, HEADS, start)
        if reference is None:
            assert closed is None and scanned is None, (name, n, start)
            continue
        for spans in (closed, scanned):
            assert spans is not None and spans[0].dtype == torch.int32 and spans[0].shape[0] in (1, HEADS)
            for ours, theirs in zip(per_head(spans), reference):
                assert torch.equal(ours, theirs), (name, n, start)
        assert closed[0].shape == scanned[0].shape  # heads with the same spans kept once by both


@pytest.mark.parametrize("name", sorted(RULES))
def test_edge_counts_from_key_runs_equal_the_dense_mask(name):
    rule, n = RULES[name], 301
    mask = rule.dense_mask(torch.arange(n, device="cpu"), n_head=HEADS)
    mask = mask.expand(HEADS, n, n) if rule.per_head else mask  # heads of one window: no head axis
    for head in range(HEADS if rule.per_head else 1):
        expected = int((mask[head] if rule.per_head else mask).sum())
        assert rule.count_edges(n, head) == expected, (name, head)


def listed_key_plan(lo: torch.Tensor, hi: torch.Tensor, n: int):
    """key_first, key_end by the definition, row group by row group: each row group's key groups are those
    between its rows' smallest lo and largest hi; and whether those key groups never decrease (a row group
    without keys: none after any), where key_plan searches instead of listing them."""
    S, g = lo.shape[0], KEY_GROUP
    groups = -(-n // g)
    first = torch.full((S, groups), n, dtype=torch.int32, device="cpu")
    end = torch.zeros_like(first)
    monotone = True
    for s in range(S):
        previous = (0, 0)
        for r in range(groups):
            rows = [i for i in range(r * g, min(n, (r + 1) * g)) if lo[s, i] < hi[s, i]]
            reached = (min(int(lo[s, i]) for i in rows) // g, -(-max(int(hi[s, i]) for i in rows) // g)) if rows \
                else (n // g, 0)
            monotone &= reached[0] >= previous[0] and reached[1] >= previous[1]
            previous = reached
            for key_group in range(*reached):
                first[s, key_group] = min(int(first[s, key_group]), r * g)
                end[s, key_group] = max(int(end[s, key_group]), min(n, (r + 1) * g))
    return first, end, monotone


def test_the_backward_plan_equals_its_definition():
    """Searched where row groups' key groups never decrease (windows, blocks), listed where they do (rows outside
    every bridge window attend nothing): both equal the plan by its definition."""
    n, searched = 301, set()
    for name, rule in RULES.items():
        spans = rule_spans(rule, n, HEADS)
        if spans is None:
            continue
        first, end, monotone = listed_key_plan(*spans, n)
        key_first, key_end = key_plan(*spans, n)
        assert torch.equal(key_first, first) and torch.equal(key_end, end), name
        searched.add(monotone)
    assert searched == {True, False}  # both ways were taken


def test_the_union_of_runs_is_its_keys():
    generator = torch.Generator(device="cpu").manual_seed(0)
    for runs in (1, 2, 3):
        bounds = torch.randint(-5, 40, (runs, 2, 200), generator=generator, device="cpu")
        lo, hi, size = union_of_runs([(b[0], b[1]) for b in bounds], 3, 30)
        keys = torch.arange(3, 30, device="cpu")
        inside = ((bounds[:, 0, :, None] <= keys) & (keys < bounds[:, 1, :, None])).any(0)  # (200, keys)
        assert torch.equal(size, inside.sum(-1))
        assert torch.equal(lo, torch.where(inside.any(-1), keys[inside.int().argmax(-1)], 3))
        assert torch.equal(hi, torch.where(inside.any(-1), keys[26 - inside.flip(-1).int().argmax(-1)] + 1, 3))


class PlainWindows(EdgeRule):
    """Sliding windows per head written as allowed() alone: no key_runs, no head_groups."""

    per_head = True
    windows = (3, 7, 7, 20)
    lookback = 19

    def allowed(self, q, k, h=None):
        return (k <= q) & (q - k < head_values(self.windows, h))


class PlainCausal(EdgeRule):
    def allowed(self, q, k, h=None):
        return k <= q


def test_a_rule_without_key_runs_gets_its_spans_from_the_scan():
    n = 150
    lo, hi = rule_spans(PlainWindows(), n, HEADS)  # every head in one allowed() call
    for head, window in enumerate(PlainWindows.windows):
        expected = rule_spans(SlidingWindow(window), n, 1)
        assert torch.equal(lo[head], expected[0][0]) and torch.equal(hi[head], expected[1][0])
    for ours, theirs in zip(rule_spans(PlainCausal(), n, 1, 20), rule_spans(Causal(), n, 1, 20)):
        assert torch.equal(ours, theirs)
    assert rule_spans(AnyOf((PlainCausal(), SlidingWindow(4))), n, 1) is not None  # a union with a plain rule scans


def test_the_scan_of_an_unbounded_rule_never_builds_an_n_by_n_tensor():
    n = 4096
    with LargestTensor() as planning:
        lo, hi = rule_spans(PlainCausal(), n, 1)
    assert planning.numel <= SCAN_ENTRIES < n * n // 32, planning.shape  # rows in blocks of some 2^18 candidates
    assert bool((lo == 0).all()) and torch.equal(hi[0].long(), torch.arange(1, n + 1, device="cpu"))
    count = sum(int(a.sum()) for _, _, a in edge_blocks(PlainCausal(), 300))
    assert count == 300 * 301 // 2


@dataclass(frozen=True)
class AllowedOnly(EdgeRule):
    """A rule's edges written as allowed() alone (with its lookback, lookahead and key_ranges): no key_runs and no
    head_groups, so planning scans it, every head in one allowed() call."""

    rule: EdgeRule = None

    @property
    def lookback(self):
        return self.rule.lookback

    @property
    def lookahead(self):
        return self.rule.lookahead

    @property
    def per_head(self):
        return self.rule.per_head

    def allowed(self, q, k, h=None):
        return self.rule.allowed(q, k, h)

    def key_ranges(self, q_lo, q_hi):
        return self.rule.key_ranges(q_lo, q_hi)


@pytest.mark.parametrize("name", sorted(RULES))
def test_block_structures_from_key_runs_equal_the_scan_of_allowed(name):
    """The chunked kernel's and FlexAttention's block structures (the keys each block uses: FlexAttention's key
    prefix reads the same), its block masks (each tile partial or full) and the residue survey, from the spans of
    the stated runs and from allowed() alone."""
    rule, plain = RULES[name], AllowedOnly(RULES[name])
    assert rule_spans(plain, 301, HEADS) is not None or rule_spans(rule, 301, HEADS) is None
    for ours, theirs in zip(rule_spans(plain, 301, HEADS) or (), rule_spans(rule, 301, HEADS) or ()):
        assert torch.equal(ours.expand(HEADS, -1), theirs.expand(HEADS, -1)), name  # every head in one call
    for n, size, start in ((301, 16, 0), (203, 32, 37)):
        assert torch.equal(block_structure(rule, n, size, HEADS, "cpu", start),
                           block_structure(plain, n, size, HEADS, "cpu", start)), name
        assert edge_keys(rule, n, size, HEADS, start) == edge_keys(plain, n, size, HEADS, start), name
    for n, start in ((777, 0), (530, 41)):
        ours, theirs = (_static_block_mask(r, n, HEADS, "cpu", start) for r in (rule, plain))
        assert torch.equal(ours.to_dense(), theirs.to_dense()), name
        for a, b in ((ours.kv_num_blocks, theirs.kv_num_blocks), (ours.full_kv_num_blocks, theirs.full_kv_num_blocks)):
            assert torch.equal(a, b), name
    assert edge_divisors(rule, 301, HEADS) == edge_divisors(plain, 301, HEADS), name
    groups = [edge_head_groups(r, 301, HEADS) or [(list(range(HEADS)), None)] for r in (rule, plain)]
    assert [heads for heads, _ in groups[0]] == [heads for heads, _ in groups[1]], name


def test_per_head_windows_are_grouped_in_closed_form_each_group_under_its_stated_window(monkeypatch):
    """mswa's rule: its heads grouped by their key_runs, each group running the window its head_groups() names (its
    own band and chunk), the names checked against the key_runs too: no scan of allowed() at any length."""
    def scanned(*args):
        raise AssertionError("allowed() was scanned")

    monkeypatch.setattr(HeadWindows, "allowed", scanned)
    monkeypatch.setattr(SlidingWindow, "allowed", scanned)
    groups = layout_groups(HeadWindows((8, 8, 16, 40)), 4093, HEADS)
    assert groups == (([0, 1], SlidingWindow(8), None), ([2], SlidingWindow(16), None), ([3], SlidingWindow(40), None))


def test_block_structures_from_spans_in_groups_of_blocks_equal_one_group(monkeypatch):
    from attention.ops import blocks

    rule, n, size = AnyOf((FixedBlock(40), BoundaryWindows("pbb", 40, 40, 200))), 333, 8
    whole = block_structure(rule, n, size, HEADS, "cpu"), edge_keys(rule, n, size, HEADS)
    monkeypatch.setattr(blocks, "SPAN_KEYS_PER_GROUP", 3 * 7 * size)  # groups of 3 blocks of 7 key blocks or fewer
    assert torch.equal(block_structure(rule, n, size, HEADS, "cpu"), whole[0])
    assert edge_keys(rule, n, size, HEADS) == whole[1] == edge_keys(AllowedOnly(rule), n, size, HEADS)
