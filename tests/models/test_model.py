import pytest
import torch

from config import ModelConfig, load_config
from model import GPT, sample_next


def tiny(arch="gpt2", **kw):
    cfg = ModelConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61,
                      bias=arch == "gpt2", **kw)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def meta_params(config_file):
    cfg = load_config([config_file])
    with torch.device("meta"):
        return GPT(cfg.model).num_params()


def test_paper_configs_have_the_papers_sizes():
    assert abs(meta_params("configs/bridges/owt_124m_full.py") / 124.4e6 - 1) < 0.005
    assert abs(meta_params("configs/sa/slimpajama_360m_full.py") / 360e6 - 1) < 0.01


def test_families_differ_as_specified():
    gpt2, llama = tiny("gpt2"), tiny("llama")
    assert gpt2.wpe is not None and llama.wpe is None  # llama's positions come from RoPE in the mixer
    assert isinstance(gpt2.blocks[0].ln_1, torch.nn.LayerNorm) and isinstance(llama.blocks[0].ln_1, torch.nn.RMSNorm)
    assert llama.blocks[0].mlp.c_gate is not None and gpt2.blocks[0].mlp.c_gate is None
    assert not any(n.endswith("bias") for n, _ in llama.named_parameters())
    assert gpt2.lm_head.weight is gpt2.wte.weight
    assert llama.blocks[0].mixer.rope_theta is not None and gpt2.blocks[0].mixer.rope_theta is None


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal_through_the_model(arch):
    model = tiny(arch, attn_gate=True)
    idx = torch.randint(0, 61, (2, 40))
    t = 17
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 61, (2, 40 - t - 1))
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1])
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_generation_equals_uncached(arch):
    model = tiny(arch)
    prompt = torch.randint(0, 61, (2, 9))
    fast = model.generate(prompt, 30, temperature=0, use_cache=True)
    slow = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert torch.equal(fast, slow)


def test_generation_past_the_learned_position_table():
    model = tiny("gpt2")  # block_size 64
    prompt = torch.randint(0, 61, (1, 50))
    fast = model.generate(prompt, 40, temperature=0, use_cache=True)
    slow = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert fast.shape == (1, 90) and torch.equal(fast, slow)


def test_loss_ignores_negative_targets():
    model = tiny()
    idx = torch.randint(0, 61, (1, 10))
    targets = idx.clone()
    targets[:, :5] = -1
    logits, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits[0, 5:], idx[0, 5:])
    torch.testing.assert_close(loss, expected)


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample_next(logits, top_p=0.7, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token, not the third
    draws = {sample_next(logits, top_p=0.45, generator=g).item() for _ in range(50)}
    assert draws == {0}
    assert sample_next(logits, temperature=0).item() == 0


def test_weight_decay_only_on_matrices():
    model = tiny()
    opt = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    decayed, plain = opt.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0


@pytest.mark.parametrize("tie", [True, False])
def test_flops_count_the_head_matmul_once(tie):
    # MFU's numerator: 6 FLOPs per matmul parameter (the head included once, tied or not) plus the mixers' own
    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61, bias=False,
                            tie_embeddings=tie))
    body = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte.", "wpe.", "lm_head.")))
    mixing = 3 * sum(block.mixer.mixing_flops(64) for block in model.blocks)
    assert model.flops_per_token(64) == 6 * (body + model.lm_head.weight.numel()) + mixing


def test_peak_flops_know_the_h100_form_factors():
    from common.flops import peak_flops_of

    assert peak_flops_of("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12  # SXM
    assert peak_flops_of("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert peak_flops_of("NVIDIA H100 NVL", torch.bfloat16) == 835e12
    assert peak_flops_of("NVIDIA H200", torch.float32) == 989e12 / 2  # TF32
    assert peak_flops_of("NVIDIA L40S", torch.bfloat16) == 362e12 and peak_flops_of("NVIDIA L4", torch.bfloat16) == 121e12
    assert peak_flops_of("Some Future GPU", torch.bfloat16) is None


def test_a_kv_cache_grows_past_the_length_it_was_allocated_for():
    """Caches are allocated for the length asked and grow as a sequence runs past it: generation need not know its
    length up front (a huge --max_new_tokens never allocates everything at once)."""
    model = tiny("llama")  # RoPE: any length
    prompt = torch.randint(0, 61, (2, 5))
    caches = model.init_caches(2, 6)
    assert caches[0].k.shape[2] == 6
    logits, _ = model(prompt, caches=caches)
    tokens = [prompt]
    for step in range(12):  # 5 + 12 positions: past 6, then past the doubled 12
        nxt = logits[:, -1:].argmax(-1)
        tokens.append(nxt)
        logits, _ = model(nxt, caches=caches, start_pos=5 + step)
    assert caches[0].k.shape[2] >= 17
    full, _ = model(torch.cat(tokens, 1))
    torch.testing.assert_close(logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
    # the memory a generation holds is measured from the caches the layers build, nothing allocated
    one = model.generation_bytes(2, 1000)
    assert model.generation_bytes(2, 2000) - one == 1000 * 2 * (8 + 2 * 2 * model.config.n_embd * 4)


def test_document_mask_needs_the_end_of_text_token():
    with pytest.raises(ValueError, match="eot_id"):
        GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=61, document_mask=True, eot_id=-1))
