"""Packed documents (attention/documents.py) in the CUDA path's kernels: span attention (its Triton kernels under
Triton's interpreter on the CPU) and FlexAttention (on the CPU standing in for CUDA: attention/simulate_cuda.py),
against the dense reference with the same documents, forward and backward, at odd lengths, with grouped-query
heads and several documents per row (one of length 1, end-of-text tokens at the first and last positions, a row
without any); without a boundary they equal the kernels without documents exactly."""

import math
from dataclasses import dataclass

import pytest
import torch

from attention import simulate_cuda
from attention.bridge import BoundaryWindows
from attention.documents import document_starts
from attention.edges import AnyOf, Causal, EdgeRule, FixedBlock, GlobalKeys, HeadWindows, SlidingWindow
from attention.kernels import attend_planned, plan_attention
from attention.ops.dense import dense_attention
from attention.ops.flex.block_mask import document_block_mask, flex_block_mask
from attention.ops.span.spans import document_rows
from attention.stochastic import PermutedWindow
from attention.swat import AlibiBias
from helpers import Dilated, GLOBAL, assert_close_at_scale, flex_has_backward, packed_documents

# eager FlexAttention on the CPU (the gpu tests without a GPU) warns that it is unfused: expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@dataclass(frozen=True)
class Earlier(EdgeRule):
    """The `window` keys before the query, not the query itself: a document's first token has no key."""

    window: int = 6

    @property
    def lookback(self):
        return self.window

    def allowed(self, q, k, h=None):
        return (k < q) & (q - k <= self.window)


@dataclass(frozen=True)
class Centered(EdgeRule):
    """Keys on both sides of the query: a run that crosses into the next document too."""

    reach: int = 5
    lookahead = 5

    @property
    def lookback(self):
        return self.reach

    def allowed(self, q, k, h=None):
        return (k - q).abs() <= self.reach


SLOPES = (-0.5, -0.125, 0.25, 0.0625)  # swat's ALiBi: slopes of both signs


def inputs(B, n, H=4, H_kv=2, D=16, dtype=torch.float32, seed=0, device="cpu"):
    """q (B, H, n, D) and k, v with H_kv heads, as heads-first views of (B, n, heads, D) projections."""
    generator = torch.Generator(device=device).manual_seed(seed)
    make = lambda heads: (torch.randn(B, n, heads, D, generator=generator, device=device).to(dtype)  # noqa: E731
                          .transpose(1, 2).requires_grad_())
    return make(H), make(H_kv), make(H_kv)


def reference(q, k, v, rule, docs, score_mod=None, activation="softmax"):
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    return dense_attention(q, k, v, rule, torch.arange(q.shape[2], device=q.device), score_mod=score_mod,
                           activation=activation, docs=docs)


def outputs_and_grads(y, tensors, seed=1):
    grad = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(seed), dtype=y.dtype,
                       device=y.device)
    return [y, *torch.autograd.grad(y, tensors, grad)]


def check(kernel, rule, docs, B, n, dtype, tolerance, score_mod=None, activation="softmax", D=16):
    """kernel's attention with docs equals the dense reference with them, output and the gradients of q, k, v."""
    q, k, v = inputs(B, n, D=D, dtype=dtype)
    plan = plan_attention(rule, kernel, n, 4, D, "cpu", score_mod=score_mod, activation=activation, documents=True)
    assert plan.kernel == kernel
    ours = outputs_and_grads(attend_planned(q, k, v, plan, 0.0, docs), (q, k, v))
    theirs = outputs_and_grads(reference(q, k, v, rule, docs, score_mod, activation), (q, k, v))
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tolerance)
    return ours


def unbroken_equals_plain(kernel, rule, B, n, dtype, score_mod=None, activation="softmax", D=16):
    """With one document per row, attention with docs is attention without them, to the bit."""
    q, k, v = inputs(B, n, D=D, dtype=dtype)
    plain = plan_attention(rule, kernel, n, 4, D, "cpu", score_mod=score_mod, activation=activation)
    masked = plan_attention(rule, kernel, n, 4, D, "cpu", score_mod=score_mod, activation=activation, documents=True)
    docs = torch.zeros(B, n, dtype=torch.long, device="cpu")
    ours = outputs_and_grads(attend_planned(q, k, v, masked, 0.0, docs), (q, k, v))
    theirs = outputs_and_grads(attend_planned(q, k, v, plain), (q, k, v))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


# ---- span attention: its Triton kernels under the interpreter ------------------------------------------------

