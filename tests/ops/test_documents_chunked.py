"""Packed documents (attention/documents.py) in the CPU's kernels: the chunked kernel on each of its paths (the fused
CPU flash kernel with head groups and layouts, sigmoid attention, batched SDPA and explicit math over the tiles)
and the window kernel mask the rule's edges AND same document, as the dense reference does, forward and backward;
without a boundary they give what they give without documents, bit for bit."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attention import simulate_cuda
from attention.bridge import BoundaryWindows
from attention.documents import begins_document
from attention.edges import AnyOf, EdgeRule, FixedBlock, SlidingWindow
from attention.kernels import KERNELS, attend_planned, plan_attention
from attention.layer import MaskedAttention
from attention.layouts import LaidOutRule, Layout
from attention.ops.contract import AttentionCall, AttentionPlan
from attention.ops.dense import dense_attention
from attention.registry import build_mixer, example_cases, pattern_names
from attention.swat import AlibiBias
from config import ModelConfig
from conftest import generator
from helpers import BRIDGED, Dilated, GLOBAL, LargestTensor, PerHeadRule, fwd_bwd, packed_documents

HEADS, DIM = 4, 8


@dataclass(frozen=True)
class EarlierKeys(EdgeRule):
    """The window keys before the query, not the query itself: a document's first token has none of its own."""

    lookback = 12

    def allowed(self, q, k, h=None):
        return (k < q) & (q - k <= 12)


RULES = [SlidingWindow(16), SlidingWindow(33), FixedBlock(20), PerHeadRule(), Dilated(), EarlierKeys(), *BRIDGED,
         *GLOBAL]
ALIBI = AlibiBias(torch.tensor([-0.5, -0.25, 0.25, 0.5]), -1.0)


def inputs(n, batch=3, kv_heads=HEADS, seed=0):
    """q (batch, HEADS, n, DIM) and k, v (batch, kv_heads, n, DIM) in float64, requiring gradients."""
    g = generator(seed)
    shapes = [(batch, HEADS, n, DIM)] + [(batch, kv_heads, n, DIM)] * 2
    return [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_() for shape in shapes]


def chunked_plan(rule, n, score_mod=None, activation="softmax", cpu_flash=True, documents=True):
    """The chunked kernel's own plan (never the window kernel in its place); cpu_flash=False: the branch CUDA
    takes (batched SDPA or explicit math over the tiles)."""
    call = AttentionCall(rule, n, HEADS, DIM, "cpu", score_mod=score_mod, activation=activation, documents=documents)
    data = dataclasses.replace(KERNELS["chunked"].plan(call), cpu_flash=cpu_flash)
    return AttentionPlan("chunked", call, data)


def assert_equals_dense(run, rule, docs, tensors, score_mod=None, activation="softmax"):
    """run(q, k, v) against the dense reference with docs, forward and backward (k and v repeated to q's heads)."""
    n = tensors[0].shape[2]

    def dense(q, k, v):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        return dense_attention(q, k, v, rule, torch.arange(n), score_mod=score_mod, activation=activation, docs=docs)

    ref, ref_grads = fwd_bwd(dense, tensors)
    out, grads = fwd_bwd(run, tensors)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("n", [37, 203])
@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("cpu_flash", [True, False], ids=["flash", "tiles"])
def test_chunked_with_documents_equals_dense(rule, n, cpu_flash):
    # documents of length 1 to 12, an end-of-text token at the first and the last position of row 0, a row with
    # no boundary at all; heads of different windows (PerHeadRule) and residue-class layouts (Dilated)
    docs = packed_documents(3, n, lengths=(1, 12), eot_last=True)
    plan = chunked_plan(rule, n, cpu_flash=cpu_flash)
    assert_equals_dense(lambda q, k, v: attend_planned(q, k, v, plan, 0.0, docs), rule, docs, inputs(n))


@pytest.mark.parametrize("cpu_flash, activation", [(True, "softmax"), (False, "softmax"), (True, "sigmoid")],
                         ids=["flash", "tiles", "sigmoid"])
