"""This project's GPT as a transformers model, so the field's tools take it as they take any causal LM:
`AutoModelForCausalLM`, `generate`, lm-eval's `HFLM` (`lm_eval --model hf`), the Hub.

    from runtime import hf_gpt  # registers model_type "efficient_attention_gpt" with AutoConfig / AutoModelForCausalLM
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("out/run/hf")                  # a folder written by export.py
    model = hf_gpt.EfficientAttentionForCausalLM.from_run("out/run", "best")    # a run folder, in memory

The model is `GPT` (model.py) itself, under the name `model`: one definition of every variant, the same
kernels as training. The config keeps the run's whole ModelConfig under `gpt` and mirrors the names tools
read (`vocab_size`, `hidden_size`, `num_hidden_layers`, `num_attention_heads`, `max_position_embeddings`).
`max_position_embeddings` is the trained length (`block_size`): learned positions stop there, and for RoPE
models it is the length the model was trained on, which lm-eval truncates contexts to, as it does for a Llama.

Decoding keeps the variants' own caches (attention/cache.py, the recurrent states), not a transformers
`Cache`: `generate` passes them back as `past_key_values`, and a variant without a cached form (sa) re-runs
the sequence at every step, as `GPT.generate` does. The variants' kernels take no padding mask, so a
left-padded batch (lm-eval's batched `generate_until`) is generated one row at a time with its padding
removed; batch stopping criteria cannot follow a row, so those rows run to EOS or the length limit, and the
caller's stop strings cut them (lm-eval cuts every output at its `until` strings).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from config import ModelConfig, dataclass_fields
from model import GPT
from runtime.checkpoint import load_model

MODEL_TYPE = "efficient_attention_gpt"


class EfficientAttentionConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, gpt: dict | None = None, **kwargs):
        self.gpt = dict(gpt or {})  # ModelConfig's fields (config.py), as a run's config.json holds them
        if self.gpt:
            m = self.model_config()
            kwargs.setdefault("tie_word_embeddings", m.tie_embeddings)
            self.vocab_size = m.vocab_size
            self.hidden_size = m.n_embd
            self.num_hidden_layers = m.n_layer
            self.num_attention_heads = m.n_head
            self.max_position_embeddings = m.block_size
        super().__init__(**kwargs)

    def model_config(self):
        known = dataclass_fields(ModelConfig)
        unknown = sorted(set(self.gpt) - set(known))
        if unknown:
            raise ValueError(f"the checkpoint's config has settings this version of the code does not know "
                             f"({', '.join(unknown)}): use the version it was exported with (its git hash is in "
                             "the folder's export.json)")
        return ModelConfig(**self.gpt)


class GPTCache:
    """The layers' own caches (GPT.init_caches) and how many positions they hold."""

    def __init__(self, caches: list, length: int = 0):
        self.caches = caches
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class EfficientAttentionForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = EfficientAttentionConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}  # only when config.tie_word_embeddings

    def __init__(self, config: EfficientAttentionConfig):
        super().__init__(config)
        self.model = GPT(config.model_config())
        self.post_init()

    @classmethod
    def from_run(cls, out_dir, ckpt: str = "best", device="cpu"):
        """The trained model of a run folder (checkpoint.load_model), wrapped without copying its weights."""
        gpt, _, raw = load_model(out_dir, ckpt, device)
        config = EfficientAttentionConfig(gpt=dataclasses.asdict(gpt.config), name_or_path=str(out_dir))
        with torch.device("meta"):  # the GPT is built once, by load_model
            wrapper = cls(config)
        wrapper.model = gpt
        wrapper.eval()
        return wrapper, raw

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the variants keep caches of their own (GPTCache)

    def _init_weights(self, module):
        pass  # GPT initialises itself when built (GPT.init_weights); a loaded checkpoint overwrites every weight

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values: GPTCache | None = None,
                use_cache: bool | None = None, labels=None, logits_to_keep: int = 0, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{MODEL_TYPE} models take no padding mask (the variants' kernels attend over every "
                             "position given): call them one sequence at a time, or with sequences of equal length")
        gpt = self.model
        cacheable = all(block.mixer.supports_cache for block in gpt.blocks)
        if use_cache and cacheable:
            if past_key_values is None:
                T = input_ids.size(1)
                limit = gpt.config.block_size if gpt.wpe is not None else 1 << 62
                past_key_values = GPTCache(gpt.init_caches(input_ids.size(0), min(T + 64, limit)))
            logits, _ = gpt(input_ids, caches=past_key_values.caches, start_pos=past_key_values.length)
            past_key_values.length += input_ids.size(1)
        else:
            logits, _ = gpt(input_ids)
            past_key_values = None
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here; -100 is ignored
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)

    def prepare_inputs_for_generation(self, input_ids, past_key_values: GPTCache | None = None, attention_mask=None,
                                      use_cache=None, **kwargs):
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.length:]  # what the caches do not hold yet
        return {"input_ids": input_ids, "past_key_values": past_key_values, "use_cache": use_cache,
                "attention_mask": attention_mask if past_key_values is None else None}

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        if input_ids is None or attention_mask is None or bool(attention_mask.all()):
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        kwargs.pop("stopping_criteria", None)  # built for the padded batch: it would misread a row
        return generate_rows(super().generate, input_ids, attention_mask, kwargs)


def generate_rows(generate, input_ids, attention_mask, kwargs: dict, pad_token_id: int | None = None):
    """`generate` over a left-padded batch, one row at a time with its padding removed; returns the batch's
    layout: each row's padded prompt, then its new tokens, right-padded with pad_token_id to one length."""
    pad = kwargs.get("pad_token_id", pad_token_id)
    pad = 0 if pad is None else pad
    rows = []
    for ids, mask in zip(input_ids, attention_mask):
        n_pad = int((mask == 0).sum())
        if bool(mask[n_pad:].all()) is False:
            raise ValueError("generate takes left padding only (padding before each prompt)")
        row_kwargs = dict(kwargs)
        if row_kwargs.get("max_length") is not None:
            row_kwargs["max_length"] = row_kwargs["max_length"] - n_pad
        out = generate(input_ids=ids[None, n_pad:], attention_mask=mask[None, n_pad:], **row_kwargs)
        rows.append(torch.cat([ids[:n_pad], out[0]]))
    length = max(len(row) for row in rows)
    out = torch.full((len(rows), length), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


AutoConfig.register(MODEL_TYPE, EfficientAttentionConfig, exist_ok=True)
AutoModelForCausalLM.register(EfficientAttentionConfig, EfficientAttentionForCausalLM, exist_ok=True)