SPAN_RULES = {
    "swa": SlidingWindow(9),
    "swa_wide": SlidingWindow(40),  # tiles with interior key blocks, which documents cut into
    "full": Causal(),
    "mswa": HeadWindows((3, 6, 12, 24)),
    "block": FixedBlock(12),
    "bridge": AnyOf((FixedBlock(16), BoundaryWindows("pbb", 16, 12, 48))),
    "earlier": Earlier(),  # rows with no key in their document
    "centered": Centered(),  # keys past the query: the next document's too
}
SPAN_TOLERANCE = dict(atol=2e-5, rtol=1e-4)  # float32, as tests/ops/test_span_kernel.py


@pytest.mark.parametrize("name", sorted(SPAN_RULES))
def test_span_kernels_mask_documents_as_the_dense_reference(name):
    n = 61
    docs = packed_documents(3, n, lengths=(1, 30), eot_last=True)
    check("span", SPAN_RULES[name], docs, 3, n, torch.float32, SPAN_TOLERANCE)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_span_documents_with_swat_sigmoid_and_alibi(activation):
    n, D = 53, 24
    bias = AlibiBias(torch.tensor(SLOPES, device="cpu"), -math.log(40))
    docs = packed_documents(2, n, lengths=(5, 30), eot_last=True)
    check("span", SlidingWindow(40), docs, 2, n, torch.float32, SPAN_TOLERANCE, bias, activation, D)


def rows_without_a_key_are_zero(kernel, n, tolerance, dtype):
    docs = packed_documents(2, n, lengths=(3, 40))
    y, dq, _, _ = check(kernel, Earlier(), docs, 2, n, dtype, tolerance)
    first = docs == torch.arange(n, device="cpu")  # a document's first token: no earlier key in it
    assert first.sum() > 4
    assert (y.transpose(1, 2)[first] == 0).all() and (dq.transpose(1, 2)[first] == 0).all()


def test_span_rows_without_a_key_in_their_document_are_zero_with_zero_gradient():
    rows_without_a_key_are_zero("span", 45, SPAN_TOLERANCE, torch.float32)


def test_span_documents_over_stochastic_slots_compare_documents():
    """sa's band: rows in slot order, docs permuted alike (layout rows, halo copies included)."""
    n = 61
    rule = PermutedWindow(torch.randperm(n, generator=torch.Generator().manual_seed(3), device="cpu"), 14)
    rows = rule.token.shape[0]
    docs = packed_documents(2, n, lengths=(1, 20), eot_last=True)[:, rule.token]
    check("span", rule, docs, 2, rows, torch.float32, SPAN_TOLERANCE)


def test_span_documents_without_a_boundary_equal_no_documents_exactly():
    """Clipped to their documents (interior key blocks included), compared (sa's slots), and with swat's sigmoid."""
    n = 45
    unbroken_equals_plain("span", SlidingWindow(40), 1, n, torch.float32)
    rule = PermutedWindow(torch.randperm(n, generator=torch.Generator().manual_seed(3), device="cpu"), 14)
    unbroken_equals_plain("span", rule, 1, rule.token.shape[0], torch.float32)
    bias = AlibiBias(torch.tensor(SLOPES, device="cpu"), -1.0)
    unbroken_equals_plain("span", SlidingWindow(40), 1, n, torch.float32, bias, "sigmoid")


def test_span_documents_from_a_position_offset():
    """A prefill from position start: docs are positions, the kernels' rows start at 0."""
    n, start, rule = 40, 7, SlidingWindow(12)
    tokens = torch.ones(2, n, dtype=torch.long, device="cpu")
    tokens[0, [5, 6, 20]] = 0
    docs = document_starts(tokens, 0, torch.arange(start, start + n, device="cpu"), first=torch.tensor([2, 7]))
    q, k, v = inputs(2, n)
    plan = plan_attention(rule, "span", n, 4, 16, "cpu", start, documents=True)
    y = attend_planned(q, k, v, plan, 0.0, docs)
    pos = torch.arange(start, start + n, device="cpu")
    ref = dense_attention(q, *(t.repeat_interleave(2, 1) for t in (k, v)), rule, pos, docs=docs)
    torch.testing.assert_close(y, ref, **SPAN_TOLERANCE)


def test_document_rows_are_each_rows_document():
    docs = packed_documents(3, 50, lengths=(1, 9), eot_last=True)
    first, end = document_rows(docs)
    rows = torch.arange(50, device="cpu")
    same = docs[:, :, None] == docs[:, None, :]
    assert torch.equal(same, (rows >= first[..., None]) & (rows < end[..., None]))
    first, end = document_rows(docs + 5, start=5)  # positions 5.., rows 0..
    assert torch.equal(same, (rows >= first[..., None]) & (rows < end[..., None]))


