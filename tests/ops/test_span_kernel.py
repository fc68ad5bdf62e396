"""Span attention (attention/ops/span): its Triton kernels, run here under Triton's interpreter on CPU tensors
(conftest sets TRITON_INTERPRET=1 without a GPU), against the project's dense reference over the rule's own edges
(attention/ops/dense.py: dense_attention), forward and backward, at odd sizes; and the spans it derives from rules."""

import math

import pytest
import torch

from attention.bridge import BoundaryWindows
from attention.edges import AnyOf, Causal, FixedBlock, GlobalKeys, HeadWindows, SlidingWindow
from attention.kernels import attend_planned, plan_attention
from attention.ops.dense import dense_attention
from attention.ops.span import op
from attention.ops.span.naive import span_attention_naive, span_mask
from attention.ops.span.spans import KEY_GROUP, band_spans, rule_spans, span_scores, spans_problem, static_spans
from attention.stochastic import PermutedWindow
from attention.swat import AlibiBias
from helpers import assert_close_at_scale, covering

RULES = {
    "swa": SlidingWindow(9),
    "swa_wide": SlidingWindow(40),
    "mswa": HeadWindows((3, 6, 12, 24)),
    "block": FixedBlock(12),
    "bridge": BoundaryWindows("bridge", 16, 8, 48),
    "pbb": BoundaryWindows("pbb", 16, 12, 48),
    "se_bridge": BoundaryWindows("se_bridge", 16, 6, 48),
    "pbb_union": AnyOf((FixedBlock(16), BoundaryWindows("pbb", 16, 12, 48))),
    "bridge_union": AnyOf((FixedBlock(16), BoundaryWindows("bridge", 16, 8, 48))),
}


def inputs(n, H=4, H_kv=4, D=16, dtype=torch.float32, seed=0):
    """q, k, v as the layers pass them: heads-first views of (B, n, H, D) projections."""
    generator = torch.Generator().manual_seed(seed)
    make = lambda heads: (torch.randn(2, n, heads, D, generator=generator, device="cpu").to(dtype)  # noqa: E731
                          .transpose(1, 2).requires_grad_())
    return make(H), make(H_kv), make(H_kv)


