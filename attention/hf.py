"""This codebase's attention variants inside any Hugging Face causal LM, without training (papers 000 §4.2,
004 §6.9), through transformers' attention-function registry (`AttentionInterface`).

    from transformers import AutoModelForCausalLM
    from eval.hf_model import use_variant_attention

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B", torch_dtype="bfloat16")
    use_variant_attention(model, attn_pattern="pbb,pbb,pbb,full", block_len=128, bridge_width=128)
    use_variant_attention(model, attn_pattern="sa", swa_window=256)          # or swa, block, mswa, se_bridge, ...
    use_variant_attention(model, attn_pattern="moba", moba_block=128, moba_topk=2)

use_variant_attention (eval/hf_model.py) builds the layers' ModelConfig over the model's own shape (variant_config)
and hands it to use_variant_layers here. The layer pattern comes from the training config's keys (`attn_pattern`
repeated over the model's layers, `swa_window`, `block_len`, `bridge_width`, `bridge_fusion`, `sa_mode`, `sa_seed`,
`moba_block`, ...), mapped by each HF attention module's `layer_idx`; the model's own projections, RoPE, norms and
scaling stay its own. q and k arrive rotated at their original positions (what sa needs), k and v are repeated for
grouped-query attention, and a `scaling` other than 1/sqrt(head_dim) is folded into q. What the variants cannot
honour is refused: logit soft-capping, attention sinks, padded batches (score sequences one at a time, or batch
equal lengths), mixers with trained parameters of their own (sa_swa's gates, attn_gate, the recurrent mixers).

Decoding (`hf_decode`): `full` (paper 000's protocol) applies the variant to the prompt's forward only and
decodes over the full KV cache; `variant` keeps each layer's rule while decoding (recomputed over the cache
under the rule's mask; moba's new queries choose their blocks among the cache's). sa has no decoding form of
its own (a new permutation every forward): over a cache it decodes `full` either way, and eval/hf_model.py's
generate re-runs the whole sequence at every step under `variant` instead, as GPT.generate does.
"""

from __future__ import annotations

import math

import torch

from attention.call import MixerCall
from attention.capabilities import pretrained_problem
from attention.ops.dense import masked_attention, repeat_kv
from attention.registry import build_mixer

HF_ATTENTION = "efficient_attention"  # the name under which the function is registered in transformers
HF_DECODE = ("full", "variant")


def check_hf_decode(hf_decode: str) -> None:
    if hf_decode not in HF_DECODE:
        raise ValueError(f"hf_decode={hf_decode!r}: expected one of {', '.join(HF_DECODE)}")


def use_variant_layers(model, config, hf_decode: str = "full") -> list:
    """Make every attention layer of a transformers causal LM run the layer that `config` (a ModelConfig over the
    model's own shape: eval/hf_model.py's variant_config) builds at its layer index; returns the per-layer mixers
    (their rules, and sa's `last_order` after a forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_hf_decode(hf_decode)
    n_layer = config.n_layer
    with torch.device("meta"):  # the mixers' own projections are never used: only their rules and kernels
        mixers = [build_mixer(config, i) for i in range(n_layer)]
    for i, mixer in enumerate(mixers):
        problem = pretrained_problem(mixer)  # the variant says whether it can run there (attention/capabilities.py)
        if problem:
            raise ValueError(f"layer {i}: {problem}")
        mixer.eval()
    layers = {}
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            module._variant = (mixers[module.layer_idx], hf_decode)
            layers[module.layer_idx] = module
    if sorted(layers) != list(range(n_layer)):
        raise ValueError(f"found attention modules for layers {sorted(layers)} of {n_layer}: this model's layers do "
                         "not say their layer_idx")
    keep_every_key(model.config.get_text_config())
    AttentionInterface.register(HF_ATTENTION, variant_attention)
    AttentionMaskInterface.register(HF_ATTENTION, no_padding_mask)
    model.set_attn_implementation(HF_ATTENTION)
    return mixers


def keep_every_key(text_config) -> None:
    """Make the model's KV cache keep every position. transformers sizes each layer's cache from the config's own
    sliding window (Mistral, Qwen with use_sliding_window): it would drop the keys past that window, which full
    attention and every variant reaching further read while decoding. Which keys a query reads is the variant's
    rule now, so the config's window no longer applies."""
    if getattr(text_config, "sliding_window", None) is not None:
        text_config.sliding_window = None
    if getattr(text_config, "use_sliding_window", False):
        text_config.use_sliding_window = False
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        text_config.layer_types = ["full_attention" if kind in ("sliding_attention", "chunked_attention") else kind
                                   for kind in layer_types]


def no_padding_mask(*args, attention_mask=None, **kwargs):
    """The mask transformers would build: none, since each variant builds its own; a padded batch is refused
    (the variants' positions, sa's permutation among them, would include the padding)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("efficient_attention does not take padded batches: score sequences one at a time or batch "
                         "sequences of equal length")
    return None


def variant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface: query (B, H, Tq, D), key and value (B, H_kv, Tk, D), already
    projected and rotated; returns (B, Tq, H, D) and no attention weights."""
    mixer, hf_decode = module._variant
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("efficient_attention cannot honour soft-capping or attention sinks")
    if attention_mask is not None:  # no_padding_mask builds none; a caller's own 4D mask cannot be honoured
        raise ValueError("efficient_attention builds its own masks: call the model without a 4D attention_mask")
    if not mixer.native_gqa:  # grouped-query attention, for mixers whose kernels take one k/v head per query head
        key, value = repeat_kv(query, key, value)
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-9):
        query = query * (scaling * math.sqrt(head_dim))  # the kernels scale by 1/sqrt(head_dim)
    n_query, n_key = query.shape[2], key.shape[2]
    if n_query == n_key:  # the prompt's forward, from position 0: the variant
        y = mixer.attend(query, key, value, MixerCall.at(n_query, query.device))
    else:  # decoding over a cache of n_key - n_query earlier positions
        pos = torch.arange(n_key - n_query, n_key, device=query.device)
        key_pos = torch.arange(n_key, device=query.device)
        if hf_decode == "full" or not mixer.supports_cache:  # sa redraws its edges: decoding is full attention
            y = masked_attention(query, key, value, key_pos[None, :] <= pos[:, None], pos, key_pos)
        else:  # the variant's own cached step (moba: each new query chooses its blocks among the cache's)
            y = mixer.attend_cached(query, key, value, pos, key_pos)
    return y.transpose(1, 2).contiguous(), None
