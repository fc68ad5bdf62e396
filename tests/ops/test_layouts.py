"""A rule written as allowed() alone costs its edges: compacted key tiles and residue-class layouts, found from
the rule (attention/layouts.py, attention/kernels.py), equal the dense reference forward and backward."""

from dataclasses import dataclass

import pytest
import torch

from attention.edges import AnyOf, EdgeRule, GlobalKeys, SlidingWindow
from attention.kernels import attend, attend_planned, computed_scores, plan_attention
from attention.layouts import Layout, from_layout, layout_groups, residue_layout, to_layout
from attention.ops.dense import dense_attention
from conftest import REPO
from model import GPT
from config import ModelConfig
from helpers import Dilated, LargestTensor, fwd_bwd, qkv

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@dataclass(frozen=True)
class Sinks(EdgeRule):
    """A window plus the first keys (attention sinks), as allowed() alone: no lookback, no key_ranges."""

    window: int = 16
    sinks: int = 3

    def allowed(self, q, k, h=None):
        return (k <= q) & ((q - k < self.window) | (k < self.sinks))


@dataclass(frozen=True)
class FixedPattern(EdgeRule):
    """The Sparse Transformer's fixed pattern: own block, plus the last key of every earlier block."""

    block: int = 16

    def allowed(self, q, k, h=None):
        return (k <= q) & ((q // self.block == k // self.block) | (k % self.block == self.block - 1))


@dataclass(frozen=True)
class StatedDilated(Dilated):
    """The same rule with its layout and bound stated instead of found."""

    @property
    def lookback(self):
        return max(self.dilations) * self.window - 1

    def residue_classes(self, n_head):
        return list(self.dilations)


@dataclass(frozen=True)
class Strided(EdgeRule):
    """One dilation (3) for every head, not per head, plus a look ahead: offsets -3 .. 3 d in steps of d."""

    lookahead = 3

    def allowed(self, q, k, h=None):
        return ((q - k) % 3 == 0) & (q - k < 30) & (k - q <= 3)


@dataclass(frozen=True)
class GlobalTokens(EdgeRule):
    """Longformer: a window, plus every stride-th position global (attending every earlier key, attended by every
    later query), as allowed() alone: a few dense rows."""

    window: int = 8
    stride: int = 40

    def allowed(self, q, k, h=None):
        return (k <= q) & ((q - k < self.window) | (q % self.stride == 0) | (k % self.stride == 0))


LAYOUT_RULES = [Sinks(), FixedPattern(), FixedPattern(20), Dilated(), StatedDilated(), Strided(), GlobalTokens()]


@pytest.mark.parametrize("n", [77, 200, 257])
@pytest.mark.parametrize("rule", LAYOUT_RULES, ids=repr)
def test_a_rule_written_as_allowed_alone_equals_dense_forward_and_backward(rule, n):
    tensors = qkv(n)
    pos = torch.arange(n)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, pos), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "chunked"), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("rule", [Dilated(), FixedPattern()], ids=repr)
def test_sigmoid_attention_in_a_layout_equals_dense(rule):
    tensors = qkv(300)
    pos = torch.arange(300)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, pos, activation="sigmoid"), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "chunked", activation="sigmoid"), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    plan = plan_attention(rule, "flex", 300, 4, 8, "cpu", activation="sigmoid")
    assert plan.data.groups is not None  # in its layout or key order: forward only (flex on the CPU)
    torch.testing.assert_close(attend_planned(*(t.detach().float() for t in tensors), plan), ref.float(),
                               atol=1e-5, rtol=1e-4)


def test_the_layout_is_found_from_the_rule_or_taken_as_stated():
    n = 200
    found = layout_groups(Dilated(), n, 4)
    assert [(heads, layout is not None) for heads, _, layout in found] == [([0], False), ([1], True), ([2], True),
                                                                          ([3], True)]
    assert [torch.equal(layout.order, residue_layout(n, d).order) for (_, _, layout), d in zip(found[1:], (2, 3, 4))]
    stated = layout_groups(StatedDilated(), n, 4)
    assert [(heads, None if layout is None else layout.order.tolist()) for heads, _, layout in stated] == \
        [(heads, None if layout is None else layout.order.tolist()) for heads, _, layout in found]
    tensors = [t.detach() for t in qkv(n)]
    torch.testing.assert_close(attend(*tensors, StatedDilated(), "chunked"), attend(*tensors, Dilated(), "chunked"))
    # written with its far keys named (key_ranges), the sinks rule gets the same compacted tiles as allowed() alone
    named = AnyOf((SlidingWindow(16), GlobalKeys(3)))
    (_, _, found_tiles), = [(g.heads, g.rule, g.data) for g in plan_attention(Sinks(), "chunked", n, 4, 8, "cpu").data.groups]
    (_, _, named_tiles), = [(g.heads, g.rule, g.data) for g in plan_attention(named, "chunked", n, 4, 8, "cpu",
                                                                             chunk=found_tiles.chunk).data.groups]
    assert torch.equal(found_tiles.key_index, named_tiles.key_index) and torch.equal(found_tiles.mask, named_tiles.mask)
    torch.testing.assert_close(attend(*tensors, Sinks(), "chunked"), attend(*tensors, named, "chunked"))
    # a rule whose offsets share no divisor keeps the tokens' order; one divisor for all heads is one group
    assert [layout for _, _, layout in layout_groups(Sinks(), n, 4)] == [None]
    (heads, _, layout), = layout_groups(Strided(), n, 4)
    assert heads == [0, 1, 2, 3] and layout.order[:3].tolist() == [0, 3, 6]