def fused_inputs(n, H=4, H_kv=4, D=16, seed=0):
    """q, k, v as a model's fused projection gives them: heads-first views of one (B, n, (H + 2 H_kv) D) tensor,
    no one of them dense in memory."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, n, (H + 2 * H_kv) * D, generator=generator, device="cpu").requires_grad_()
    q, k, v = qkv.split((H * D, H_kv * D, H_kv * D), dim=-1)
    return tuple(t.view(2, n, -1, D).transpose(1, 2) for t in (q, k, v))


def two_rows_of_documents(n, marks):
    """Each token's document (attention/documents.py) for two rows of n tokens: the first with end-of-text marks at
    `marks` (two adjacent: a document of one token), the second with one at its last token only."""
    from attention.documents import document_starts

    ends = torch.zeros(2, n, dtype=torch.long)
    ends[0, list(marks)] = 1
    ends[1, n - 1] = 1
    return document_starts(ends, 1, torch.arange(n))


def grads(y, tensors, seed=1):
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(y.dtype)
    return torch.autograd.grad(y, tensors, g)


def test_the_tests_run_the_triton_kernels_under_the_interpreter():
    """Without a GPU the op's CPU kernel must be Triton's code, not the reference (else these tests prove nothing;
    on a GPU machine the gpu tests below run the compiled kernels)."""
    assert op.triton_installed() and (op.interpreting() or torch.cuda.is_available())
    if not op.interpreting():
        return
    q, k, v = inputs(20)
    spans = static_spans(SlidingWindow(5), 20, 4, 0, "cpu")
    out, lse = op.triton_forward(q.detach(), k.detach(), v.detach(), spans.lo, spans.hi, None, None, 0.0, False)
    assert out.stride(2) == q.shape[1] * q.shape[3]  # laid out (B, n, H, D)
    torch.testing.assert_close(out, span_attention_naive(q, k, v, spans.lo, spans.hi)[0].detach())


# the bridges past their configured context (48), the windows and blocks at a shorter odd length: every rule and
# both lengths run, not every pair of them
@pytest.mark.parametrize("name, n", [(name, 77 if isinstance(RULES[name], (BoundaryWindows, AnyOf)) else 45)
                                     for name in sorted(RULES)])
def test_span_kernels_equal_the_dense_reference_forward_and_backward(name, n):
    rule = RULES[name]
    q, k, v = inputs(n)
    plan = plan_attention(rule, "span", n, 4, 16, "cpu")
    assert plan.kernel == "span"
    y = attend_planned(q, k, v, plan)
    ref = dense_attention(q, k, v, rule, torch.arange(n, device="cpu"))
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


# each kind of bridge, the fused projection and packed documents are paths of their own: every one runs, not every
# combination of them
@pytest.mark.parametrize("kind,fused,documents", [(kind, fused, documents) for (kind, fused), documents in covering(
    [("bridge", False), ("pbb", False), ("se_bridge", False), ("bridge", True)], [False, True])])
def test_two_paths_summed_in_one_call_equal_the_dense_reference(kind, fused, documents, monkeypatch):
    """Branch fusion (a layer's two separately normalised span paths, summed: Kernel.run_sum): the second pass adds
    the first's output and gradients in as it stores them, and equals the two paths' dense references added,
    forward and backward, with grouped-query heads and packed documents; no output is added after the kernels.
    fused: q, k, v are views of one fused projection (the model's), whose gradients are laid out unlike them."""
    from attention.kernels import attend_paths

    n, block = 77, 16
    rules = (FixedBlock(block), BoundaryWindows(kind, block, 6 if kind == "se_bridge" else 8, n))
    q, k, v = (fused_inputs if fused else inputs)(n, H=4, H_kv=2)
    docs = two_rows_of_documents(n, (5, 30, 31, 60)) if documents else None
    plans = tuple(plan_attention(rule, "span", n, 4, 16, "cpu", documents=documents) for rule in rules)
    calls = []
    pair = op.span_pair_attention
    monkeypatch.setattr("attention.ops.span.kernel.span_pair_attention",
                        lambda *args, **kwargs: calls.append(1) or pair(*args, **kwargs))
    y = attend_paths(q, k, v, plans, docs=docs)
    assert calls == [1]
    pos = torch.arange(n, device="cpu")
    ref = sum(dense_attention(q, k, v, rule, pos, docs=docs) for rule in rules)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_two_paths_summed_in_bfloat16_stay_close_to_float32():
    """The accumulating forms in bfloat16, as training runs them: the first path's output and gradients stored in
    bfloat16 and added to by the second pass, against the float32 references of both paths added."""
    from attention.kernels import attend_paths

    n, block = 45, 16
    rules = (FixedBlock(block), BoundaryWindows("bridge", block, 8, n))
    q, k, v = inputs(n, H=4, H_kv=2, dtype=torch.bfloat16)
    plans = tuple(plan_attention(rule, "span", n, 4, 16, "cpu") for rule in rules)
    y = attend_paths(q, k, v, plans)
    pos = torch.arange(n, device="cpu")
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sum(dense_attention(*exact, rule, pos) for rule in rules)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, exact)):
        assert_close_at_scale(ours, theirs, torch.bfloat16)


@pytest.mark.parametrize("fused, documents", covering([False, True], [True, False]))  # each path, not each pair
def test_two_paths_apart_in_one_call_equal_the_dense_reference(fused, documents, monkeypatch):
    """Two paths with outputs of their own over one q, k, v (sa_swa's sa in slots and its swa: Kernel.run_apart):
    one op, whose backward runs sa's kernels in slots and then swa's adding their gradients into sa's; each output
    and the gradients of both (under different upstream gradients) equal the dense references, with grouped-query
    heads, packed documents, and q, k, v as views of one fused projection (whose gradients are laid out unlike
    them)."""
    from attention.kernels import attend_apart
    from attention.stochastic import plan_stochastic, stochastic_attention

    n, window = 57, 14
    q, k, v = (fused_inputs if fused else inputs)(n, H=4, H_kv=2)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5), device="cpu")
    docs = two_rows_of_documents(n, (3, 27, 28, 47)) if documents else None
    sa = plan_stochastic(order, window, "span", 4, 16, "cpu", documents)
    swa = plan_attention(SlidingWindow(window), "span", n, 4, 16, "cpu", documents=documents)
    calls = []
    apart = op.span_pair_apart
    monkeypatch.setattr("attention.ops.span.kernel.span_pair_apart",
                        lambda *args, **kwargs: calls.append(1) or apart(*args, **kwargs))
    y_sa, y_swa = attend_apart(q, k, v, (sa.attention, swa), (sa.layout, None), docs=docs)
    assert calls == [1] and y_sa.grad_fn is y_swa.grad_fn  # one op, one backward for both paths
    repeat = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731  (the dense sa reference takes one k/v per head)
    ref_sa = stochastic_attention(q, repeat(k), repeat(v), order, window, "dense", docs=docs)
    ref_swa = dense_attention(q, k, v, SlidingWindow(window), torch.arange(n, device="cpu"), docs=docs)
    torch.testing.assert_close(y_sa, ref_sa, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(y_swa, ref_swa, atol=2e-5, rtol=1e-4)
    upstream = [torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), device="cpu")
                for seed, y in enumerate((y_sa, y_swa))]
    ours = torch.autograd.grad((y_sa, y_swa), (q, k, v), upstream)
    theirs = torch.autograd.grad((ref_sa, ref_swa), (q, k, v), upstream)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
