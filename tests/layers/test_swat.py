"""SWAT (paper 001): slopes and bias sign by hand, every backend against dense for every slope setting,
no n x n tensor on the chunked path, cached generation, configuration errors, and the Table 3 grid configs."""

import math

import pytest
import torch
import torch.nn.functional as F

from attention.call import MixerCall
from attention.edges import SlidingWindow
from attention.kernels import attend
from attention.ops.chunked.op import chunked_attention
from attention.ops.score_mod import ScoreBias
from attention.swat import AlibiBias, parse_bias, swat_slopes
from config import ConfigError, ModelConfig, load_config
from conftest import REPO, generator
from helpers import CUDA_HEAD_DIM, LargestTensor, flex_has_backward
from helpers import weighted_fwd_bwd as fwd_bwd  # the ramp-weighted gradients these tests were written with
from model import GPT


def qkv(n, batch=2, heads=4, dim=8, dtype=torch.float32, device=None):
    g = generator(n, device)
    return [torch.randn(batch, heads, n, dim, generator=g, dtype=dtype, device=device).requires_grad_()
            for _ in range(3)]


def test_slopes_by_schedule_and_split():
    assert swat_slopes(12, "paper", "6:6") == [-1 / 2, -1 / 4, -1 / 8, -1 / 16, -1 / 32, -1 / 64,
                                               1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64]
    assert swat_slopes(12, "paper", "") == swat_slopes(12, "paper", "6:6")  # balanced by default
    assert swat_slopes(4, "paper", "4:0") == [-1 / 2, -1 / 4, -1 / 8, -1 / 16]  # classic direction only
    assert swat_slopes(4, "paper", "0:4") == [1 / 2, 1 / 4, 1 / 8, 1 / 16]
    assert swat_slopes(3, "none", "") == [0.0, 0.0, 0.0]
    assert parse_bias("-log(w)", 128) == -math.log(128) and parse_bias("0.5", 128) == 0.5


# The authors' slopes for 12 heads (their flash-linear-attention fork, fla/layers/sig_attn.py, get_alibi_slope:
# x = 256^(1/H), magnitudes 1/x^(k) with k = 1.. in each direction, reverse-direction heads first, then the classic
# heads flipped), as flash-attention slopes (bias -slope * (i - j)), written out: 6:6 is the function at commit
# 293ab61 (H/2 each way), 8:4 at commit 60a2650 (H/3 reverse, H/1.5 classic), 12:0 its all-classic case.
M = [0.629961, 0.39685, 0.25, 0.15749, 0.099213, 0.0625, 0.039373, 0.024803, 0.015625, 0.009843, 0.006201, 0.003906]
AUTHORS_FLASH_SLOPES = {
    "6:6": [-M[0], -M[1], -M[2], -M[3], -M[4], -M[5], M[5], M[4], M[3], M[2], M[1], M[0]],
    "8:4": [-M[0], -M[1], -M[2], -M[3], M[7], M[6], M[5], M[4], M[3], M[2], M[1], M[0]],
    "12:0": [M[11], M[10], M[9], M[8], M[7], M[6], M[5], M[4], M[3], M[2], M[1], M[0]],
}


@pytest.mark.parametrize("split", AUTHORS_FLASH_SLOPES)
def test_alibi_schedule_is_the_authors_code(split):
    # our bias is +s_h (i - j): the authors' flash-attention slopes with the sign turned
    expected = [-slope for slope in AUTHORS_FLASH_SLOPES[split]]
    assert swat_slopes(12, "alibi", split) == pytest.approx(expected, abs=1e-6)
    neg, pos = (int(n) for n in split.split(":"))
    assert sum(s < 0 for s in swat_slopes(12, "alibi", split)) == neg  # neg heads are classic ALiBi


