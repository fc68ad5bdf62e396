"""The attention core: edge rules, every backend against the dense reference, caches, structural properties."""

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from attention.edges import AnyOf, Causal, EdgeRule, FixedBlock, GlobalKeys, SlidingWindow
from attention.kernels import attend, resolve_backend
from attention.ops.chunked.op import chunked_attention
from attention.ops.dense import dense_attention
from attention.ops.flex.op import FLEX_MIN_HEAD_DIM
from config import ConfigError, ModelConfig, load_config
from conftest import run_in_process
from helpers import (BRIDGED, CUDA_HEAD_DIM, GLOBAL, RULES, LargestTensor, PerHeadRule, flex_has_backward, fwd_bwd, qkv,
                     tiny)
from model import GPT

# eager FlexAttention on CPU warns that it is unfused: expected here, where it only checks masks
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@dataclass(frozen=True)
class EveryThirdQuery(EdgeRule):
    """Only queries at multiples of 3 attend (to the 5 most recent keys): other rows have no allowed key, as
    positions outside every write-back window of a bridge branch do."""

    lookback = 4

    def allowed(self, q, k, h=None):
        return (k <= q) & (q - k < 5) & (q % 3 == 0)


LENGTHS = [64, 100, 257]  # multiples of 16 and not


def alibi(score, b, h, q_idx, kv_idx):
    """A position bias in FlexAttention's score_mod form, to exercise the score_mod path of every backend."""
    return score - (h + 1) * 0.1 * (q_idx - kv_idx)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_lookback_bounds_every_allowed_edge(rule):
    pos = torch.arange(300)
    mask = rule.dense_mask(pos, n_head=4)
    distance = pos[:, None] - pos[None, :]
    assert not (mask & (distance < -rule.lookahead)).any()  # causal: lookahead 0
    assert (mask & (distance == 0)).any(-1).all()  # every query sees itself
    if rule.lookback is not None:
        assert int(torch.where(mask, distance, -1).max()) == rule.lookback
    for chunk in (8, 16, 32):  # the key ranges of a query chunk hold every edge of its queries (the kernels look
        for offset in (0, 5):  # nowhere else)
            absolute = pos + offset
            inside = torch.zeros(300, 300, dtype=torch.bool)
            for first in range(0, 300, chunk):
                for lo, hi in rule.key_ranges(offset + first, offset + min(300, first + chunk)):
                    inside[first:first + chunk, max(0, lo - offset):max(0, hi - offset)] = True
            assert not (rule.dense_mask(absolute, n_head=4) & ~inside).any()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("rule", RULES, ids=repr)  # any static rule, bounded or not: block-sparse
@pytest.mark.parametrize("chunk", [0, 8])
def test_chunked_equals_dense_forward_and_backward(rule, n, chunk):
    tensors = qkv(n)
    pos = torch.arange(n)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, pos), tensors)
    out, grads = fwd_bwd(lambda q, k, v: chunked_attention(q, k, v, rule, chunk=chunk or rule.chunk_size()), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("rule", [SlidingWindow(33), FixedBlock(20), PerHeadRule(), EveryThirdQuery()], ids=repr)
def test_chunked_autograd_sdpa_path_equals_dense(rule):
    # the path CUDA and attention dropout use (on CPU the fused flash Function is the default)
    tensors = qkv(100)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, torch.arange(100)), tensors)
    out, grads = fwd_bwd(lambda q, k, v: chunked_attention(q, k, v, rule, chunk=16, fused=False), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_chunked_bfloat16_is_close_to_float32_reference():
    q, k, v = (t.detach().float() for t in qkv(300, dtype=torch.float32))
    ref = dense_attention(q, k, v, SlidingWindow(40), torch.arange(300))
    out = chunked_attention(*(t.bfloat16() for t in (q, k, v)), SlidingWindow(40), chunk=32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
@pytest.mark.parametrize("rule", [SlidingWindow(16), FixedBlock(20), PerHeadRule()], ids=repr)
def test_chunked_score_mod_and_sigmoid_equal_dense(rule, activation):
    n = 100
    tensors = qkv(n)
    pos = torch.arange(n)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, pos, score_mod=alibi,
                                                             activation=activation), tensors)
    out, grads = fwd_bwd(lambda q, k, v: chunked_attention(q, k, v, rule, chunk=16, score_mod=alibi,
                                                           activation=activation), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_sdpa_equals_dense_forward_and_backward(rule):
    tensors = qkv(100)
    pos = torch.arange(100)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, pos), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, "sdpa"), tensors)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("score_mod", [None, alibi])
