"""Taylor linear attention: the feature map (the recurrence core's forms with it: tests/ops/test_recurrence.py), the
layer's causality and generation, the hybrid with MSWA."""

import torch

from attention.ops.linear.feature_map import taylor_features, taylor_kernel
from config import ModelConfig, load_config
from model import GPT


def test_feature_map_is_the_taylor_expansion_of_exp():
    q, k = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    t = q @ k.T / 2  # sqrt(d) = 2
    torch.testing.assert_close(taylor_features(q) @ taylor_features(k).T, 1 + t + t * t / 2)
    torch.testing.assert_close(taylor_kernel(q, k), 1 + t + t * t / 2)
    assert taylor_features(q).shape[-1] == 1 + 4 + 16


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
