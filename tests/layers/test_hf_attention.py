"""attention/hf.py: the variants inside transformers' own models (small random Llama, Qwen2, Qwen3, Mistral and
GPT-2, built from configs as the real checkpoints are shaped: grouped-query attention, Qwen3's head_dim and
qk-norm, GPT-2's fused qkv)."""

import pytest
import torch
import transformers

from attention.kernels import attend
from attention.moba import MixtureOfBlockAttention
from attention.ops.moba.naive import moba_choose, moba_dense
from attention.stochastic import StochasticAttention, stochastic_attention
from conftest import run_in_process, train_in_process
from eval.hf_model import use_variant_attention
from scripts.gpucheck import tiny_hf

LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA_LIKE),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, LLAMA_LIKE),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**LLAMA_LIKE, "head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {**LLAMA_LIKE, "sliding_window": None}),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_embd=64, n_layer=4, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0)),
}


def pair(name, **overrides):
    """(the unpatched sdpa model, an identical copy to patch)."""
    config_class, model_class, settings = ARCHITECTURES[name]
    torch.manual_seed(0)
    reference = model_class(config_class(**{**settings, **overrides}, attn_implementation="sdpa")).eval()
    patched = model_class(config_class(**{**settings, **overrides}, attn_implementation="sdpa")).eval()
    patched.load_state_dict(reference.state_dict())
    return reference, patched


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_full_pattern_equals_the_unpatched_model_in_prefill_and_cached_decoding(name):
    reference, patched = pair(name)
    use_variant_attention(patched, attn_pattern="full")
    assert patched.config._attn_implementation == "efficient_attention"
    idx = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(reference(idx).logits, patched(idx).logits, atol=1e-5)
        prompt = [model(idx[:, :30], use_cache=True).past_key_values for model in (reference, patched)]
        for step in range(30, 33):  # three cached decoding steps
            steps = [model(idx[:, step:step + 1], past_key_values=cache).logits
                     for model, cache in zip((reference, patched), prompt)]
            assert torch.allclose(*steps, atol=1e-5), step


def test_swa_equals_transformers_sliding_window_at_the_same_window():
    # Mistral's sliding_window=w lets a query see itself and the w - 1 keys before it: swa(w) exactly
    reference, patched = pair("mistral", sliding_window=8)
    use_variant_attention(patched, attn_pattern="swa", swa_window=8)
    idx = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(reference(idx).logits, patched(idx).logits, atol=1e-5)


def capture(mixers):
    """Record every layer's (q, k, v, output) and, for sa, the permutation it drew."""
    records = []
    for i, mixer in enumerate(mixers):
        def recording(q, k, v, call, mixer=mixer, attend_=mixer.attend, i=i):
            y = attend_(q, k, v, call)
            records.append((i, mixer, q, k, v, y, getattr(mixer, "last_order", None)))
            return y
        mixer.attend = recording
    return records