def test_flex_forward_equals_dense_on_cpu(rule, score_mod):
    # torch 2.13 runs FlexAttention forward (not backward) on CPU: this checks the mask_mod and block mask
    # derived from each rule; the CUDA training path uses the same block masks
    q, k, v = (t.detach().float() for t in qkv(200, dtype=torch.float32))
    ref = dense_attention(q, k, v, rule, torch.arange(200), score_mod=score_mod)
    out = attend(q, k, v, rule, "flex", score_mod=score_mod)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_flex_refuses_cpu_training():
    q, k, v = qkv(32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="attn_backend=chunked"):
        attend(q, k, v, SlidingWindow(8), "flex")


def test_chunked_with_a_position_offset():
    rule, n, start = FixedBlock(16), 70, 5  # blocks are not aligned with the chunks
    tensors = qkv(n)
    ref = dense_attention(*tensors, rule, torch.arange(start, start + n))
    torch.testing.assert_close(chunked_attention(*tensors, rule, start=start, chunk=16), ref)


def test_auto_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", SlidingWindow(8), cpu) == "chunked"
    assert resolve_backend("auto", SlidingWindow(8), cuda) == "span"
    assert resolve_backend("auto", Causal(), cpu) == resolve_backend("auto", Causal(), cuda) == "sdpa"
    # only plain causal attention keeps SDPA: every other static rule, unbounded or not, runs block-sparse; on
    # CUDA span attention where each query's keys are one run (the bridges' union), FlexAttention elsewhere
    for rule in BRIDGED:
        assert (resolve_backend("auto", rule, cpu), resolve_backend("auto", rule, cuda)) == ("chunked", "span")
    for rule in GLOBAL:
        assert (resolve_backend("auto", rule, cpu), resolve_backend("auto", rule, cuda)) == ("chunked", "flex")


def test_block_sparse_layout_keeps_only_key_blocks_with_edges():
    from attention.ops.blocks import block_structure

    n, c = 1024, 64
    window = block_structure(SlidingWindow(128), n, c, 1, "cpu")
    sinks = block_structure(AnyOf((SlidingWindow(128), GlobalKeys(4))), n, c, 1, "cpu")
    assert window.shape == (16, 3) and sinks.shape == (16, 4)  # the band, plus the first block for the sinks
    assert sinks[10].tolist() == [0, 8, 9, 10] and window[10].tolist() == [8, 9, 10]
    # a rule that does not name its far keys gets every earlier block as candidates, and keeps those with edges
    class Sinks(EdgeRule):
        def allowed(self, q, k, h=None):
            return (k <= q) & ((q - k < 128) | (k < 4))

    assert torch.equal(block_structure(Sinks(), n, c, 1, "cpu"), sinks)


def test_chunked_swa_never_builds_an_n_by_n_tensor():
    n, w = 32768, 256
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    with LargestTensor() as largest:
        chunked_attention(q, k, v, SlidingWindow(w), chunk=SlidingWindow(w).chunk_size()).sum().backward()
    assert largest.numel <= 2 * n * (w + 128), largest.shape  # tiles of 128 queries x 384 keys, not n x n
    assert all(size < n for size in largest.shape[-2:]) or largest.numel < n * n // 64


