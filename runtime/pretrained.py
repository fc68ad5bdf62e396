"""Start training from pretrained weights, as nanoGPT's init_from='gpt2' does.

    python train.py configs/bridges/owt_124m_pbb.py --init_from=gpt2            # OpenAI's GPT-2 small, any attn_pattern
    python train.py CONFIG --init_from=gpt2-medium                      # gpt2-large, gpt2-xl likewise
    python train.py CONFIG --init_from=hf:./my-gpt2                     # a local (or hub) GPT-2-shaped checkpoint
    python train.py CONFIG --init_from=hf:Qwen/Qwen3-0.6B --attn_pattern=sa_swa   # Llama-family, below

The checkpoint is read with Hugging Face `transformers` (hub names download once into its cache; a folder
written by `save_pretrained` works offline). These architectures load (LLAMA_FAMILY): gpt2, and llama, mistral,
qwen2, qwen3 into the llama arch, with grouped-query attention (n_kv_head), Qwen3's head width (attn_head_dim)
and qk-norm, and Qwen2's q/k/v biases; refused are RoPE scaling (Llama 3.1's llama3 type, YaRN, ...), biases
on the output projection or the MLP, and activations other than SiLU. Mistral's and Qwen's own sliding window
is not copied: the log says which swa_window reproduces it. The checkpoint's architecture replaces the
config's (layers, heads, widths, vocabulary, biases, norm eps, RoPE theta, GELU form, tied embeddings);
everything else stays the config's, attn_pattern included: the attention weights (c_attn, c_proj, the qk-norms)
load into any mixer that has them (full, swa, block, the bridges, sa, swat, mswa, moba, ...), so a
full-attention model can be uptrained to a sparse pattern.
Parameters the checkpoint lacks (e.g. sa_swa's gates, attn_gate) keep their fresh initialisation and are
listed; a mixer with no attention weights (mlstm, gated_deltanet, linear) is refused. block_size may be at
most the checkpoint's context (the position table is cropped to it).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from attention.registry import MIXERS, pattern_names
from config import ModelConfig

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# GPT-2's MLP activations that are the tanh approximation (gelu_new is OpenAI's original)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
PROJECT_TYPE = "efficient_attention_gpt"  # a run exported as this project's class (export.py, hf_gpt.py)
# what an exported run's config does not impose on the new run: how it trains and runs, not what it computes
RUN_ONLY = ("block_size", "dropout", "attn_backend", "init_std")


class PretrainedError(Exception):
    pass


def pretrained_source(init_from: str) -> str | None:
    """The Hugging Face name or path that init_from names, or None when it names no pretrained weights."""
    if init_from in GPT2_NAMES:
        return "openai-community/" + init_from
    if init_from.startswith("hf:"):
        return init_from[3:]
    return None


def load_hf_model(source: str):
    """The transformers model of a checkpoint of an architecture that loads, in float32 on the CPU."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise PretrainedError("init_from with pretrained weights needs transformers: pip install transformers") from None
    # registers this project's model type, which export.py writes (imports transformers: only when used)
    from runtime import hf_gpt  # noqa: F401

    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise PretrainedError(f"cannot read the checkpoint {source!r} ({str(e).splitlines()[0][:200]}): give a hub "
                              "name (downloads need the network once) or a folder written by save_pretrained") from None
    if hf_config.model_type not in ("gpt2", *LLAMA_FAMILY, PROJECT_TYPE):
        raise PretrainedError(f"{source!r} is a {hf_config.model_type} model: init_from loads gpt2, "
                              f"{', '.join(LLAMA_FAMILY)} checkpoints and this project's exports ({PROJECT_TYPE})")
    return AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()


def pretrained_model_config(hf_config, m: ModelConfig) -> list[str]:
    """Give m the checkpoint's architecture (in place); returns the settings that changed (and notes), for the log."""
    try:
        names = set(pattern_names(m.attn_pattern))
    except ValueError as e:
        raise PretrainedError(str(e)) from None
    others = sorted(name for name in names if name in MIXERS and not MIXERS[name].pretrained_attention_shapes)
    if others and hf_config.model_type != PROJECT_TYPE:  # checked before the checkpoint's shapes are set: they would be blamed on settings never given
        raise PretrainedError(f"attn_pattern={m.attn_pattern!r} has {', '.join(others)} layers, which have no "
                              "counterpart in a pretrained transformer's attention to load: use attention mixers "
                              "only (full, swa, sa, block, bridge, ...), or train this pattern from scratch")
    if hf_config.model_type == PROJECT_TYPE:
        settings, notes = project_settings(hf_config, m)
    else:
        settings, notes = (gpt2_settings if hf_config.model_type == "gpt2" else llama_settings)(hf_config, m)
    changed = [f"{key}={value!r}" for key, value in settings.items() if getattr(m, key) != value]
    for key, value in settings.items():
        setattr(m, key, value)
    return changed + notes