def test_span_stand_in_masks_documents():
    """On the CPU standing in for CUDA span attention's ops run their naive reference, with the documents too."""
    with simulate_cuda.simulating():
        n = 70
        docs = packed_documents(2, n, lengths=(1, 30), eot_last=True)
        check("span", SlidingWindow(20), docs, 2, n, torch.float64, dict(atol=1e-12, rtol=1e-10))


# ---- FlexAttention: compiled with aot_eager on the CPU standing in for CUDA ----------------------------------

FLEX_RULES = {
    "swa": SlidingWindow(150),
    "full": Causal(),
    "mswa": HeadWindows((3, 60, 120, 240)),
    "block": FixedBlock(130),
    "bridge": AnyOf((FixedBlock(128), BoundaryWindows("bridge", 128, 64, 512))),
    "sinks": GLOBAL[0],  # keys read from a prefix of copies
    "dilated": Dilated(40),  # residue classes as sequences of their own
    "earlier": Earlier(70),
}
FLEX_TOLERANCE = dict(atol=1e-10, rtol=1e-8)  # float64


@pytest.fixture
def cuda_path():
    with simulate_cuda.simulating():
        yield


@pytest.mark.gpu_sim
@pytest.mark.parametrize("name", sorted(FLEX_RULES))
def test_flex_masks_documents_as_the_dense_reference(name, cuda_path):
    n = 301  # three blocks of 128, the last one short
    docs = packed_documents(3, n, lengths=(1, 150), eot_last=True)
    check("flex", FLEX_RULES[name], docs, 3, n, torch.float64, FLEX_TOLERANCE)


@pytest.mark.gpu_sim
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_flex_documents_with_swat_sigmoid_and_alibi(activation, cuda_path):
    n = 301
    bias = AlibiBias(torch.tensor(SLOPES, device="cpu", dtype=torch.float64), -math.log(150))
    docs = packed_documents(2, n, lengths=(20, 150), eot_last=True)
    check("flex", SlidingWindow(150), docs, 2, n, torch.float64, FLEX_TOLERANCE, bias, activation)


@pytest.mark.gpu_sim
def test_flex_documents_over_stochastic_slots(cuda_path):
    n = 211
    rule = PermutedWindow(torch.randperm(n, generator=torch.Generator().manual_seed(3), device="cpu"), 60)
    rows = rule.token.shape[0]
    docs = packed_documents(2, n, lengths=(1, 80), eot_last=True)[:, rule.token]
    check("flex", rule, docs, 2, rows, torch.float64, FLEX_TOLERANCE)


@pytest.mark.gpu_sim
def test_flex_rows_without_a_key_in_their_document_are_zero_with_zero_gradient(cuda_path):
    rows_without_a_key_are_zero("flex", 301, FLEX_TOLERANCE, torch.float64)


@pytest.mark.gpu_sim
@pytest.mark.parametrize("name", ["swa", "sinks", "dilated"])
def test_flex_documents_without_a_boundary_equal_no_documents_exactly(name, cuda_path):
    unbroken_equals_plain("flex", FLEX_RULES[name], 2, 301, torch.float64)


@pytest.mark.gpu_sim
def test_flex_documents_in_a_compiled_block_build_their_mask_in_the_graph(cuda_path):
    """Training calls the kernel inside a compiled block: the documents' block mask is built there, from docs as an
    input (a new batch's documents recompile nothing), forward and backward."""
    from torch._dynamo.utils import counters

    n, rule = 301, SlidingWindow(150)
    plan = plan_attention(rule, "flex", n, 4, 16, "cpu", documents=True)
    block = torch.compile(lambda q, k, v, docs: attend_planned(q, k, v, plan, 0.0, docs), backend="aot_eager",
                          fullgraph=True)
    counters.clear()
    for seed in range(2):
        docs = packed_documents(3, n, lengths=(1, 150), seed=seed)
        q, k, v = inputs(3, n, dtype=torch.float64, seed=seed)
        ours = outputs_and_grads(block(q, k, v, docs), (q, k, v))
        theirs = outputs_and_grads(reference(q, k, v, rule, docs), (q, k, v))
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **FLEX_TOLERANCE)
    assert counters["stats"]["unique_graphs"] == 1


