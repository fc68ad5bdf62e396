"""lm-evaluation-harness (lm_eval 0.4) on this project's models, through lm_eval's own Hugging Face model class.

`EfficientAttentionLM` is lm_eval's `HFLM` (`lm_eval --model hf`): tokenization, BOS and prefix tokens, context
length and truncation, batching, rolling windows and generation are lm_eval's, so numbers are comparable with
published lm_eval numbers. Only the model is this project's:
- a training run's folder: its checkpoint as this project's transformers model (runtime/hf_gpt.py), its tokenizer as a
  transformers tokenizer (runtime/hf_tokenizer.py: BOS = EOS = the run's end-of-text token, nothing added);
- a Hugging Face model (hub name or folder) loaded by HFLM itself, with a variant in its attention layers
  (attention/hf.py, paper 000 §4.2) when attention settings are given; without them it is stock HFLM.

Importing this module registers the model type "efficient-attention-gpt" with lm_eval. lm_eval is an optional
extra: `pip install -r requirements-eval.txt`.

    python -m eval.lm_eval_adapter --model efficient-attention-gpt --model_args pretrained=out/run,ckpt=best \\
        --device cuda --batch_size 32 \\
        --tasks wikitext,lambada_openai,lambada_standard,piqa,hellaswag,winogrande,arc_easy,arc_challenge,boolq,social_iqa
    python -m eval.lm_eval_adapter --model efficient-attention-gpt --device cuda --batch_size 8 \\
        --model_args pretrained=Qwen/Qwen3-8B,dtype=bfloat16,attn_pattern=sa,swa_window=128 --tasks hellaswag

(the stock `lm_eval` command does not know this model type: this module runs lm_eval's CLI after registering
it; any lm_eval option works). `model_args` are HFLM's (dtype, max_length, add_bos_token, prefix_token_id, ...)
plus `ckpt=best|last` for a run, and for a Hugging Face model the attention settings of the model config
(attn_pattern, swa_window, block_len, ...; a layer pattern is written with colons, as model_args is split at
commas: attn_pattern=pbb:pbb:pbb:full) and `hf_decode=full|variant`. A run is evaluated as it was trained:
attention settings are refused there. A run exported with export.py evaluates the same with stock
`lm_eval --model hf --model_args pretrained=FOLDER[,trust_remote_code=True]`.

    import lm_eval
    from eval.lm_eval_adapter import EfficientAttentionLM
    lm = EfficientAttentionLM(pretrained="out/quickstart", device="cpu", batch_size=16)
    lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

A variant's kernels take no padding mask: left-padded generation batches are generated one row at a time
(each with its own stop strings); loglikelihood batches are right-padded, which causal attention never reads,
except where a layer's edges depend on the sequence's length (sa): those models score one sequence at a time.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:
    raise ImportError(
        f"the lm-evaluation-harness adapter needs lm_eval ({e}): pip install -r requirements-eval.txt"
    ) from e

from config import ModelConfig, dataclass_fields, set_value
from eval.hf_model import use_variant_attention
from runtime.checkpoint import run_tokenizer
from runtime.hf_gpt import EfficientAttentionForCausalLM, generate_rows
from runtime.hf_tokenizer import hf_tokenizer

logger = logging.getLogger(__name__)

MODEL_NAME = "efficient-attention-gpt"


def is_run_folder(path) -> bool:
    """A training run's folder (its checkpoints, ckpt_best / ckpt_last), not a save_pretrained one."""
    folder = Path(path)
    return folder.is_dir() and any(folder.glob("ckpt_*"))


def attention_settings(raw: dict) -> dict:
    """The attention settings among model_args, typed as the model config types them (lm_eval passes strings or
    guessed types; a layer pattern comes with colons, since model_args is split at commas)."""
    typed, fields = ModelConfig(), dataclass_fields(ModelConfig)
    for key, value in raw.items():
        value = str(value).replace(":", ",") if key == "attn_pattern" else str(value)
        set_value(typed, key, value, fields)
    return {key: getattr(typed, key) for key in raw}