def test_bias_sign_and_slopes_by_hand_two_heads_four_tokens():
    """q = k = 0: every score is the bias alone, so with one-hot values the output row i of head h lists
    sigmoid(s_h (i - j)) for the keys j of i's window. Head 0 slope -1/2 (favours recent keys), head 1 +1/2."""
    model = GPT(ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=11,
                            attn_pattern="swat", swa_window=3, swat_split="1:1", swat_slopes="paper",
                            attn_backend="dense"))
    layer = model.blocks[0].mixer
    assert layer.slopes == [-0.5, 0.5]
    assert "-0.5 +0.5" in layer.describe()
    q = k = torch.zeros(1, 2, 4, 4)
    v = torch.eye(4).expand(1, 2, 4, 4)  # value of token j is the one-hot e_j
    y = layer.attend(q, k, v, MixerCall(torch.arange(4)))[0]
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = {0: [[s(0.), 0, 0, 0], [s(-.5), s(0.), 0, 0], [s(-1.), s(-.5), s(0.), 0], [0, s(-1.), s(-.5), s(0.)]],
                1: [[s(0.), 0, 0, 0], [s(.5), s(0.), 0, 0], [s(1.), s(.5), s(0.), 0], [0, s(1.), s(.5), s(0.)]]}
    for head, rows in expected.items():
        torch.testing.assert_close(y[head], torch.tensor([[float(x) for x in r] for r in rows]))
    assert y[0, 3, 1] < y[0, 3, 2] and y[1, 3, 1] > y[1, 3, 2]  # negative slope prefers the recent key
    assert (y.sum(-1) > 1).any()  # no normalisation


SLOPE_SETTINGS = [("paper", "2:2"), ("paper", "4:0"), ("paper", "0:4"), ("alibi", "3:1"), ("none", "")]


@pytest.mark.parametrize("schedule, split", SLOPE_SETTINGS)
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
@pytest.mark.parametrize("offset", [0.0, -math.log(24)])
def test_chunked_equals_dense_forward_and_backward(schedule, split, activation, offset):
    n, window = 203, 24  # several chunks, a ragged last one
    mod = AlibiBias(torch.tensor(swat_slopes(4, schedule, split)), offset)
    tensors = qkv(n)
    ref, ref_grads = fwd_bwd(lambda q, k, v: attend(q, k, v, SlidingWindow(window), "dense", score_mod=mod,
                                                    activation=activation), tensors)
    for fused in (True, False):  # the fused kernel (flash CPU / ChunkedSigmoid) and the generic tile path
        out, grads = fwd_bwd(lambda q, k, v: chunked_attention(q, k, v, SlidingWindow(window), chunk=16,
                                                               score_mod=mod, activation=activation, fused=fused),
                             tensors)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("schedule, split", SLOPE_SETTINGS)
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_flex_forward_equals_dense(schedule, split, activation):  # CPU flex has no backward; CUDA test below
    n, window = 300, 64
    mod = AlibiBias(torch.tensor(swat_slopes(4, schedule, split)), 0.0)
    q, k, v = (t.detach() for t in qkv(n))
    with torch.no_grad():
        ref = attend(q, k, v, SlidingWindow(window), "dense", score_mod=mod, activation=activation)
        out = attend(q, k, v, SlidingWindow(window), "flex", score_mod=mod, activation=activation)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