@pytest.mark.parametrize("pattern, settings", [
    ("sa,sa,sa,full", {}),
    ("pbb,pbb,pbb,full", {"bridge_fusion": "branch"}),
    ("pbb,pbb,pbb,full", {"bridge_fusion": "union"}),
    ("se_bridge,se_bridge,se_bridge,full", {"bridge_fusion": "branch"}),
    ("block,block,block,full", {}),
    ("mswa_h,mswa_h,mswa_h,full", {"swa_window": 16, "block_size": 128}),
    ("mswa", {"swa_window": 16, "block_size": 128}),  # its windows also change with depth: four groups of one layer
    ("moba,moba,moba,full", {"moba_block": 8, "moba_topk": 3}),
])
def test_every_layer_of_a_3_to_1_schedule_equals_the_dense_reference_on_its_own_q_k_v(pattern, settings):
    _, patched = pair("qwen3")
    settings = {"swa_window": 8, "block_len": 8, "bridge_width": 8, "bridge_extension": 4, "block_size": 64,
                **settings}
    mixers = use_variant_attention(patched, attn_pattern=pattern, **settings)
    records = capture(mixers)
    idx = torch.randint(0, 100, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        patched(idx)
        assert [r[0] for r in records] == [0, 1, 2, 3]
        for i, mixer, q, k, v, y, order in records:
            # grouped-query k and v (2 heads for 4) reach the kernels that take them as they are, uncopied
            assert k.shape[1] == (2 if mixer.native_gqa else 4), (pattern, i)
            if isinstance(mixer, StochasticAttention):
                dense = stochastic_attention(q, k, v, order, mixer.window, "dense")
            elif isinstance(mixer, MixtureOfBlockAttention):
                dense = moba_dense(q, k, v, torch.arange(64), moba_choose(q, k, torch.arange(64), 8, 3), 8)
            else:
                dense = sum(attend(q, k, v, rule, "dense") for rule in mixer.paths())
            assert torch.allclose(y, dense, atol=1e-5), (pattern, i)
        if pattern.startswith("sa"):  # one permutation per layer, redrawn at every forward
            orders = [r[6] for r in records[:3]]
            assert not torch.equal(orders[0], orders[1])
            patched(idx)
            assert not torch.equal(records[4][6], orders[0])


@pytest.mark.parametrize("settings", [{"attn_pattern": "swa", "swa_window": 8},
                                      {"attn_pattern": "moba", "moba_block": 8, "moba_topk": 2}])
def test_decoding_full_uses_the_whole_cache_and_variant_keeps_the_rule(settings):
    idx = torch.randint(0, 100, (1, 41), generator=torch.Generator().manual_seed(4))
    logits = {}
    for hf_decode in ("full", "variant"):
        _, patched = pair("llama")
        use_variant_attention(patched, hf_decode=hf_decode, **settings)
        with torch.no_grad():
            cache = patched(idx[:, :40], use_cache=True).past_key_values
            logits[hf_decode] = patched(idx[:, 40:], past_key_values=cache).logits[:, -1]
            recomputed = patched(idx).logits[:, -1]  # the whole sequence under the rule, no cache
    assert torch.allclose(logits["variant"], recomputed, atol=1e-5)  # the rule, over the cache
    assert not torch.allclose(logits["full"], recomputed, atol=1e-3)  # paper 000's protocol: full attention


def test_what_the_variants_cannot_honour_is_refused():
    _, patched = pair("llama")
    with pytest.raises(ValueError, match="parameters or state of its own"):
        use_variant_attention(patched, attn_pattern="sa_swa")
    with pytest.raises(ValueError, match="hf_decode"):
        use_variant_attention(patched, hf_decode="sometimes", attn_pattern="swa")
    use_variant_attention(patched, attn_pattern="swa", swa_window=8)
    idx = torch.randint(0, 100, (2, 12))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="padded batches"), torch.no_grad():
        patched(idx, attention_mask=padded)
    with torch.no_grad():  # an all-ones mask (what generate passes) is no padding
        patched(idx, attention_mask=torch.ones(2, 12, dtype=torch.long))
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
    with pytest.raises(ValueError, match="soft-capping"):
        use_variant_attention(transformers.Gemma2ForCausalLM(config), attn_pattern="swa")


@pytest.mark.e2e
def test_recurrent_mixers_inside_a_pretrained_model_are_refused_with_the_reason(tmp_path):
    folder, data_dir = tiny_hf.build_tiny_hf_model(tmp_path / "hf")
    from attention.registry import MIXERS, PATTERN_ALIASES, RecurrentMixer

    recurrent = [name for name, cls in MIXERS.items() if issubclass(cls, RecurrentMixer)]
    hybrid = next(name for name, alias in PATTERN_ALIASES.items() if set(alias.pattern.split(",")) & set(recurrent))
    for pattern in (*recurrent, hybrid):
        proc = run_in_process(["-m", "eval"], f"--hf={folder}", f"--data_dir={data_dir}", f"--attn_pattern={pattern}",
                   f"--out_dir={tmp_path / pattern}", "--limit=1", "--progress=False")
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "parameters or state of its own" in proc.stderr
    proc = train_in_process(["configs/quickstart.py", f"--init_from=hf:{folder}", f"--data_dir={data_dir}",
                             "--attn_pattern=swax", f"--out_dir={tmp_path / 'run'}", "--max_iters=1"], check=False)
    assert proc.returncode == 2 and "mlstm layers, which have no counterpart" in proc.stderr, proc.stderr
    assert "n_kv_head" not in proc.stderr
