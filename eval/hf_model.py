"""A Hugging Face causal LM, its attention replaced by a variant (attention/hf.py), behind the interface this
codebase's evaluation reads from a trained GPT: `model(idx) -> (logits, None)`, `generate(...)`,
`config` (the variant's ModelConfig; block_size is the evaluation context), `wpe` (not None for learned
positions, which limit the context), `num_params()`. So `python -m eval --hf=...` runs ppl, niah, recall and
diagnostics on it (lm-eval runs such models through lm_eval's own HFLM: eval/lm_eval_adapter.py).

    from eval.hf_model import load_pretrained_lm
    model, tokenizer = load_pretrained_lm("Qwen/Qwen3-8B", {"attn_pattern": "sa", "swa_window": 128},
                                          dtype="bfloat16", device="cuda", context=4096)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from attention.capabilities import set_window
from attention.hf import check_hf_decode, use_variant_layers
from attention.registry import validate_config
from config import ModelConfig
from data.tokenizer import TokenizerUnavailable, get_tokenizer
from model import sample_next
from runtime.pretrained import PretrainedError


def variant_config(model, **settings):
    """The ModelConfig of `settings` (attention keys) over the transformers model's own shape."""
    text = model.config.get_text_config()
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, key, None):
            raise ValueError(f"the model sets {key}={getattr(text, key)}: the variants' kernels have no logit "
                             "soft-capping, and ignoring it would change the model")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    shape = {"n_layer": text.num_hidden_layers, "n_head": heads, "n_embd": heads * head_dim, "pos_embedding": "none",
             "vocab_size": 1}
    unknown = set(settings) - set(ModelConfig.__dataclass_fields__) | set(settings) & set(shape)
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: not an attention setting here (the model's own shape is used)")
    # block_size: the context the bridges' boundaries are laid over (theirs are those of the model's context)
    config = ModelConfig(**shape, **{"block_size": getattr(text, "max_position_embeddings", 1 << 20), **settings})
    validate_config(config)
    return config


def use_variant_attention(model, hf_decode: str = "full", **settings) -> list:
    """Make every attention layer of a transformers causal LM run the variant of `settings` (ModelConfig keys)
    for its layer index; returns the per-layer mixers (their rules, and sa's `last_order` after a forward)."""
    check_hf_decode(hf_decode)  # a wrong mode is named before the settings are checked
    return use_variant_layers(model, variant_config(model, **settings), hf_decode)


class VariantLM(nn.Module):
    def __init__(self, hf_model, settings: dict, hf_decode: str = "full", context: int = 2048):
        super().__init__()
        self.hf = hf_model.eval()
        self.hf_decode = hf_decode
        self.context = context
        position_tables = [m for name, m in hf_model.named_modules() if name.endswith(("wpe", "embed_positions"))]
        self.wpe = position_tables[0] if position_tables else None  # learned positions: a hard limit
        self.base_settings = settings
        self.use(**settings)

    def use(self, **settings):
        """Apply the variant of these settings (replacing the current one); returns self."""
        self.settings = settings
        self.mixers = use_variant_attention(self.hf, hf_decode=self.hf_decode, **settings)
        limit = self.hf.config.get_text_config().max_position_embeddings if self.wpe is not None else None
        self.config = dataclasses.replace(variant_config(self.hf, **settings),
                                          block_size=min(self.context, limit or self.context))
        return self

    def with_changes(self, **changes):
        """The same weights under the base settings with these changed (e.g. another window)."""
        return self.use(**{**self.base_settings, **changes})

    def set_window(self, window: int) -> int:
        self.with_changes(swa_window=window)
        return sum(set_window(mixer, window) for mixer in self.mixers)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())

    def forward(self, idx, targets=None):
        if targets is not None:
            raise ValueError("a pretrained model is evaluated here, not trained: call it without targets")
        return self.hf(idx, use_cache=False).logits, None

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None,
                 use_cache=True):
        """GPT.generate's contract over the model's own KV cache (decoding as hf_decode says). Under
        hf_decode=variant a layer without a decoding form (sa: a new permutation every forward) makes every
        step re-run the whole sequence, as GPT.generate does."""
        if self.hf_decode == "variant" and not all(mixer.supports_cache for mixer in self.mixers):
            use_cache = False
        cache, context = None, idx
        for _ in range(max_new_tokens):
            if use_cache:
                out = self.hf(context, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
            else:
                out = self.hf(idx, use_cache=False)
            idx_next = sample_next(out.logits[:, -1, :], temperature, top_k, top_p, generator)
            idx = torch.cat((idx, idx_next), dim=1)
            context = idx_next
        return idx


def load_pretrained_lm(source: str, settings: dict, dtype: str = "float32", device: str = "cpu",
                       context: int = 2048, hf_decode: str = "full", tokenizer: str = ""):
    """(VariantLM, tokenizer) of a hub name or a folder written by save_pretrained. The tokenizer (data.tokenizer
    interface) is the model's own tokenizer.json unless `tokenizer` names another."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise PretrainedError("--hf needs transformers: pip install -r requirements.txt") from None
    from runtime import hf_gpt  # imports transformers, checked above

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise PretrainedError(f"cannot load {source!r} ({str(e).splitlines()[0][:200]}): give a hub name (downloads "
                              "need the network once) or a folder written by save_pretrained") from None
    if isinstance(hf_model, hf_gpt.EfficientAttentionForCausalLM):  # its layers are this project's already
        raise PretrainedError(f"{source} is a run exported by export.py (this project's model class): evaluate the "
                              "run's folder with --out_dir, or load it with init_from=hf: to train on")
    try:
        model = VariantLM(hf_model.to(device), settings, hf_decode, context)
    except ValueError as e:
        raise PretrainedError(str(e)) from None
    try:
        return model, get_tokenizer(tokenizer or source)
    except TokenizerUnavailable as e:
        raise PretrainedError(f"{e} (--hf_tokenizer= names another tokenizer.json or hub tokenizer)") from None
