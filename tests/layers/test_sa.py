"""Stochastic attention (paper 000): sa and sa_swa against the dense reference, causality, permutations,
seeding and resume, the recipe's sizes, and the graph statistics of App. A."""

import json
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attention.call import MixerCall
from attention.edges import SlidingWindow
from attention.ops.flex.block_mask import flex_block_mask
from attention.stochastic import (PermutedWindow, StochasticWindow, inverse_permutation, plan_stochastic,
                                  stochastic_attention, stochastic_edge_count, stochastic_halo)
from config import ModelConfig, load_config
from conftest import generator, run_in_process, train_in_process
from helpers import CUDA_HEAD_DIM, LargestTensor, flex_has_backward
from helpers import weighted_fwd_bwd as fwd_bwd  # the ramp-weighted gradients these tests were written with
from model import GPT
from scripts.sa import graph_stats as sa_stats


def qkv(n, batch=2, heads=3, dim=8, requires_grad=True, dtype=torch.float64, device=None):
    g = generator(n, device)
    return [torch.randn(batch, heads, n, dim, generator=g, dtype=dtype, device=device).requires_grad_(requires_grad)
            for _ in range(3)]


def original_space_mask(order, window):
    """sa's mask written out from the paper's definition, independently of attention/edges.py."""
    n = len(order)
    slot_of = [0] * n
    for s, t in enumerate(order.tolist()):
        slot_of[t] = s
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            d = abs(slot_of[i] - slot_of[j])
            mask[i, j] = min(d, n - d) < window / 2
    return mask