def test_rows_the_documents_leave_without_a_key_get_zero_output_and_gradient(cpu_flash, activation):
    n = 64
    docs = packed_documents(3, n, lengths=(1, 12), eot_last=True, seed=9)
    plan = chunked_plan(EarlierKeys(), n, activation=activation, cpu_flash=cpu_flash)
    q, k, v = inputs(n)
    out = attend_planned(q, k, v, plan, 0.0, docs)
    begins = begins_document(docs, torch.arange(n))  # EarlierKeys gives a document's first token earlier ones only
    assert torch.isfinite(out).all() and (out.transpose(1, 2)[begins] == 0).all()
    grad_q, = torch.autograd.grad(out.sum(), q)
    assert (grad_q.transpose(1, 2)[begins] == 0).all() and (grad_q.transpose(1, 2)[~begins] != 0).any()


@pytest.mark.parametrize("rule", [SlidingWindow(16), PerHeadRule(), Dilated(), *BRIDGED[:1]], ids=repr)
@pytest.mark.parametrize("activation, score_mod", [("sigmoid", ALIBI), ("sigmoid", None), ("softmax", ALIBI),
                                                   ("softmax", lambda s, b, h, q, k: s - 0.1 * (h + 1) * (q - k))],
                         ids=["sigmoid_alibi", "sigmoid", "softmax_alibi", "softmax_score_mod"])
def test_chunked_score_biases_and_sigmoid_with_documents_equal_dense(rule, activation, score_mod):
    # swat's sigmoid attention with ALiBi (ChunkedSigmoid), a ScoreBias on the fused flash path, and a score_mod
    # of any other kind (explicit math over the tiles); without a score_mod a layout rule runs in its layout
    n = 101
    docs = packed_documents(3, n, lengths=(1, 30), eot_first=False, eot_last=True, seed=1)
    plan = chunked_plan(rule, n, score_mod, activation)
    assert_equals_dense(lambda q, k, v: attend_planned(q, k, v, plan, 0.0, docs), rule, docs, inputs(n), score_mod,
                        activation)


@pytest.mark.parametrize("rule", [SlidingWindow(16), PerHeadRule(), Dilated()], ids=repr)
@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_grouped_query_heads_with_documents_equal_dense(rule, activation):
    n = 77
    docs = packed_documents(3, n, lengths=(1, 20), seed=2)
    plan = chunked_plan(rule, n, activation=activation)
    assert_equals_dense(lambda q, k, v: attend_planned(q, k, v, plan, 0.0, docs), rule, docs,
                        inputs(n, kv_heads=2), activation=activation)


def test_documents_are_told_apart_by_equality_in_any_order_of_rows():
    # a caller that permutes the tokens (stochastic attention's slots) passes docs permuted alike: the kernel runs
    # over rows whose documents are not in order
    n, rule = 90, SlidingWindow(20)
    order = torch.randperm(n, generator=generator(3))
    docs = packed_documents(3, n, lengths=(1, 25), seed=3)
    rows_rule, back = LaidOutRule(rule, Layout(order)), torch.argsort(order)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, torch.arange(n), docs=docs), inputs(n))
    for cpu_flash in (True, False):
        plan = chunked_plan(rows_rule, n, cpu_flash=cpu_flash)
        out, grads = fwd_bwd(lambda q, k, v: attend_planned(q[:, :, order], k[:, :, order], v[:, :, order], plan, 0.0,
                                                            docs[:, order])[:, :, back], inputs(n))
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)


def test_with_dropout_no_edge_crosses_a_document():
    # dropout takes the batched SDPA path; a query's output then reaches only the keys and values of its own
    # document, whichever probabilities dropout drops
    n, rule = 120, SlidingWindow(40)
    docs = packed_documents(3, n, lengths=(5, 30), seed=4)
    plan = chunked_plan(rule, n)
    q, k, v = inputs(n)
    torch.manual_seed(0)
    y = attend_planned(q, k, v, plan, 0.5, docs)
    row, query = 0, n // 2
    grads = torch.autograd.grad(y[row, :, query].sum(), (q, k, v))
    outside = docs[row] != docs[row, query]
    assert outside.any() and (~outside).sum() > 1
    for g in grads:
        assert (g[:, :, outside] == 0).all() and (g[1:] == 0).all()
    assert (grads[1][row, :, ~outside] != 0).any()


