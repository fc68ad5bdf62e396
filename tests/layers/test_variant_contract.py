"""The variant contract holds for a rule written plainly: a per-head allowed() may leave out its head axis where its
heads agree (as head_values does), and heads with the same edges are grouped by the kernels from allowed() alone,
at the cost head_groups() would give. The rule here is LongLoRA's shifted sparse attention (S2-Attn), causal: groups
of G tokens; the heads with a shift attend within groups moved by G/2."""

from dataclasses import dataclass

import pytest
import torch

from attention import simulate_cuda
from attention.edges import EdgeRule, head_values
from attention.kernels import attend, computed_scores, plan_attention, plans_in
from attention.ops.chunked.tiles import chunk_tiles
from attention.ops.dense import dense_attention
from config import ModelConfig
from model import GPT

GROUP = 16


@dataclass(frozen=True)
class ShiftedGroups(EdgeRule):
    """S2-Attn: head h attends causally within groups of `group` tokens moved by shifts[h]."""

    group: int = GROUP
    shifts: tuple = (0, 0, GROUP // 2, GROUP // 2)
    per_head = True

    @property
    def lookback(self):
        return self.group - 1

    def allowed(self, q, k, h=None):
        shift = head_values(self.shifts, h)  # a plain int when every head has the same shift: no head axis
        return (k <= q) & ((q + shift) // self.group == (k + shift) // self.group)


@dataclass(frozen=True)
class ShiftedGroupsStated(ShiftedGroups):
    """The same rule with its head groups stated."""

    def head_groups(self):
        by_shift = {}
        for head, shift in enumerate(self.shifts):
            by_shift.setdefault(shift, []).append(head)
        return [(heads, ShiftedGroups(self.group, (shift,) * len(heads))) for shift, heads in by_shift.items()]


def test_a_per_head_rule_without_a_head_axis_gives_one_value_per_head():
    rule = ShiftedGroups(shifts=(0, 0, 0, 0))
    q, k, h = torch.arange(40)[None, :, None], torch.arange(40)[None, None, :], torch.arange(4)[:, None, None]
    assert rule.allowed(q, k, h).shape == (4, 40, 40)
    assert rule.dense_mask(torch.arange(40), n_head=4).shape == (4, 40, 40)


def model_under(rule: EdgeRule, backend: str) -> GPT:
    """A two-layer GPT whose attention layers run under rule (the same weights for every backend)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=96, vocab_size=97, bias=False,
                            attn_pattern="swa", swa_window=32, attn_backend=backend))
    for block in model.blocks:
        block.mixer.rule = rule
    return model


def loss_and_grads(model: GPT):
    tokens = torch.randint(0, 97, (2, 97), generator=torch.Generator().manual_seed(1))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(a, b, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, atol=tol, rtol=tol)
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)


@pytest.mark.parametrize("shifts", [(0, 0, 0, 0), (0, 0, GROUP // 2, GROUP // 2)], ids=["no head axis", "two groups"])
def test_a_plain_per_head_rule_trains_on_the_cpu_and_the_simulated_cuda_path_as_the_dense_reference(shifts):
    rule = ShiftedGroups(shifts=shifts)
    reference = loss_and_grads(model_under(rule, "dense"))
    model = model_under(rule, "auto")
    assert {p.kernel for block in model.plan(2, 96, "cpu") for p in plans_in(block)} == {"chunked"}
    assert_same(loss_and_grads(model), reference)
    with simulate_cuda.simulating():
        for backend in ("auto", "flex"):  # auto: span attention (each row's keys are one run)
            model = model_under(rule, backend)
            kernels = {p.kernel for block in model.plan(2, 96, "cpu") for p in plans_in(block)}
            assert kernels == {"span" if backend == "auto" else "flex"}, kernels
            assert_same(loss_and_grads(model), reference)


def test_a_plain_per_head_rule_with_a_head_axis_of_one_value_runs_every_kernel_exactly():
    rule = ShiftedGroups(shifts=(GROUP // 2,) * 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 70, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    probe = torch.randn(2, 4, 70, 16, generator=g, dtype=torch.float64)
    ref = dense_attention(q, k, v, rule, torch.arange(70))
    ref_grads = torch.autograd.grad(ref, (q, k, v), probe)
    for backend, tol in (("chunked", 1e-7), ("sdpa", 1e-7), ("span", 1e-5)):  # span: float32 inside the kernel
        out = attend(q, k, v, rule, backend)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), probe), ref_grads):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_head_groups_found_from_allowed_alone_cost_what_stated_ones_cost(n=1024):
    plain, stated = ShiftedGroups(), ShiftedGroupsStated()
    edges = sum(plain.count_edges(n, h) for h in range(4))
    assert edges == sum(stated.count_edges(n, h) for h in range(4))
    found = plan_attention(plain, "chunked", n, 4, 16, "cpu")
    assert [group.heads for group in found.data.groups] == [(0, 1), (2, 3)]
    per_edge = computed_scores(found, 4) / edges
    assert per_edge == computed_scores(plan_attention(stated, "chunked", n, 4, 16, "cpu"), 4) / edges
    # the four heads as one group pay for both shifts' keys in every tile
    one_group = 4 * chunk_tiles(plain, n, 0, plain.chunk_size(), 4, "cpu").scores(n, 4) / edges
    assert per_edge < 0.9 * one_group, (per_edge, one_group)