class PositionBias(ScoreBias):
    """An absolute-position bias (not relative): the chunked kernels evaluate it at every tile's positions."""

    def bias(self, h, q_idx, kv_idx):
        return 0.01 * (h + 1) * torch.cos(0.1 * q_idx.float()) - 0.002 * kv_idx.float()


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_absolute_score_bias_with_a_start_offset(activation):
    n, window, start = 150, 24, 37  # a continued sequence: positions start .. start + n - 1
    tensors = qkv(n, dtype=torch.float64)
    rule = SlidingWindow(window)
    ref, ref_grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "dense", start=start, score_mod=PositionBias(),
                                                    activation=activation), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "chunked", start=start, score_mod=PositionBias(),
                                                activation=activation, chunk=16), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_bf16_sigmoid_attention_stays_close_to_float32():
    """No normaliser: each output sums up to w sigmoid-weighted values, so bf16 inputs are scored in float32
    and only the result is rounded; it stays within bf16's precision of the float32 result, gradients too."""
    n, window = 1024, 256
    mod = AlibiBias(torch.tensor(swat_slopes(4, "paper", "2:2")), 0.0)
    tensors = qkv(n)
    ref, ref_grads = fwd_bwd(lambda q, k, v: attend(q, k, v, SlidingWindow(window), "chunked", score_mod=mod,
                                                    activation="sigmoid"), tensors)
    half = [t.detach().bfloat16().requires_grad_() for t in tensors]
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, SlidingWindow(window), "chunked", score_mod=mod,
                                                activation="sigmoid"), half)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ref.abs().max() > 10  # sums of many weights: magnitudes a normalised attention would not reach
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        assert ((got.float() - want).norm() / want.norm()) < 1e-2
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as training runs it: the kernel still scores in float32
        out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, SlidingWindow(window), "chunked", score_mod=mod,
                                                    activation="sigmoid"), half)
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        assert ((got.float() - want).norm() / want.norm()) < 1e-2


def test_chunked_sigmoid_never_builds_an_n_by_n_tensor():
    n, window = 16384, 256
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    mod = AlibiBias(torch.tensor([-0.5, 0.5]), 0.0)
    with LargestTensor() as largest:
        chunked_attention(q, k, v, SlidingWindow(window), chunk=128, score_mod=mod, activation="sigmoid").sum().backward()
    assert largest.numel <= 2 * n * (window + 128), largest.shape  # O(n w) tiles and masks, never n x n
    assert all(size < n for size in largest.shape[-2:])


def swat_model(n_layer=2, **kw):
    cfg = dict(arch="llama", n_layer=n_layer, n_head=4, n_embd=32, block_size=64, vocab_size=61,
               attn_pattern="swat", swa_window=8, swat_split="3:1")
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg)).eval()


@pytest.mark.parametrize("kw", [{}, {"swat_rope": False}, {"swat_activation": "softmax", "swat_slopes": "alibi"},
                                {"swat_bias": "-log(w)", "swat_slopes": "none"}])
def test_model_backends_agree_and_generation_with_a_rolling_cache_equals_uncached(kw):
    model = swat_model(**kw)
    idx = torch.randint(0, 61, (2, 50))
    logits = {}
    for backend in ("dense", "chunked", "flex"):  # flex: forward only on CPU
        for block in model.blocks:
            block.mixer.backend = backend
        with torch.no_grad():
            logits[backend] = model(idx)[0]
    for backend in ("chunked", "flex"):
        torch.testing.assert_close(logits[backend], logits["dense"], atol=1e-5, rtol=1e-5)
    for block in model.blocks:
        block.mixer.backend = "chunked"
    caches = model.init_caches(batch_size=1, max_len=10_000)
    assert all(c.k.shape[2] == 8 for c in caches)  # w keys (stored after RoPE), whatever the length
    for prompt_len in (3, 20):  # shorter and longer than the window
        prompt = torch.randint(0, 61, (2, prompt_len))
        fast = model.generate(prompt, 30, temperature=0, use_cache=True)
        slow = model.generate(prompt, 30, temperature=0, use_cache=False)
        assert torch.equal(fast, slow)
    # the logits of a cached step equal those of the uncached forward over the whole sequence
    seq = torch.randint(0, 61, (1, 30))
    caches = model.init_caches(1, 30)
    model(seq[:, :20], caches=caches)
    step, _ = model(seq[:, 20:21], caches=caches, start_pos=20)
    torch.testing.assert_close(step[0, -1], model(seq[:, :21])[0][0, -1], atol=1e-5, rtol=1e-5)


