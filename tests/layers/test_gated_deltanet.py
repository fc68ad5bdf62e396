"""Gated DeltaNet: chunked == recurrent, a hand-worked case, cached generation, causality, training, init, config."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from attention import validate_config
from attention.gated_deltanet import GatedDeltaNet
from attention.ops.gated_deltanet.chunk import chunked_gated_delta_rule
from attention.ops.gated_deltanet.fla_kernel import fla_chunk_kernel
from attention.ops.gated_deltanet.naive import recurrent_gated_delta_rule
from config import ModelConfig
from conftest import assert_models_agree_in_bf16
from helpers import cached_logits
from model import GPT


def inputs(n, d=4, D=5, seed=0, dtype=torch.float64, with_state=False):
    """q, k unit vectors (q scaled), v, log decays g <= 0, beta in (0, 1), and optionally a start state."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 3, n)
    q = F.normalize(torch.randn(*shape, d, generator=gen, dtype=dtype), dim=-1) / d ** 0.5
    k = F.normalize(torch.randn(*shape, d, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(*shape, D, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(*shape, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(*shape, generator=gen, dtype=dtype))
    tensors = [q, k, v, g, beta]
    if with_state:
        tensors.append(torch.randn(2, 3, d, D, generator=gen, dtype=dtype))
    return [t.requires_grad_() for t in tensors]


def grads(outputs, tensors):
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outputs]
    return torch.autograd.grad(outputs, tensors, weights)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("n, chunk", [(37, 8), (32, 16), (5, 8), (9, 1)])
def test_chunked_equals_recurrent_forward_and_backward(n, chunk, with_state):
    tensors = inputs(n, with_state=with_state)
    q, k, v, g, beta = tensors[:5]
    state = tensors[5] if with_state else None
    y, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    y_ref, final_ref = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(final, final_ref)
    for a, b in zip(grads([y, final], tensors), grads([y_ref, final_ref], tensors)):
        torch.testing.assert_close(a, b)


def test_float32_tolerance():
    q, k, v, g, beta = (t.detach() for t in inputs(100, d=8, D=8, dtype=torch.float32))
    y, final = chunked_gated_delta_rule(q, k, v, g, beta, chunk=16)
    y_ref, final_ref = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-4)


def test_strong_decay_does_not_overflow():
    # log decays summing to -3000 in a chunk: exp(G_i - G_j) above the diagonal would be inf
    q, k, v, _, beta = (t.detach() for t in inputs(16))
    g = torch.full_like(beta, -200.0)
    y, final = chunked_gated_delta_rule(q, k, v, g, beta, chunk=16)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    torch.testing.assert_close(y, recurrent_gated_delta_rule(q, k, v, g, beta)[0])


@pytest.mark.parametrize("form", ["recurrent", "chunk1", "chunk2", "chunk4"])
def test_two_tokens_by_hand(form):
    # S_t = a_t (I - b_t k_t^T k_t) S_{t-1} + b_t k_t^T v_t, o_t = q_t S_t, from S_0 = 0:
    #   t=1: S_1 = 0.5 [1, 0]^T 2 = [[1], [0]];  o_1 = [1, 0] S_1 = 1
    #   t=2: a S_1 = [[0.8], [0]]; k_2 (a S_1) = 0.48; delta = 0.25 (1 - 0.48) = 0.13
    #        S_2 = [[0.8 + 0.6 * 0.13], [0.8 * 0.13]] = [[0.878], [0.104]];  o_2 = [0, 1] S_2 = 0.104
    t = lambda *x: torch.tensor(x, dtype=torch.float64).view(1, 1, 2, -1)  # noqa: E731
    q, k, v = t(1.0, 0.0, 0.0, 1.0), t(1.0, 0.0, 0.6, 0.8), t(2.0, 1.0)
    g = torch.tensor([math.log(0.5), math.log(0.8)], dtype=torch.float64).view(1, 1, 2)
    beta = torch.tensor([0.5, 0.25], dtype=torch.float64).view(1, 1, 2)
    if form == "recurrent":
        y, S = recurrent_gated_delta_rule(q, k, v, g, beta)
    else:
        y, S = chunked_gated_delta_rule(q, k, v, g, beta, chunk=int(form[-1]))
    torch.testing.assert_close(y.flatten(), torch.tensor([1.0, 0.104], dtype=torch.float64))
    torch.testing.assert_close(S.flatten(), torch.tensor([0.878, 0.104], dtype=torch.float64))


def tiny(pattern="gated_deltanet", **overrides):
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=50, bias=False,
                      attn_pattern=pattern, gdn_chunk=8, swa_window=8, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # larger convolution weights than the init's, so every tap visibly matters
        for block in model.blocks:
            if isinstance(block.mixer, GatedDeltaNet):
                for conv in (block.mixer.q_conv, block.mixer.k_conv, block.mixer.v_conv):
                    conv.weight.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("prompt", [2, 11])
def test_prefill_then_steps_equals_one_pass(prompt):
    # a 2-token prompt leaves zero padding in the convolution state; 11 crosses a chunk boundary
    model = tiny()
    idx = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(0))
    full, _ = model(idx)
    assert all(c.empty for c in model.init_caches(2, 30))
    torch.testing.assert_close(cached_logits(model, idx, prompt), full)