PATTERNS = ["full", "swa", "block", "swa,full"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal_through_a_whole_model(arch, pattern):
    model = tiny(arch, pattern)
    idx = torch.randint(0, 61, (2, 50))
    for t in (7, 8, 23):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(0, 61, (2, 50 - t - 1))
        torch.testing.assert_close(model(idx)[0][:, :t + 1], model(changed)[0][:, :t + 1])


def input_gradients(model, idx, target):
    """d logits[:, target] / d (token embedding at every position)."""
    captured = {}

    def keep(module, inputs, output):
        output.retain_grad()
        captured["emb"] = output

    handle = model.wte.register_forward_hook(keep)
    logits, _ = model(idx)
    handle.remove()
    logits[:, target].sum().backward()
    return captured["emb"].grad.abs().sum(dim=(0, 2))  # per source position


def test_block_boundary_barrier_through_any_depth():
    # 004 Theorem 1: with fixed blocks, a block's first position gets exactly nothing from the previous one
    model = tiny("gpt2", "block", n_layer=6)
    grads = input_gradients(model, torch.randint(0, 61, (1, 40)), target=16)  # block_len 8: 16 starts block 2
    assert grads[15] == 0 and grads[:16].abs().sum() == 0
    assert grads[16] > 0


@pytest.mark.parametrize("n_layer", [1, 2, 3])
def test_swa_receptive_field_grows_by_w_minus_1_per_layer(n_layer):
    model = tiny("llama", "swa", n_layer=n_layer)  # w = 8
    target = 40
    grads = input_gradients(model, torch.randint(0, 61, (1, 48)), target)
    reach = target - n_layer * 7
    assert (grads[reach:target + 1] > 0).all()
    assert (grads[:reach] == 0).all() and (grads[target + 1:] == 0).all()


@pytest.mark.parametrize("pattern", ["swa", "block", "swa,full"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_generation_equals_uncached(arch, pattern):
    model = tiny(arch, pattern)
    for prompt_len in (3, 20):  # shorter and longer than the window / block
        prompt = torch.randint(0, 61, (2, prompt_len))
        fast = model.generate(prompt, 30, temperature=0, use_cache=True)
        slow = model.generate(prompt, 30, temperature=0, use_cache=False)
        assert torch.equal(fast, slow)


def test_rolling_cache_holds_only_the_window():
    model = tiny("llama", "swa")
    caches = model.init_caches(batch_size=1, max_len=10_000)
    assert all(c.k.shape[2] == 8 for c in caches)  # w keys, whatever the generation length
    caches = tiny("llama", "block").init_caches(1, 10_000)
    assert all(c.k.shape[2] == 8 for c in caches)


@pytest.mark.parametrize("args, message", [
    (["--attn_pattern=full", "--attn_backend=chunked"], "is for rules that skip keys"),
    (["--attn_backend=fast"], "attn_backend='fast'"),
    (["--attn_pattern=swa", "--swa_window=0"], "swa_window=0"),
])
def test_attention_config_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["configs/quickstart.py", *args])


@pytest.mark.e2e
def test_mask_stats_reproduces_the_score_counts_of_004_table_2():
    counts = {}
    own = {"full": [], "swa": ["--swa_window=128"], "block": ["--block_len=128"]}  # a run refuses the others'
    for pattern in ("full", "swa", "block"):
        proc = run_in_process(["-m", "scripts.mask_stats"], "--config", "configs/quickstart.py", "--seq_len", "1024",
                              "--json", f"--attn_pattern={pattern}", *own[pattern], "--n_layer=2")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        heads = report["layers"][0]["heads"]
        assert len({h["scores"] for h in heads}) == 1
        counts[pattern] = heads[0]["scores"]
        if pattern == "swa":
            growth = [r["sources_of_last"] for r in report["receptive_field"]]
            assert growth == [128, 255]  # w, then w - 1 more per layer
    assert counts == {"full": 524_800, "swa": 122_944, "block": 66_048}


@dataclasses.dataclass(frozen=True)
class FixedPattern(EdgeRule):
    """Sparse Transformer's "fixed" pattern written as allowed() alone: the query's own block and the last key
    of every earlier block (a summary column)."""
    block: int = 128

    def allowed(self, q, k, h=None):
        return (k <= q) & ((k // self.block == q // self.block) | (k % self.block == self.block - 1))


@pytest.mark.e2e
def test_the_kernels_scores_are_counted_against_the_edges_so_a_costly_rule_shows():
    """computed_scores counts every tile the chunked kernel and every block FlexAttention's mask evaluates:
    swa's band costs 1.5x its edges, plain causal attention 1.0x, and a rule written as allowed() alone whose
    far keys a block layout cannot skip (a summary column in every earlier block) about as much, compacted;
    scripts/mask_stats.py prints the same ratios for a config's layers."""
    from attention.kernels import computed_scores, plan_attention
    from attention.ops.flex.kernel import flex_scores
    from attention.ops.flex.block_mask import flex_block_mask

    n, heads = 4096, 2
    ratios = {}
    for name, rule in (("swa", SlidingWindow(256)), ("causal", Causal()), ("fixed", FixedPattern(128))):
        for backend in ("auto", "flex"):
            plan = plan_attention(rule, backend, n, heads, 64, "cpu")
            ratios[name, plan.kernel] = computed_scores(plan, heads) / (heads * rule.count_edges(n))
    assert ratios["swa", "chunked"] == pytest.approx(1.5, abs=0.01)
    assert ratios["swa", "flex"] == pytest.approx(1.5, abs=0.01)
    assert ratios["causal", "sdpa"] == 1.0
    # the fixed pattern's summary column puts an edge in every earlier key block, which its plain block mask pays
    # for in full: the chunked kernel's compacted tiles hold only the keys with edges, FlexAttention reads the
    # summary keys from a prefix of copies (one block per query block; 3.2x at 4K, 2.0x at 16K)
    fixed = FixedPattern(128)
    block_layout = flex_scores(flex_block_mask(fixed, n, heads, "cpu"), heads) / (heads * fixed.count_edges(n))
    assert block_layout > 20 and ratios["fixed", "chunked"] < 2.5 and ratios["fixed", "flex"] < 3.5
    dense = plan_attention(SlidingWindow(256), "dense", n, heads, 64, "cpu")
    assert computed_scores(dense, heads) == heads * n * n
    proc = run_in_process(["-m", "scripts.mask_stats"], "--config", "configs/quickstart.py", "--seq_len", "1024",
                          "--json", "--attn_pattern=swa", "--swa_window=128", "--n_layer=1", "--receptive_field=no")
    assert proc.returncode == 0, proc.stderr
    layer = json.loads(proc.stdout)["layers"][0]
    assert layer["kernel"] == "chunked" and 1.0 < layer["kernel_vs_edges"] < 2.0 and layer["flex_vs_edges"] > 1.0


def test_auto_never_picks_flex_below_its_smallest_head_dimension():
    # torch 2.13's CUDA FlexAttention lowering needs head_dim >= 16: auto takes the chunked kernel there, and
    # the GPU checks below use heads of that size (span attention pads any head dimension)
    cuda, sinks = torch.device("cuda"), GLOBAL[0]
    assert resolve_backend("auto", sinks, cuda, head_dim=8) == "chunked"
    assert resolve_backend("auto", sinks, cuda, head_dim=FLEX_MIN_HEAD_DIM) == "flex"
    assert resolve_backend("auto", SlidingWindow(8), cuda, head_dim=8) == "span"
    assert CUDA_HEAD_DIM >= FLEX_MIN_HEAD_DIM


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_queries_without_keys_get_zero_output_and_gradient(backend):
    rule = EveryThirdQuery()
    tensors = qkv(50)
    ref, ref_grads = fwd_bwd(lambda q, k, v: dense_attention(q, k, v, rule, torch.arange(50)), tensors)
    out, grads = fwd_bwd(lambda q, k, v: attend(q, k, v, rule, backend), tensors)
    assert torch.isfinite(out).all() and (out[:, :, 1::3] == 0).all()
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


# ---- gpu tests (tests/conftest.py): on CUDA where it exists, else on the CPU under the device guard ----------

@pytest.mark.gpu
@pytest.mark.parametrize("rule, backend", [(rule, backend) for rule in RULES for backend in ("flex", "chunked")],
                         ids=repr)
def test_gpu_backends_equal_dense_forward_and_backward(rule, backend, device):
    q, k, v = qkv(300, dim=CUDA_HEAD_DIM, dtype=torch.float32, device=device)
    pos = torch.arange(300, device=device)
    backward = backend != "flex" or flex_has_backward(device)
    ref, ref_grads = fwd_bwd(lambda a, b, c: dense_attention(a, b, c, rule, pos), [q, k, v])
    out, grads = fwd_bwd(lambda a, b, c: attend(a, b, c, rule, backend), [q, k, v], backward)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for g, r in zip(grads or (), ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [SlidingWindow(64), FixedBlock(64)], ids=repr)
def test_gpu_flex_bfloat16_is_close_to_float32(rule, device):
    q, k, v = (t.detach() for t in qkv(1024, heads=4, dim=64, dtype=torch.float32, device=device))
    ref = dense_attention(q, k, v, rule, torch.arange(1024, device=device))
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), rule, "flex")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["dense", "chunked", "sdpa", "flex"])
@pytest.mark.parametrize("rule", [Causal(), SlidingWindow(16), PerHeadRule()], ids=repr)
def test_grouped_query_kv_heads_equal_repeated_heads(rule, backend):
    # k and v with 2 heads for 4 query heads: SDPA and flex take them as they are (enable_gqa, no copy), the other
    # kernels repeat them; every backend equals attention over explicitly repeated heads, forward and backward
    q, _, _ = qkv(70, dtype=torch.float32)
    k, v = (t[:, :2].detach().requires_grad_() for t in qkv(70, seed=1, dtype=torch.float32)[1:])
    backward = backend != "flex"
    shared, shared_grads = fwd_bwd(lambda a, b, c: attend(a, b, c, rule, backend), [q, k, v], backward)
    repeated, repeated_grads = fwd_bwd(lambda a, b, c: attend(a, b.repeat_interleave(2, 1), c.repeat_interleave(2, 1),
                                                              rule, "dense"), [q, k, v])
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-4)
    for g, r in zip(shared_grads or (), repeated_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pattern", ["full", "swa", "sa"])
def test_grouped_query_model_caches_kv_heads_and_generates_as_uncached(pattern):
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=128, vocab_size=61,
                      bias=False, attn_pattern=pattern, swa_window=8, sa_mode="deterministic")
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    if model.blocks[0].mixer.supports_cache:  # the cache keeps the 2 k/v heads, not 4 repeated ones
        assert all(c.k.shape[1] == 2 for c in model.init_caches(batch_size=1, max_len=64))
    prompt = torch.randint(0, 61, (2, 20))
    assert torch.equal(model.generate(prompt, 20, temperature=0, use_cache=True),
                       model.generate(prompt, 20, temperature=0, use_cache=False))


