"""Start training from pretrained weights, as nanoGPT's init_from='gpt2' does.

    python train.py configs/owt_124m_pbb.py --init_from=gpt2            # OpenAI's GPT-2 small, any attn_pattern
    python train.py CONFIG --init_from=gpt2-medium                      # gpt2-large, gpt2-xl likewise
    python train.py CONFIG --init_from=hf:./my-gpt2                     # a local (or hub) GPT-2-shaped checkpoint

The checkpoint is read with Hugging Face `transformers` (hub names download once into its cache; a folder
written by `save_pretrained` works offline). Its architecture replaces the config's (gpt2 arch, layers, heads,
width, vocabulary, biases, LayerNorm eps, tanh GELU, tied embeddings); everything else stays the config's,
attn_pattern included: the attention weights (c_attn, c_proj) load into any mixer that has them (full, swa,
block, the bridges, sa, swat, mswa, ...), so a full-attention model can be uptrained to a sparse pattern.
Parameters the checkpoint lacks (e.g. sa_swa's gates, attn_gate) keep their fresh initialisation and are
listed; a mixer with no attention weights (mlstm, gated_deltanet, linear) is refused. block_size may be at
most the checkpoint's context (the position table is cropped to it).
"""

from __future__ import annotations

from config import ModelConfig

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# GPT-2's MLP activations that are the tanh approximation (gelu_new is OpenAI's original)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


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
    """The transformers model of a GPT-2-shaped checkpoint, in float32 on the CPU."""
    try:
        from transformers import AutoConfig, GPT2LMHeadModel
    except ImportError:
        raise PretrainedError("init_from with pretrained weights needs transformers: pip install transformers") from None
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise PretrainedError(f"cannot read the checkpoint {source!r} ({str(e).splitlines()[0][:200]}): give a hub "
                              "name (downloads need the network once) or a folder written by save_pretrained") from None
    if hf_config.model_type != "gpt2":
        raise PretrainedError(f"{source!r} is a {hf_config.model_type} model: init_from loads GPT-2's architecture "
                              "(model_type gpt2) only")
    return GPT2LMHeadModel.from_pretrained(source, torch_dtype="float32").eval()


def pretrained_model_config(hf_config, m: ModelConfig) -> list[str]:
    """Give m the checkpoint's architecture (in place); returns the settings that changed, for the log."""
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
                "pos_embedding": "learned", "norm_eps": hf_config.layer_norm_epsilon, "tie_embeddings": True,
                "gelu": "tanh" if hf_config.activation_function in TANH_GELU else "exact"}
    changed = [f"{key}={value!r}" for key, value in settings.items() if getattr(m, key) != value]
    for key, value in settings.items():
        setattr(m, key, value)
    return changed


def gpt2_state_dict(hf_model, block_size: int) -> dict:
    """The checkpoint's weights under this codebase's names: GPT-2's Conv1D layers store (in, out) matrices,
    nn.Linear (out, in), so those are transposed; the position table is cropped to block_size."""
    renamed = {"attn.c_attn": "mixer.c_attn", "attn.c_proj": "mixer.c_proj", "mlp.c_fc": "mlp.c_fc",
               "mlp.c_proj": "mlp.c_proj", "ln_1": "ln_1", "ln_2": "ln_2"}
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for name, value in hf_model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers; the head is tied to wte
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
    state = gpt2_state_dict(hf_model, model.config.block_size)
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