@pytest.mark.parametrize("window", [11, 40])  # 40: tiles with interior key blocks (no mask, ALiBi's row term apart)
def test_swat_scores_alibi_and_sigmoid_in_the_kernel(activation, window):
    """swat's sigmoid (no row max or sum) and ALiBi with slopes of both signs and an offset, grouped-query heads
    and a head dimension that is no power of two."""
    n, rule = 53, SlidingWindow(window)
    q, k, v = inputs(n, H=4, H_kv=2, D=24)
    bias = AlibiBias(torch.tensor([-0.5, -0.125, 0.25, 0.0625], device="cpu"), -math.log(window))
    plan = plan_attention(rule, "span", n, 4, 24, "cpu", score_mod=bias, activation=activation)
    assert plan.kernel == "span" and plan.data.slopes is not None
    y = attend_planned(q, k, v, plan)
    ref = dense_attention(q, k, v, rule, torch.arange(n, device="cpu"), score_mod=bias, activation=activation)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_stochastic_band_is_causal_in_the_tokens_order():
    """sa's rule over permuted rows: the band of the unrolled ring, causal in original positions."""
    n, window = 61, 14
    rule = PermutedWindow(torch.randperm(n, generator=torch.Generator().manual_seed(3), device="cpu"), window)
    rows = rule.token.shape[0]
    spans = band_spans(rule, rows, "cpu")
    torch.testing.assert_close(span_mask(spans.lo.long(), spans.hi.long(), spans.order.long(), rows)[0],
                               rule.dense_mask(torch.arange(rows, device="cpu")))
    q, k, v = inputs(rows)
    plan = plan_attention(rule, "span", rows, 4, 16, "cpu")
    y = attend_planned(q, k, v, plan)
    ref = dense_attention(q, k, v, rule, torch.arange(rows, device="cpu"))
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_stochastic_band_in_slots_reads_each_row_at_its_token(monkeypatch):
    """sa through span attention in slots (Kernel.run_in_layout): q, k, v stay in token order and the kernels read
    each slot at its token's row, so nothing is gathered to the layout (ToLayout is never called); the output and
    gradients equal the dense reference in original positions, with packed documents and without, at a length
    whose halo copies wrap at both ends, in both sizes of tile (the GPU's 64 x 64 under the interpreter too)."""
    import attention.stochastic as stochastic

    def gathered(*args):
        raise AssertionError("span attention in slots gathered q, k, v to the layout")

    monkeypatch.setattr(stochastic, "to_layout", gathered)
    n, window = 100, 22  # 120 layout rows: two of the GPU's row tiles, the second short
    order = torch.randperm(n, generator=torch.Generator().manual_seed(4), device="cpu")
    starts = (0, 1, 37, 38, 70, 99)  # documents of one token, and one at the last position
    docs = torch.tensor([max(s for s in starts if s <= t) for t in range(n)], device="cpu").expand(2, n)
    for blocks in ((16, 16), (64, 64)):
        monkeypatch.setattr(op, "TEST_BLOCKS", blocks)
        for documents in (None, docs):
            q, k, v = inputs(n, H=2, H_kv=2)
            y = stochastic.stochastic_attention(q, k, v, order, window, "span", docs=documents)
            ref = stochastic.stochastic_attention(q, k, v, order, window, "dense", docs=documents)
            torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
            for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
                torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_bfloat16_inputs_accumulate_in_float32():
    n, rule = 70, SlidingWindow(20)
    q, k, v = inputs(n, dtype=torch.bfloat16)
    y = attend_planned(q, k, v, plan_attention(rule, "span", n, 4, 16, "cpu"))
    assert y.dtype == torch.bfloat16
    ref = dense_attention(*(t.float() for t in (q, k, v)), rule, torch.arange(n, device="cpu"))
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    for ours, theirs in zip(grads(y, (q, k, v)), grads(ref, (q, k, v))):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", sorted(RULES))
def test_spans_are_the_rules_edges_and_the_backward_plan_covers_them(name):
    rule, n = RULES[name], 100
    lo, hi = rule_spans(rule, n, 4)
    mask = span_mask(lo.long(), hi.long(), None, n)
    torch.testing.assert_close(mask if rule.per_head else mask[0],
                               rule.dense_mask(torch.arange(n, device="cpu"), n_head=4))
    spans = static_spans(rule, n, 4, 0, "cpu")
    rows, keys = torch.nonzero(mask.any(0), as_tuple=True)
    first, end = spans.key_first.amin(0), spans.key_end.amax(0)
    assert bool(((first[keys // KEY_GROUP] <= rows) & (rows < end[keys // KEY_GROUP])).all())


def test_rules_whose_rows_are_not_one_run_are_not_spans():
    assert spans_problem(AnyOf((SlidingWindow(16), GlobalKeys(3)))) != ""  # sinks beside a window
    assert rule_spans(AnyOf((SlidingWindow(8), GlobalKeys(2))), 64, 1) is None
    assert spans_problem(SlidingWindow(16)) == spans_problem(FixedBlock(32)) == ""
    with pytest.raises(ValueError, match="attn_backend=span"):
        plan_attention(AnyOf((SlidingWindow(16), GlobalKeys(3))), "span", 64, 4, 16, "cpu")
    assert plan_attention(Causal(), "auto", 64, 4, 16, "cpu").kernel == "sdpa"


def test_a_window_costs_its_band_not_the_sequence():
    """The kernels' tiles of 64 x 64 over a window of 256: the band's key blocks, 1.25x the edges at any length."""
    for n in (4096, 16384):
        rule = SlidingWindow(256)
        lo, hi = rule_spans(rule, n, 1)
        spans = static_spans(rule, n, 1, 0, "cpu")
        ratio = span_scores(spans, 1, 64, 64) / rule.count_edges(n)
        assert 1.0 < ratio < 1.3, ratio


@pytest.mark.gpu  # on CUDA where it exists (the GPU's tiles, compiled Triton), else on the CPU's interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_span_kernels_equal_the_dense_reference(device, dtype):
    # the interpreter is slow: fewer rows on the CPU, still past the narrowest window and ending in a short tile
    n, H = (700 if device == "cuda" else 45), 4
    generator = torch.Generator(device=device).manual_seed(0)
    cases = [(SlidingWindow(130), None, "softmax"), (HeadWindows((32, 64, 128, 256)), None, "softmax"),
             (AnyOf((FixedBlock(128), BoundaryWindows("pbb", 128, 128, 512))), None, "softmax"),
             (SlidingWindow(100), AlibiBias(torch.tensor([-0.5, -0.25, 0.25, 0.5], device=device), -1.0), "sigmoid")]
    for rule, bias, activation in cases:
        q, k, v = (torch.randn(2, n, H, 64, generator=generator, device=device).to(dtype).transpose(1, 2)
                   .requires_grad_() for _ in range(3))
        plan = plan_attention(rule, "span", n, H, 64, device, score_mod=bias, activation=activation)
        y = attend_planned(q, k, v, plan)
        ref = dense_attention(*(t.float() for t in (q, k, v)), rule, torch.arange(n, device=device), score_mod=bias,
                              activation=activation)
        assert_close_at_scale(y, ref, dtype)
        g = torch.randn(y.shape, generator=generator, device=device)
        ours = torch.autograd.grad(y, (q, k, v), g.to(dtype))
        theirs = torch.autograd.grad(ref, (q, k, v), g)
        for a, b in zip(ours, theirs):
            assert_close_at_scale(a, b, dtype)


def test_auto_picks_on_the_gpu_what_measured_fastest():
    """attn_backend=auto's GPU choice rests on GPU figures: the chosen kernel is the fastest in every measurement
    recorded for it, and each names its device and versions."""
    from attention.kernels import GPU_CHOICES, GPU_MEASUREMENTS

    for family, choice in GPU_CHOICES.items():
        assert GPU_MEASUREMENTS[family], f"{family}: no measurement behind choosing {choice}"
        for m in GPU_MEASUREMENTS[family]:
            assert choice in m.ms and min(m.ms, key=m.ms.get) == choice, (family, m)
            assert m.device and "torch" in m.versions and "Triton" in m.versions