@pytest.mark.e2e
def test_eager_flex_runs_compiled_even_where_the_caller_forces_eager(monkeypatch):
    # train.py's probes run the model under torch.compiler.set_stance("force_eager") (its compiled blocks would
    # recompile for every probe length); the flex call inside must still run compiled, or on a GPU it would
    # build (B, H, n, n) scores. Compiled flex runs on CPU too, forward only, which this checks
    import attention.ops.flex.op as flex_op
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex_op, "COMPILE_EAGER_FLEX", True)
    torch._dynamo.reset()
    counters.clear()
    q, k, v = (t.detach() for t in qkv(200, heads=2, dim=16, dtype=torch.float32))
    with torch.compiler.set_stance("force_eager"):
        out = flex_op.flex(q, k, v, SlidingWindow(32))
    assert counters["frames"]["ok"] >= 1  # flex_attention was compiled, not run eagerly
    torch.testing.assert_close(out, dense_attention(q, k, v, SlidingWindow(32), torch.arange(200)), atol=1e-5,
                               rtol=1e-4)
    torch._dynamo.reset()


def test_no_registered_variant_builds_an_n_by_n_tensor_on_its_training_path():
    # every mixer under a static edge rule other than plain causal attention (and every recurrent mixer), as its
    # layer runs it (kernel_forward: the plan and kernel training uses), forward and backward; sa's
    # permuted band has its own test (tests/layers/test_sa.py)
    from attention.registry import RecurrentMixer, build_mixer, example_cases, pattern_names

    n, checked = 8192, []
    for name, settings in example_cases(128).items():
        if len(pattern_names(settings["attn_pattern"])) > 1:
            continue  # a pattern of several mixers (swax): each is a case of its own
        cfg = ModelConfig(**{"arch": "llama", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": n, "bias": False,
                             **settings})
        layer = build_mixer(cfg, cfg.n_layer - 1)
        rule = layer.edge_rule() if hasattr(layer, "edge_rule") else None
        static = rule is not None and rule.static and type(rule) is not Causal
        if not (static or isinstance(layer, RecurrentMixer)):
            continue  # plain causal attention (SDPA); rules drawn per forward or chosen by the data (sa, moba)
        inputs = layer.kernel_inputs(1, n, "cpu", torch.float32)
        with LargestTensor() as largest:
            layer.kernel_forward(*inputs).sum().backward()
        assert largest.numel < n * n // 8 and sum(size >= n // 8 for size in largest.shape) <= 1, (name, largest.shape)
        checked.append(name)
    assert {"swa", "block", "mswa", "swat", "pbb", "se_bridge", "mlstm", "gated_deltanet", "linear", "pbb_union",
            "bridge_union", "se_bridge_union", "swat_softmax"} <= set(checked)


def test_a_union_with_far_keys_takes_its_local_rules_chunk():
    # the far keys cost one key chunk per query chunk whatever its size; the window sets the chunk below 64
    assert AnyOf((SlidingWindow(32), GlobalKeys(4))).chunk_size() == SlidingWindow(32).chunk_size() == 16
    assert AnyOf((SlidingWindow(256), GlobalKeys(4))).chunk_size() == 64


@pytest.mark.e2e
def test_bench_attention_runs_cases_with_settings_on_the_cpu(tmp_path):
    """The documented CASE:KEY=VALUE form, for a built-in case: measured in its own process like any other (the
    command line that starts them runs in this process)."""
    proc = run_in_process(["-m", "scripts.bench_attention"], "--variants=swa:swa_window=32,block", "--lengths=128",
                          "--repeats=1", f"--json={tmp_path / 'bench.json'}")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["swa:swa_window=32", "block"] and all(r["ms"] > 0 for r in results)
