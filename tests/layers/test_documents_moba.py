"""MoBA over packed documents (attention/moba.py, attention/ops/moba): a query chooses among the blocks its document
overlaps, each scored by the mean of its document's keys in the block, and attends to its document's keys in the
chosen blocks. Every form (the dense reference, the blockwise kernel, the Triton kernels under Triton's
interpreter, cached decoding) against that definition written out per query, forward and backward; no boundary
changes nothing; nothing crosses from one document into the next."""

import math

import pytest
import torch

from attention.call import MixerCall
from attention import simulate_cuda
from attention.documents import document_starts
from attention.ops.moba import op
from attention.ops.moba.blockwise import moba_blockwise
from attention.ops.moba.naive import moba_choose, moba_dense
from attention.registry import build_mixer
from config import ModelConfig
from conftest import generator
from helpers import LargestTensor, assert_close_at_scale, fwd_bwd, packed_documents


def inputs(n, batch=3, heads=3, dim=8, dtype=torch.float64, seed=0):
    """q, k, v (batch, heads, n, dim) laid out (batch, n, heads, dim) as the layers pass them, requiring gradients."""
    g = generator(seed)
    return [torch.randn(batch, n, heads, dim, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def chosen_by_definition(q, k, t, start, block, topk):
    """One query's blocks: its own, then the best earlier blocks its document (from `start`) overlaps, each scored
    by q . the mean of the document's keys in it."""
    own = t // block
    score = lambda j: float(q @ k[max(j * block, start):(j + 1) * block].mean(0))  # noqa: E731
    return {own, *sorted(range(start // block, own), key=score, reverse=True)[:topk - 1]}


def moba_by_definition(q, k, v, q_pos, docs, block, topk):
    """Dense attention of each query (at q_pos) over the keys of its document in its blocks (chosen_by_definition),
    and those blocks per (row, head, query)."""
    B, H, Tq, D = q.shape
    keys = torch.arange(k.shape[2])
    mask = torch.zeros(B, H, Tq, k.shape[2], dtype=torch.bool)
    chosen = {}
    for b in range(B):
        for h in range(H):
            for i, t in enumerate(q_pos.tolist()):
                start = int(docs[b, i])
                blocks = chosen_by_definition(q[b, h, i].detach(), k[b, h].detach(), t, start, block, topk)
                chosen[b, h, i] = blocks
                mask[b, h, i] = (keys >= start) & (keys <= t) & torch.isin(keys // block, torch.tensor(list(blocks)))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, -math.inf)
    return torch.softmax(scores, -1) @ v, chosen


def chosen_sets(chosen):
    """moba_choose's blocks as chosen_by_definition's sets, per (row, head, query)."""
    B, H, T, _ = chosen.shape
    rows = chosen.tolist()
    return {(b, h, i): {j for j in rows[b][h][i] if j >= 0} for b in range(B) for h in range(H) for i in range(T)}


def assert_results_equal(ours, reference, **tolerance):
    for a, b in zip([ours[0], *ours[1]], [reference[0], *reference[1]]):
        torch.testing.assert_close(a.to(b.dtype), b, **tolerance)


def cut_first_blocks_chosen(chosen, docs, q_pos, block):
    """How many (query, block) choices take a block where the query's document begins after the block's start
    (scored by part of the block), other than the query's own."""
    first = (docs // block)[:, None, :, None]
    cut = (docs % block != 0)[:, None, :, None] & (first < (q_pos // block)[:, None])
    return int(((chosen == first) & cut).sum())


CASES = [(70, 8, 2), (71, 8, 3), (33, 16, 4), (64, 8, 1), (45, 12, 5)]


@pytest.mark.parametrize("n, block, topk", CASES)
@pytest.mark.parametrize("eot_last", [False, True])
def test_blockwise_and_dense_kernels_equal_the_definition_forward_and_backward(n, block, topk, eot_last):
    """Odd lengths, a document of one token, end-of-text tokens first and last in row 0, none in the last row."""
    tensors = inputs(n)
    pos = torch.arange(n)
    docs = packed_documents(3, n, lengths=(1, 30), eot_last=eot_last)
    reference = fwd_bwd(lambda q, k, v: moba_by_definition(q, k, v, pos, docs, block, topk)[0], tensors)
    chosen = moba_choose(*tensors[:2], pos, block, topk, docs)
    assert chosen_sets(chosen) == moba_by_definition(*tensors, pos, docs, block, topk)[1]
    assert (chosen[..., 0] == pos // block).all()  # the own block first, always
    if topk > 1 and n > 60:
        assert cut_first_blocks_chosen(chosen, docs, pos, block) > 0  # means over part of a block are exercised
    for kernel in (moba_blockwise, moba_dense):
        assert_results_equal(fwd_bwd(lambda q, k, v: kernel(q, k, v, pos, chosen, block, docs=docs), tensors),
                             reference)


@pytest.mark.parametrize("n_keys, n_queries", [(70, 70), (70, 9), (71, 1)])
def test_decoding_over_a_cache_and_the_dropout_path_equal_the_definition(n_keys, n_queries):
    """Queries at the end of a longer key sequence (every chosen block, the own one too, through the grouped path),
    and the dropout path's autograd at p = 0."""
    from attention.ops.moba.blockwise import _moba_blockwise

    q, k, v = inputs(n_keys)
    q = q[:, :, -n_queries:].detach().requires_grad_()
    pos = torch.arange(n_keys - n_queries, n_keys)
    docs = packed_documents(3, n_keys, lengths=(1, 30), eot_last=True)[:, -n_queries:]
    reference = fwd_bwd(lambda q, k, v: moba_by_definition(q, k, v, pos, docs, 8, 3)[0], (q, k, v))
    chosen = moba_choose(q, k, pos, 8, 3, docs)
    for kernel in (moba_blockwise, moba_dense, lambda *args, docs: _moba_blockwise(*args, 0.0, docs)):
        assert_results_equal(fwd_bwd(lambda q, k, v: kernel(q, k, v, pos, chosen, 8, docs=docs), (q, k, v)),
                             reference)


def test_the_layer_with_documents_and_its_cached_steps_equal_the_definition():
    config = ModelConfig(n_layer=1, n_head=3, n_embd=24, block_size=128, vocab_size=61, arch="llama",
                         attn_pattern="moba", moba_block=8, moba_topk=3, document_mask=True, eot_id=7)
    mixer = build_mixer(config, 0).double().eval()
    q, k, v = inputs(53)
    docs = packed_documents(3, 53, lengths=(1, 30), eot_last=True)
    expected = moba_by_definition(q, k, v, torch.arange(53), docs, 8, 3)[0]
    torch.testing.assert_close(mixer.kernel_forward(q, k, v, docs), expected)
    steps = [mixer.attend_cached(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], torch.tensor([t]),
                                 torch.arange(t + 1), docs[:, t:t + 1]) for t in range(40, 53)]
    torch.testing.assert_close(torch.cat(steps, 2), expected[:, :, 40:])


@pytest.mark.parametrize("kernel", ["blockwise", "dense", "triton"])
def test_without_a_boundary_documents_change_nothing(kernel):
    n, block, topk = 45, 8, 3
    dtype = torch.float32 if kernel == "triton" else torch.float64
    tensors = inputs(n, batch=2, heads=2, dtype=dtype)  # the interpreter's cost grows with rows and heads
    pos = torch.arange(n)
    docs = document_starts(torch.ones(2, n, dtype=torch.long), 7, pos)  # one document per row
    if kernel == "triton":
        q, k = tensors[:2]
        assert torch.equal(op.triton_choose(q, k, block, topk, docs), op.triton_choose(q, k, block, topk))
        run = lambda q, k, v, docs=None: op.moba_attention(q, k, v, block, topk, docs)  # noqa: E731
    else:
        chosen = moba_choose(*tensors[:2], pos, block, topk)
        assert torch.equal(moba_choose(*tensors[:2], pos, block, topk, docs), chosen)
        run = {"blockwise": moba_blockwise, "dense": moba_dense}[kernel]
        run = lambda q, k, v, docs=None, run=run: run(q, k, v, pos, chosen, block, docs=docs)  # noqa: E731
    with_docs = fwd_bwd(lambda q, k, v: run(q, k, v, docs), tensors)
    without = fwd_bwd(run, tensors)
    for a, b in zip([with_docs[0], *with_docs[1]], [without[0], *without[1]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["blockwise", "triton"])
def test_a_document_is_untouched_by_the_one_before(kernel):
    """Changing the queries, keys and values of one document changes no output of the next, and the next
    document's outputs have no gradient on it."""
    n, block, topk = 70, 8, 3
    dtype = torch.float32 if kernel == "triton" else torch.float64
    q, k, v = inputs(n, batch=2, heads=2, dtype=dtype)  # the interpreter's cost grows with rows and heads
    pos = torch.arange(n)
    marks = torch.zeros(2, n, dtype=torch.long)
    marks[:, [21, 43]] = 7  # documents 0..20, 21..42 (starting inside a block) and 43..69 in every row
    docs = document_starts(marks, 7, pos)

    def run(q, k, v):
        if kernel == "triton":
            return op.moba_attention(q, k, v, block, topk, docs)
        return moba_blockwise(q, k, v, pos, moba_choose(q, k, pos, block, topk, docs), block, docs=docs)

    g = generator(5)
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[:, :, 21:43] = torch.randn(t[:, :, 21:43].shape, generator=g, dtype=dtype)
    before, after = run(q, k, v), run(*changed)
    assert torch.equal(before[:, :, 43:], after[:, :, 43:])
    assert (before[:, :, 21:43] - after[:, :, 21:43]).abs().max() > 1e-3  # the document itself did change
    grads = torch.autograd.grad(before[:, :, 43:].square().sum(), (q, k, v))
    assert all(grad[:, :, :43].abs().max() == 0 and grad[:, :, 43:].abs().max() > 0 for grad in grads)


@pytest.mark.parametrize("n, block, topk", [(70, 8, 2), (90, 12, 4), (47, 16, 3)])
def test_triton_kernels_equal_the_definition_forward_and_backward(n, block, topk):
    """Triton's own code under its interpreter (tests/conftest.py), float32 against the float64 definition."""
    assert op.span_op.interpreting() or torch.cuda.is_available()
    # two rows: the first with documents of every kind, the last one document (the interpreter's cost grows with
    # rows and heads)
    tensors = inputs(n, batch=2, heads=2, dim=16, dtype=torch.float32)
    pos = torch.arange(n)
    docs = packed_documents(2, n, lengths=(1, 30), eot_last=True)
    chosen = op.triton_choose(*tensors[:2], block, topk, docs)
    assert torch.equal(chosen, moba_choose(*tensors[:2], pos, block, topk, docs))
    wide = [t.detach().double().requires_grad_() for t in tensors]
    expected, blocks = moba_by_definition(*wide, pos, docs, block, topk)
    assert chosen_sets(chosen) == blocks
    y = op.moba_attention(*tensors, block, topk, docs)
    grad = torch.randn(y.shape, generator=generator(1), dtype=torch.float64)
    reference = expected, torch.autograd.grad(expected, wide, grad)
    assert_results_equal((y, torch.autograd.grad(y, tensors, grad.float())), reference, atol=2e-5, rtol=1e-4)


def test_the_layer_takes_documents_on_cudas_path_compiled_whole():
    """On CUDA's path (simulated) a moba layer with documents takes the custom ops, with docs an input of the
    compiled graph (fullgraph: no graph break, no host code per step; the plan built outside, as GPT.forward
    builds it), and equals the definition."""
    config = ModelConfig(n_layer=1, n_head=3, n_embd=24, block_size=64, vocab_size=64, arch="llama",
                         attn_pattern="moba", moba_block=8, moba_topk=3, document_mask=True, eot_id=7)
    q, k, v = inputs(48, dtype=torch.float32)
    docs = packed_documents(3, 48, lengths=(1, 30))
    with simulate_cuda.simulating():
        mixer = build_mixer(config, 0)
        assert mixer.uses_triton("cpu")
        before = simulate_cuda.STAND_IN_CALLS["moba"]
        plan = mixer.plan(3, 48, "cpu")
        y = torch.compile(lambda q, k, v, plan, docs: mixer.attend(q, k, v, MixerCall(torch.arange(48), None, plan, docs)),
                          fullgraph=True, backend="aot_eager")(q, k, v, plan, docs)
        assert simulate_cuda.STAND_IN_CALLS["moba"] > before
    wide = [t.detach().double() for t in (q, k, v)]
    torch.testing.assert_close(y.double(), moba_by_definition(*wide, torch.arange(48), docs, 8, 3)[0],
                               atol=2e-5, rtol=1e-4)
    y.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_the_blockwise_kernel_with_documents_never_builds_an_n_by_n_tensor():
    n, block, topk, dim = 8192, 64, 2, 8
    q, k, v = (torch.randn(1, 2, n, dim, requires_grad=True) for _ in range(3))
    docs = packed_documents(1, n, lengths=(200, 3000))
    with LargestTensor() as largest:
        chosen = moba_choose(q, k, torch.arange(n), block, topk, docs)
        moba_blockwise(q, k, v, torch.arange(n), chosen, block, docs=docs).sum().backward()
    # as without documents: the block scores (n x n / c) and the pairs' partial outputs (n k D) are the largest
    assert largest.numel <= 2 * n * max(n // block, topk * dim), largest.shape


@pytest.mark.gpu  # on CUDA where it exists (the GPU's tiles, compiled Triton), else on the CPU's interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_moba_kernels_with_documents_equal_the_dense_reference(device, dtype):
    # the interpreter is slow: on the CPU fewer rows, still blocks of two key tiles and a choice among earlier ones
    n, block, topk = (900, 128, 3) if device == "cuda" else (70, 32, 2)
    g = generator(0, device)
    q, k, v = (torch.randn(2, n, 4, 64, generator=g, device=device).to(dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    pos = torch.arange(n, device=device)
    marks = torch.zeros(2, n, dtype=torch.long, device=device)
    marks[0, torch.arange(0, n, n // 7, device=device)] = 7  # documents of n // 7 in row 0, one in row 1
    marks[0, [n // 2, n // 2 + 1, n - 1]] = 7  # and one of a single token, and an end-of-text token last
    docs = document_starts(marks, 7, pos)
    chosen = moba_choose(q, k, pos, block, topk, docs)
    assert torch.equal(op.moba_choose_op(q, k, block, topk, docs), chosen)
    y = op.moba_attention(q, k, v, block, topk, docs)
    ref = moba_dense(*(t.float() for t in (q, k, v)), pos, chosen, block, docs=docs)
    assert_close_at_scale(y, ref, dtype)
    grad = torch.randn(y.shape, generator=g, device=device)
    for a, b in zip(torch.autograd.grad(y, (q, k, v), grad.to(dtype)), torch.autograd.grad(ref, (q, k, v), grad)):
        assert_close_at_scale(a, b, dtype)