def test_greedy_generation_with_and_without_cache():
    model = tiny()
    prompt = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.generate(prompt, 20, temperature=0, use_cache=True),
                       model.generate(prompt, 20, temperature=0, use_cache=False))


def test_layer_is_causal():
    model = tiny()
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 21] = (idx[:, 21] + 1) % 50
    before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :21], after[:, :21])
    assert not torch.allclose(before[:, 21:], after[:, 21:])  # and the change does reach the later tokens


def test_hybrid_trains_one_step(monkeypatch):
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=50, bias=False,
                      attn_pattern="swa,gated_deltanet", swa_window=8, gdn_chunk=8)
    validate_config(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert [type(b.mixer).__name__ for b in model.blocks][1] == "GatedDeltaNet"
    opt = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    idx = torch.randint(0, 50, (2, 33))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    mixer = model.blocks[1].mixer
    assert mixer.A_log.grad.abs().sum() > 0 and mixer.dt_offset.grad.abs().sum() > 0
    opt.step()
    import attention.gated_deltanet as gdn_module

    seen, original = [], gdn_module.chunked_gated_delta_rule

    def spy(*tensors, **kwargs):
        seen.append({t.dtype for t in tensors if isinstance(t, torch.Tensor)})
        return original(*tensors, **kwargs)

    monkeypatch.setattr(gdn_module, "chunked_gated_delta_rule", spy)
    with torch.no_grad():
        full, _ = model(idx)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = model(idx)  # the recurrence itself stays in float32
    assert seen == [{torch.float32}]
    torch.testing.assert_close(low.float(), full, atol=2e-2, rtol=0)


def test_init_ranges_after_model_init():
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=8, n_embd=32, block_size=32, vocab_size=50, bias=False,
                      attn_pattern="gated_deltanet")
    torch.manual_seed(0)
    for block in GPT(cfg).blocks:
        mixer = block.mixer
        A = mixer.A_log.exp()
        assert ((A > 0) & (A <= 16)).all()  # fla: A ~ U(0, 16)
        dt = F.softplus(mixer.dt_offset)
        assert ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))).all()
        assert dt.std() > 0 and A.std() > 0  # one time scale per head
        assert torch.equal(mixer.o_norm_weight, torch.ones(4))
    assert GPT(cfg).blocks[0].mixer.describe().startswith("Gated DeltaNet")
    torch.manual_seed(0)
    A = torch.cat([GPT(dataclasses.replace(cfg, n_head=32, n_embd=128)).blocks[0].mixer.A_log.exp() for _ in range(4)])
    assert (A < 1).sum() >= 2  # 1/16 of the draws: U(1, 16) would give none


@pytest.mark.parametrize("field, value", [("gdn_chunk", 0), ("gdn_conv_size", 0), ("gdn_kernel", "triton")])
def test_config_errors(field, value):
    cfg = ModelConfig(attn_pattern="swa,gated_deltanet", n_layer=2, **{field: value})
    with pytest.raises(ValueError, match=field):
        validate_config(cfg)


@pytest.mark.skipif(fla_chunk_kernel() is not None, reason="fla is installed")
def test_fla_kernel_without_fla_is_a_clear_error():
    cfg = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, vocab_size=50, attn_pattern="gated_deltanet",
                      gdn_kernel="fla")
    with pytest.raises(ImportError, match="flash-linear-attention"):
        GPT(cfg)


if torch.cuda.is_available() and fla_chunk_kernel() is not None:  # where the optional fla path can run

    @pytest.mark.gpu
    def test_cuda_fla_layer_equals_native_layer_in_bf16(device):
        cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=50, bias=False,
                          attn_pattern="gated_deltanet")
        torch.manual_seed(0)
        fla = GPT(cfg).to(device)
        native = GPT(dataclasses.replace(cfg, gdn_kernel="native")).to(device)
        native.load_state_dict(fla.state_dict())
        idx = torch.randint(0, 50, (2, 200), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a, b = fla(idx)[0].float(), native(idx)[0].float()
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)

    @pytest.mark.gpu
    def test_cuda_fla_model_gradients_equal_native_in_bf16(device):
        # model level, with gradients: fla's chunk kernel against the built-in chunked form on the same weights
        # under bf16 autocast: logits and every parameter's gradient within 5e-2 relative (fla computes in bf16)
        cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=50, bias=False,
                          attn_pattern="gated_deltanet", gdn_kernel="fla")
        assert_models_agree_in_bf16(cfg, dataclasses.replace(cfg, gdn_kernel="native"), device, 5e-2)


def test_chunked_training_form_never_builds_an_n_by_n_tensor():
    from helpers import LargestTensor

    n, chunk = 8192, 64
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 1, n, 16, generator=g), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, 1, n, 16, generator=g, requires_grad=True)
    decay = (-torch.rand(1, 1, n, generator=g) * 0.1).requires_grad_()
    beta = torch.rand(1, 1, n, generator=g).requires_grad_()
    with LargestTensor() as largest:
        y, _ = chunked_gated_delta_rule(q, k, v, decay, beta, chunk=chunk)
        y.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(decay.grad).all()
    assert largest.numel <= n * chunk, largest.shape  # chunk x chunk tiles per chunk, never n x n