def test_swat_rope_switch_and_slopes_stay_float32():
    assert swat_model().blocks[0].mixer.rope_theta is not None
    assert swat_model(swat_rope=False).blocks[0].mixer.rope_theta is None
    model = swat_model(swat_slopes="alibi", swat_split="2:2").to(torch.bfloat16)  # as evaluation casts it
    slopes = model.blocks[0].mixer.score_mod("cpu").slopes
    assert slopes.dtype == torch.float32 and slopes.tolist() == swat_slopes(4, "alibi", "2:2")
    assert not any("slope" in key for key in model.state_dict())  # derived from the config, not saved


@pytest.mark.parametrize("args, message", [
    (["--swat_activation=relu"], "swat_activation='relu'"),
    (["--swat_split=2:1"], "add up to n_head=4"),
    (["--swat_split=two"], "'neg:pos'"),
    (["--swat_slopes=linear"], "swat_slopes='linear'"),
    (["--swat_bias=log(w)"], r"swat_bias='log\(w\)'"),
    (["--attn_backend=sdpa"], "neither sigmoid attention nor score biases"),
    (["--attn_backend=sdpa", "--swat_activation=softmax"], "neither sigmoid attention nor score biases"),
    (["--swat_slopes=none", "--swat_split=2:2"], "no effect with swat_slopes=none"),
    (["--n_head=3", "--n_embd=48"], "n_head=3 is odd"),
])
def test_config_errors_name_the_problem(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["configs/quickstart.py", "--attn_pattern=swat", "--n_head=4", "--swa_window=8", *args])


