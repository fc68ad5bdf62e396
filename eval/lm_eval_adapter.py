"""lm-evaluation-harness (lm_eval 0.4) adapter: evaluate a trained checkpoint on the harness's tasks.

Importing this module registers the model type "efficient-attention-gpt" with lm_eval. lm_eval is an
optional extra: `pip install -r requirements-eval.txt`.

Python API (from the repository root):

    import lm_eval
    from eval.lm_eval_adapter import CheckpointLM

    lm = CheckpointLM(out_dir="out/quickstart", ckpt="best", device="cpu", batch_size=16)
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])
    print(results["results"]["lambada_openai"])

    # or by name, with lm_eval's string arguments
    lm_eval.simple_evaluate(model="efficient-attention-gpt", model_args="out_dir=out/quickstart,ckpt=best",
                            tasks=["lambada_openai"], batch_size=16, device="cuda")

Command line: the stock `lm_eval` command does not know this model type, so run lm_eval's CLI through this
module, which registers it first (any lm_eval option works after it):

    python -m eval.lm_eval_adapter --model efficient-attention-gpt \\
        --model_args out_dir=out/run,ckpt=best --device cuda --batch_size 32 \\
        --tasks wikitext,lambada_openai,lambada_standard,piqa,hellaswag,winogrande,arc_easy,arc_challenge,boolq,social_iqa

(those ten are the zero-shot suites of the papers: paper 000 reports LAMBADA's standard version, LMB-s,
the others its OpenAI version; their datasets come from the Hugging Face hub on first use). `python -c "import eval.lm_eval_adapter, lm_eval.__main__ as m; m.cli_evaluate()" --model ...` is the
same thing. Give the batch size and device with --batch_size (the CLI's default is 1) and --device (default
cuda:0; the CPU is used where CUDA is missing); a batch_size or device inside --model_args takes precedence,
with a warning. --include_path adds task YAMLs of your own, as usual.

A Hugging Face causal LM with a variant in its attention layers (attention/hf.py, paper 000 §4.2) takes
hf=NAME_OR_PATH instead of out_dir, with any attention setting of the model config:

    python -m eval.lm_eval_adapter --model efficient-attention-gpt --device cuda --batch_size 8 \
        --model_args hf=Qwen/Qwen3-8B,hf_dtype=bfloat16,attn_pattern=sa,swa_window=128 \
        --tasks hellaswag,mmlu,lambada_openai,arc_easy,arc_challenge,boolq

(hf_decode=full|variant, hf_context=2048: the length lm_eval's rolling windows use, hf_tokenizer= another
tokenizer). The model's own tokenizer.json scores the requests. model_args is split at commas, so a layer
pattern is written with colons there: attn_pattern=pbb:pbb:pbb:full.

Constructor arguments (also the keys of --model_args): out_dir, ckpt=best|last, device=cpu, batch_size=16,
max_length (default: block_size for learned positions; RoPE/position-free models have no hard limit, and
then only the rolling-window size defaults to block_size), max_gen_toks=256. `CheckpointLM.from_model(model,
tokenizer)` wraps a model already in memory.

How requests are scored:
- loglikelihood: context and continuation are tokenised separately, after moving the context's trailing
  whitespace to the continuation (lm_eval's convention); an empty context becomes [end-of-text]. Scoring is
  eval.ranking.continuation_logprobs (contexts too long for the model are cut from the left).
- loglikelihood_rolling: the string is split into disjoint windows of max_length predicted tokens; the first
  is conditioned on [end-of-text], later ones on as much preceding text as fits (lm_eval's rolling scheme).
- generate_until: greedy unless sampling is asked for (do_sample=True, or temperature > 0 without
  do_sample), with the model's KV cache; stops at end-of-text, at the first `until` string (cut from the
  output) or after max_gen_toks tokens. With a position limit the prompt is cut from the left to
  max_length - max_gen_toks tokens, as lm_eval's Hugging Face model does.
Requests run in one process (no data parallelism across GPUs).
"""

from __future__ import annotations

import logging

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    raise ImportError(
        f"the lm-evaluation-harness adapter needs lm_eval ({e}): pip install -r requirements-eval.txt"
    ) from e

from eval.ranking import context_limit, continuation_logprobs
from progress import progress_bar

logger = logging.getLogger(__name__)