WINDOWS = [BoundaryWindows("bridge", 16, 16, 257), BoundaryWindows("pbb", 20, 12, 257),
           BoundaryWindows("se_bridge", 16, 8, 257)]


@pytest.mark.parametrize("rule", BRIDGED + WINDOWS, ids=repr)
@pytest.mark.parametrize("n", [37, 203])
@pytest.mark.parametrize("cuda_branch", [False, True], ids=["cpu", "cuda_branch"])
def test_window_kernel_with_documents_equals_dense(rule, n, cuda_branch):
    # paper 004's bridges: the window kernel runs in the chunked kernel's place for a rule of disjoint windows;
    # on CUDA (here the CPU standing in for it) its tiles are laid out otherwise
    docs = packed_documents(3, n, lengths=(1, 12), eot_last=True, seed=5)
    plan = plan_attention(rule, "chunked", n, HEADS, DIM, "cpu", documents=True)
    if isinstance(rule, BoundaryWindows):
        assert plan.kernel == "window"
    with simulate_cuda.simulating(cuda_branch):
        for tensors in (inputs(n), inputs(n, kv_heads=2)):
            assert_equals_dense(lambda q, k, v: attend_planned(q, k, v, plan, 0.0, docs), rule, docs, tensors)


def registered_paths(window=16, n_head=HEADS):
    """(case, rule, score_mod, activation) of every path of every registered mixer that is masked attention under
    static rules, as the registry's example cases build them."""
    for name, settings in example_cases(window).items():
        if len(pattern_names(settings["attn_pattern"])) > 1:
            continue  # a pattern of several mixers: each is a case of its own
        cfg = ModelConfig(**{"arch": "llama", "n_layer": 1, "n_head": n_head, "n_embd": n_head * DIM,
                             "block_size": 256, "bias": False, **settings})
        layer = build_mixer(cfg, cfg.n_layer - 1)
        if not isinstance(layer, MaskedAttention):
            continue
        for rule in layer.paths():
            if rule.static:
                yield name, rule, layer.score_mod("cpu"), layer.activation


REGISTERED = list(registered_paths())


@pytest.mark.parametrize("case, rule, score_mod, activation", REGISTERED,
                         ids=[f"{case}-{type(rule).__name__}" for case, rule, *_ in REGISTERED])
def test_registered_rules_with_documents_equal_dense(case, rule, score_mod, activation):
    n = 203
    docs = packed_documents(3, n, lengths=(1, 40), eot_last=True, seed=6)
    tensors = inputs(n)
    for plan in (chunked_plan(rule, n, score_mod, activation),
                 plan_attention(rule, "auto", n, HEADS, DIM, "cpu", score_mod=score_mod, activation=activation,
                                documents=True)):
        assert_equals_dense(lambda q, k, v: attend_planned(q, k, v, plan, 0.0, docs), rule, docs, tensors,
                            score_mod, activation)


@pytest.mark.parametrize("rule, score_mod, activation, cpu_flash",
                         [(SlidingWindow(16), None, "softmax", True), (SlidingWindow(16), None, "softmax", False),
                          (PerHeadRule(), None, "softmax", True), (Dilated(), None, "softmax", True),
                          (Dilated(), None, "sigmoid", True), (Dilated(), None, "softmax", False),
                          (SlidingWindow(16), ALIBI, "sigmoid", True), (SlidingWindow(16), ALIBI, "softmax", True),
                          (FixedBlock(20), lambda s, b, h, q, k: s - 0.1 * (q - k), "softmax", True),
                          (BRIDGED[0], None, "softmax", True)],
                         ids=["swa_flash", "swa_tiles", "per_head", "dilated", "dilated_sigmoid", "dilated_tiles",
                              "swa_sigmoid_alibi", "swa_softmax_alibi", "block_score_mod", "bridged"])