def project_settings(hf_config, m: ModelConfig) -> tuple[dict, list[str]]:
    """An exported run: its whole model config (attention pattern and the variants' settings included, which
    its weights belong to), but for how the new run trains (RUN_ONLY)."""
    exported = hf_config.model_config()
    if exported.resolved_pos_embedding == "learned" and m.block_size > exported.block_size:
        raise PretrainedError(f"block_size={m.block_size} is longer than the checkpoint's {exported.block_size} "
                              f"learned positions: use --block_size={exported.block_size} or less")
    settings = {key: value for key, value in dataclasses.asdict(exported).items() if key not in RUN_ONLY}
    return settings, []


def gpt2_settings(hf_config, m: ModelConfig) -> tuple[dict, list[str]]:
    if hf_config.activation_function not in TANH_GELU + ("gelu",):
        raise PretrainedError(f"the checkpoint's MLP activation {hf_config.activation_function!r} is not GELU")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_config, "scale_attn_weights", True):
        raise PretrainedError("the checkpoint scales attention scores other than by 1/sqrt(head_dim), which this "
                              "model does not do")
    if m.block_size > hf_config.n_positions:
        raise PretrainedError(f"block_size={m.block_size} is longer than the checkpoint's {hf_config.n_positions} "
                              f"learned positions: use --block_size={hf_config.n_positions} or less")
    settings = {"arch": "gpt2", "n_layer": hf_config.n_layer, "n_head": hf_config.n_head, "n_embd": hf_config.n_embd,
                "vocab_size": hf_config.vocab_size, "bias": True, "mlp_hidden": hf_config.n_inner or 4 * hf_config.n_embd,
                "pos_embedding": "learned", "norm_eps": hf_config.layer_norm_epsilon,
                "tie_embeddings": bool(getattr(hf_config, "tie_word_embeddings", True)),
                "gelu": "tanh" if hf_config.activation_function in TANH_GELU else "exact"}
    return settings, []


def llama_settings(c, m: ModelConfig) -> tuple[dict, list[str]]:
    """Llama, Mistral, Qwen2, Qwen3 in the llama arch (RMSNorm, SwiGLU, half-split RoPE, as transformers')."""
    kind = c.model_type
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 1e4)}
    if rope.get("rope_type", "default") != "default":
        raise PretrainedError(f"the checkpoint scales RoPE ({rope['rope_type']}), which this model's RoPE does not")
    if c.hidden_act != "silu":
        raise PretrainedError(f"the checkpoint's MLP activation {c.hidden_act!r} is not SiLU (SwiGLU)")
    if getattr(c, "mlp_bias", False) or (kind != "qwen2" and getattr(c, "attention_bias", False)):
        raise PretrainedError("the checkpoint has biases on the MLP or the attention output, which the llama arch "
                              "does not (only Qwen2's q/k/v biases are expressed, as qkv_bias)")
    if m.block_size > c.max_position_embeddings:
        raise PretrainedError(f"block_size={m.block_size} is longer than the checkpoint's context "
                              f"{c.max_position_embeddings}: use --block_size={c.max_position_embeddings} or less")
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    settings = {"arch": "llama", "n_layer": c.num_hidden_layers, "n_head": heads, "n_embd": c.hidden_size,
                "n_kv_head": 0 if kv_heads == heads else kv_heads,
                "attn_head_dim": 0 if head_dim * heads == c.hidden_size else head_dim,
                "qk_norm": kind == "qwen3", "qkv_bias": kind == "qwen2", "vocab_size": c.vocab_size, "bias": False,
                "mlp_hidden": c.intermediate_size, "pos_embedding": "rope", "rope_theta": float(rope["rope_theta"]),
                "norm_eps": c.rms_norm_eps, "tie_embeddings": bool(c.tie_word_embeddings)}
    window = getattr(c, "sliding_window", None) if kind == "mistral" or getattr(c, "use_sliding_window", False) else None
    notes = [f"note: the checkpoint attends within a sliding window of {window} (--attn_pattern=swa "
             f"--swa_window={window} reproduces it)"] if window and window < m.block_size else []
    return settings, notes