@pytest.mark.parametrize("rule, most", [(FixedPattern(128), 2.0), (Sinks(256, 4), 1.6),
                                        (Dilated(64, (1, 2, 4, 8)), 1.6)], ids=repr)
def test_the_kernel_computes_about_the_edges_of_a_rule_written_as_allowed_alone(rule, most):
    """computed_scores over allowed edges: a block layout would pay every key block the summary column or the
    dilated span touches (many times the edges); compacted tiles and residue layouts pay about swa's 1.5."""
    n, heads = 4096, 4
    plan = plan_attention(rule, "chunked", n, heads, 64, "cpu")
    edges = sum(rule.count_edges(n, h) for h in range(heads))
    assert computed_scores(plan, heads) / edges < most


def test_a_few_dense_rows_run_apart_and_cost_about_their_edges():
    """Global tokens (Longformer): their rows attend every earlier key, and a tile pays for its widest row. The
    layout found from the rule moves them behind the other rows, so the window rows keep swa's tiles: scores per
    allowed edge within 1.3x swa's (1.44 against 1.50 here; 11.3 before: the global rows in place, each call of tiles
    padded to its widest chunk)."""
    from attention.layouts import WideRowsLast

    n, heads, rule = 8192, 2, GlobalTokens(256, 256)
    (group_heads, laid_out, layout), = layout_groups(rule, n, heads)
    assert isinstance(laid_out, WideRowsLast) and layout.order[-1] == 7936 and len(laid_out.wide) == 29
    plan = plan_attention(rule, "chunked", n, heads, 64, "cpu")
    swa = plan_attention(SlidingWindow(256), "chunked", n, heads, 64, "cpu")
    ours = computed_scores(plan, heads) / (heads * rule.count_edges(n))
    window = computed_scores(swa, heads) / (heads * SlidingWindow(256).count_edges(n))
    assert ours < 1.3 * window, (ours, window)
    q, k, v = (torch.randn(1, heads, n, 16, requires_grad=True) for _ in range(3))
    with LargestTensor() as training:
        attend_planned(q, k, v, plan).sum().backward()
    assert training.numel <= 2 * heads * n * 512, training.shape  # never n x n
    tensors = qkv(700)  # and exact, forward and backward, where several chunks hold global rows
    small = GlobalTokens(16, 50)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, small, torch.arange(700)), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, small, "chunked"), tensors)
    assert isinstance(layout_groups(small, 700, 4)[0][1], WideRowsLast)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_grouped_query_heads_in_layouts_equal_repeated_heads():
    q, _, _ = qkv(90, dtype=torch.float32)
    k, v = (t[:, :2].detach().requires_grad_() for t in qkv(90, seed=1, dtype=torch.float32)[1:])
    for rule in (Dilated(), FixedPattern()):
        shared, shared_grads = fwd_bwd(lambda a, b, c: attend(a, b, c, rule, "chunked"), [q, k, v])
        repeated, repeated_grads = fwd_bwd(lambda a, b, c: attend(a, b.repeat_interleave(2, 1),
                                                                  c.repeat_interleave(2, 1), rule, "dense"), [q, k, v])
        torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-4)
        for g, r in zip(shared_grads, repeated_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rule", [Sinks(64, 4), FixedPattern(64), Dilated(32, (1, 2, 4, 8))], ids=repr)
def test_layouts_never_build_an_n_by_n_tensor(rule):
    n = 8192
    q, k, v = (torch.randn(1, 4, n, 16, requires_grad=True) for _ in range(3))
    with LargestTensor() as planning:
        plan = plan_attention(rule, "chunked", n, 4, 16, "cpu")
    with LargestTensor() as training:
        attend_planned(q, k, v, plan).sum().backward()
    # its scan: groups of query blocks against their candidate keys, at most 2^24 entries (n x n is 2^26 here)
    assert planning.numel <= 1 << 24 < n * n, planning.shape
    assert training.numel <= 4 * n * 512, training.shape  # tiles of a chunk's keys, never n x n


def test_layout_gathers_have_inverse_gathers_as_backward():
    layout = Layout(torch.randperm(50, generator=torch.Generator().manual_seed(0)), halo=4)
    x = torch.randn(2, 3, 50, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: to_layout(t, layout), (x,))
    y = torch.randn(2, 3, layout.rows, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: from_layout(t, layout), (y,))
    assert torch.equal(from_layout(to_layout(x, layout), layout), x)


@pytest.mark.parametrize("rule", [Dilated(), FixedPattern(), Sinks()], ids=repr)
def test_cached_generation_past_the_context_stays_in_the_tokens_order(rule):
    """A model whose layers run a layout rule: the prompt's pass plans the layout, each cached step attends in
    the tokens' order; cached and uncached greedy generation agree past the trained context (32)."""
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=32, vocab_size=61,
                      bias=False, attn_pattern="swa", swa_window=8)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    for block in model.blocks:
        block.mixer.rule = rule
    prompt = torch.randint(0, 61, (2, 20))
    fast = model.generate(prompt, 40, temperature=0, use_cache=True)
    slow = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(fast, slow)


