"""MoBA's Triton kernels (attention/ops/moba), run here under Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 without a GPU): the choice against moba_choose, attention against the dense reference over
MoBA's own edges, forward and backward, at odd sizes; and the layer taking them on CUDA's path."""

import math

import pytest
import torch

from attention.call import MixerCall
from attention import simulate_cuda
from attention.documents import document_starts
from attention.ops.moba import op
from attention.ops.moba.naive import moba_choose, moba_dense
from attention.ops.span.op import interpreting
from helpers import assert_close_at_scale


def inputs(n, H=3, D=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, H, D, generator=generator, device="cpu").to(dtype).transpose(1, 2)
                 .requires_grad_() for _ in range(3))


@pytest.mark.parametrize("n, block, topk", [(70, 8, 2), (100, 16, 3), (64, 16, 1), (90, 12, 4), (33, 16, 3)])
def test_moba_kernels_equal_the_dense_reference_forward_and_backward(n, block, topk, monkeypatch):
    """With every fresh float tensor filled with NaN: the pairs' partial outputs and dq are allocated unfilled (no
    zero fill at 32K: a pass over 0.5 GB each), and a pair of no chosen block (early queries have fewer than
    topk - 1 blocks to choose) must never be read. The argsort of every (query, chosen block) pair and its tile
    tables are built once by moba_attention and handed to the backward, not rebuilt there."""
    assert interpreting() or torch.cuda.is_available()  # without a GPU: Triton's own code, not the reference
    q, k, v = inputs(n)
    pos = torch.arange(n, device="cpu")
    chosen = op.triton_choose(q, k, block, topk)
    assert torch.equal(chosen, moba_choose(q, k, pos, block, topk))
    if topk > 1:
        assert (chosen[..., 1:] < 0).any() and (chosen[..., 1:] >= 0).any()
    ref = moba_dense(q, k, v, pos, chosen, block)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), device="cpu")
    expected = torch.autograd.grad(ref, (q, k, v), g)
    empty, init, builds = torch.empty, op.PairTiles.__init__, []

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    def counting(self, chosen, block, rows, packed=None):
        builds.append(packed is None or packed.numel() == 0)
        init(self, chosen, block, rows, packed)

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(op.PairTiles, "__init__", counting)
    y = op.moba_attention(q, k, v, block, topk)
    grads = torch.autograd.grad(y, (q, k, v), g)
    monkeypatch.undo()
    assert builds == ([True, False, False] if topk > 1 else [])  # built; read by the forward; by the backward
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def lower_block_first(q, k, block, topk, docs=None):
    """naive.py's choice with ties in a stated order: among equal scores the lower block first (a stable sort)."""
    B, H, n, D = q.shape
    n_blocks = n // block
    means = k.reshape(B, H, n_blocks, block, D).mean(3)
    scores = q @ means.transpose(-1, -2)
    own = (torch.arange(n) // block)[:, None]
    blocks = torch.arange(n_blocks)
    unseen = blocks > own
    if docs is not None:
        unseen = unseen | (blocks < (docs // block)[:, None, :, None])
    scores = scores.masked_fill(unseen, -math.inf).masked_fill(blocks == own, math.inf)
    best, chosen = scores.sort(dim=-1, descending=True, stable=True)
    return chosen[..., :topk].masked_fill(best[..., :topk] == -math.inf, -1)


def test_the_choice_takes_the_lower_block_first_among_equal_scores():
    """Small integers tie often, and exactly in any order of summation: among equal scores the kernel takes the
    lower block first, within a chunk of blocks and across chunks (25 blocks: two chunks of 16 here), with packed
    documents too (starting at block edges: the blocks' means stay plain, their scores exact)."""
    n, block = 200, 8
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randint(-2, 3, (2, n, 3, 16), generator=generator).float().transpose(1, 2) for _ in range(2))
    marks = torch.zeros(2, n, dtype=torch.long)
    marks[0, [40, 48, 120]] = 1
    for docs in (None, document_starts(marks, 1, torch.arange(n))):
        for topk in (2, 4):
            assert torch.equal(op.triton_choose(q, k, block, topk, docs), lower_block_first(q, k, block, topk, docs))


def test_bfloat16_and_a_head_dimension_that_is_no_power_of_two():
    n, block, topk = 75, 16, 2
    q, k, v = inputs(n, D=24, dtype=torch.bfloat16)
    y = op.moba_attention(q, k, v, block, topk)
    chosen = moba_choose(q, k, torch.arange(n, device="cpu"), block, topk)
    ref = moba_dense(*(t.float() for t in (q, k, v)), torch.arange(n, device="cpu"), chosen, block)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_layer_runs_the_kernels_on_cudas_path_compiled_whole():
    """On CUDA's path (simulated) a moba layer's training forward takes the kernels, equals the dense reference
    and compiles as one graph (fullgraph: no graph break, so no data-dependent host code per step), its plan (the
    own blocks' spans) built outside, as GPT.forward builds it."""
    from attention.registry import build_mixer
    from config import ModelConfig

    config = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, arch="llama",
                         attn_pattern="moba", moba_block=8, moba_topk=3)
    with simulate_cuda.simulating():
        mixer = build_mixer(config, 0)
        assert mixer.uses_triton("cpu") and mixer.expected_graph_breaks("cpu", torch.float32) == ""
        q, k, v = inputs(48, H=2)
        before = simulate_cuda.STAND_IN_CALLS["moba"]
        plan = mixer.plan(2, 48, "cpu")
        compiled = torch.compile(lambda q, k, v, plan: mixer.attend(q, k, v, MixerCall(torch.arange(48), plan=plan)),
                                 fullgraph=True, backend="aot_eager")
        y = compiled(q, k, v, plan)
        assert simulate_cuda.STAND_IN_CALLS["moba"] > before
    pos = torch.arange(48, device="cpu")
    ref = moba_dense(q, k, v, pos, moba_choose(q, k, pos, 8, 3), 8)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    y.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_the_ops_look_up_no_cached_tensor_inside(monkeypatch):
    """The own blocks' spans come from the layer's plan, built outside compiled code; the kernels' ops never fill
    or read a cache of device tensors themselves (under CUDA graphs, a tensor cached during a graph's warm-up stays
    in the graph's memory pool and the step fails: the H100 run of 2026-11-27 did)."""
    from attention.registry import build_mixer
    from config import ModelConfig

    config = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, arch="llama",
                         attn_pattern="moba", moba_block=8, moba_topk=3)
    with simulate_cuda.simulating():
        (own,) = build_mixer(config, 0).plan(2, 48, "cpu")
    q, k, v = inputs(48, H=2)

    def cached(*args):
        raise AssertionError("a MoBA op looked up cached spans")

    monkeypatch.setattr(op, "static_spans", cached)
    monkeypatch.setattr(op, "own_blocks", cached)
    y = op.moba_attention(q, k, v, 8, 3, own=own)  # the Triton kernels, interpreted
    y.sum().backward()
    pos = torch.arange(48, device="cpu")
    torch.testing.assert_close(y, moba_dense(q, k, v, pos, moba_choose(q, k, pos, 8, 3), 8), atol=2e-5, rtol=1e-4)


@pytest.mark.gpu  # on CUDA where it exists (the GPU's tiles, compiled Triton), else on the CPU's interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_moba_kernels_equal_the_dense_reference(device, dtype):
    # the interpreter is slow: on the CPU fewer rows, still blocks of two key tiles and a choice among earlier ones
    n, block, topk = (900, 128, 3) if device == "cuda" else (70, 32, 2)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 64, generator=generator, device=device).to(dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    pos = torch.arange(n, device=device)
    chosen = moba_choose(q, k, pos, block, topk)
    assert torch.equal(op.moba_choose_op(q, k, block, topk), chosen)
    y = op.moba_attention(q, k, v, block, topk)
    ref = moba_dense(*(t.float() for t in (q, k, v)), pos, chosen, block)
    assert_close_at_scale(y, ref, dtype)
    g = torch.randn(y.shape, generator=generator, device=device)
    for a, b in zip(torch.autograd.grad(y, (q, k, v), g.to(dtype)), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close_at_scale(a, b, dtype)
