"""Block attention with boundary bridges (paper 004): the windows of Table 1, the score accounting of Table 2,
branch and union fusion on every backend against the dense reference, zero added parameters, caches."""

import contextlib
import io
import json

import pytest
import torch

from attention.call import MixerCall
from attention import validate_config
from attention.bridge import BoundaryWindows
from attention.edges import AnyOf, FixedBlock
from attention.kernels import attend
from attention.ops.dense import dense_attention
from attention.ops.window import window_plan
from attention.registry import SETTINGS, pattern_settings
from config import ModelConfig
from conftest import REPO, load_script
from helpers import LargestTensor, flex_has_backward, fwd_bwd, qkv
from model import GPT

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def table1_mask(kind, n, b, width, context):
    """The bridge path written out from Table 1's sets, window by window (independent of BoundaryWindows):
    every boundary p = j b, except that the first boundary at or past the configured context's end, which
    training never has, writes back only after itself."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    context_end = -(-context // b) * b
    for p in range(b, n + b, b):
        if kind == "se_bridge":
            sources, write_back = range(p - b, p + width), range(p, p + width)
        else:
            h = width // 2
            sources = range(p - h, p + h)
            write_back = sources if kind == "bridge" and p != context_end else range(p, p + h)
        for q in write_back:
            for k in sources:
                if 0 <= k <= q < n:
                    mask[q, k] = True
    return mask


@pytest.mark.parametrize("kind, width", [("bridge", 16), ("bridge", 8), ("pbb", 16), ("pbb", 32), ("se_bridge", 8),
                                         ("se_bridge", 16)])
@pytest.mark.parametrize("n", [64, 75, 80, 150, 200])  # within the configured context (80) and past it
def test_the_predicate_is_table_1(kind, width, n):
    rule = BoundaryWindows(kind, 16, width, context=80)
    torch.testing.assert_close(rule.dense_mask(torch.arange(n)), table1_mask(kind, n, 16, width, 80))
    pos = torch.arange(n)
    assert (rule.dense_mask(pos) & (pos[None, :] > pos[:, None])).sum() == 0  # causal


def stats(*args):
    # scripts/mask_stats.py's main in this process (test_attention runs it as a command): ten counts cost ten
    # interpreter start-ups otherwise
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        load_script("mask_stats").main(["--config", str(REPO / "configs/bridges/owt_124m_full.py"), "--json", "--receptive_field=no", *args])
    layer = json.loads(printed.getvalue())["layers"][0]
    return layer["scores_per_head"], layer["edges_per_head"], layer["write_back"]


def of(pattern, *args):
    """args for attn_pattern=pattern without the variant settings none of its mixers reads (a run refuses those)."""
    read = pattern_settings(pattern)
    keys = [arg[2:].split("=", 1)[0] if arg.startswith("--") else "" for arg in args]
    return [*(arg for arg, key in zip(args, keys) if key not in SETTINGS or key in read), f"--attn_pattern={pattern}"]


def test_mask_stats_reproduces_table_2_and_the_union_counts():
    common = ["--seq_len", "1024", "--block_len=128", "--swa_window=128", "--bridge_width=128", "--bridge_extension=64"]
    assert stats(*of("block", *common))[0] == 66_048
    assert stats(*of("swa", *common))[0] == 122_944
    assert stats(*of("full", *common))[0] == 524_800
    assert stats(*of("bridge", *common)) == (123_840, 94_720, 896)
    assert stats(*of("pbb", *common)) == (123_840, 94_720, 448)
    assert stats(*of("se_bridge", *common)) == (195_744, 123_392, 448)
    # union form at n = 8192 (Sec. 6.9): unique allowed edges, block + repair
    union = ["--seq_len", "8192", "--block_size=8192", "--block_len=128", "--swa_window=128", "--bridge_fusion=union"]
    assert stats(*of("pbb", *union))[:2] == (786_432, 786_432)
    assert stats(*of("block", *union))[0] == 528_384
    assert stats(*of("swa", *union))[0] == 1_040_448
    assert stats(*of("full", *union))[0] == 33_558_528


def model(pattern, **kw):
    cfg = dict(arch="gpt2", n_layer=2, n_head=2, n_embd=16, block_size=96, vocab_size=50, block_len=16,
               bridge_width=16, bridge_extension=8, attn_pattern=pattern, dropout=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg)).double()


def test_branch_is_two_separate_softmaxes_summed_and_zero_outside_write_back():
    n, b = 80, 16
    q, k, v = (t.detach() for t in qkv(n))
    pos = torch.arange(n)
    for kind, width in [("bridge", 16), ("pbb", 16), ("se_bridge", 8)]:
        mixer = model(kind).blocks[0].mixer
        y = mixer.attend(q, k, v, MixerCall(pos))
        block = dense_attention(q, k, v, FixedBlock(b), pos)
        bridge_mask = table1_mask(kind, n, b, width, 96)
        scores = (q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5).masked_fill(~bridge_mask, float("-inf"))
        bridge = torch.nan_to_num(torch.softmax(scores, -1)) @ v  # rows without sources: zero
        torch.testing.assert_close(y, block + bridge)
        outside = ~bridge_mask.any(-1)
        assert outside.any()
        torch.testing.assert_close(y[:, :, outside], block[:, :, outside])  # no bridge contribution there
        union = model(kind, bridge_fusion="union").blocks[0].mixer.attend(q, k, v, MixerCall(pos))
        torch.testing.assert_close(union, dense_attention(q, k, v, AnyOf((FixedBlock(b),
                                                                             BoundaryWindows(kind, b, width, 96))), pos))


@pytest.mark.parametrize("kind", ["bridge", "pbb", "se_bridge"])
@pytest.mark.parametrize("fusion", ["branch", "union"])
@pytest.mark.parametrize("backend", ["chunked", "sdpa", "span"])  # span: the Triton kernels, interpreted on the CPU
def test_backends_equal_dense_forward_and_backward(kind, fusion, backend):
    # 40 positions: two boundaries, the second's window cut by the end; short, since the interpreter runs span
    idx = torch.randint(0, 50, (2, 41), generator=torch.Generator().manual_seed(1))
    results = []
    for name in ("dense", backend):
        m = model(kind, bridge_fusion=fusion, attn_backend=name)
        logits, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((logits, [p.grad for p in m.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["bridge", "pbb", "se_bridge"])
def test_flex_forward_equals_dense_on_cpu(kind):
    idx = torch.randint(0, 50, (2, 75), generator=torch.Generator().manual_seed(1))
    for fusion in ("branch", "union"):
        ref = model(kind, bridge_fusion=fusion, attn_backend="dense").float().eval()
        flex = model(kind, bridge_fusion=fusion, attn_backend="flex").float().eval()
        with torch.no_grad():
            torch.testing.assert_close(flex(idx)[0], ref(idx)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bridge", "pbb", "se_bridge"])
def test_no_added_parameters_causal_and_cached_generation(kind):
    assert model(kind).num_params() == model("block").num_params()
    for fusion in ("branch", "union"):
        m = model(kind, bridge_fusion=fusion).eval()
        idx = torch.randint(0, 50, (2, 70), generator=torch.Generator().manual_seed(2))
        changed = idx.clone()
        changed[:, 40] = (idx[:, 40] + 1) % 50
        a, b = m(idx)[0], m(changed)[0]
        torch.testing.assert_close(a[:, :40], b[:, :40])
        prompt = idx[:, :30]
        torch.testing.assert_close(m.generate(prompt, 30, temperature=0, use_cache=True),
                                   m.generate(prompt, 30, temperature=0, use_cache=False))


@pytest.mark.parametrize("kind", ["bridge", "pbb", "se_bridge"])
def test_past_the_context_every_boundary_is_bridged_as_in_training(kind):
    """Scored past its context (block_size 96), a RoPE model keeps the local structure it was trained with:
    a position past the context sees what the same text sees inside the context of a sequence that starts a
    multiple of the block later. (Bridging only the context's boundaries left every later position on the
    block path alone, a model it was never trained as: 004's bridges then scored worse than Block at 4x the
    training length.)"""
    m = model(kind, arch="llama", bias=False).eval()
    idx = torch.randint(0, 50, (1, 260), generator=torch.Generator().manual_seed(3))
    shift = 96  # a multiple of the block (16): the boundaries line up
    with torch.no_grad():
        long, short = m(idx)[0], m(idx[:, shift:])[0]
    # short's positions [64, 88): inside its context, two layers' reach (2 x 23) past its start and before its
    # context's end; long's [160, 184): past its context, more than that reach after its context's end
    torch.testing.assert_close(long[:, 160:184], short[:, 64:88])
    assert not torch.allclose(long[:, 100:110], short[:, 4:14])  # near a start the contexts differ


def test_bridges_restore_the_boundary_edge_block_lacks():
    b = 16
    for pattern in ("block", "bridge", "pbb", "se_bridge"):
        reach = model(pattern).blocks[0].mixer.edge_mask(64)
        assert bool(reach[b, b - 1]) == (pattern != "block")  # the edge (p - 1 -> p) of Theorem 2 / Lemma 2


@pytest.mark.parametrize("kind, width", [("bridge", 16), ("pbb", 16), ("pbb", 32), ("se_bridge", 8), ("se_bridge", 16)])
@pytest.mark.parametrize("n, context", [(64, 96), (75, 96), (96, 96), (20, 96), (10, 96), (12, 16), (40, 40),
                                        (200, 96), (150, 40), (107, 40)])  # and past the configured context
def test_window_kernel_equals_dense_forward_and_backward(kind, width, n, context):
    """The bridge path window by window (every backend but dense), at lengths cutting windows anywhere."""
    rule = BoundaryWindows(kind, 16, width, context)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    results = []
    for y in (attend(q, k, v, rule, "chunked"), dense_attention(q, k, v, rule, torch.arange(n))):
        results.append((y, *torch.autograd.grad(y.square().sum(), (q, k, v), materialize_grads=True)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu  # on CUDA where it exists, else on the CPU under the device guard (tests/conftest.py)
@pytest.mark.parametrize("kind, width", [("bridge", 64), ("pbb", 64), ("se_bridge", 32)])
def test_gpu_window_kernel_equals_dense_and_bfloat16_is_close(kind, width, device):
    rule, n = BoundaryWindows(kind, 64, width, 512), 300
    q, k, v = qkv(n, dim=32, dtype=torch.float32, device=device)
    backward = flex_has_backward(device)
    out, grads = fwd_bwd(lambda a, b, c: attend(a, b, c, rule, "flex"), [q, k, v], backward)
    ref, ref_grads = fwd_bwd(lambda a, b, c: dense_attention(a, b, c, rule, torch.arange(n, device=device)), [q, k, v])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads or (), ref_grads):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        low = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), rule, "flex")
    torch.testing.assert_close(low.float(), ref, atol=2e-2, rtol=2e-2)


def test_window_kernel_scores_only_the_write_back_rows():
    """Table 2's geometry (n = 1024, b = w = 128, e = 64): one tile per boundary, its write-back rows by its
    sources, and no other scores."""
    n, b = 1024, 128
    for kind, width, rows, keys in (("bridge", 128, 128, 128), ("pbb", 128, 64, 128), ("se_bridge", 64, 64, 192)):
        q_index, k_index, mask, inside = window_plan(BoundaryWindows(kind, b, width, n), n, "cpu")
        assert mask.shape == (7, rows, keys) and len(inside) == 7 * rows
        assert sorted(q_index.tolist()) == [q for q in range(n) if BoundaryWindows(kind, b, width, n).window_of(
            torch.tensor(q)) > 0]  # exactly the write-back sets: 896, 448, 448 positions


def test_branch_chunked_training_path_never_builds_an_n_by_n_tensor():
    n, b = 8192, 128
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    for rule in (FixedBlock(b), *(BoundaryWindows(kind, b, 64, n) for kind in ("bridge", "pbb", "se_bridge"))):
        with LargestTensor() as largest:
            attend(q, k, v, rule, "chunked").sum().backward()
        assert largest.numel <= 4 * n * (b + 64 + 128), largest.shape
        assert sum(size >= n for size in largest.shape) <= 1, largest.shape  # at most one axis spans the sequence


@pytest.mark.parametrize("bad, message", [
    (dict(attn_pattern="bridge", bridge_width=256), "bridge_width=256"),
    (dict(attn_pattern="pbb", bridge_width=15), "must be even"),
    (dict(attn_pattern="se_bridge", bridge_extension=200), "bridge_extension=200"),
    (dict(attn_pattern="pbb", bridge_fusion="sum"), "bridge_fusion"),
])
def test_config_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        validate_config(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_len=128, **bad))


def test_paper_configs_share_the_124m_recipe():
    from config import load_config

    sizes = set()
    for family in ("full", "block", "swa", "bridge", "pbb", "se_bridge"):
        cfg = load_config([f"configs/bridges/owt_124m_{family}.py"])
        m, t = cfg.model, cfg.train
        assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout, m.bias) == (12, 12, 768, 1024, 0.0, True)
        assert (t.batch_size, t.gradient_accumulation_steps, t.learning_rate, t.min_lr, t.warmup_iters) == \
            (16, 8, 2e-4, 6e-5, 1000)
        # through step 20,000: the paper's 20,001 updates (App. D), as the loop stops before the step it is given
        assert (t.max_iters, t.weight_decay, t.grad_clip, cfg.eval.eval_interval, cfg.eval.eval_iters) == \
            (20001, 0.1, 1.0, 500, 100)
        if family != "full":
            assert (m.block_len, m.swa_window, m.bridge_width, m.bridge_extension, m.bridge_fusion) == \
                (128, 128, 128, 64, "branch")
        with torch.device("meta"):
            sizes.add(GPT(m).num_params())
    assert len(sizes) == 1 and abs(sizes.pop() / 124.4e6 - 1) < 0.005  # no variant adds a parameter