def test_document_block_masks_keep_only_blocks_that_meet_in_a_document():
    """Documents aligned with blocks leave causal attention its diagonal blocks only; a block whose rows and keys
    are one document stays full; without a boundary the rule's block mask is unchanged."""
    n, size = 1024, 128
    rule_mask = flex_block_mask(Causal(), n, 1, "cpu")
    aligned = (torch.arange(n, device="cpu") // size * size)[None]
    mask = document_block_mask(rule_mask, aligned)
    assert mask.kv_num_blocks.tolist() == [[[1] * 8]] and mask.kv_indices[0, 0, :, 0].tolist() == list(range(8))
    assert mask.full_kv_num_blocks.sum() == 0  # the diagonal blocks are causal: partial
    two = torch.where(torch.arange(n, device="cpu") < 512, 0, 512)[None]  # two documents of 4 blocks
    mask = document_block_mask(rule_mask, two)
    blocks = mask.kv_num_blocks + mask.full_kv_num_blocks
    assert blocks.tolist() == [[[1, 2, 3, 4, 1, 2, 3, 4]]] and mask.full_kv_num_blocks.tolist() == [[[0, 1, 2, 3] * 2]]
    docs = packed_documents(3, n, lengths=(100, 400))
    mask = document_block_mask(rule_mask, docs)
    assert mask.kv_num_blocks.shape[0] == 3  # one per row of the batch
    computed = mask.kv_num_blocks + mask.full_kv_num_blocks
    assert (computed <= rule_mask.kv_num_blocks + rule_mask.full_kv_num_blocks).all()
    assert torch.equal(computed[2], (rule_mask.kv_num_blocks + rule_mask.full_kv_num_blocks)[0])  # no boundary
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(mask, name)[2], getattr(rule_mask, name)[0])


def test_documents_are_found_on_the_device_without_reading_them_on_the_host():
    """No data-dependent Python in the documents' masks: they trace into one graph (a read on the host, which would
    synchronise a GPU, would break it)."""
    n = 301
    rule_mask = flex_block_mask(SlidingWindow(150), n, 1, "cpu")
    docs = packed_documents(2, n)
    build = torch.compile(lambda docs: document_block_mask(rule_mask, docs).kv_indices, backend="eager",
                          fullgraph=True)
    assert torch.equal(build(docs), document_block_mask(rule_mask, docs).kv_indices)
    rows = torch.compile(document_rows, backend="eager", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(rows(docs, 0), document_rows(docs, 0)))


# ---- on CUDA where it exists (the GPU's tiles, compiled Triton and FlexAttention), else on the CPU ------------

def aligned_and_odd_documents(B, n, device):
    """docs with an end-of-text token first, one last, one document of length 1 and boundaries inside key blocks;
    the last row one document."""
    tokens = torch.ones(B, n, dtype=torch.long, device=device)
    for b in range(B - 1):
        tokens[b, torch.arange(b, n, 21 + 16 * b, device=device)] = 0
    tokens[0, [2, 3, n - 1]] = 0
    return document_starts(tokens, 0, torch.arange(n, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_span_kernels_mask_documents(device, dtype):
    # the interpreter is slow: fewer rows on the CPU, still past the narrowest window and ending in a short tile
    n, H = (700 if device == "cuda" else 45), 4
    docs = aligned_and_odd_documents(2, n, device)
    cases = [(SlidingWindow(130), None, "softmax"), (Causal(), None, "softmax"),
             (HeadWindows((32, 64, 128, 256)), None, "softmax"),
             (SlidingWindow(100), AlibiBias(torch.tensor([-0.5, -0.25, 0.25, 0.5], device=device), -1.0), "sigmoid")]
    for rule, bias, activation in cases:
        q, k, v = inputs(2, n, H, H, 64, dtype, device=device)
        plan = plan_attention(rule, "span", n, H, 64, device, score_mod=bias, activation=activation, documents=True)
        y = attend_planned(q, k, v, plan, 0.0, docs)
        ref = dense_attention(*(t.float() for t in (q, k, v)), rule, torch.arange(n, device=device), score_mod=bias,
                              activation=activation, docs=docs)
        assert_close_at_scale(y, ref, dtype)
        g = torch.randn(y.shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
        for a, b in zip(torch.autograd.grad(y, (q, k, v), g.to(dtype)), torch.autograd.grad(ref, (q, k, v), g)):
            assert_close_at_scale(a, b, dtype)


@pytest.mark.gpu
def test_gpu_flex_masks_documents(device):
    n = 700 if device == "cuda" else 300
    docs = aligned_and_odd_documents(3, n, device)
    backward = flex_has_backward(device)
    for rule in (Causal(), FixedBlock(128), AnyOf((SlidingWindow(16), GlobalKeys(3)))):
        q, k, v = (t.detach().requires_grad_(backward) for t in inputs(3, n, 4, 2, 16, torch.float32, device=device))
        plan = plan_attention(rule, "flex", n, 4, 16, device, documents=True)
        y = attend_planned(q, k, v, plan, 0.0, docs)
        ref = reference(q, k, v, rule, docs)
        torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
        if backward:
            g = torch.randn(y.shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
            for a, b in zip(torch.autograd.grad(y, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
