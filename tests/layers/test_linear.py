"""Taylor linear attention: chunked == quadratic == recurrent, causality, generation, the hybrid with MSWA."""

import pytest
import torch

from attention.ops.linear.chunk import chunked_linear_attention
from attention.ops.linear.feature_map import taylor_features, taylor_kernel
from attention.ops.linear.naive import quadratic_linear_attention
from attention.ops.linear.recurrent import recurrent_linear_attention
from config import ModelConfig, load_config
from model import GPT


def qkv(n, d=4, D=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, dim, generator=g, dtype=dtype).requires_grad_() for dim in (d, d, D)]


def grads(y, tensors):
    return torch.autograd.grad(y, tensors, torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                                                        dtype=y.dtype))


def test_feature_map_is_the_taylor_expansion_of_exp():
    q, k = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    t = q @ k.T / 2  # sqrt(d) = 2
    torch.testing.assert_close(taylor_features(q) @ taylor_features(k).T, 1 + t + t * t / 2)
    torch.testing.assert_close(taylor_kernel(q, k), 1 + t + t * t / 2)
    assert taylor_features(q).shape[-1] == 1 + 4 + 16


@pytest.mark.parametrize("n, chunk", [(37, 8), (64, 16), (5, 8)])
def test_chunked_equals_quadratic_and_recurrent_forward_and_backward(n, chunk):
    tensors = qkv(n)
    ref = quadratic_linear_attention(*tensors)
    chunked, state = chunked_linear_attention(*tensors, chunk=chunk)
    recurrent, rec_state = recurrent_linear_attention(*tensors)
    torch.testing.assert_close(chunked, ref)
    torch.testing.assert_close(recurrent, ref)
    torch.testing.assert_close(state[0], rec_state[0])
    torch.testing.assert_close(state[1], rec_state[1])
    for a, b, c in zip(grads(ref, tensors), grads(chunked, tensors), grads(recurrent, tensors)):
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a)


def test_float32_tolerance():
    tensors = qkv(100, dtype=torch.float32)
    torch.testing.assert_close(chunked_linear_attention(*tensors, chunk=16)[0], quadratic_linear_attention(*tensors),
                               atol=1e-5, rtol=1e-4)


def test_prefill_then_steps_equals_one_pass():
    q, k, v = (t.detach() for t in qkv(30))
    full, _ = chunked_linear_attention(q, k, v, chunk=8)
    first, state = chunked_linear_attention(q[:, :, :17], k[:, :, :17], v[:, :, :17], chunk=8)
    rest, _ = recurrent_linear_attention(q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full)


def hybrid():
    cfg = ModelConfig(arch="llama", n_layer=12, n_head=4, n_embd=32, block_size=64, vocab_size=61, bias=False,
                      attn_pattern="linear,mswa,mswa", swa_window=16, linear_feature_dim=8, linear_chunk=8)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def test_hybrid_is_causal_and_decodes_with_constant_state():
    model = hybrid()
    idx = torch.randint(0, 61, (2, 50))
    changed = idx.clone()
    changed[:, 21:] = torch.randint(0, 61, (2, 29))
    torch.testing.assert_close(model(idx)[0][:, :21], model(changed)[0][:, :21])
    prompt = idx[:, :19]
    assert torch.equal(model.generate(prompt, 30, temperature=0), model.generate(prompt, 30, temperature=0,
                                                                                 use_cache=False))


def test_hybrid_config_reproduces_the_paper_layout():
    cfg = load_config(["configs/quickstart.py", "--n_layer=12", "--n_head=8", "--n_embd=64", "--arch=llama",
                       "--attn_pattern=linear,mswa,mswa", "--swa_window=128", "--vocab_size=320",
                       "--block_size=2048"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    kinds = [type(b.mixer).__name__ for b in model.blocks]
    assert kinds[0::3] == ["TaylorLinearAttention"] * 4
    # the 8 local layers take the MSWA schedule as a whole: depth groups of two layers each
    assert [b.mixer.rule.windows[-1] for i, b in enumerate(model.blocks) if i % 3] == [64, 64, 128, 128, 256, 256,
                                                                                      512, 512]
