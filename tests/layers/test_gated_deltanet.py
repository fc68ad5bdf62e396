"""Gated DeltaNet: the layer on the recurrence core's delta rule (whose forms tests/ops/test_recurrence.py holds to each
other and to a hand-worked case): cached generation, causality, training, init, config, fla's kernel."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attention import validate_config
from attention.gated_deltanet import GatedDeltaNet
from attention.ops.gated_deltanet.fla_kernel import fla_chunk_kernel
from config import ModelConfig
from conftest import assert_models_agree_in_bf16
from helpers import cached_logits
from model import GPT


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

    seen, original = [], gdn_module.recurrence

    def spy(form, q, k, v, gates, *args, **kwargs):
        tensors = (q, k, v, gates.log_decay, gates.beta)
        seen.append({t.dtype for t in tensors if isinstance(t, torch.Tensor)})
        return original(form, q, k, v, gates, *args, **kwargs)

    monkeypatch.setattr(gdn_module, "recurrence", spy)
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