@pytest.mark.e2e
def test_sliding_window_training_and_one_eval_command_for_lengths_and_windows(tmp_path):
    """Train at length T = 4w, then score one checkpoint at several lengths (beyond T and beyond every
    document, as one stream) and windows in one command: the layout of paper 001's Table 2."""
    import json
    import subprocess
    import sys

    out = tmp_path / "swat"
    train = subprocess.run([sys.executable, "train.py", "configs/quickstart.py", f"--out_dir={out}", "--arch=llama",
                            "--bias=False", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
                            "--attn_pattern=swat", "--swa_window=8", "--max_iters=10", "--eval_interval=10",
                            "--eval_iters=2", "--log_interval=5"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "ALiBi slopes per head: -0.5 +0.5" in train.stdout  # printed at start-up
    proc = subprocess.run([sys.executable, "-m", "eval", f"--out_dir={out}", "--progress=False", "--tasks=ppl",
                           "--ppl_lengths=8,32,2048", "--ppl_windows=8,32", "--ppl_stream=True",
                           "--ppl_max_tokens=4097"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "eval" / "ppl.json").read_text())["results"]["rows"]
    nll = {(r["window"], r["length"]): r["nll"] for r in rows}
    assert len(nll) == 6 and all(r["tokens"] == 4096 for r in rows)  # the stream: every token but the first
    assert nll[8, 8] == pytest.approx(nll[32, 8], rel=1e-6)  # a window >= the length changes nothing
    assert nll[8, 2048] != pytest.approx(nll[32, 2048], rel=1e-6)
    summary = (out / "eval" / "summary.md").read_text()
    assert "| loss | L=8 | L=32 | L=2048 |" in summary and "| window 8 (trained) |" in summary


def test_recipe_and_ablation_grid_configs():
    cfg = load_config(["configs/swat/fineweb_swat_340m.py"])
    with torch.device("meta"):
        params = GPT(cfg.model).num_params()
    assert abs(params / 340e6 - 1) < 0.01, params
    m = cfg.model
    assert (m.n_layer, m.n_embd, m.n_head, m.swa_window, m.block_size, m.vocab_size) == (24, 1024, 16, 256, 4096, 32000)
    assert (m.attn_pattern, m.swat_activation, m.swat_rope) == ("swat", "sigmoid", True)
    assert cfg.train.batch_size * cfg.train.gradient_accumulation_steps * m.block_size == 2 ** 19  # 0.5M tokens
    # Table 3: (activation, rope, slopes, split, window, training length), the paper's numbers divided by 8
    grid = {1: ("softmax", True, "none", "", 16, 16), 2: ("sigmoid", True, "none", "", 16, 16),
            3: ("softmax", True, "none", "", 16, 128), 4: ("sigmoid", False, "alibi", "12:0", 16, 128),
            5: ("sigmoid", False, "paper", "8:4", 16, 128), 6: ("sigmoid", False, "paper", "6:6", 16, 128),
            7: ("sigmoid", False, "paper", "6:6", 16, 256), 8: ("sigmoid", True, "paper", "6:6", 16, 128),
            9: ("sigmoid", True, "paper", "6:6", 128, 128), 10: ("softmax", True, "none", "", 128, 128),
            11: ("sigmoid", False, "alibi", "12:0", 128, 128)}  # the origin ALiBi (App. C.3)
    files = sorted((REPO / "configs" / "swat").glob("owt_swat_[01]*.py"))
    assert len(files) == 11
    for path in files:
        m = load_config([str(path.relative_to(REPO))]).model
        no = int(path.stem.split("_")[2])
        assert (m.swat_activation, m.swat_rope, m.swat_slopes, m.swat_split, m.swa_window, m.block_size) == grid[no]
        assert m.n_head == 12 and m.attn_pattern == "swat"


@pytest.mark.gpu  # on CUDA where it exists, else on the CPU under the device guard (tests/conftest.py)
@pytest.mark.parametrize("backend", ["flex", "chunked"])
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_gpu_swat_equals_dense_forward_and_backward(backend, activation, device):
    n, window = 1000, 128
    mod = AlibiBias(torch.tensor(swat_slopes(4, "paper", "2:2"), device=device), 0.0)
    tensors = qkv(n, dim=CUDA_HEAD_DIM, device=device)
    rule = SlidingWindow(window)
    backward = backend != "flex" or flex_has_backward(device)
    ref, ref_grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "dense", score_mod=mod, activation=activation),
                             tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, backend, score_mod=mod, activation=activation),
                         tensors, backward)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads or (), ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_swat_bf16_stays_close_to_float32(device):
    """No normaliser: the output is a sum of up to w sigmoid-weighted values, so check bf16 against fp32."""
    n, window = 2048, 256
    mod = AlibiBias(torch.tensor(swat_slopes(4, "paper", "2:2"), device=device), 0.0)
    q, k, v = (t.detach() for t in qkv(n, dim=CUDA_HEAD_DIM, device=device))
    ref = attend(q, k, v, SlidingWindow(window), "dense", score_mod=mod, activation="sigmoid")
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), SlidingWindow(window), "flex", score_mod=mod,
                 activation="sigmoid")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel


def test_flex_sigmoid_score_mod_is_logsigmoid_without_its_cuda_buffer_op():
    # FlexAttention's eager form vmaps the score_mod; on CUDA, F.logsigmoid's op returns an empty buffer that vmap
    # cannot batch (swat failed so under aot_eager on an H200). The score_mod is log(sigmoid) from pointwise ops
    from torch.fx.experimental.proxy_tensor import make_fx

    from attention.ops.flex.op import flex_score_mod

    mod = flex_score_mod(None, 0, "sigmoid")
    s = torch.cat([torch.linspace(-120, 120, 2001), torch.tensor([0.0, -1e-8, 1e-8, 88.0, -88.0])])
    index = torch.tensor(0)
    torch.testing.assert_close(mod(s, index, index, index, index), F.logsigmoid(s), rtol=1e-6, atol=1e-7)
    low = mod(s.bfloat16(), index, index, index, index)
    torch.testing.assert_close(low.float(), F.logsigmoid(s.bfloat16()).float(), rtol=1e-2, atol=1e-2)
    ops = {str(node.target) for node in make_fx(mod)(s, index, index, index, index).graph.nodes}
    assert not any("log_sigmoid" in op for op in ops), ops