@register_model(MODEL_NAME)
class EfficientAttentionLM(HFLM):
    def __init__(self, pretrained, ckpt: str = "best", hf_decode: str = "full", device: str | None = "cuda",
                 **kwargs):
        model_keys = set(dataclass_fields(ModelConfig))
        settings = attention_settings({key: kwargs.pop(key) for key in list(kwargs) if key in model_keys})
        device = self._resolve_device(device)
        self._run_info: dict = {}
        self._variant: dict | None = None
        if isinstance(pretrained, (str, os.PathLike)) and is_run_folder(pretrained):
            if settings:
                raise ValueError(f"{', '.join(sorted(settings))}: a run is evaluated with the attention it was trained "
                                 "with; attention settings go with a Hugging Face model (pretrained=NAME_OR_FOLDER)")
            model, raw = EfficientAttentionForCausalLM.from_run(pretrained, ckpt, device or "cpu")
            dtype = kwargs.pop("dtype", None)
            if dtype not in (None, "auto"):
                model = model.to(getattr(torch, str(dtype)))
            tokenizer = kwargs.pop("tokenizer", None) or hf_tokenizer(run_tokenizer(raw))
            super().__init__(pretrained=model, tokenizer=tokenizer, **{"backend": "causal", **kwargs})
            self.pretrained = str(pretrained)  # the model's name in results, as a hub name or folder is
            self._run_info = {"run": str(pretrained), "ckpt": raw.get("path"), "step": raw.get("step")}
            self._one_at_a_time_if_length_dependent(block.mixer for block in model.model.blocks)
        else:
            super().__init__(pretrained=pretrained, device=device, **kwargs)
            if settings:
                self.use_variant(hf_decode=hf_decode, **settings)

    def _one_at_a_time_if_length_dependent(self, mixers):
        """HFLM right-pads a loglikelihood batch to its longest sequence: causal layers never read the padding, but
        a layer whose edges depend on the sequence's length (sa draws its permutation over the padded length)
        would score another sequence than the one asked. Such models score one sequence at a time."""
        asked = self.__dict__.setdefault("_asked_batch_size", self.batch_size_per_gpu)
        self.batch_size_per_gpu = asked
        if not all(mixer.length_independent for mixer in mixers) and asked != 1:
            logger.warning("a layer's edges depend on the sequence length (sa): scoring one sequence at a time "
                           "instead of batch_size=%s, so padding never changes them", asked)
            self.batch_size_per_gpu = 1

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        # a value given in model_args wins over the CLI's own batch_size/device, with a warning
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is None:
                continue
            if key in args and str(args[key]) != str(value):
                logger.warning("%s=%s from model_args overrides %s=%s", key, args[key], key, value)
                continue
            args[key] = value
        return cls(**args)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @staticmethod
    def _resolve_device(device):
        # lm_eval's CLI asks for cuda unless told otherwise; on a machine without CUDA run on the CPU
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            logger.warning("device=%s but CUDA is not available: using cpu", device)
            return "cpu"
        return device

    def use_variant(self, hf_decode: str = "full", **settings):
        """Put the variant of these settings (model config keys) in the Hugging Face model's attention layers."""
        mixers = use_variant_attention(self.model, hf_decode=hf_decode, **settings)
        self._variant = {"hf_decode": hf_decode, **settings}
        self._one_at_a_time_if_length_dependent(mixers)
        return self

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        mask = generation_kwargs.get("attention_mask")
        if (self._variant is None and not self._run_info) or mask is None or bool(mask.all()):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        def generate_one(input_ids, attention_mask, max_length, **kwargs):
            return super(EfficientAttentionLM, self)._model_generate(input_ids, max_length, stop,
                                                                     attention_mask=attention_mask, **kwargs)

        kwargs = {key: value for key, value in generation_kwargs.items() if key != "attention_mask"}
        return generate_rows(generate_one, context, mask, {"max_length": max_length, **kwargs},
                             pad_token_id=self.tokenizer.pad_token_id)

    def get_model_info(self) -> dict:
        if self._run_info:  # a run has no hub revision to look up
            return {"model_num_parameters": self.model.num_parameters(), "model_dtype": str(self.model.dtype),
                    **self._run_info}
        info = super().get_model_info()
        if self._variant:
            info["attention"] = dict(self._variant)
        return info


if __name__ == "__main__":
    # lm_eval's own command line, with this model type registered (see the module docstring)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