MODEL_NAME = "efficient-attention-gpt"
GENERATE_CHUNK = 32  # tokens generated between checks for a stop string
KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "temperature", "do_sample", "top_k", "top_p"}


@register_model(MODEL_NAME)
class CheckpointLM(LM):
    """A GPT of this repository behind lm_eval's LM interface (loglikelihood, loglikelihood_rolling,
    generate_until)."""

    def __init__(self, out_dir=None, ckpt: str = "best", device: str = "cpu", batch_size=16,
                 max_length: int | None = None, max_gen_toks: int = 256, max_batch_size=None, *,
                 model=None, tokenizer=None, hf=None, hf_dtype="float32", hf_decode="full", hf_context=2048,
                 hf_tokenizer="", **settings):
        super().__init__()
        device = self._resolve_device(device)
        if settings and hf is None:
            raise ValueError(f"unknown argument(s) {', '.join(sorted(settings))}: attention settings go with hf=NAME_OR_PATH")
        if hf is not None and model is None:  # a Hugging Face causal LM with a variant in its attention
            from config import ModelConfig, dataclass_fields, set_value
            from eval.hf_model import load_pretrained_lm

            typed = ModelConfig()
            for key, value in settings.items():  # lm_eval's model_args arrive as strings or guessed types
                value = str(value).replace(":", ",") if key == "attn_pattern" else str(value)  # commas split model_args
                set_value(typed, key, value, dataclass_fields(ModelConfig))
            settings = {key: getattr(typed, key) for key in settings}
            model, tokenizer = load_pretrained_lm(hf, settings, hf_dtype, device or "cpu", int(hf_context),
                                                  hf_decode, hf_tokenizer)
            self._info = {"hf": hf, "hf_decode": hf_decode, **settings}
        elif model is None:
            if out_dir is None:
                raise ValueError("CheckpointLM needs out_dir (a training run's folder), "
                                 "or use CheckpointLM.from_model(model, tokenizer)")
            from checkpoint import load_model, run_tokenizer

            model, _, raw = load_model(out_dir, ckpt, device or "cpu")
            tokenizer = run_tokenizer(raw)
            self._info = {"out_dir": str(out_dir), "ckpt": ckpt, "step": raw.get("step")}
        else:
            if tokenizer is None:
                raise ValueError("from_model needs the tokenizer the model was trained with")
            if device:
                model = model.to(device)
            self._info = {}
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = next(self.model.parameters()).device
        self._batch_size = self._parse_batch_size(batch_size)
        learned_positions = self.model.wpe is not None
        block_size = self.model.config.block_size
        if max_length is not None:
            max_length = int(max_length)
            if max_length < 1 or (learned_positions and max_length > block_size):
                raise ValueError(f"max_length={max_length}: expected 1..{block_size} (the model's block_size; "
                                 "learned positions cannot go further)" if learned_positions
                                 else f"max_length={max_length}: expected a positive number of tokens")
        self._max_len_arg = max_length  # what continuation_logprobs crops to (None: the model's own limit)
        self._limit = context_limit(self.model, max_length)  # None: no hard limit (RoPE / no positions)
        self._max_gen_toks = int(max_gen_toks)
        self._warned_kwargs: set[str] = set()
        self._info.update({"tokenizer": tokenizer.name, "n_params": self.model.num_params(),
                           "max_length": self.max_length, "position_limit": self._limit})

    @classmethod
    def from_model(cls, model, tokenizer, device=None, batch_size=16, max_length=None, max_gen_toks=256):
        """Wrap a GPT already in memory (put into eval mode) and its tokenizer (data.tokenizer interface)."""
        return cls(device=device, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks,
                   model=model, tokenizer=tokenizer)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        # lm_eval also sends its own batch_size/max_batch_size/device (the CLI always sends batch_size);
        # a value given in model_args wins instead of colliding with it
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is None:
                continue
            if key in args and str(args[key]) != str(value):
                logger.warning("%s=%s from model_args overrides %s=%s", key, args[key], key, value)
                continue
            args[key] = value
        return cls(**args)

    @staticmethod
    def _resolve_device(device):
        # lm_eval's CLI asks for cuda:0 unless told otherwise; on a machine without CUDA run on the CPU
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            logger.warning("device=%s but CUDA is not available: using cpu", device)
            return "cpu"
        return device

    @staticmethod
    def _parse_batch_size(batch_size) -> int:
        if batch_size is None:
            return 16
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            logger.warning("batch_size=%s: automatic batch sizing is not supported; using 16", batch_size)
            return 16
        batch_size = int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: expected a positive integer")
        return batch_size

    # properties lm_eval and its callers look at ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        """Longest input used: the position limit, or block_size (the training length) for models without one."""
        return self._limit or self.model.config.block_size

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def get_model_info(self) -> dict:
        """Recorded by lm_eval.simple_evaluate in results["config"]."""
        return dict(self._info)

    def tok_encode(self, string: str) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    # scoring ------------------------------------------------------------------------------------------------

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        context_ids = self.tok_encode(context) if context else []
        return context_ids or [self.eot_token_id], self.tok_encode(continuation)

    def _score(self, pairs, desc: str, disable_tqdm: bool) -> list[dict]:
        """continuation_logprobs over all pairs, longest first, one batch at a time for the progress bar."""
        results: list[dict | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        with progress_bar(total=len(pairs), enabled=not disable_tqdm, desc=desc) as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                scored = continuation_logprobs(self.model, [pairs[i] for i in batch], self.batch_size,
                                               self._max_len_arg)
                for i, result in zip(batch, scored):
                    results[i] = result
                bar.update(len(batch))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        to_score = [i for i, (_, continuation) in enumerate(pairs) if continuation]
        scored = self._score([pairs[i] for i in to_score], "loglikelihood", disable_tqdm)
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # an empty continuation: log 1
        for i, result in zip(to_score, scored):
            out[i] = (result["logprob"], result["greedy"])
        for req, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return out

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) pairs that together predict every token once, max_length at a time."""
        windows = get_rolling_token_windows(token_list=tokens, prefix_token=self.eot_token_id,
                                            max_seq_len=self.max_length, context_len=1)
        return [make_disjoint_window(w) for w in windows]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, pairs = [], []
        for n, req in enumerate(requests):
            (string,) = req.args
            for pair in self.rolling_windows(self.tok_encode(string)):
                owners.append(n)
                pairs.append(pair)
        totals = [0.0] * len(requests)
        for n, result in zip(owners, self._score(pairs, "loglikelihood_rolling (windows)", disable_tqdm)):
            totals[n] += result["logprob"]
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # generation ---------------------------------------------------------------------------------------------

    def _sampling(self, gen_kwargs: dict) -> dict:
        unknown = set(gen_kwargs) - KNOWN_GEN_KWARGS - self._warned_kwargs
        if unknown:
            logger.warning("generate_until ignores %s", ", ".join(sorted(unknown)))
            self._warned_kwargs |= unknown
        do_sample = gen_kwargs.get("do_sample")
        temperature = gen_kwargs.get("temperature")
        temperature = 1.0 if temperature is None and do_sample else float(temperature or 0.0)
        if do_sample is False or not temperature:
            return {"temperature": 0}
        return {"temperature": temperature, "top_k": gen_kwargs.get("top_k"), "top_p": gen_kwargs.get("top_p")}

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        until = gen_kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        max_gen_toks = int(gen_kwargs.get("max_gen_toks") or self.max_gen_toks)
        sampling = self._sampling(gen_kwargs)
        ids = (self.tok_encode(context) if context else []) or [self.eot_token_id]
        if self._limit is not None:
            keep = self._limit - max_gen_toks if self._limit > max_gen_toks else self._limit
            ids = ids[-keep:]
        idx = torch.tensor([ids], dtype=torch.long, device=self._device)
        generated: list[int] = []
        while len(generated) < max_gen_toks:
            n = min(GENERATE_CHUNK, max_gen_toks - len(generated))
            idx = self.model.generate(idx, n, use_cache=True, **sampling)
            new = idx[0, -n:].tolist()
            if self.eot_token_id in new:
                generated += new[:new.index(self.eot_token_id)]
                break
            generated += new
            if until and any(s in self.tok_decode(generated) for s in until):
                break
        text = self.tok_decode(generated)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in progress_bar(requests, not disable_tqdm, desc="generate_until"):
            context, gen_kwargs = req.args
            with torch.no_grad():
                text = self._generate(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out


if __name__ == "__main__":
    # lm_eval's own command line, with this model type registered (see the module docstring)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
