"""Multi-scale window attention: the schedules of paper 002, its kernels against the dense reference."""

import json
import subprocess
import sys

import pytest
import torch

from attention.edges import HeadWindows
from attention.kernels import attend
from attention.mswa import mswa_windows
from attention.ops.dense import dense_attention
from config import ConfigError, ModelConfig, load_config
from conftest import REPO
from model import GPT

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def schedule(*args):
    cfg = load_config(["configs/quickstart.py", "--n_embd=64", "--swa_window=128", "--block_size=1024", *args]).model
    return [mswa_windows(cfg, i) if name.startswith("mswa") else None
            for i, name in enumerate(cfg.attn_pattern.split(",") * (cfg.n_layer // len(cfg.attn_pattern.split(","))))]


def test_table_1_for_12_layers_and_8_heads():
    windows = schedule("--n_layer=12", "--n_head=8", "--attn_pattern=mswa")
    for layer, base in zip(range(12), [32] * 3 + [64] * 3 + [128] * 3 + [256] * 3):
        assert windows[layer] == (base // 4, base // 4, base // 2, base // 2, base, base, 2 * base, 2 * base)
    assert windows[0][0] == 8 and windows[11][-1] == 512


def test_a_window_as_long_as_the_training_length_is_refused():
    from config import ConfigError

    with pytest.raises(ConfigError, match="windows up to 512, at least block_size=512"):
        schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--block_size=512")  # deepest heads: 2 x 2 x 128
    schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--block_size=513")


def test_variants_and_ablations():
    assert set(schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa_h")) == {(32, 64, 128, 256)}
    assert schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa_l") == [(32,) * 4, (64,) * 4, (128,) * 4,
                                                                              (256,) * 4]
    assert schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--mswa_layer_order=reverse")[0] == \
        (64, 128, 256, 512)
    arithmetic = schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa_l", "--mswa_variation=arithmetic")
    assert [w[0] for w in arithmetic] == [64, 96, 128, 160]  # the paper's example for base 128
    assert schedule("--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--mswa_variation=arithmetic")[0] == \
        (32, 48, 64, 80)


def test_hybrid_takes_depth_groups_over_the_mswa_layers():
    windows = schedule("--n_layer=12", "--n_head=4", "--attn_pattern=full,mswa,mswa")
    mswa_layers = [w for w in windows if w is not None]
    assert windows[0] is None and len(mswa_layers) == 8
    assert [w[2] for w in mswa_layers] == [32, 32, 64, 64, 128, 128, 256, 256]


@pytest.mark.parametrize("args, message", [
    (["--n_layer=4", "--n_head=6", "--n_embd=60", "--attn_pattern=mswa"], "n_head=6 is not a multiple of 4"),
    (["--n_layer=6", "--n_head=4", "--attn_pattern=mswa"], "use a multiple of 4"),
    (["--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--swa_window=100"], "divisible by 16"),
    (["--n_layer=4", "--n_head=4", "--attn_pattern=mswa", "--mswa_variation=linear"], "geometric or arithmetic"),
])
def test_schedule_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["configs/quickstart.py", "--n_embd=64", *args])


def test_mswa_h_needs_no_layer_multiple():
    load_config(["configs/quickstart.py", "--n_layer=3", "--n_head=4", "--n_embd=64", "--attn_pattern=mswa_h", "--swa_window=32"])


def qkv(n, heads=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, heads, n, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]


def alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.1 * (q_idx - kv_idx)


@pytest.mark.parametrize("score_mod", [None, alibi])
@pytest.mark.parametrize("n", [50, 130])
def test_grouped_heads_equal_dense_forward_and_backward(n, score_mod):
    rule = HeadWindows((4, 4, 8, 8, 16, 16, 32, 32))  # the chunked kernel runs one group per window
    tensors = qkv(n)
    pos = torch.arange(n)
    ref = dense_attention(*tensors, rule, pos, score_mod=score_mod)
    out = attend(*tensors, rule, "chunked", score_mod=score_mod)
    torch.testing.assert_close(out, ref)
    g = torch.randn(ref.shape, dtype=ref.dtype)
    for a, b in zip(torch.autograd.grad(ref, tensors, g), torch.autograd.grad(out, tensors, g)):
        torch.testing.assert_close(b, a)


def test_flex_forward_equals_dense_for_per_head_windows():
    rule = HeadWindows((4, 4, 8, 8, 16, 16, 32, 32))
    q, k, v = (t.detach().float() for t in qkv(200))
    torch.testing.assert_close(attend(q, k, v, rule, "flex"), dense_attention(q, k, v, rule, torch.arange(200)),
                               atol=1e-5, rtol=1e-4)


def test_model_is_causal_and_cached_generation_matches():
    cfg = ModelConfig(arch="llama", n_layer=4, n_head=4, n_embd=32, block_size=64, vocab_size=61, bias=False,
                      attn_pattern="mswa", swa_window=16)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 61, (2, 60))
    changed = idx.clone()
    changed[:, 31:] = torch.randint(0, 61, (2, 29))
    torch.testing.assert_close(model(idx)[0][:, :31], model(changed)[0][:, :31])
    prompt = idx[:, :20]
    assert torch.equal(model.generate(prompt, 40, temperature=0), model.generate(prompt, 40, temperature=0,
                                                                                 use_cache=False))
    assert [c.k.shape[2] for c in model.init_caches(1, 10_000)] == [8, 16, 32, 64]  # largest window per layer


@pytest.mark.e2e
def test_mask_stats_relative_cost_of_table_2():
    proc = subprocess.run([sys.executable, "-m", "scripts.mask_stats", "--config", "configs/quickstart.py", "--seq_len",
                           "512", "--json", "--receptive_field=no", "--n_layer=12", "--n_head=8", "--n_embd=64",
                           "--attn_pattern=mswa", "--swa_window=128", "--block_size=1024"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    summed = json.loads(proc.stdout)["summed_windows"]
    assert summed["sum"] == 10_800 and summed["swa_sum"] == 12_288
    assert summed["swa_over_this"] == pytest.approx(256 / 225)