def test_documents_without_a_boundary_change_nothing(rule, score_mod, activation, cpu_flash):
    n = 203
    docs = torch.zeros(3, n, dtype=torch.long)  # every row one document
    plans = [chunked_plan(rule, n, score_mod, activation, cpu_flash, documents) for documents in (False, True)]
    without, without_grads = fwd_bwd(lambda q, k, v: attend_planned(q, k, v, plans[0]), inputs(n))
    out, grads = fwd_bwd(lambda q, k, v: attend_planned(q, k, v, plans[1], 0.0, docs), inputs(n))
    assert torch.equal(out, without)
    assert all(torch.equal(g, w) for g, w in zip(grads, without_grads))


@pytest.mark.parametrize("rule", WINDOWS, ids=repr)
@pytest.mark.parametrize("cuda_branch", [False, True], ids=["cpu", "cuda_branch"])
def test_window_kernel_documents_without_a_boundary_change_nothing(rule, cuda_branch):
    n = 203
    plans = [plan_attention(rule, "chunked", n, HEADS, DIM, "cpu", documents=documents) for documents in (False, True)]
    assert plans[1].kernel == "window"
    with simulate_cuda.simulating(cuda_branch):
        without, without_grads = fwd_bwd(lambda q, k, v: attend_planned(q, k, v, plans[0]), inputs(n))
        out, grads = fwd_bwd(lambda q, k, v: attend_planned(q, k, v, plans[1], 0.0,
                                                            torch.zeros(3, n, dtype=torch.long)), inputs(n))
    assert torch.equal(out, without)
    assert all(torch.equal(g, w) for g, w in zip(grads, without_grads))


def test_auto_runs_the_chunked_and_window_kernels_with_documents_on_the_cpu():
    call = AttentionCall(SlidingWindow(16), 100, HEADS, DIM, "cpu", documents=True)
    assert KERNELS["chunked"].document_problem(call) == KERNELS["window"].document_problem(call) == ""
    bridge = BoundaryWindows("bridge", 16, 16, 257)
    assert plan_attention(bridge, "auto", 100, HEADS, DIM, "cpu", documents=True).kernel == "window"
    assert plan_attention(AnyOf((FixedBlock(16), bridge)), "auto", 100, HEADS, DIM, "cpu",
                          documents=True).kernel == "chunked"


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value back to the host (a synchronisation on CUDA)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule, activation", [(SlidingWindow(16), "softmax"), (PerHeadRule(), "softmax"),
                                              (Dilated(), "softmax"), (SlidingWindow(16), "sigmoid"),
                                              (BoundaryWindows("bridge", 16, 16, 257), "softmax")], ids=repr)
def test_the_paths_cuda_takes_read_no_document_back_to_the_host(rule, activation):
    # CUDA's branch of the chunked kernel (batched SDPA over the tiles), sigmoid attention and the window kernel
    # mask documents on the device: no host synchronisation, forward or backward
    n = 101
    docs = packed_documents(3, n, lengths=(1, 30), seed=8)
    plan = (plan_attention(rule, "chunked", n, HEADS, DIM, "cpu", documents=True) if isinstance(rule, BoundaryWindows)
            else chunked_plan(rule, n, activation=activation, cpu_flash=False))
    q, k, v = inputs(n)
    with simulate_cuda.simulating(), HostReads() as host:
        attend_planned(q, k, v, plan, 0.0, docs).sum().backward()
    assert host.reads == []


@pytest.mark.parametrize("rule", [SlidingWindow(256), Dilated(32, (1, 2, 4, 8)), BoundaryWindows("bridge", 256, 256,
                                                                                                  8192)], ids=repr)
def test_documents_never_build_an_n_by_n_tensor(rule):
    n = 8192
    docs = packed_documents(2, n, lengths=(200, 3000), seed=7)
    q, k, v = (torch.randn(2, HEADS, n, 16, requires_grad=True) for _ in range(3))
    plan = plan_attention(rule, "chunked", n, HEADS, 16, "cpu", documents=True)
    with LargestTensor() as largest:
        attend_planned(q, k, v, plan, 0.0, docs).sum().backward()
    assert largest.numel <= 2 * HEADS * n * 512, largest.shape  # tiles of a chunk's keys, never n x n
