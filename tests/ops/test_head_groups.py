"""Per-head rules whatever their head_groups() returns: LongLoRA's shifted sparse attention (S2-Attn, causal; half the
heads attend within groups of G tokens, the other half within groups moved by G/2) with the hints a reader writes
from docs/adding_a_variant.md: per-head sub-rules whose heads agree (of the rule's own class, so each one states
its heads as one group of itself), sub-rules that do not vary by head, the rule itself over every head, and hints
that disagree with allowed(). The kernels group heads by allowed(), plan without recursion and follow allowed():
the chunked kernel, span attention's Triton kernels (under the interpreter) and FlexAttention equal the dense
reference, and a small GPT with the rule trains on the CPU path and on the CUDA path simulated on the CPU."""

from dataclasses import dataclass

import pytest
import torch

from attention import simulate_cuda
from attention.edges import EdgeRule, head_values
from attention.kernels import attend_planned, plan_attention, plans_in
from attention.layer import MaskedAttention
from attention.layouts import HeadSubset, edge_head_groups, layout_groups
from attention.local import BLOCK_LEN
from attention.ops.dense import dense_attention
from attention.ops.span.spans import rule_spans
from attention.registry import MIXERS
from config import ModelConfig
from model import GPT

G = 16
SHIFTS = (0, 0, G // 2, G // 2)


def by_shift(shifts):
    """[(shift, its heads)] in order of first head."""
    heads_of = {}
    for head, shift in enumerate(shifts):
        heads_of.setdefault(shift, []).append(head)
    return list(heads_of.items())


@dataclass(frozen=True)
class S2Attn(EdgeRule):
    """Head h attends causally within groups of `group` tokens moved by shifts[h]; no hint."""

    group: int = G
    shifts: tuple = SHIFTS
    per_head = True

    @property
    def lookback(self):
        return self.group - 1

    def allowed(self, q, k, h=None):
        shift = head_values(self.shifts, h)
        return (k <= q) & ((q + shift) // self.group == (k + shift) // self.group)


@dataclass(frozen=True)
class ShiftedBlocks(EdgeRule):
    """One shift for every head: not a per-head rule."""

    group: int = G
    shift: int = 0

    @property
    def lookback(self):
        return self.group - 1

    def allowed(self, q, k, h=None):
        return (k <= q) & ((q + self.shift) // self.group == (k + self.shift) // self.group)


@dataclass(frozen=True)
class PerHeadSubRules(S2Attn):
    """The reader's S2-Attn: each group's rule is this class again, with one shift for its heads, so it states its
    own heads as one group of itself."""

    def head_groups(self):
        return [(heads, PerHeadSubRules(self.group, (shift,) * len(heads))) for shift, heads in by_shift(self.shifts)]


@dataclass(frozen=True)
class PlainSubRules(S2Attn):
    def head_groups(self):
        return [(heads, ShiftedBlocks(self.group, shift)) for shift, heads in by_shift(self.shifts)]


@dataclass(frozen=True)
class EveryHead(S2Attn):
    def head_groups(self):
        return [(list(range(len(self.shifts))), self)]


@dataclass(frozen=True)
class SwappedHint(S2Attn):
    """Disagrees with allowed(): each group is given the other group's shift."""

    def head_groups(self):
        return [(heads, ShiftedBlocks(self.group, self.group // 2 - shift)) for shift, heads in by_shift(self.shifts)]


@dataclass(frozen=True)
class PartialHint(S2Attn):
    """Disagrees with allowed(): one shifted head among the unshifted ones, the other left out."""

    def head_groups(self):
        return [([0, 1, 2], ShiftedBlocks(self.group, 0))]


HINTS = {"per-head sub-rules": PerHeadSubRules(), "plain sub-rules": PlainSubRules(), "every head": EveryHead(),
         "swapped": SwappedHint(), "partial": PartialHint()}


@pytest.mark.parametrize("name", sorted(HINTS))
def test_head_groups_come_from_allowed_and_a_hint_only_names_a_group_s_rule(name):
    rule, n = HINTS[name], 100
    groups = edge_head_groups(rule, n, 4)
    assert [heads for heads, _ in groups] == [[0, 1], [2, 3]]
    stated = {tuple(heads): sub_rule for heads, sub_rule in rule.head_groups()}
    for heads, sub_rule in groups:  # the stated rule where it has the group's edges, else the rule's own
        right = name in ("per-head sub-rules", "plain sub-rules")
        assert sub_rule == (stated[tuple(heads)] if right else HeadSubset(rule, tuple(heads))), sub_rule
    assert [heads for heads, _, _ in layout_groups(rule, n, 4)] == [[0, 1], [2, 3]]
    for ours, theirs in zip(rule_spans(rule, n, 4), rule_spans(S2Attn(), n, 4)):  # no recursion, allowed()'s spans
        assert torch.equal(ours, theirs)


def inputs(n, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 4, n, 16, generator=g, device="cpu").requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("backend", ["chunked", "span"])
@pytest.mark.parametrize("name", ["per-head sub-rules", "every head", "swapped"])
def test_kernels_equal_the_dense_reference_whatever_the_hint(name, backend, n=45):
    """span: its Triton kernels under the interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), one batch
    row (the interpreter's time goes by programs)."""
    rule = HINTS[name]
    q, k, v = inputs(n, batch=1)
    plan = plan_attention(rule, backend, n, 4, 16, "cpu")
    assert plan.kernel == backend
    out = attend_planned(q, k, v, plan)
    ref = dense_attention(q, k, v, S2Attn(), torch.arange(n, device="cpu"))
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), device="cpu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), probe), torch.autograd.grad(ref, (q, k, v), probe)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["swapped", "partial"])
def test_a_plan_from_a_position_offset_follows_allowed_whatever_the_hint(name, n=45):
    """A cached prefill from position 5 runs its heads in the tokens' order (attention/ops/heads.py), where the
    groups also come from allowed() and a wrong hint's rule is not taken."""
    q, k, v = (t.detach() for t in inputs(n, batch=1))
    plan = plan_attention(HINTS[name], "chunked", n, 4, 16, "cpu", start=5)
    ref = dense_attention(q, k, v, S2Attn(), torch.arange(5, 5 + n, device="cpu"))
    torch.testing.assert_close(attend_planned(q, k, v, plan), ref, atol=2e-5, rtol=1e-4)


def test_flex_forward_equals_the_dense_reference_whatever_the_hint(n=150):
    """FlexAttention on the CPU (forward only there), planned over the head groups."""
    q, k, v = (t.detach() for t in inputs(n))
    ref = dense_attention(q, k, v, S2Attn(), torch.arange(n, device="cpu"))
    for name in ("per-head sub-rules", "every head", "swapped"):
        out = attend_planned(q, k, v, plan_attention(HINTS[name], "flex", n, 4, 16, "cpu"))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


class S2AttnMixer(MaskedAttention):
    """Attention under the reader's S2-Attn rule: half the heads shifted by half a group of block_len."""

    settings = MaskedAttention.settings + (BLOCK_LEN,)
    rule_class = PerHeadSubRules

    def __init__(self, config, layer_idx):
        half = config.n_head // 2
        shifts = (0,) * half + (config.block_len // 2,) * half
        super().__init__(config, layer_idx, self.rule_class(config.block_len, shifts))


@pytest.fixture
def s2_attn(monkeypatch):
    """The mixer registered as "s2_attn" for this test only (other tests enumerate the registry)."""
    monkeypatch.setitem(MIXERS, "s2_attn", S2AttnMixer)
    return "s2_attn"


def training(backend, steps=3):
    """Losses of a few AdamW steps of a small GPT whose layers run the S2-Attn rule, and the first step's gradients."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=97, bias=False,
                            dropout=0.0, attn_pattern="s2_attn", block_len=G, attn_backend=backend))
    kernels = {p.kernel for plan in model.plan(2, 64, "cpu") for p in plans_in(plan)}
    tokens = torch.randint(0, 97, (2, 65), generator=torch.Generator().manual_seed(1), device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first_grads = [], None
    for _ in range(steps):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return kernels, losses, first_grads


def test_a_gpt_with_the_s2_attn_rule_trains_on_the_cpu_and_the_simulated_cuda_path(s2_attn):
    _, ref_losses, ref_grads = training("dense")
    paths = {"chunked": training("auto")}
    with simulate_cuda.simulating():
        paths["span"] = training("auto")  # the CUDA path's kernel for a rule whose rows are runs of keys
    for kernel, (kernels, losses, grads) in paths.items():
        assert kernels == {kernel}, kernels
        assert losses[-1] < losses[0], losses
        assert losses == pytest.approx(ref_losses, rel=1e-4), (kernel, losses, ref_losses)
        for ours, theirs in zip(grads, ref_grads):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