class CountedOperations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_drawn_order_is_planned_in_a_handful_of_operations():
    """sa plans each layer at every forward (on the GPU each operation a kernel launched from the host): the band's
    spans, its backward plan and the layout's slots are the same for every order, built once and shared, so a plan
    pays only for its order: the inverse permutation, the tokens at the layout's rows (twice: layout and rule)
    and their int32 copy, 7 operations where it was 34."""
    n, window = 4096, 256
    halo = stochastic_halo(window)
    orders = [torch.randperm(n, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    first = plan_stochastic(orders[0], window, "span", 4, 16, "cpu")
    with CountedOperations() as counted:
        second = plan_stochastic(orders[1], window, "span", 4, 16, "cpu")
    assert counted.count <= 7
    a, b = first.attention.data.spans, second.attention.data.spans
    assert all(x is y for x, y in ((a.lo, b.lo), (a.hi, b.hi), (a.key_first, b.key_first), (a.key_end, b.key_end)))
    rows = torch.arange(n + 2 * halo)
    assert torch.equal(b.order, orders[1][(rows - halo) % n].int()) and not torch.equal(a.order, b.order)
    assert torch.equal(second.layout.token, orders[1][(rows - halo) % n])
    assert torch.equal(orders[1][second.layout.slot_of], torch.arange(n))
    # the shared band is the band: rows within halo of each other, the backward's rows per 16 keys from it
    assert torch.equal(b.lo[0], (rows - halo).clamp(min=0).int()) and torch.equal(
        b.hi[0], (rows + halo + 1).clamp(max=n + 2 * halo).int())
    keys = torch.arange(0, n + 2 * halo, 16)
    assert torch.equal(b.key_first[0], (keys - halo).clamp(min=0).int())
    assert torch.equal(b.key_end[0], (keys + 16 + halo).clamp(max=n + 2 * halo).int())


@pytest.mark.parametrize("n,window", [(9, 4), (40, 7), (64, 8), (97, 16)])
def test_rules_match_the_definition_written_out(n, window):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    expected = original_space_mask(order, window)
    pos = torch.arange(n)
    assert torch.equal(StochasticWindow(inverse_permutation(order), window).dense_mask(pos), expected)
    if n // 2 > stochastic_halo(window):  # the permuted layout exists
        rule = PermutedWindow(order, window)
        ext = rule.dense_mask(torch.arange(n + 2 * rule.halo))[rule.halo:rule.halo + n]  # the real queries
        token = order[rule.extended_slots()]
        in_original = torch.zeros(n, n, dtype=torch.bool)
        rows = order[:, None].expand(n, n + 2 * rule.halo)
        in_original[rows[ext], token[None, :].expand_as(ext)[ext]] = True
        assert torch.equal(in_original, expected)
        assert ext.sum() == expected.sum()  # every edge exactly once: no slot is counted twice in a band
        distance = torch.arange(n + 2 * rule.halo)[None, :] - torch.arange(n + 2 * rule.halo)[:, None]
        full = rule.dense_mask(torch.arange(n + 2 * rule.halo))
        assert not (full & ((distance > rule.lookahead) | (distance < -rule.lookback))).any()
    assert expected.sum() == stochastic_edge_count(n, window)  # the closed form holds for every permutation


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
@pytest.mark.parametrize("n,window", [(200, 16), (130, 33), (300, 256), (50, 256), (9, 6)])
def test_backends_equal_dense_forward_and_backward(backend, n, window):
    tensors = qkv(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = fwd_bwd(lambda q, k, v: stochastic_attention(q, k, v, order, window, "dense"), tensors)
    out, grads = fwd_bwd(lambda q, k, v: stochastic_attention(q, k, v, order, window, backend), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("n,window", [(300, 16), (700, 100), (130, 256)])
def test_flex_forward_equals_dense(n, window):  # CPU flex has no backward; the CUDA tests cover it
    q, k, v = qkv(n, requires_grad=False)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    ref = stochastic_attention(q, k, v, order, window, "dense")
    torch.testing.assert_close(stochastic_attention(q, k, v, order, window, "flex"), ref)


def test_flex_block_mask_of_a_permutation_is_the_band():
    n, window = 1024, 64
    rule = PermutedWindow(torch.randperm(n), window)
    mask = flex_block_mask(rule, n + 2 * rule.halo, None, "cpu")
    blocks = mask.kv_num_blocks[0, 0]
    assert blocks.max() <= 3 and blocks.sum() < (blocks.numel() ** 2) / 3  # banded, not n x n


def sa_config(pattern="sa", **kw):
    base = dict(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=61, bias=False,
                attn_pattern=pattern, swa_window=8)
    return ModelConfig(**{**base, **kw})


def fixed(model, order):
    """Make every sa layer use `order` (the same permutation for a fair comparison of backends)."""
    for block in model.blocks:
        block.mixer.draw_orders = lambda batch, n, device: order
    return model


@pytest.mark.parametrize("pattern", ["sa", "sa_swa"])
@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_layers_equal_dense_with_the_same_permutation(pattern, backend):
    torch.manual_seed(0)
    ref_model = GPT(sa_config(pattern, attn_backend="dense")).double()
    model = GPT(sa_config(pattern, attn_backend=backend)).double()
    model.load_state_dict(ref_model.state_dict())
    order = torch.randperm(100)
    x = torch.randint(0, 61, (2, 100))
    losses, grads = [], []
    for m in (ref_model, model):
        loss = fixed(m, order)(x, x)[1]
        loss.backward()
        losses.append(loss)
        grads.append({name: p.grad for name, p in m.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_sa_swa_on_span_runs_its_two_paths_in_one_call(monkeypatch):
    """sa_swa on span attention: each layer runs sa and swa in one op (Kernel.run_apart), whose backward sums the
    paths' gradients in the kernels: sa in slots, and at a length where every slot is in every window (n // 2 <=
    halo: sa is causal attention in token order); its loss and every parameter's gradient equal the dense backend's
    under the same permutation."""
    from attention.ops.span import kernel, op

    calls = []
    monkeypatch.setattr(kernel, "span_pair_apart", lambda *a, **kw: calls.append(kw.get("halo_a", a[-1]))
                        or op.span_pair_apart(*a, **kw))
    torch.manual_seed(0)
    ref_model = GPT(sa_config("sa_swa", attn_backend="dense"))
    model = GPT(sa_config("sa_swa", attn_backend="span"))
    model.load_state_dict(ref_model.state_dict())
    for n, halo in ((40, stochastic_halo(8)), (7, -1)):
        order = torch.randperm(n)
        x = torch.randint(0, 61, (2, n))
        losses, grads = [], []
        for m in (ref_model, model):
            m.zero_grad()
            loss = fixed(m, order)(x, x)[1]
            loss.backward()
            losses.append(loss)
            grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
        assert calls == [halo, halo]  # one per layer
        calls.clear()
        torch.testing.assert_close(losses[1], losses[0])
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_per_sequence_permutations_equal_dense_per_sequence():
    torch.manual_seed(0)
    model = GPT(sa_config(sa_shared_batch=False)).double().train()
    x = torch.randint(0, 61, (3, 80))
    q, k, v = qkv(80, batch=3, heads=2, requires_grad=False)
    layer = model.blocks[0].mixer
    y = layer.attend(q, k, v, MixerCall(torch.arange(80)))
    orders = layer.last_order
    assert orders.shape == (3, 80) and len({tuple(o.tolist()) for o in orders}) == 3
    for b in range(3):
        ref = stochastic_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], orders[b], 8, "dense")
        torch.testing.assert_close(y[b:b + 1], ref)
    assert model(x, x)[1].isfinite()


@pytest.mark.parametrize("pattern", ["sa", "sa_swa", "sa,swa"])
def test_causal_in_original_positions_for_every_sampled_permutation(pattern):
    torch.manual_seed(0)
    model = GPT(sa_config(pattern, n_layer=2)).double().train()
    x = torch.randint(0, 61, (2, 96))
    for seed in range(5):
        changed = x.clone()
        changed[:, 60:] = torch.randint(0, 61, (2, 36))
        torch.manual_seed(seed)
        logits = model(x)[0]
        torch.manual_seed(seed)  # the same permutations for the changed input
        logits_changed = model(changed)[0]
        torch.testing.assert_close(logits[:, :60], logits_changed[:, :60])
        assert not torch.allclose(logits[:, 60:], logits_changed[:, 60:])


def test_permutations_differ_across_layers_and_steps_and_are_shared_by_heads():
    torch.manual_seed(0)
    model = GPT(sa_config(n_layer=3)).train()
    x = torch.randint(0, 61, (2, 64))
    seen = []
    for _ in range(2):
        model(x)
        seen += [tuple(block.mixer.last_order.tolist()) for block in model.blocks]
        assert all(block.mixer.last_order.shape == (64,) for block in model.blocks)  # one per layer: all heads
    assert len(set(seen)) == 6
    # heads share it: a layer's output equals the dense reference under that single permutation for all heads
    layer = model.blocks[0].mixer.double()
    q, k, v = qkv(64, heads=2, requires_grad=False)
    y = layer.attend(q, k, v, MixerCall(torch.arange(64)))
    torch.testing.assert_close(y, stochastic_attention(q, k, v, layer.last_order, 8, "dense"))


def test_inference_modes():
    torch.manual_seed(0)
    x = torch.randint(0, 61, (2, 64))
    stochastic = GPT(sa_config()).eval()
    assert not torch.equal(stochastic(x)[0], stochastic(x)[0])  # a fresh permutation each forward
    deterministic = GPT(sa_config(sa_mode="deterministic", sa_seed=3)).eval()
    deterministic.load_state_dict(stochastic.state_dict())
    first = deterministic(x)[0]
    torch.testing.assert_close(deterministic(x)[0], first)
    orders = [block.mixer.last_order for block in deterministic.blocks]
    assert not torch.equal(orders[0], orders[1])  # fixed, but per layer
    other_seed = GPT(sa_config(sa_mode="deterministic", sa_seed=4)).eval()
    other_seed.load_state_dict(stochastic.state_dict())
    assert not torch.equal(other_seed(x)[0], first)
    deterministic.train()
    deterministic(x)
    assert not torch.equal(deterministic.blocks[0].mixer.last_order, orders[0])  # training always draws


def test_generation_reruns_the_context_and_matches_uncached():
    torch.manual_seed(0)
    model = GPT(sa_config("sa_swa", sa_mode="deterministic")).eval()
    prompt = torch.randint(0, 61, (2, 10))
    assert not model.blocks[0].mixer.supports_cache
    torch.testing.assert_close(model.generate(prompt, 8, temperature=0, use_cache=True),
                               model.generate(prompt, 8, temperature=0, use_cache=False))


def test_sa_swa_has_two_gates_and_single_paths_one():
    sa_swa = GPT(sa_config("sa_swa", attn_gate=True)).blocks[0].mixer
    assert sa_swa.gate is None and sa_swa.gate_sa.weight.shape == (32, 32) and sa_swa.gate_swa.bias is None
    assert GPT(sa_config("sa", attn_gate=True)).blocks[0].mixer.gate is not None


def meta_params(config_file):
    cfg = load_config([config_file])
    with torch.device("meta"):
        return GPT(cfg.model).num_params()


def test_recipe_sizes():
    for variant in ("full", "swa", "sa"):
        assert abs(meta_params(f"configs/sa/slimpajama_360m_{variant}.py") / 360e6 - 1) < 0.01, variant
    assert abs(meta_params("configs/sa/slimpajama_360m_sa_swa.py") / 385e6 - 1) < 0.01
    cfg = load_config(["configs/sa/slimpajama_360m_sa.py"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.mlp_hidden, cfg.model.swa_window,
            cfg.model.block_size, cfg.model.vocab_size) == (24, 1024, 16, 2734, 256, 2048, 32000)
    assert cfg.train.learning_rate == 3e-4 and cfg.train.min_lr == 3e-5
    assert 3.8e6 < cfg.train.batch_size * cfg.train.gradient_accumulation_steps * 2048 < 4.0e6
    for variant in ("full", "swa", "sa", "sa_swa"):
        small = load_config([f"configs/sa/sa_small_{variant}.py"])
        assert small.model.attn_pattern == variant and small.data.dataset == "recall_byte"


def test_edge_accounting():
    model = GPT(sa_config("sa,sa_swa", swa_window=16))
    sa_layer, sa_swa_layer = (block.mixer for block in model.blocks)
    n = 200
    sa = stochastic_edge_count(n, 16)
    assert sa_layer.edge_counts(n) == [(sa, sa)] * 2
    swa = SlidingWindow(16).count_edges(n)
    computed, union = sa_swa_layer.edge_counts(n)[0]
    assert computed == sa + swa and swa < union < computed
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # the layer's seeded permutation
    mask = StochasticWindow(inverse_permutation(order), 16).dense_mask(torch.arange(n)) | \
        SlidingWindow(16).dense_mask(torch.arange(n))
    assert union == int(mask.sum())
    assert abs(sa / swa - 0.5) < 0.05  # half of the window's slots are causal


def test_chunked_sa_never_builds_an_n_by_n_tensor():
    n, window = 16384, 256
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    order = torch.randperm(n)
    with LargestTensor() as largest:
        stochastic_attention(q, k, v, order, window, "chunked").sum().backward()
    assert largest.numel <= 2 * (n + window) * (window + 128), largest.shape


@pytest.mark.parametrize("window", [31, 32])
def test_connection_probability_matches_appendix_a1(window):
    n = 512
    non_causal = sa_stats.connection_probability(n, window, samples=600, pairs=128)
    causal = sa_stats.connection_probability(n, window, samples=600, pairs=128, causal=True)
    assert abs(non_causal["z_exact"]) < 3 and abs(causal["z_exact"]) < 3
    if window % 2:  # an odd window holds exactly w slots: the paper's (w-1)/(n-1)
        assert non_causal["exact"] == pytest.approx((window - 1) / (n - 1)) and abs(non_causal["z_paper"]) < 3
    else:  # |d| < w/2 holds w - 1 slots for even w
        assert non_causal["exact"] == pytest.approx((window - 2) / (n - 1))
    assert causal["estimate"] == pytest.approx(non_causal["estimate"] / 2, rel=0.1)


def test_receptive_field_sa_in_log_depth_swa_in_linear_depth():
    n, window = 512, 16
    sa = sa_stats.receptive_field("sa", n, window, 12, causal=False, targets=64)
    swa = sa_stats.receptive_field("swa", n, window, 80, causal=False, targets=64)
    assert sa_stats.depth_to_cover(sa) <= math.ceil(math.log(n, window)) + 3
    assert sa_stats.depth_to_cover(swa, 0.99) >= n / window
    sa_causal = sa_stats.receptive_field("sa", n, window, 12, causal=True)
    swa_causal = sa_stats.receptive_field("swa", n, window, 12, causal=True)
    assert swa_causal[-1] < 0.4 < 0.9 < sa_causal[-1]  # the last token after 12 layers


@pytest.mark.e2e
def test_sa_stats_script_prints_and_plots(tmp_path):
    plot = tmp_path / "rf.png"
    proc = run_in_process(["-m", "scripts.sa.graph_stats"], "--n", "256", "--window", "16", "--samples", "200",
                          "--max_depth", "40", "--plot", str(plot), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert plot.stat().st_size > 1000
    assert report["summary"]["sa non-causal"]["full_coverage_at"] <= 5


@pytest.mark.e2e
def test_training_draws_reproducible_permutations_and_resumes_exactly(tmp_path):
    # in this process: what is checked is the seeding and the resume, which train.py does itself, not the process
    args = ["configs/sa/sa_small_sa_swa.py", "--n_layer=2", "--n_embd=32", "--block_size=64", "--batch_size=4",
            "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=8", "--eval_interval=4"]

    def train(out, *extra):
        train_in_process([*args, f"--out_dir={out}", *extra])
        return {r["step"]: r["train_loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
                if "train_loss" in r}

    reference = train(tmp_path / "ref", "--max_iters=8")
    assert train(tmp_path / "again", "--max_iters=8") == reference  # same seed, same permutations
    train(tmp_path / "resumed", "--max_iters=4")
    assert train(tmp_path / "resumed", "--max_iters=8", "--init_from=resume") == reference
    assert train(tmp_path / "seeded", "--max_iters=8", "--seed=7") != reference


@pytest.mark.gpu  # on CUDA where it exists, else on the CPU under the device guard (tests/conftest.py)
@pytest.mark.parametrize("backend", ["flex", "chunked", "span"])
def test_gpu_sa_equals_dense_forward_and_backward(backend, device):
    # the interpreter runs span: fewer rows on the CPU (120 still leaves sa its permuted layout: n // 2 > halo)
    n, window = (1000 if device == "cuda" else 120 if backend == "span" else 300), 64
    q, k, v = qkv(n, dim=CUDA_HEAD_DIM, dtype=torch.float32, device=device)
    order = torch.randperm(n, generator=generator(0, device), device=device)
    backward = backend != "flex" or flex_has_backward(device)
    ref, ref_grads = fwd_bwd(lambda a, b, c: stochastic_attention(a, b, c, order, window, "dense"), [q, k, v])
    out, grads = fwd_bwd(lambda a, b, c: stochastic_attention(a, b, c, order, window, backend), [q, k, v],
                         backward)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads or (), ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4)


@pytest.mark.gpu  # on CUDA where it exists, else on the CPU under the device guard (tests/conftest.py)
def test_gpu_sa_swa_paths_in_one_op_equal_dense_forward_and_backward(device):
    """sa_swa's two paths in one span op (sa in slots, swa accumulating its gradients into sa's), against each
    path's dense reference under two different upstream gradients."""
    from attention.kernels import attend_apart, plan_attention
    from attention.ops.dense import dense_attention

    n, window = (1000 if device == "cuda" else 90), 64  # the interpreter runs span: fewer rows (n // 2 > halo)
    q, k, v = qkv(n, dim=CUDA_HEAD_DIM, dtype=torch.float32, device=device)
    order = torch.randperm(n, generator=generator(0, device), device=device)
    sa = plan_stochastic(order, window, "span", 3, CUDA_HEAD_DIM, device)
    swa = plan_attention(SlidingWindow(window), "span", n, 3, CUDA_HEAD_DIM, device)
    both = attend_apart(q, k, v, (sa.attention, swa), (sa.layout, None))
    assert both is not None
    refs = (stochastic_attention(q, k, v, order, window, "dense"),
            dense_attention(q, k, v, SlidingWindow(window), torch.arange(n, device=device)))
    upstream = [torch.randn(r.shape, generator=generator(seed + 1, device), device=device)
                for seed, r in enumerate(refs)]
    for ours, theirs in zip((*both, *torch.autograd.grad(both, (q, k, v), upstream)),
                            (*refs, *torch.autograd.grad(refs, (q, k, v), upstream))):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_batched_scoring_of_sa_does_not_depend_on_batch_mates():
    """sa draws its permutation over the whole (padded) length: scoring batches only equal lengths keeps a
    sequence's score what it is alone, whatever batch_size (deterministic permutations make it comparable)."""
    import numpy as np

    from eval.ppl import perplexity
    from eval.ranking import continuation_logprobs

    torch.manual_seed(0)
    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61, bias=False,
                            attn_pattern="sa", swa_window=16, sa_mode="deterministic")).eval()
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(0, 61, (n,), generator=g).tolist(), [5, 6]) for n in (20, 45, 20, 30)]
    alone = [continuation_logprobs(model, [pair], batch_size=1)[0]["logprob"] for pair in pairs]
    batched = [r["logprob"] for r in continuation_logprobs(model, pairs, batch_size=4)]
    assert batched == pytest.approx(alone, abs=1e-5)
    docs = [np.random.default_rng(2).integers(0, 61, n) for n in (50, 70, 33)]
    assert perplexity(model, docs, 32, batch_size=8, progress=False)["nll"] == \
        pytest.approx(perplexity(model, docs, 32, batch_size=1, progress=False)["nll"], rel=1e-6)