def pretrained_state_dict(hf_model, block_size: int) -> dict:
    """The checkpoint's weights under this codebase's names."""
    if hf_model.config.model_type == "gpt2":
        return gpt2_state_dict(hf_model, block_size)
    if hf_model.config.model_type == PROJECT_TYPE:  # the GPT itself, under the name `model`
        state = dict(hf_model.model.state_dict())
        if "wpe.weight" in state:
            state["wpe.weight"] = state["wpe.weight"][:block_size]
        return state
    return llama_state_dict(hf_model)


def tokenizer_identity(source: str) -> dict | None:
    """The identity (data.tokenizer) of the tokenizer a run exported to this folder was trained with, from its
    export.json: its tokenizer files are that tokenizer converted, whose vocabulary hashes otherwise."""
    try:
        with open(os.path.join(source, "export.json")) as f:
            return json.load(f).get("tokenizer")
    except (OSError, ValueError):
        return None


def llama_state_dict(hf_model) -> dict:
    """q, k and v projections fused into c_attn (rows in that order, as Attention splits them); the rest renamed."""
    renamed = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn.o_proj": "mixer.c_proj",
               "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm", "mlp.gate_proj": "mlp.c_gate",
               "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
    hf_state = hf_model.state_dict()
    state = {"wte.weight": hf_state["model.embed_tokens.weight"], "ln_f.weight": hf_state["model.norm.weight"]}
    if not hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = hf_state["lm_head.weight"]
    for name, value in hf_state.items():
        if not name.startswith("model.layers."):
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        module, _, leaf = rest.rpartition(".")
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            if module == "self_attn.q_proj":
                parts = [hf_state[f"model.layers.{index}.self_attn.{p}_proj.{leaf}"] for p in "qkv"]
                state[f"blocks.{index}.mixer.c_attn.{leaf}"] = torch.cat(parts, dim=0)
        elif module in renamed:
            state[f"blocks.{index}.{renamed[module]}.{leaf}"] = value
        else:
            raise PretrainedError(f"the checkpoint's {name} has no counterpart in the llama arch")
    return state


def gpt2_state_dict(hf_model, block_size: int) -> dict:
    """The checkpoint's weights under this codebase's names: GPT-2's Conv1D layers store (in, out) matrices,
    nn.Linear (out, in), so those are transposed; the position table is cropped to block_size."""
    renamed = {"attn.c_attn": "mixer.c_attn", "attn.c_proj": "mixer.c_proj", "mlp.c_fc": "mlp.c_fc",
               "mlp.c_proj": "mlp.c_proj", "ln_1": "ln_1", "ln_2": "ln_2"}
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for name, value in hf_model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers
        if name == "lm_head.weight":
            if not getattr(hf_model.config, "tie_word_embeddings", True):
                state[name] = value  # an untied head (OpenAI's checkpoints tie it to wte)
            continue
        name = name.removeprefix("transformer.")
        if name.startswith("h."):
            _, index, rest = name.split(".", 2)
            module, _, leaf = rest.rpartition(".")
            ours = f"blocks.{index}.{renamed[module]}.{leaf}"
            state[ours] = value.t().contiguous() if rest in conv1d else value
        elif name == "wpe.weight":
            state[name] = value[:block_size]
        else:  # wte.weight, ln_f.weight, ln_f.bias
            state[name] = value
    return state


def load_pretrained_weights(model, hf_model) -> list[str]:
    """Copy the checkpoint's weights into model (built from pretrained_model_config's settings). Returns the
    model's parameters the checkpoint has no value for, which keep their fresh initialisation."""
    state = pretrained_state_dict(hf_model, model.config.block_size)
    own = model.state_dict()
    for name, value in state.items():
        if name not in own:
            layer = name.split(".")[1] if name.startswith("blocks.") else "?"
            mixer = type(model.blocks[int(layer)].mixer).__name__ if layer != "?" else "the model"
            raise PretrainedError(f"layer {layer}'s mixer ({mixer}) has no {name.split('.', 2)[-1]}: its attn_pattern "
                                  "cannot take pretrained attention weights (choose attention mixers: full, swa, "
                                  "block, sa, mswa, swat, bridge, pbb, se_bridge, ...)")
        if own[name].shape != value.shape:
            raise PretrainedError(f"{name}: the checkpoint's {tuple(value.shape)} does not fit the model's "
                                  f"{tuple(own[name].shape)}")
    model.load_state_dict(state, strict=False)
    return sorted({name for name, _ in model.named_parameters()} - set(state))  # tied lm_head is wte