@pytest.mark.e2e
def test_the_example_variants_run_as_written(monkeypatch):
    """examples/: the rules of the layout benchmarks, each a variant in one file of allowed() alone, imported as
    a user drops them in: their models equal the dense backend's and generate with a cache. (In this process:
    example_rule registers them in a copy of the registry that no other test sees.)"""
    for name in ("window_sinks", "fixed_pattern", "dilated_window", "longformer", "shifted_groups"):
        example_rule(name, monkeypatch)
        outs = []
        for backend in ("auto", "dense"):
            cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=61, bias=False,
                              attn_pattern=name, swa_window=8, block_len=8, attn_backend=backend)
            torch.manual_seed(0)
            model = GPT(cfg).eval()
            idx = torch.randint(0, 61, (2, 64), generator=torch.Generator().manual_seed(1))
            outs.append(model(idx, idx)[0])
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
        prompt = idx[:, :10]
        assert torch.equal(model.generate(prompt, 20, temperature=0),
                           model.generate(prompt, 20, temperature=0, use_cache=False))


@pytest.mark.gpu_sim
@pytest.mark.parametrize("rule", [Dilated(), FixedPattern(), Sinks(), Strided()], ids=repr)
def test_cuda_path_flex_runs_layouts_compiled_forward_and_backward(rule):
    """On the CPU standing in for CUDA (attention/simulate_cuda.py): FlexAttention compiled with aot_eager in one
    graph (no break) under each head group's block mask in its layout or key order, forward and backward, equals
    the dense reference.
    (The same kernels as every rule's on CUDA, with gathered inputs: the GPU check's gpu_tests budget keeps its
    flex compilations for the registered variants.)"""
    from attention import simulate_cuda

    tensors = qkv(300, dim=16, dtype=torch.float32)
    pos = torch.arange(300)
    ref, ref_grads = fwd_bwd(lambda a, b, c: dense_attention(a, b, c, rule, pos), tensors)
    with simulate_cuda.simulating():
        plan = plan_attention(rule, "auto", 300, 4, 16, "cpu")
        assert plan.kernel == "flex" and plan.data.groups is not None  # head groups in a layout or key order
        # as inside a compiled block: the gathers, the layout's autograd functions and flex in one graph
        compiled = torch.compile(lambda a, b, c: attend_planned(a, b, c, plan), backend="aot_eager", fullgraph=True)
        out, grads = fwd_bwd(compiled, tensors)
        eager = attend_planned(*(t.detach() for t in tensors), plan)  # an eager call: flex compiled on its own
    torch.testing.assert_close(eager, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4)


def example_rule(name: str, monkeypatch):
    """examples/NAME.py's module, loaded as a user drops it in, its mixer registered in a copy of the registry that
    the test leaves behind (every other test keeps the registry's own variants)."""
    import importlib.util

    from attention import registry

    monkeypatch.setattr(registry, "MIXERS", dict(registry.MIXERS))
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_few_dense_rows_are_planned_and_run_without_an_n_by_n_tensor(monkeypatch):
    # examples/longformer.py's rule: the global rows attend every key, and the plan's scan takes their key blocks
    # in groups of their own, never padding every query block of a group to their width (which built
    # (32, 64, 8192) at n = 8192)
    rule = example_rule("longformer", monkeypatch).WindowAndGlobalTokens(128, 128)
    n = 8192
    q, k, v = (torch.randn(1, 2, n, 16, device="cpu", requires_grad=True) for _ in range(3))
    with LargestTensor() as largest:
        plan = plan_attention(rule, "auto", n, 2, 16, "cpu")
        attend_planned(q, k, v, plan).sum().backward()
    assert largest.numel < n * n // 8, largest.shape
